"""The compressors, as a table: what each one sends and how it codes one piece of gradient.

    name        exchange    on the wire                              error feedback
    none        ring        the gradients themselves (fp32)          no
    fp16        ring        gradients / N cast to float16            no
    int8        two_phase   int8 codes, one scale per segment        no
    1bit        two_phase   signs 8 per byte, one scale per segment  yes (worker and server)
    1bit-adam   momentum    nothing in sync(); OneBitAdam sends the  yes (worker and server)
                            momentum's signs (onebit_adam.py)
    powersgd    low_rank    P (n x r) and Q (m x r) per matrix       yes (per matrix)
                            (powersgd.py)

The exchanges (how the coded pieces travel) live in minidist/parallel/compression.py; this
file holds only pure functions of arrays: the codes, and the message format of the
two-phase exchange, [scale, payload] per segment. The strategy reads a compressor's row
and never its name.

The codes are exercises (10.3 onebit_compress, 10.4 onebit_decompress); the table's
encoders look them up in this module's globals when called, so a student's function put
in their place (minidist/grader/plugin.py) is the one the strategy uses.

On a device (MINIDIST_DEVICE=cuda or strict) the codes run where the gradients are: each
function takes its array functions from its input's kind (`ns(x)`: NumPy for a host
array, xp for a device array; CuPy's get_array_module idiom), a scale stays a 0-d device
array (no transfer per segment), and only the coded message crosses to the host, when the
comm layer stages it for MPI. On the host every function is the NumPy code it always was.
"""
from dataclasses import dataclass

import numpy as np

from minidist.backend import on_device, xp


def ns(x):
    """The array module of x: xp for a device array, NumPy otherwise."""
    return xp if on_device(x) else np


def scalar(value, dtype):
    """A 0-d result as a scale of dtype: a NumPy scalar on the host (as the codes always
    returned), a 0-d array on a device (reading it on the host would be a transfer)."""
    return value.astype(dtype) if on_device(value) else np.dtype(dtype).type(value)


def unpack_bits(packed, n):
    """The first n bits of packed (uint8, 8 per byte, big-endian), as uint8 0/1: CuPy's
    unpackbits has no `count`, so the padding bits are sliced off."""
    return ns(packed).unpackbits(packed)[:n]


# ----------------------------------------------------------------------------- 1-bit (signs)

def onebit_compress(x, residual):
    """Signs of v = x + residual, packed 8 per byte, and one scale: (packed, scale, new_residual).

    The scale is the mean absolute value of v, so the decompressed vector (+-scale)
    has the same L1 norm as v. A zero counts as +. new_residual = v - decompressed: what
    this step did not send, added to the next step's x (error feedback). Returns new
    arrays in x's dtype; x and residual are left as they are. (Exercise 10.3.)
    """
    m = ns(x)
    x = m.asarray(x)
    v = x + m.asarray(residual, dtype=x.dtype)
    packed = m.packbits(v >= 0)
    scale = scalar(m.mean(m.abs(v)) if v.size else m.zeros((), x.dtype), x.dtype)
    new_residual = v - onebit_decompress(packed, scale, v.size)
    return packed, scale, new_residual


def onebit_decompress(packed, scale, n):
    """The n values +scale (bit 1) / -scale (bit 0), in scale's dtype. (Exercise 10.4.)"""
    m = ns(packed)
    scale = m.asarray(scale)
    bits = unpack_bits(m.asarray(packed, dtype=np.uint8), n)
    return m.where(bits.astype(bool), scale, -scale).astype(scale.dtype)


# ----------------------------------------------------------------------------- int8

def int8_compress(x):
    """Symmetric 8-bit codes with one scale: (q, scale), x ~ q * scale.

    scale = max|x| / 127, q = round(x / scale) clipped to [-127, 127]; the error is at most
    scale / 2 per element. An all-zero x has scale 0 and q all zero (x / 1 there: no
    branch on the scale, which a device would have to send home to decide).
    """
    m = ns(x)
    x = m.asarray(x)
    if not x.size:
        return m.zeros(x.shape, np.int8), scalar(m.zeros((), x.dtype), x.dtype)
    scale = scalar(m.max(m.abs(x)) / 127, x.dtype)
    q = m.clip(m.rint(x / m.where(scale == 0, x.dtype.type(1), scale)), -127, 127).astype(np.int8)
    return q, scale


def int8_decompress(q, scale):
    """q * scale, in scale's dtype."""
    m = ns(q)
    scale = m.asarray(scale)
    return m.asarray(q).astype(scale.dtype) * scale


# ----------------------------------------------------------------------------- messages

def pack(scale, payload, dtype):
    """One uint8 message: the scale's bytes (in the gradients' dtype), then the payload's."""
    m = ns(payload)
    head = m.asarray(scale, dtype=dtype).reshape(1).view(np.uint8)
    return m.concatenate([head, m.ascontiguousarray(payload).reshape(-1).view(np.uint8)])


def unpack(msg, dtype):
    """(scale, payload bytes) of a message made by pack."""
    k = np.dtype(dtype).itemsize
    return msg[:k].copy().view(dtype)[0], msg[k:]


# ----------------------------------------------------------------------------- the table

def _int8_encode(x, residual):
    q, scale = int8_compress(x)
    return scale, ns(q).asarray(q, np.int8), None


def _int8_decode(payload, scale, n):
    return int8_decompress(payload.view(np.int8), scale)


def _onebit_encode(x, residual):
    packed, scale, new_residual = onebit_compress(x, residual)
    return scale, packed, new_residual


def _onebit_decode(payload, scale, n):
    return onebit_decompress(payload, scale, n)


@dataclass(frozen=True)
class Compressor:
    """One row of the table.

    exchange: how the gradients travel after the warm-up (compression.py's exchanges).
    wire: ring: the dtype summed hop by hop (None: the gradients' own).
    bits: two_phase and momentum: bits per value of the payload (plan.traffic.code_bytes).
    encode(x, residual) -> (scale, payload, new residual or None); decode(payload, scale, n).
    error_feedback: a worker residual of the flat vector and a server residual per chunk.
    scales: the default of CompressedDataParallel(scales=None) (lesson 10 measured these).
    bucketed: takes bucket_bytes; needs_warmup: warmup_steps must be 1 or more."""
    exchange: str
    wire: object = None
    bits: int = 0
    encode: object = None
    decode: object = None
    error_feedback: bool = False
    scales: str = "tensor"
    bucketed: bool = True
    needs_warmup: bool = False


TABLE = {
    "none": Compressor("ring"),
    "fp16": Compressor("ring", wire=np.float16),
    "int8": Compressor("two_phase", bits=8, encode=_int8_encode, decode=_int8_decode),
    "1bit": Compressor("two_phase", bits=1, encode=_onebit_encode, decode=_onebit_decode,
                       error_feedback=True, scales="chunk"),
    "1bit-adam": Compressor("momentum", bits=1, error_feedback=True, bucketed=False, needs_warmup=True),
    "powersgd": Compressor("low_rank", bucketed=False),
}
COMPRESSORS = tuple(TABLE)
