"""gelu_backward with c = np.sqrt(2 / np.pi): a NumPy float64 scalar, which turns a float32
x into a float64 gradient (NumPy 2 keeps float32 only for Python floats). Right in float64;
in float32 every GELU gradient would be twice the bytes and the engine would cast it back."""
import numpy as np

EXPECT = {"0.4": "is float64, expected float32: keep the inputs' dtype"}
RANKS = 1


def gelu_backward(x, grad):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x * x * x))
    dy = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return grad * dy
