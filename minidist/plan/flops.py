"""FLOPs of training a decoder-only transformer: per token (PaLM) and per step, counted
matrix product by matrix product (Narayanan et al. 2021).

A matrix product of (m, k) by (k, n) is 2mkn FLOPs (a multiply and an add). Per layer and
forward, B sequences of s tokens, hidden size h, a heads of h/a, a_kv key/value heads,
MLP width f (Narayanan et al. 2021, arXiv 2104.04473, section 5.1 and appendix):
    attention projections   Q, output 2 x 2Bsh^2; K, V 2 x 2Bsh (h a_kv/a)   (a_kv = a: 8Bsh^2)
    attention scores        QK^T and probabilities x V: 2 x 2Bs^2h
    MLP                     GELU: 2 matrices h x f; SwiGLU: 3 (gate, up, down): 2Bshf each
    logits                  2BshV, once per step (not per layer)
Backward costs twice the forward (the input's gradient and the weight's), so the model
FLOPs are 3x the forward. Full recomputation runs every layer's forward once more (the
logits are not recomputed); selective recomputation reruns the attention scores only
(Korthikanti et al. 2022, arXiv 2205.05198, section 5). With GPT's shapes (f = 4h, GELU,
a_kv = a) these give the two papers' closed forms:
    model FLOPs                       72 B s L h^2 (1 + s/(6h) + V/(12 L h))
        (Korthikanti et al. 2022's model FLOPs, the count behind their MFU, Table 5)
    hardware FLOPs, full recompute    96 B s L h^2 (1 + s/(6h) + V/(16 L h))
        (Narayanan et al. 2021, section 5.1: the FLOPs their runs executed, recomputation in)
Elementwise work (softmax, layer norms, GELU) is not counted, as in both papers.

Per token (PaLM, Chowdhery et al. 2022, arXiv 2204.02311, appendix B): 6N + 12 L H Q T.
"""


def flops_per_token(n_layer, n_head, head_dim, seq, n_params):
    """Training FLOPs per token: 6N + 12 L H Q T (PaLM's appendix B). 6N: each parameter
    does one multiply-add forward and two backward per token; 12 L H Q T: the attention
    scores' two matrix products, which have no parameters, forward and backward."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq


def attention_projection_flops(B, s, h, heads=None, kv_heads=None):
    """Forward FLOPs of one layer's Q, K, V and output projections: 2Bsh (2h + 2 h_kv),
    h_kv = kv_heads x h/heads the width of K and V (grouped-query attention), h without it."""
    h_kv = h
    if kv_heads is not None and kv_heads != heads:
        if heads is None or h % heads:
            raise ValueError(f"kv_heads needs heads that divide h (h {h}, heads {heads})")
        h_kv = kv_heads * (h // heads)
    return 2 * B * s * h * (2 * h + 2 * h_kv)


def attention_score_flops(B, s, h):
    """Forward FLOPs of one layer's QK^T and probabilities x V: 2 x 2Bs^2h (every head,
    every key; the causal mask's zeros are counted, as in Narayanan et al.)."""
    return 4 * B * s * s * h


def mlp_flops(B, s, h, ffn=None, swiglu=False):
    """Forward FLOPs of one layer's MLP: 2Bshf per matrix of h x f, two matrices (GELU) or
    three (SwiGLU: gate, up, down). f defaults to GPT's 4h."""
    f = 4 * h if ffn is None else ffn
    return (3 if swiglu else 2) * 2 * B * s * h * f


def logit_flops(B, s, h, V):
    """Forward FLOPs of the output layer: 2BshV."""
    return 2 * B * s * h * V


def layer_flops(B, s, h, heads=None, ffn=None, kv_heads=None, swiglu=False):
    """Forward FLOPs of one transformer layer: projections, scores and MLP. GPT's shapes:
    24Bsh^2 + 4Bs^2h."""
    return (attention_projection_flops(B, s, h, heads, kv_heads) + attention_score_flops(B, s, h)
            + mlp_flops(B, s, h, ffn, swiglu))


RECOMPUTE = ("none", "selective", "full")


def step_flops(B, s, L, h, V, heads=None, ffn=None, kv_heads=None, swiglu=False, recompute="none"):
    """(model FLOPs, hardware FLOPs) of one training step of B sequences of s tokens.

    model: 3 x (L layer_flops + logits), what MFU counts; hardware adds what recomputation
    runs again: every layer's forward under "full", the attention scores (4Bs^2hL) under
    "selective", nothing under "none" (what HFU counts)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    layer = layer_flops(B, s, h, heads, ffn, kv_heads, swiglu)
    model = 3 * (L * layer + logit_flops(B, s, h, V))
    again = {"none": 0, "selective": L * attention_score_flops(B, s, h),
             "full": L * layer}[recompute]
    return model, model + again
