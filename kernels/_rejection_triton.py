"""Triton kernels of :func:`adaptive_spec.kernels.verify.verify` (imported only when used).

One launch for a greedy batch (``temperature=None``), two for a stochastic one; the only host
work per call is argument checking, two allocations and the launches (no synchronisation, no
per-row tensors: offsets, temperatures and the request of every row are computed in-kernel).

Launch 1, ``_rows_kernel``: one program per (logits row, vocabulary split). It finds its request
from ``cu_num_draft_tokens`` (a count over the batch), reads its chunk of the row once, as the
logits dtype, into float32 registers, and keeps per lane a running max and argmax of
``logits / T`` and, only for rows of stochastic requests that acceptance or sampling can use, an
online sum of exponentials (one ``exp`` per element, rescaled when the lane max changes). Greedy
rows never compute an exponential. The last program of a row to finish (an atomic counter per
row) combines the splits and writes the row's argmax, max and sum; the last row of a request to
finish (an atomic counter per request) runs the sequential acceptance test for that request and
writes its output row, counts and, for a greedy request, the emitted token.

Launch 2, ``_sample_kernel`` (stochastic batches only): for every stochastic request the one
row to sample from (the first rejected position, else the bonus position) is read once more,
split over the vocabulary, with the residual ``max(0, p - q)`` (q read only at that row) and the
in-kernel Philox noise of the exponential race; the last split of a request to finish combines
the partial winners and writes the emitted token. If the residual is all zero (p == q), that
program falls back to a race over p.

The counters live in a zeroed workspace allocated per call; ``tl.debug_barrier`` before each
``acq_rel`` atomic orders the program's own stores before the release, and the combining
programs read the partials with ``.cg`` loads (L2, not a possibly stale L1).

The module stays whole (about 620 lines) because its parts change together: the greedy and the
stochastic paths are one row-pass kernel specialised by the ``STOCHASTIC`` constexpr (a split
between them would write that kernel twice); the layouts of the result and workspace buffers are
sized by :func:`verify_triton` and addressed by offsets inside both kernels; and
``python -m adaptive_spec.kernels.bench --baseline FILE`` times another copy of this file, loaded
on its own, against this one, which needs the whole implementation in one file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import VerifyOutput, check_verify
from ._common import triton_interpret
from ._philox_triton import philox4x32, to_uniform
from .philox import NOISE_SUB, PURPOSE_ACCEPT, PURPOSE_SAMPLE

# Globals used inside kernels must be constexpr.
C_ACCEPT = tl.constexpr(PURPOSE_ACCEPT)
C_SAMPLE = tl.constexpr(PURPOSE_SAMPLE)
BIG32 = tl.constexpr(2147483647)
NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: a lane that saw no finite logit
#: Most vocabulary splits of one row in launch 1 (fixed so the kernel compiles once).
SPLIT_MAX = 64
#: Most vocabulary splits of the sampled row in launch 2.
SAMPLE_SPLIT_MAX = 32
#: Requests scanned per step when a row looks up its request.
REQ_BLOCK = 128


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Launch parameters of the verification kernels.

    Attributes
    ----------
    block : int
        Elements per load of the row pass (power of two; ``num_warps * 32 * 16 / itemsize``
        gives one 16-byte load per thread).
    unroll : int
        Loads issued per step of the row pass before their values are used.
    num_warps : int
        Warps per row-pass program.
    chunk : int
        Target elements per row-pass program (rounded up to ``block``); rows are split into
        ``ceil(V / chunk)`` programs, or more when the batch is too small to fill the GPU.
    sample_chunks : int
        Noise chunks (``4 * NOISE_SUB`` vocabulary entries each) per sampling program.
    sample_warps : int
        Warps per sampling program.
    """

    block: int = 1024
    unroll: int = 4
    num_warps: int = 8
    chunk: int = 32768
    sample_chunks: int = 4
    sample_warps: int = 4


