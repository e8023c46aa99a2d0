"""Triton kernels of :func:`adaptive_spec.kernels.verify.verify` (imported only when used).

Four launches: (1) split-vocabulary row statistics (running max, sum of exponentials, argmax)
over every logits row, which is the one full read of the logits; (2) per request, combine the
partial statistics, write the argmax of every row and run the sequential acceptance test;
(3) for stochastic requests only, one more pass over the single row to sample from (the
rejected position or the bonus position), split over the vocabulary; (4) combine (3)'s partial
winners and write the emitted token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, triton_interpret
from ._philox_triton import philox4x32, to_uniform
from .philox import NOISE_SUB, PURPOSE_ACCEPT, PURPOSE_SAMPLE
from .rejection import VerifyOutput, _check_args, row_request_index

# Globals used inside kernels must be constexpr.
C_ACCEPT = tl.constexpr(PURPOSE_ACCEPT)
C_SAMPLE = tl.constexpr(PURPOSE_SAMPLE)


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride_row,
    row_inv_t_ptr,
    part_m_ptr,
    part_s_ptr,
    part_i_ptr,
    V,
    chunk,
    n_split,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    inv_t = tl.load(row_inv_t_ptr + row)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    offs = tl.arange(0, BLOCK)
    m_acc = tl.full([BLOCK], float("-inf"), tl.float32)
    s_acc = tl.zeros([BLOCK], tl.float32)
    i_acc = tl.zeros([BLOCK], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for v0 in range(lo, hi, BLOCK):
        v = v0 + offs
        x = tl.load(base + v, mask=v < hi, other=float("-inf")).to(tl.float32) * inv_t
        gt = x > m_acc
        d = tl.where(gt, m_acc - x, x - m_acc)
        e = tl.where(x == float("-inf"), 0.0, tl.exp(d))
        s_acc = tl.where(gt, s_acc * e + 1.0, s_acc + e)
        m_acc = tl.where(gt, x, m_acc)
        i_acc = tl.where(gt, v, i_acc)
    m = tl.max(m_acc, axis=0)
    w = tl.where(m_acc == float("-inf"), 0.0, s_acc * tl.exp(m_acc - m))
    s = tl.sum(w, axis=0)
    big = 2147483647
    i = tl.min(tl.where(m_acc == m, i_acc, big), axis=0)
    out = row * n_split + split
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, s)
    tl.store(part_i_ptr + out, i)


@triton.jit
def _accept_kernel(
    logits_ptr,
    stride_row,
    draft_ptr,
    cu_ptr,
    draft_probs_ptr,
    inv_t_ptr,
    greedy_ptr,
    seeds_ptr,
    part_m_ptr,
    part_s_ptr,
    part_i_ptr,
    n_split,
    row_m_ptr,
    row_s_ptr,
    argmax_ptr,
    out_ptr,
    n_acc_ptr,
    sample_pos_ptr,
    rejected_ptr,
    V,
    max_k,
    STOCHASTIC: tl.constexpr,
    HAS_Q: tl.constexpr,
    SPLIT_P2: tl.constexpr,
):
    i = tl.program_id(0)
    end = tl.load(cu_ptr + i).to(tl.int64)
    start = tl.load(cu_ptr + i - 1, mask=i > 0, other=0).to(tl.int64)
    kk = tl.minimum(end - start, max_k)
    greedy = tl.load(greedy_ptr + i) != 0
    inv_t = tl.load(inv_t_ptr + i)
    if STOCHASTIC:
        seed = tl.load(seeds_ptr + i)
    so = tl.arange(0, SPLIT_P2)
    smask = so < n_split
    n_acc = tl.zeros([], tl.int64)
    rejected = tl.zeros([], tl.int1)
    sample_pos = kk
    greedy_tok = tl.zeros([], tl.int64)
    for j in range(0, kk + 1):
        row = start + i + j
        pm = tl.load(part_m_ptr + row * n_split + so, mask=smask, other=float("-inf"))
        ps = tl.load(part_s_ptr + row * n_split + so, mask=smask, other=0.0)
        pi = tl.load(part_i_ptr + row * n_split + so, mask=smask, other=2147483647)
        m = tl.max(pm, axis=0)
        s = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - m)), axis=0)
        am = tl.min(tl.where(pm == m, pi, 2147483647), axis=0).to(tl.int64)
        tl.store(argmax_ptr + row, am)
        tl.store(row_m_ptr + row, m)
        tl.store(row_s_ptr + row, s)
        active = (j < kk) & (rejected == 0)
        d = tl.load(draft_ptr + start + j, mask=j < kk, other=-1).to(tl.int64)
        valid = active & (d >= 0) & (d < V)
        ok = d == am
        if STOCHASTIC:
            dc = tl.where(valid, d, 0)
            xd = tl.load(logits_ptr + row * stride_row + dc).to(tl.float32) * inv_t
            p = tl.exp(xd - m) / s
            if HAS_Q:
                q = tl.load(draft_probs_ptr + (start + j) * V + dc, mask=valid, other=0.0)
                q = q.to(tl.float32)
            else:
                q = 1.0
            zero = tl.zeros([], tl.uint32)
            w0, _w1, _w2, _w3 = philox4x32(
                zero, (start * 0 + j).to(tl.uint32), zero + C_ACCEPT, zero, seed
            )
            u = to_uniform(w0)
            ok_s = (q > 0) & (u * q < p)
            ok = tl.where(greedy, ok, ok_s)
        ok = valid & ok
        tl.store(out_ptr + i * (max_k + 1) + j, d, mask=ok)
        n_acc += ok.to(tl.int64)
        newly = active & (ok == 0)
        is_bonus = (j == kk) & (rejected == 0)
        greedy_tok = tl.where(newly | is_bonus, am, greedy_tok)
        sample_pos = tl.where(newly, j, sample_pos)
        rejected = rejected | newly
    tl.store(n_acc_ptr + i, n_acc)
    tl.store(sample_pos_ptr + i, sample_pos)
    tl.store(rejected_ptr + i, rejected.to(tl.int8))
    tl.store(out_ptr + i * (max_k + 1) + n_acc, greedy_tok, mask=greedy)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    draft_ptr,
    cu_ptr,
    draft_probs_ptr,
    inv_t_ptr,
    greedy_ptr,
    seeds_ptr,
    row_m_ptr,
    row_s_ptr,
    sample_pos_ptr,
    rejected_ptr,
    best_r_ptr,
    best_ri_ptr,
    best_p_ptr,
    best_pi_ptr,
    V,
    chunks_per_split,
    n_split,
    HAS_Q: tl.constexpr,
    SUB: tl.constexpr,
):
    i = tl.program_id(0)
    split = tl.program_id(1)
    greedy = tl.load(greedy_ptr + i) != 0
    if greedy:
        return
    end = tl.load(cu_ptr + i).to(tl.int64)
    start = tl.load(cu_ptr + i - 1, mask=i > 0, other=0).to(tl.int64)
    pos = tl.load(sample_pos_ptr + i)
    rej = tl.load(rejected_ptr + i) != 0
    row = start + i + pos
    m = tl.load(row_m_ptr + row)
    s = tl.load(row_s_ptr + row)
    inv_t = tl.load(inv_t_ptr + i)
    seed = tl.load(seeds_ptr + i)
    d = tl.load(draft_ptr + start + pos, mask=rej & (pos < end - start), other=-1).to(tl.int64)
    t = tl.arange(0, SUB)
    zero = tl.zeros([SUB], tl.uint32)
    br = tl.full([SUB], -1.0, tl.float32)
    bri = tl.zeros([SUB], tl.int64)
    bp = tl.full([SUB], -1.0, tl.float32)
    bpi = tl.zeros([SUB], tl.int64)
    base = logits_ptr + row * stride_row
    qbase = draft_probs_ptr + (start + pos) * V
    c_lo = split * chunks_per_split
    for c in range(c_lo, c_lo + chunks_per_split):
        w0, w1, w2, w3 = philox4x32(
            (t + c * SUB).to(tl.uint32),
            zero + pos.to(tl.uint32),
            zero + C_SAMPLE,
            zero,
            seed,
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
            v = t.to(tl.int64) + c * (4 * SUB) + lane * SUB
            vm = v < V
            x = tl.load(base + v, mask=vm, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(x - m) / s
            if HAS_Q:
                q = tl.load(qbase + v, mask=vm & (t * 0 + rej.to(tl.int32) > 0), other=0.0)
                q = q.to(tl.float32)
            else:
                q = tl.where(v == d, 1.0, 0.0)
            r = tl.where(rej, tl.maximum(p - q, 0.0), p)
            e = -tl.log(to_uniform(w))
            sr = tl.where(vm, r / e, -1.0)
            sp = tl.where(vm, p / e, -1.0)
            up_r = sr > br
            br = tl.where(up_r, sr, br)
            bri = tl.where(up_r, v, bri)
            up_p = sp > bp
            bp = tl.where(up_p, sp, bp)
            bpi = tl.where(up_p, v, bpi)
    big = 9223372036854775807
    mr = tl.max(br, axis=0)
    mri = tl.min(tl.where(br == mr, bri, big), axis=0)
    mp = tl.max(bp, axis=0)
    mpi = tl.min(tl.where(bp == mp, bpi, big), axis=0)
    o = i * n_split + split
    tl.store(best_r_ptr + o, mr)
    tl.store(best_ri_ptr + o, mri)
    tl.store(best_p_ptr + o, mp)
    tl.store(best_pi_ptr + o, mpi)


@triton.jit
def _finalize_kernel(
    greedy_ptr,
    n_acc_ptr,
    best_r_ptr,
    best_ri_ptr,
    best_p_ptr,
    best_pi_ptr,
    out_ptr,
    max_k,
    n_split,
    SPLIT_P2: tl.constexpr,
):
    i = tl.program_id(0)
    greedy = tl.load(greedy_ptr + i) != 0
    if greedy:
        return
    so = tl.arange(0, SPLIT_P2)
    sm = so < n_split
    big = 9223372036854775807
    br = tl.load(best_r_ptr + i * n_split + so, mask=sm, other=-2.0)
    bri = tl.load(best_ri_ptr + i * n_split + so, mask=sm, other=big)
    bp = tl.load(best_p_ptr + i * n_split + so, mask=sm, other=-2.0)
    bpi = tl.load(best_pi_ptr + i * n_split + so, mask=sm, other=big)
    mr = tl.max(br, axis=0)
    ir = tl.min(tl.where(br == mr, bri, big), axis=0)
    mp = tl.max(bp, axis=0)
    ip = tl.min(tl.where(bp == mp, bpi, big), axis=0)
    tok = tl.where(mr > 0, ir, ip)
    n_acc = tl.load(n_acc_ptr + i)
    tl.store(out_ptr + i * (max_k + 1) + n_acc, tok)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


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
) -> VerifyOutput:
    """Triton implementation of :func:`adaptive_spec.kernels.verify.verify`."""
    max_k = _check_args(
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
    out = torch.full((b, max_k + 1), -1, dtype=torch.int64, device=dev)
    n_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    argmax = torch.empty(n_rows, dtype=torch.int64, device=dev)
    if b == 0:
        return VerifyOutput(out, n_acc + 1, n_acc, argmax)
    logits = target_logits if target_logits.stride(1) == 1 else target_logits.contiguous()
    draft = draft_token_ids.contiguous()
    if draft.numel() == 0:
        draft = torch.full((1,), -1, dtype=torch.int64, device=dev)
    cu = cu_num_draft_tokens.contiguous()
    q = draft_probs.contiguous() if draft_probs is not None else None
    if temperature is None:
        greedy = torch.ones(b, dtype=torch.int8, device=dev)
        inv_t = torch.ones(b, dtype=torch.float32, device=dev)
        stochastic = False
    else:
        t32 = temperature.to(torch.float32)
        g = t32 <= 0
        greedy = g.to(torch.int8)
        inv_t = torch.where(g, torch.ones_like(t32), 1.0 / t32)
        stochastic = True
    row_inv_t = inv_t[row_request_index(cu, n_rows)].contiguous()
    seeds_arg = seeds.contiguous() if seeds is not None else greedy

    # (1) row statistics, split over the vocabulary so that small batches still fill the GPU.
    interp = triton_interpret()
    block = 128 if interp else (2048 if logits.element_size() == 4 else 4096)
    target = _num_programs_target(dev)
    max_split = max(1, -(-vocab // (block if interp else 8 * block)))
    n_split = max(1, min(max_split, -(-target // n_rows)))
    per_split = _cdiv(vocab, n_split)
    chunk = _cdiv(per_split, block) * block
    n_split = -(-vocab // chunk)
    part_m = torch.empty(n_rows * n_split, dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    part_i = torch.empty(n_rows * n_split, dtype=torch.int32, device=dev)
    _row_stats_kernel[(n_rows, n_split)](
        logits,
        logits.stride(0),
        row_inv_t,
        part_m,
        part_s,
        part_i,
        vocab,
        chunk,
        n_split,
        BLOCK=block,
        num_warps=8 if not interp else 1,
    )

    # (2) acceptance, per request.
    row_m = torch.empty(n_rows, dtype=torch.float32, device=dev)
    row_s = torch.empty_like(row_m)
    sample_pos = torch.empty(b, dtype=torch.int64, device=dev)
    rejected = torch.empty(b, dtype=torch.int8, device=dev)
    _accept_kernel[(b,)](
        logits,
        logits.stride(0),
        draft,
        cu,
        q if q is not None else row_m,
        inv_t,
        greedy,
        seeds_arg,
        part_m,
        part_s,
        part_i,
        n_split,
        row_m,
        row_s,
        argmax,
        out,
        n_acc,
        sample_pos,
        rejected,
        vocab,
        max_k,
        STOCHASTIC=stochastic,
        HAS_Q=q is not None,
        SPLIT_P2=next_pow2(n_split),
        num_warps=1,
    )
    if stochastic:
        # (3) + (4): sample the emitted token of stochastic requests.
        n_chunks = -(-vocab // (4 * NOISE_SUB))
        s2 = max(1, min(n_chunks, -(-target // b)))
        cps = -(-n_chunks // s2)
        s2 = -(-n_chunks // cps)
        best_r = torch.empty(b * s2, dtype=torch.float32, device=dev)
        best_ri = torch.empty(b * s2, dtype=torch.int64, device=dev)
        best_p = torch.empty_like(best_r)
        best_pi = torch.empty_like(best_ri)
        _sample_kernel[(b, s2)](
            logits,
            logits.stride(0),
            draft,
            cu,
            q if q is not None else row_m,
            inv_t,
            greedy,
            seeds_arg,
            row_m,
            row_s,
            sample_pos,
            rejected,
            best_r,
            best_ri,
            best_p,
            best_pi,
            vocab,
            cps,
            s2,
            HAS_Q=q is not None,
            SUB=NOISE_SUB,
            num_warps=4 if not interp else 1,
        )
        _finalize_kernel[(b,)](
            greedy,
            n_acc,
            best_r,
            best_ri,
            best_p,
            best_pi,
            out,
            max_k,
            s2,
            SPLIT_P2=next_pow2(s2),
            num_warps=1,
        )
    return VerifyOutput(out, n_acc + 1, n_acc, argmax)
