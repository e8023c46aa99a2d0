"""Triton Philox-4x32-10, bit-identical to ``philox.py`` (imported only when Triton is used)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def philox4x32(c0, c1, c2, c3, seed):
    """Philox-4x32-10 (Salmon et al. 2011): uint32 counters, int64 seed -> four uint32 words."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def to_uniform(x):
    """uint32 -> float32 in (0, 1): ``(2 * (x >> 9) + 1) * 2**-24``."""
    return ((x >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
