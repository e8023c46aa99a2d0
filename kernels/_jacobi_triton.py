"""Triton kernels of :mod:`adaptive_spec.kernels.jacobi` (imported only when used)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import JacobiStep, check_jacobi_step, check_lookahead_ngrams, check_pool_update
from ._common import next_pow2


@triton.jit
def _jacobi_step_kernel(
    y_ptr,
    y_stride,
    len_ptr,
    z_ptr,
    z_stride,
    acc_ptr,
    emit_ptr,
    nxt_ptr,
    nxt_len_ptr,
    K,
    KB: tl.constexpr,
):
    i = tl.program_id(0)
    ln = tl.minimum(tl.maximum(tl.load(len_ptr + i).to(tl.int64), 0), K)
    j = tl.arange(0, KB).to(tl.int64)
    jm = j < K
    y = tl.load(y_ptr + i * y_stride + j, mask=jm, other=0).to(tl.int64)
    z = tl.load(z_ptr + i * z_stride + j, mask=j < K + 1, other=-1).to(tl.int64)
    mismatch = (y != z) | (j >= ln)
    a = tl.min(tl.where(mismatch & jm, j, K), axis=0)
    a = tl.minimum(a, ln)
    tl.store(acc_ptr + i, a)
    tl.store(emit_ptr + i * (K + 1) + j, tl.where(j <= a, z, -1), mask=j < K + 1)
    nl = ln - a
    src = a + 1 + j
    zn = tl.load(z_ptr + i * z_stride + src, mask=jm & (j < nl), other=-1).to(tl.int64)
    tl.store(nxt_ptr + i * K + j, zn, mask=jm)
    tl.store(nxt_len_ptr + i, nl)


def jacobi_step_triton(
    iterate: torch.Tensor, iterate_len: torch.Tensor, predictions: torch.Tensor
) -> JacobiStep:
    """Triton implementation of :func:`adaptive_spec.kernels.jacobi.jacobi_step`."""
    b, k = check_jacobi_step(iterate, iterate_len, predictions)
    dev = iterate.device
    acc = torch.zeros(b, dtype=torch.int64, device=dev)
    emit = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)
    nxt = torch.full((b, k), -1, dtype=torch.int64, device=dev)
    nl = torch.zeros(b, dtype=torch.int64, device=dev)
    if b:
        y = iterate.contiguous() if k else torch.zeros((b, 1), dtype=torch.int64, device=dev)
        z = predictions.contiguous()
        _jacobi_step_kernel[(b,)](
            y,
            y.stride(0),
            iterate_len.contiguous(),
            z,
            z.stride(0),
            acc,
            emit,
            nxt,
            nl,
            k,
            KB=next_pow2(k + 1),
            num_warps=1,
        )
    return JacobiStep(acc, emit, acc + 1, nxt, nl)


@triton.jit
def _ngrams_kernel(
    traj_ptr,
    t_stride_b,
    t_stride_l,
    pred_ptr,
    p_stride_b,
    out_ptr,
    W,
    M,
    N: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    blk = tl.program_id(1)
    s = blk * BLOCK + tl.arange(0, BLOCK)
    sm = s < M
    r = tl.arange(0, NB)
    rm = r < N
    col = s[:, None] + r[None, :]
    is_pred = r[None, :] == N - 1
    lvl = tl.minimum(r, N - 2)
    tv = tl.load(
        traj_ptr + i * t_stride_b + lvl[None, :] * t_stride_l + col,
        mask=sm[:, None] & rm[None, :] & (is_pred == 0),
        other=0,
    ).to(tl.int64)
    pv = tl.load(pred_ptr + i * p_stride_b + col, mask=sm[:, None] & is_pred, other=0).to(tl.int64)
    g = tl.where(is_pred, pv, tv)
    bad = tl.max(tl.where(rm[None, :] & (g < 0), 1, 0), axis=1)
    g = tl.where(bad[:, None] > 0, -1, g)
    tl.store(out_ptr + (i * M + s[:, None]) * N + r[None, :], g, mask=sm[:, None] & rm[None, :])


def lookahead_ngrams_triton(trajectory: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """Triton implementation of :func:`adaptive_spec.kernels.jacobi.lookahead_ngrams`."""
    b, n, w = check_lookahead_ngrams(trajectory, predictions)
    m = max(w - n + 1, 0)
    out = torch.full((b, m, n), -1, dtype=torch.int64, device=trajectory.device)
    if b and m:
        traj = trajectory.contiguous()
        pred = predictions.contiguous()
        block = min(next_pow2(m), 128)
        _ngrams_kernel[(b, -(-m // block))](
            traj,
            traj.stride(0),
            traj.stride(1),
            pred,
            pred.stride(0),
            out,
            w,
            m,
            N=n,
            NB=next_pow2(n),
            BLOCK=block,
            num_warps=1,
        )
    return out


@triton.jit
def _pool_update_kernel(
    pool_ptr,
    ptr_ptr,
    ng_ptr,
    C,
    M,
    N: tl.constexpr,
    CB: tl.constexpr,
    NB: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.arange(0, CB)
    r = tl.arange(0, NB)
    cm = c < C
    rm = r < N
    base = pool_ptr + i.to(tl.int64) * C * N
    ptr = tl.load(ptr_ptr + i)
    for m in range(0, M):
        ng = tl.load(ng_ptr + (i.to(tl.int64) * M + m) * N + r, mask=rm, other=0).to(tl.int64)
        valid = tl.min(tl.where(rm, ng, 0), axis=0) >= 0
        tile = tl.load(base + c[:, None] * N + r[None, :], mask=cm[:, None] & rm[None, :], other=0)
        diff = tl.where(rm[None, :] & (tile != ng[None, :]), 1, 0)
        row_eq = (tl.max(diff, axis=1) == 0) & cm
        dup = tl.max(row_eq.to(tl.int32), axis=0) > 0
        write = valid & (dup == 0)
        slot = ptr % C
        wmask = rm & (r * 0 + write.to(tl.int32) > 0)
        tl.store(base + slot * N + r, ng, mask=wmask)
        ptr += write.to(tl.int64)
        tl.debug_barrier()
    tl.store(ptr_ptr + i, ptr)


def lookahead_pool_update_triton(
    pool: torch.Tensor, pool_ptr: torch.Tensor, ngrams: torch.Tensor
) -> None:
    """Triton implementation of :func:`adaptive_spec.kernels.jacobi.lookahead_pool_update`."""
    check_pool_update(pool, pool_ptr, ngrams)
    b, c, n = pool.shape
    m = ngrams.shape[1]
    if b == 0 or m == 0:
        return
    if not pool.is_contiguous() or not pool_ptr.is_contiguous():
        raise ValueError("pool and pool_ptr must be contiguous for the in-place Triton update")
    _pool_update_kernel[(b,)](
        pool,
        pool_ptr,
        ngrams.contiguous(),
        c,
        m,
        N=n,
        CB=next_pow2(c),
        NB=next_pow2(n),
        num_warps=1,
    )