#: Defaults by logits element size (bytes): 16-byte loads, a few in flight per thread.
DEFAULT_CONFIGS = {
    4: TritonConfig(block=1024, unroll=4, num_warps=8, chunk=32768),
    2: TritonConfig(block=2048, unroll=4, num_warps=8, chunk=32768),
}
INTERPRETER_CONFIG = TritonConfig(
    block=64, unroll=2, num_warps=1, chunk=512, sample_chunks=1, sample_warps=1
)


@triton.jit
def _request_of_row(cu_ptr, row, B, BB: tl.constexpr):
    """Index of the request owning logits ``row``: #requests whose last row cu[i] + i < row."""
    o = tl.arange(0, BB)
    n = tl.zeros([], tl.int32)
    for b0 in range(0, B, BB):
        ob = b0 + o
        last = tl.load(cu_ptr + ob, mask=ob < B, other=0).to(tl.int32) + ob
        n += tl.sum(((last < row) & (ob < B)).to(tl.int32), axis=0)
    return tl.minimum(n, B - 1)


@triton.jit
def _request(cu_ptr, temp_ptr, i, max_k, STOCHASTIC: tl.constexpr):
    """(first draft index, end, verified drafts k, greedy, 1 / T) of request ``i``."""
    end = tl.load(cu_ptr + i).to(tl.int32)
    start = tl.load(cu_ptr + i - 1, mask=i > 0, other=0).to(tl.int32)
    kk = tl.minimum(end - start, max_k)
    if STOCHASTIC:
        t = tl.load(temp_ptr + i).to(tl.float32)
        greedy = t <= 0.0
        inv_t = tl.math.div_rn(1.0, tl.where(greedy, 1.0, t))  # IEEE, as torch's 1 / T
    else:
        greedy = kk >= 0  # always true
        inv_t = tl.full([], 1.0, tl.float32)
    return start, end, kk, greedy, inv_t


