"""Triton kernel of :func:`adaptive_spec.kernels.ngram.ngram_match` (imported only when used)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import DEFAULT_MAX_WINDOW, NgramMatch, prepare_ngram_match
from ._common import next_pow2


@triton.jit
def _ngram_kernel(
    tok_ptr,
    stride_b,
    num_ptr,
    cap_ptr,
    out_ptr,
    num_out_ptr,
    n_out_ptr,
    lmax,
    max_window,
    max_k,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    BLOCK: tl.constexpr,
    KBLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    length = tl.minimum(tl.maximum(tl.load(num_ptr + i).to(tl.int64), 0), lmax)
    lw = tl.minimum(length, max_window)
    base = tok_ptr + i.to(tl.int64) * stride_b + (length - lw)
    e = tl.arange(0, BLOCK).to(tl.int64)
    e_ok = e < lw - 1
    run = e_ok
    m = tl.zeros([BLOCK], tl.int32)
    for j in tl.static_range(MAX_N):
        sidx = lw - 1 - j
        sfx = tl.load(base + sidx, mask=sidx >= 0, other=0)
        # (block-shaped comparison: the interpreter mis-types block & scalar-bool)
        ok = run & (e >= j) & (e * 0 + sidx >= 0)
        a = tl.load(base + e - j, mask=ok, other=0)
        cond = ok & (a == sfx)
        m += cond.to(tl.int32)
        run = cond
    best = tl.max(m, axis=0)
    n = tl.where(best >= MIN_N, best, 0)
    hit = (m >= n) & (m * 0 + n > 0) & e_ok
    e_star = tl.max(tl.where(hit, e, -1), axis=0)
    cap = tl.load(cap_ptr + i)
    num = tl.where(n > 0, cap, 0)
    period = tl.maximum(lw - 1 - e_star, 1)
    t = tl.arange(0, KBLOCK).to(tl.int64)
    tm = t < num
    src = tl.maximum(e_star, 0) + 1 + t % period
    vals = tl.load(base + src, mask=tm, other=-1).to(tl.int64)
    tl.store(out_ptr + i * max_k + t, vals, mask=t < max_k)
    tl.store(num_out_ptr + i, num.to(tl.int64))
    tl.store(n_out_ptr + i, n.to(tl.int64))


def ngram_match_triton(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    ks: torch.Tensor | int,
    *,
    min_n: int = 2,
    max_n: int = 4,
    max_window: int = DEFAULT_MAX_WINDOW,
    max_k: int | None = None,
    max_new_tokens: torch.Tensor | None = None,
) -> NgramMatch:
    """Triton implementation of :func:`adaptive_spec.kernels.ngram.ngram_match`."""
    cap, max_k = prepare_ngram_match(
        token_ids, num_tokens, ks, max_new_tokens, min_n, max_n, max_window, max_k
    )
    dev = token_ids.device
    b, lmax = token_ids.shape
    out = torch.full((b, max_k), -1, dtype=torch.int64, device=dev)
    num = torch.zeros(b, dtype=torch.int64, device=dev)
    n = torch.zeros(b, dtype=torch.int64, device=dev)
    if b == 0 or lmax == 0:
        return NgramMatch(out, num, n)
    tok = token_ids if token_ids.stride(1) == 1 else token_ids.contiguous()
    w = min(max_window, lmax)
    block = next_pow2(w)
    _ngram_kernel[(b,)](
        tok,
        tok.stride(0),
        num_tokens.contiguous(),
        cap.contiguous(),
        out,
        num,
        n,
        lmax,
        max_window,
        max_k,
        MIN_N=min_n,
        MAX_N=max_n,
        BLOCK=block,
        KBLOCK=next_pow2(max(max_k, 1)),
        num_warps=4 if block >= 1024 else 1,
    )
    return NgramMatch(out, num, n)
