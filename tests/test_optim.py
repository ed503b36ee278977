"""Optimizers against values worked by hand."""
import math

import numpy as np
import pytest

from minidist.nn import Parameter
from minidist.optim import SGD, AdamW, clip_grad_norm


def test_adamw_two_steps_by_hand():
    # One scalar parameter p0 = 1.0, lr = 0.1, betas (0.9, 0.99), eps = 1e-8, wd = 0.1;
    # gradient 0.5 at step 1, -1.0 at step 2 (torch.optim.AdamW's algorithm).
    # step 1: p = 1.0 * (1 - 0.1*0.1) = 0.99; m = 0.05; v = 0.0025;
    #         m_hat = 0.05 / 0.1 = 0.5; v_hat = 0.0025 / 0.01 = 0.25 -> p = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8)
    p1 = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8)                           # = 0.89
    # step 2: p = p1 * 0.99; m = 0.9*0.05 - 0.1 = -0.055; v = 0.99*0.0025 + 0.01*1 = 0.012475
    #         m_hat = -0.055 / 0.19; v_hat = 0.012475 / 0.0199
    p2 = p1 * 0.99 - 0.1 * (-0.055 / 0.19) / (math.sqrt(0.012475 / 0.0199) + 1e-8)
    p = Parameter(np.array([1.0]))
    opt = AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p.grad = np.array([0.5])
    opt.step()
    assert p.data[0] == pytest.approx(p1, rel=1e-12)
    assert p.data[0] == pytest.approx(0.89, rel=1e-7)
    p.grad = np.array([-1.0])
    opt.step()
    assert p.data[0] == pytest.approx(p2, rel=1e-12)
    assert opt.state_bytes() == 2 * 8                              # exp_avg and exp_avg_sq, float64


def test_adamw_param_groups_and_set_lr():
    a, b = Parameter(np.array([1.0])), Parameter(np.array([1.0]))
    opt = AdamW([{"params": [a], "weight_decay": 0.5}, {"params": [b], "weight_decay": 0.0}],
                lr=0.1, weight_decay=0.01)
    a.grad, b.grad = np.zeros(1), np.zeros(1)                     # zero grad: only decay moves a
    opt.step()
    assert a.data[0] == pytest.approx(1.0 - 0.1 * 0.5)
    assert b.data[0] == 1.0
    opt.set_lr(0.2)
    assert all(g["lr"] == 0.2 for g in opt.param_groups)
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_adamw_keeps_float32():
    p = Parameter(np.ones(4, np.float32))
    p.grad = np.full(4, 0.1, np.float32)
    AdamW([p], lr=1e-3).step()
    assert p.data.dtype == np.float32


def test_sgd_plain_and_momentum():
    p = Parameter(np.array([1.0, 2.0]))
    opt = SGD([p], lr=0.1)
    p.grad = np.array([1.0, -1.0])
    opt.step()
    np.testing.assert_allclose(p.data, [0.9, 2.1])
    q = Parameter(np.array([1.0]))
    opt = SGD([q], lr=0.1, momentum=0.9, weight_decay=0.5)
    q.grad = np.array([1.0])
    opt.step()                     # g = 1 + 0.5*1 = 1.5; buf = 1.5; q = 1 - 0.15 = 0.85
    q.grad = np.array([1.0])
    opt.step()                     # g = 1 + 0.425 = 1.425; buf = 1.35 + 1.425 = 2.775; q = 0.85 - 0.2775
    assert q.data[0] == pytest.approx(0.85 - 0.2775)


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])       # global norm 5
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(5.0)
    np.testing.assert_allclose(a.grad, [3.0, 0.0])               # below the bound: unchanged
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(np.concatenate([a.grad, b.grad]), [0.6, 0.0, 0.8], rtol=1e-6)