@triton.jit
def _argmax_chunk(
    base, lo, hi, inv_t, SCALE: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr
):
    """Max and first argmax of ``x * inv_t`` over ``[lo, hi)`` (no exponentials).

    Each step issues ``UNROLL`` loads of ``BLOCK`` elements before using them, so that several
    16-byte loads per thread are in flight while the per-lane state stays ``BLOCK`` wide.
    """
    offs = tl.arange(0, BLOCK)
    m_acc = tl.full([BLOCK], float("-inf"), tl.float32)
    i_acc = tl.zeros([BLOCK], tl.int32)
    for v0 in range(lo, hi, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            v = v0 + u * BLOCK + offs
            x = tl.load(base + v, mask=v < hi, other=float("-inf")).to(tl.float32)
            if SCALE:
                x = x * inv_t
            gt = x > m_acc
            m_acc = tl.where(gt, x, m_acc)
            i_acc = tl.where(gt, v, i_acc)
    m = tl.max(m_acc, axis=0)
    am = tl.min(tl.where(m_acc == m, i_acc, BIG32), axis=0)
    return m, am


@triton.jit
def _softmax_chunk(base, lo, hi, inv_t, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Max, sum of exp(x - max) and first argmax of ``x * inv_t`` over ``[lo, hi)``, one pass.

    Per lane: when x exceeds the lane max the sum is rescaled by exp(old - x) and gains 1,
    else it gains exp(x - max): one exponential per element. Lanes start at -FLT_MAX, so a
    masked or -inf element adds exp(-inf) = 0 without a special case.
    """
    offs = tl.arange(0, BLOCK)
    m_acc = tl.full([BLOCK], NEG_MAX, tl.float32)
    s_acc = tl.zeros([BLOCK], tl.float32)
    i_acc = tl.zeros([BLOCK], tl.int32)
    for v0 in range(lo, hi, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            v = v0 + u * BLOCK + offs
            x = tl.load(base + v, mask=v < hi, other=float("-inf")).to(tl.float32) * inv_t
            gt = x > m_acc
            diff = x - m_acc
            e = tl.exp(tl.where(gt, -diff, diff))
            s_acc = tl.where(gt, s_acc * e + 1.0, s_acc + e)
            m_acc = tl.where(gt, x, m_acc)
            i_acc = tl.where(gt, v, i_acc)
    m = tl.max(m_acc, axis=0)
    s = tl.sum(s_acc * tl.exp(m_acc - m), axis=0)
    am = tl.min(tl.where(m_acc == m, i_acc, BIG32), axis=0)
    return m, s, am


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _rows_kernel(
    logits_ptr,
    stride_row,
    draft_ptr,
    cu_ptr,
    q_ptr,
    stride_q,
    temp_ptr,
    seeds_ptr,
    res_ptr,
    ws_ptr,
    B,
    n_rows,
    V,
    max_k,
    n_split,
    chunk,
    STOCHASTIC: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
    BB: tl.constexpr,
    KP2: tl.constexpr,
    SPLIT_P2: tl.constexpr,
):
    # int64 results: out [B, max_k + 1], num_emitted [B], num_accepted [B], argmax [n_rows].
    k1 = max_k + 1
    o_emit = B * k1
    o_acc = o_emit + B
    o_am = o_acc + B
    # int32 workspace (zeroed): row counters, request counters, sample counters, partials, rows.
    w_req = n_rows
    w_pm = n_rows + 2 * B
    w_ps = w_pm + n_rows * n_split
    w_pi = w_ps + n_rows * n_split
    w_rm = w_pi + n_rows * n_split
    w_rs = w_rm + n_rows

    pid = tl.program_id(0)
    row = pid // n_split
    sp = pid - row * n_split
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, V)
    base = logits_ptr + row.to(tl.int64) * stride_row

    # (1) one read of this chunk of the row.
    if STOCHASTIC:  # the request (its temperature, the row's position) decides the work
        i = _request_of_row(cu_ptr, row, B, BB)
        start, end, kk, greedy, inv_t = _request(cu_ptr, temp_ptr, i, max_k, STOCHASTIC)
        if (greedy == 0) & (row - start - i <= kk):
            m, s, am = _softmax_chunk(base, lo, hi, inv_t, BLOCK, UNROLL)
        else:
            m, am = _argmax_chunk(base, lo, hi, inv_t, True, BLOCK, UNROLL)
            s = tl.zeros([], tl.float32)
    else:  # greedy: stream the row first, find the request afterwards
        m, am = _argmax_chunk(base, lo, hi, 1.0, False, BLOCK, UNROLL)
        s = tl.zeros([], tl.float32)
        i = _request_of_row(cu_ptr, row, B, BB)
        start, end, kk, greedy, inv_t = _request(cu_ptr, temp_ptr, i, max_k, STOCHASTIC)
    o = row * n_split + sp
    tl.store(ws_ptr + w_pm + o, _bits(m))
    tl.store(ws_ptr + w_ps + o, _bits(s))
    tl.store(ws_ptr + w_pi + o, am)
    tl.debug_barrier()
    done_row = tl.atomic_add(ws_ptr + row, 1, sem="acq_rel")
    if done_row == n_split - 1:
        # (2) the last split of this row: combine the partials.
        so = tl.arange(0, SPLIT_P2)
        sm = so < n_split
        pb = ws_ptr + row * n_split + so
        pm = tl.where(sm, _f32(tl.load(pb + w_pm, mask=sm, other=0, cache_modifier=".cg")), NEG_MAX)
        ps = tl.where(sm, _f32(tl.load(pb + w_ps, mask=sm, other=0, cache_modifier=".cg")), 0.0)
        pi = tl.load(pb + w_pi, mask=sm, other=BIG32, cache_modifier=".cg")
        rm = tl.max(pm, axis=0)
        rs = tl.sum(tl.where(sm, ps * tl.exp(pm - rm), 0.0), axis=0)
        ra = tl.min(tl.where(sm & (pm == rm), pi, BIG32), axis=0)
        tl.store(res_ptr + o_am + row, ra.to(tl.int64))
        tl.store(ws_ptr + w_rm + row, _bits(rm))
        tl.store(ws_ptr + w_rs + row, _bits(rs))
        tl.debug_barrier()
        done_req = tl.atomic_add(ws_ptr + w_req + i, 1, sem="acq_rel")
        if done_req == end - start:
            # (3) the last row of this request: sequential acceptance, vectorised over positions.
            idx = tl.arange(0, KP2)
            rows = start + i + idx
            jm = idx < kk
            d = tl.load(draft_ptr + start + idx, mask=jm, other=-1).to(tl.int64)
            amx = tl.load(res_ptr + o_am + rows, mask=idx <= kk, other=-2, cache_modifier=".cg")
            valid = jm & (d >= 0) & (d < V)
            ok = d == amx
            if STOCHASTIC:
                rmv = _f32(tl.load(ws_ptr + w_rm + rows, mask=jm, other=0, cache_modifier=".cg"))
                rsv = _f32(tl.load(ws_ptr + w_rs + rows, mask=jm, other=0, cache_modifier=".cg"))
                dc = tl.where(valid, d, 0)
                xoff = rows.to(tl.int64) * stride_row + dc
                xd = tl.load(logits_ptr + xoff, mask=valid, other=0.0).to(tl.float32) * inv_t
                p = tl.exp(xd - rmv) / tl.where(valid, rsv, 1.0)
                if HAS_Q:
                    qoff = (start + idx).to(tl.int64) * stride_q + dc
                    q = tl.load(q_ptr + qoff, mask=valid, other=0.0).to(tl.float32)
                else:
                    q = tl.full([KP2], 1.0, tl.float32)
                zero = tl.zeros([KP2], tl.uint32)
                seed = tl.load(seeds_ptr + i)
                w0, _w1, _w2, _w3 = philox4x32(zero, idx.to(tl.uint32), zero + C_ACCEPT, zero, seed)
                u = to_uniform(w0)
                ok_s = (q > 0) & (u * q < p)
                ok = tl.where(greedy, ok, ok_s)
            ok = valid & ok
            n_acc = tl.minimum(tl.min(tl.where(ok, KP2, idx), axis=0), kk)
            tok = tl.sum(tl.where(idx == n_acc, amx, 0), axis=0)
            if STOCHASTIC:
                tok = tl.where(greedy, tok, -1)  # launch 2 writes the sampled token
            val = tl.where(idx < n_acc, d, tl.where(idx == n_acc, tok, -1))
            tl.store(res_ptr + i * k1 + idx, val, mask=idx < k1)
            tl.store(res_ptr + o_emit + i, (n_acc + 1).to(tl.int64))
            tl.store(res_ptr + o_acc + i, n_acc.to(tl.int64))


@triton.jit
def _race(base, qbase, V, inv_t, m, s, d, rej, seed, pos, c_lo, c_hi, HAS_Q, RESID, SUB):
    """Exponential race over noise chunks [c_lo, c_hi): (best score, first index of it).

    Score of entry v: ``r_v / E_v`` with ``p = exp(x * inv_t - m) / s``, ``r = max(0, p - q)``
    at a rejected position (``RESID`` and ``rej``), else ``r = p``; ``E_v = -log(u_v)`` from
    Philox counter ``(c * SUB + t, pos, PURPOSE_SAMPLE, 0)``, word ``lane`` for entry
    ``c * 4 * SUB + lane * SUB + t`` (the layout of ``philox.sample_noise``).
    """
    t = tl.arange(0, SUB)
    zero = tl.zeros([SUB], tl.uint32)
    rej_v = (t * 0 + rej.to(tl.int32)) > 0
    best = tl.full([SUB], -1.0, tl.float32)
    bidx = tl.zeros([SUB], tl.int32)
    for c in range(c_lo, c_hi):
        w0, w1, w2, w3 = philox4x32(
            (t + c * SUB).to(tl.uint32), zero + pos.to(tl.uint32), zero + C_SAMPLE, zero, seed
        )
        for lane in tl.static_range(4):
            if lane == 0:
                w = w0
            elif lane == 1:
                w = w1
            elif lane == 2:
                w = w2
            else:
                w = w3
            v = c * (4 * SUB) + lane * SUB + t
            vm = v < V
            x = tl.load(base + v, mask=vm, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(x - m) / s
            if RESID:
                if HAS_Q:
                    q = tl.load(qbase + v, mask=vm & rej_v, other=0.0).to(tl.float32)
                else:
                    q = tl.where(v == d, 1.0, 0.0)
                r = tl.where(rej_v, tl.maximum(p - q, 0.0), p)
            else:
                r = p
            e = -tl.log(to_uniform(w))
            sc = tl.where(vm, r / e, -1.0)
            up = sc > best
            best = tl.where(up, sc, best)
            bidx = tl.where(up, v, bidx)
    mx = tl.max(best, axis=0)
    mi = tl.min(tl.where(best == mx, bidx, BIG32), axis=0)
    return mx, mi


# The leading parameters are those of _rows_kernel: verify_triton passes one tuple to both launches.
@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    draft_ptr,
    cu_ptr,
    q_ptr,
    stride_q,
    temp_ptr,
    seeds_ptr,
    res_ptr,
    ws_ptr,
    B,
    n_rows,
    V,
    max_k,
    n_split,
    n_chunks,
    chunks_per_prog,
    s2,
    HAS_Q: tl.constexpr,
    SUB: tl.constexpr,
    S2_P2: tl.constexpr,
):
    k1 = max_k + 1
    o_acc = B * k1 + B
    w_smp = n_rows + B
    w_rm = n_rows + 2 * B + 3 * n_rows * n_split
    w_rs = w_rm + n_rows
    w_br = w_rs + n_rows
    w_bi = w_br + B * s2

    pid = tl.program_id(0)
    i = pid // s2
    sp = pid - i * s2
    start, _end, kk, greedy, inv_t = _request(cu_ptr, temp_ptr, i, max_k, True)
    if greedy:
        return
    n_acc = tl.load(res_ptr + o_acc + i).to(tl.int32)
    rej = n_acc < kk
    row = start + i + n_acc
    m = _f32(tl.load(ws_ptr + w_rm + row))
    s = _f32(tl.load(ws_ptr + w_rs + row))
    seed = tl.load(seeds_ptr + i)
    d = tl.load(draft_ptr + start + n_acc, mask=rej, other=-1).to(tl.int64)
    base = logits_ptr + row.to(tl.int64) * stride_row
    qbase = q_ptr + (start + n_acc).to(tl.int64) * stride_q
    c_lo = sp * chunks_per_prog
    c_hi = tl.minimum(c_lo + chunks_per_prog, n_chunks)
    mx, mi = _race(base, qbase, V, inv_t, m, s, d, rej, seed, n_acc, c_lo, c_hi, HAS_Q, True, SUB)
    o = i * s2 + sp
    tl.store(ws_ptr + w_br + o, _bits(mx))
    tl.store(ws_ptr + w_bi + o, mi)
    tl.debug_barrier()
    done = tl.atomic_add(ws_ptr + w_smp + i, 1, sem="acq_rel")
    if done == s2 - 1:
        so = tl.arange(0, S2_P2)
        sm = so < s2
        pb = ws_ptr + i * s2 + so
        br = tl.where(sm, _f32(tl.load(pb + w_br, mask=sm, other=0, cache_modifier=".cg")), -2.0)
        bi = tl.load(pb + w_bi, mask=sm, other=BIG32, cache_modifier=".cg")
        top = tl.max(br, axis=0)
        tok = tl.min(tl.where(sm & (br == top), bi, BIG32), axis=0)
        if top <= 0.0:  # residual numerically all zero: sample from p instead
            _mx, tok = _race(
                base, qbase, V, inv_t, m, s, d, rej, seed, n_acc, 0, n_chunks, HAS_Q, False, SUB
            )
        tl.store(res_ptr + i * k1 + n_acc, tok.to(tl.int64))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=1024)
def plan(n_rows: int, batch: int, vocab: int, sms: int, cfg: TritonConfig) -> dict[str, int]:
    """Grid sizes of one call: row splits, chunk, sampling splits.

    Parameters
    ----------
    n_rows, batch, vocab : int
        Logits rows (T + B), requests B and vocabulary size V.
    sms : int
        Streaming multiprocessors (8 under the interpreter).
    cfg : TritonConfig
        Launch parameters.

    Returns
    -------
    dict
        ``n_split``, ``chunk`` (elements per row-pass program, a multiple of
        ``cfg.block * cfg.unroll``),
        ``n_chunks`` (noise chunks of the row), ``chunks_per_prog`` and ``s2`` (sampling
        programs per request).
    """
    target = 4 * sms  # programs wanted in flight at once
    step = cfg.block * cfg.unroll
    want = max(_cdiv(vocab, cfg.chunk), _cdiv(target, n_rows))
    n_split = max(1, min(want, _cdiv(vocab, step), SPLIT_MAX))
    chunk = _cdiv(_cdiv(vocab, n_split), step) * step
    n_split = _cdiv(vocab, chunk)
    n_chunks = _cdiv(vocab, 4 * NOISE_SUB)
    cps = max(cfg.sample_chunks, _cdiv(n_chunks, SAMPLE_SPLIT_MAX))
    if batch * _cdiv(n_chunks, cps) < target:  # small batch: split the sampled row finer
        cps = max(_cdiv(n_chunks, SAMPLE_SPLIT_MAX), _cdiv(n_chunks * batch, target), 1)
    s2 = _cdiv(n_chunks, cps)
    return {
        "n_split": n_split,
        "chunk": chunk,
        "n_chunks": n_chunks,
        "chunks_per_prog": cps,
        "s2": s2,
    }


def verify_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    max_k: int | None = None,
    validate: bool | None = None,
    config: TritonConfig | None = None,
) -> VerifyOutput:
    """Triton implementation of :func:`adaptive_spec.kernels.verify.verify`.

    Same arguments and result as ``verify``; ``config`` overrides the launch parameters (for
    tuning). No host synchronisation when ``max_k`` is given and ``validate`` is off, so the call
    can be captured in a CUDA graph.
    """
    max_k = check_verify(
        target_logits,
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        temperature,
        seeds,
        max_k,
        validate,
    )
    dev = target_logits.device
    n_rows, vocab = target_logits.shape
    b = cu_num_draft_tokens.shape[0]
    k1 = max_k + 1
    if b == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        out = torch.full((0, k1), -1, dtype=torch.int64, device=dev)
        return VerifyOutput(out, empty, empty.clone(), empty.clone())
    logits = target_logits if target_logits.stride(1) == 1 else target_logits.contiguous()
    draft = draft_token_ids
    if draft.numel() == 0:
        draft = torch.full((1,), -1, dtype=torch.int64, device=dev)
    elif draft.stride(0) != 1:
        draft = draft.contiguous()
    cu = (
        cu_num_draft_tokens
        if cu_num_draft_tokens.stride(0) == 1
        else cu_num_draft_tokens.contiguous()
    )
    stochastic = temperature is not None
    has_q = draft_probs is not None and draft_probs.shape[0] > 0
    q = logits
    if has_q:
        q = draft_probs if draft_probs.stride(1) == 1 else draft_probs.contiguous()
    temp = temperature if stochastic else cu
    seeds_arg = seeds if stochastic else cu
    interp = triton_interpret()
    if config is None:
        config = (
            INTERPRETER_CONFIG
            if interp
            else DEFAULT_CONFIGS.get(logits.element_size(), DEFAULT_CONFIGS[2])
        )
    sms = (
        _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
        if dev.type == "cuda"
        else 8
    )
    g = plan(n_rows, b, vocab, sms, config)
    n_split, s2 = g["n_split"], g["s2"]
    res = torch.empty(b * k1 + 2 * b + n_rows, dtype=torch.int64, device=dev)
    ws_words = (
        n_rows + 2 * b + 3 * n_rows * n_split + 2 * n_rows + (2 * b * s2 if stochastic else 0)
    )
    ws = torch.zeros(ws_words, dtype=torch.int32, device=dev)
    args = (
        logits,
        logits.stride(0),
        draft,
        cu,
        q,
        q.stride(0),
        temp,
        seeds_arg,
        res,
        ws,
        b,
        n_rows,
        vocab,
        max_k,
        n_split,
    )
    _rows_kernel[(n_rows * n_split,)](
        *args,
        g["chunk"],
        STOCHASTIC=stochastic,
        HAS_Q=has_q,
        BLOCK=config.block,
        UNROLL=config.unroll,
        BB=REQ_BLOCK,
        KP2=_next_pow2(k1),
        SPLIT_P2=SPLIT_MAX,
        num_warps=config.num_warps,
    )
    if stochastic:
        _sample_kernel[(b * s2,)](
            *args,
            g["n_chunks"],
            g["chunks_per_prog"],
            s2,
            HAS_Q=has_q,
            SUB=NOISE_SUB,
            S2_P2=SAMPLE_SPLIT_MAX,
            num_warps=config.sample_warps,
        )
    out, n_emit, n_acc, argmax = res.split_with_sizes([b * k1, b, b, n_rows])
    return VerifyOutput(out.view(b, k1), n_emit, n_acc, argmax)


def compile_specs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """(name, kernel, signature, constexprs) of every kernel variant, for AOT compilation.

    Used by ``python -m adaptive_spec.kernels.check --compile 90``.
    """
    i32, i64 = "i32", "i64"
    specs: list[tuple[str, object, dict[str, str], dict[str, object]]] = []
    for dt in ("fp32", "bf16", "fp16"):
        for mode in ("greedy", "stochastic", "stochastic_q"):
            sig = {"logits_ptr": f"*{dt}", "stride_row": i64, "draft_ptr": "*i64"}
            sig |= {"cu_ptr": "*i64", "q_ptr": "*fp32", "stride_q": i64, "temp_ptr": "*fp32"}
            sig |= {"seeds_ptr": "*i64", "res_ptr": "*i64", "ws_ptr": "*i32", "B": i32}
            sig |= {"n_rows": i32, "V": i32, "max_k": i32, "n_split": i32}
            rows = sig | {"chunk": i32}
            cfg = DEFAULT_CONFIGS[4 if dt == "fp32" else 2]
            const = {"STOCHASTIC": mode != "greedy", "HAS_Q": mode == "stochastic_q"}
            const |= {"BLOCK": cfg.block, "UNROLL": cfg.unroll, "BB": REQ_BLOCK, "KP2": 16}
            const |= {"SPLIT_P2": SPLIT_MAX}
            specs.append((f"verify rows {dt} {mode}", _rows_kernel, rows, const))
            if mode != "greedy":
                smp = sig | {"n_chunks": i32, "chunks_per_prog": i32, "s2": i32}
                const = {"HAS_Q": mode == "stochastic_q", "SUB": NOISE_SUB}
                const |= {"S2_P2": SAMPLE_SPLIT_MAX}
                specs.append((f"verify sample {dt} {mode}", _sample_kernel, smp, const))
    return specs
