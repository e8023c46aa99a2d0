"""Triton BGMV shrink/expand kernels of :func:`adaptive_spec.kernels.lora.lora_bgmv`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_lora
from ._common import next_pow2


@triton.jit
def _shrink_kernel(
    x_ptr,
    x_stride,
    a_ptr,
    a_stride_l,
    a_stride_k,
    idx_ptr,
    t_ptr,
    d_in,
    rank,
    RB: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0)
    ad = tl.load(idx_ptr + tok).to(tl.int64)
    r = tl.arange(0, RB)
    rm = r < rank
    acc = tl.zeros([RB], tl.float32)
    if ad >= 0:
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, d_in, BLOCK_K):
            k = k0 + kk
            km = k < d_in
            xv = tl.load(x_ptr + tok * x_stride + k, mask=km, other=0.0).to(tl.float32)
            av = tl.load(
                a_ptr + ad * a_stride_l + k[:, None] * a_stride_k + r[None, :],
                mask=km[:, None] & rm[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(xv[:, None] * av, axis=0)
    tl.store(t_ptr + tok * RB + r, acc)


@triton.jit
def _expand_kernel(
    t_ptr,
    b_ptr,
    b_stride_l,
    b_stride_r,
    idx_ptr,
    scale_ptr,
    y_ptr,
    y_stride,
    d_out,
    rank,
    RB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0)
    nb = tl.program_id(1)
    ad = tl.load(idx_ptr + tok).to(tl.int64)
    if ad >= 0:
        r = tl.arange(0, RB)
        rm = r < rank
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < d_out
        tv = tl.load(t_ptr + tok * RB + r)
        bv = tl.load(
            b_ptr + ad * b_stride_l + r[:, None] * b_stride_r + n[None, :],
            mask=rm[:, None] & nm[None, :],
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(tv[:, None] * bv, axis=0) * tl.load(scale_ptr + ad)
        yp = y_ptr + tok * y_stride + n
        yv = tl.load(yp, mask=nm, other=0.0).to(tl.float32)
        tl.store(yp, (yv + delta).to(y_ptr.dtype.element_ty), mask=nm)


def lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Triton implementation of :func:`adaptive_spec.kernels.lora.lora_bgmv`."""
    scale_t = check_lora(y, x, lora_a, lora_b, indices, scale).contiguous()
    t, d_in = x.shape
    rank = lora_a.shape[2]
    d_out = y.shape[1]
    if t == 0 or rank == 0 or lora_a.shape[0] == 0:
        return y
    if y.stride(1) != 1:
        raise ValueError("y must have unit stride in its last dimension for the in-place update")
    xc = x.contiguous()
    a = lora_a.contiguous()
    bm = lora_b.contiguous()
    idx = indices.contiguous()
    rb = next_pow2(rank)
    tbuf = torch.empty((t, rb), dtype=torch.float32, device=x.device)
    block_k = max(16, min(next_pow2(d_in), 4096 // rb))
    _shrink_kernel[(t,)](
        xc, xc.stride(0), a, a.stride(0), a.stride(1), idx, tbuf, d_in, rank, RB=rb, BLOCK_K=block_k
    )
    block_n = max(16, min(next_pow2(d_out), 4096 // rb))
    _expand_kernel[(t, -(-d_out // block_n))](
        tbuf,
        bm,
        bm.stride(0),
        bm.stride(1),
        idx,
        scale_t,
        y,
        y.stride(0),
        d_out,
        rank,
        RB=rb,
        BLOCK_N=block_n,
    )
    return y
