"""The package's own answers to exercise 00, as a student's file: every unit check and
every plug-in check (lesson 00's gradient check with them in the engine) must PASS."""
from minidist.fused import gelu_backward, layer_norm_backward, softmax_cross_entropy_backward  # noqa: F401
from minidist.ops import matmul_backward  # noqa: F401

EXPECT = {"0.1": None, "0.2": None, "0.3": None, "0.4": None}
RANKS = 1
