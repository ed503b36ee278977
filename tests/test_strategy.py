"""The strategy contract (minidist/parallel/strategy.py): every strategy in minidist/parallel
is a Strategy, and train_step calls its hooks without asking what it has."""
import ast
import importlib
import inspect
import pathlib

import numpy as np

from minidist.model import GPT, GPTConfig
from minidist.parallel.strategy import Strategy
from minidist.train import micro_batches, train_step

ROOT = pathlib.Path(__file__).resolve().parents[1]

# every class train_step is handed as dp= (a strategy); each must subclass Strategy
STRATEGIES = {
    "data_parallel": ["NaiveDataParallel", "BucketedDataParallel"],
    "zero": ["ZeRO"],
    "tp_model": ["TensorParallelSync"],
    "pipeline_parallel": ["PipelineParallel"],
    "parallel_3d": ["Parallel3D"],
    "expert_parallel": ["ExpertParallel"],
}


def test_every_strategy_is_a_strategy():
    for module, names in STRATEGIES.items():
        mod = importlib.import_module(f"minidist.parallel.{module}")
        for name in names:
            assert issubclass(getattr(mod, name), Strategy), f"{module}.{name} is not a Strategy"


def test_a_class_with_a_sync_in_parallel_is_a_strategy():
    """Every class in minidist/parallel/ with a sync() or forward_backward() (what train_step
    calls) subclasses Strategy, the ones not listed above included."""
    found = []
    for path in sorted((ROOT / "minidist" / "parallel").glob("*.py")):
        if path.stem == "strategy":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if {"sync", "forward_backward"} & methods:
                    found.append((path.stem, node.name))
    assert {n for _, n in found} >= {n for names in STRATEGIES.values() for n in names}
    for module, name in found:
        cls = getattr(importlib.import_module(f"minidist.parallel.{module}"), name)
        assert issubclass(cls, Strategy), f"{module}.{name} has train_step's hooks but is not a Strategy"


def test_train_step_asks_no_hasattr():
    tree = ast.parse(inspect.getsource(importlib.import_module("minidist.train").train_step))
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "hasattr" not in calls and "getattr" not in calls


def test_the_base_strategy_is_one_process():
    """Strategy() as dp gives the step of dp=None, bit for bit, and its hooks are the
    single-process ones."""
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=8, dropout=0.1, dtype="float64")
    x = np.random.default_rng(0).integers(0, 32, size=(4, 8))
    y = np.roll(x, -1, axis=1)
    out = []
    for dp in (None, Strategy()):
        model = GPT(cfg, seed=1)
        opt = model.configure_optimizers(0.1, 1e-2)
        raw = {}
        loss, norm = train_step(model, opt, micro_batches(x, y, 0, 3, 2), 1e-2, 1.0, dp=dp, raw_grads=raw)
        out.append((loss, norm, raw, {n: p.data.copy() for n, p in model.named_parameters()}))
    (l0, n0, g0, w0), (l1, n1, g1, w1) = out
    assert l0 == l1 and n0 == n1 and g0.keys() == g1.keys() and w0.keys() == w1.keys()
    assert all(np.array_equal(g0[k], g1[k]) for k in g0)
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)
    s = Strategy()
    assert not s.owns_schedule and s.grad_norm_sq([]) is None and s.checkpoint_layout(None) == ""


def test_the_strategies_read_a_models_pieces_without_the_checkpoint_package_or_mpi():
    """parallel/pieces.py is a leaf (NumPy and plan.rules): the strategy contract imports it,
    not minidist.checkpoint (which sits above the strategies and calls their hooks); and
    checkpoint/layouts.py's tp_regions is that one function (exercise 11.1's plug-in)."""
    import subprocess
    import sys
    code = ("import sys\nimport minidist.parallel.strategy, minidist.parallel.pieces\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('minidist.checkpoint', "
            "'minidist.comm', 'mpi4py')))\nprint(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    from minidist.checkpoint import layouts
    from minidist.parallel import pieces
    assert layouts.tp_regions is pieces.tp_regions and layouts.Held is pieces.Held


def test_no_strategy_imports_the_checkpoint_package():
    """minidist/parallel/ sits below minidist/checkpoint/: no import of it, even inside a function."""
    for path in sorted((pathlib.Path(__file__).parents[1] / "minidist" / "parallel").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("minidist.checkpoint") for n in names), f"{path.name} imports {names}"
