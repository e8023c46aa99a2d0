"""Verification of draft tokens by rejection sampling, batched and flattened as in vLLM.

Algorithm: speculative sampling of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding", ICML) and Chen et al. 2023 ("Accelerating Large Language Model
Decoding with Speculative Sampling"). For request i with draft tokens d_0..d_{k-1} and target
distributions p_0..p_k (row j is the target's distribution after the accepted prefix and
d_0..d_{j-1}):

* greedy (temperature 0): accept d_j while d_j == argmax p_j; then emit argmax p_j at the first
  mismatch (the correction) or argmax p_k when all are accepted (the bonus token);
* stochastic (temperature T > 0, p = softmax(logits / T)): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a sample of
  normalize(max(0, p_j - q_j)); when all are accepted emit a bonus sample of p_k. ``q_j`` is the
  distribution d_j was drawn from; ``draft_probs=None`` means a deterministic proposer, i.e. q_j is
  one-hot on d_j (then the residual is p_j with d_j removed).

Randomness is counter-based (Philox, ``philox.py``) keyed by the request's seed and the draft
position, so a request's result never depends on its batch-mates. Acceptance: ``u * q < p`` with
``u`` from ``accept_uniforms(seed, j)``. Sampling: exponential race
``argmax_v r_v / E_v`` with ``E_v = -log(u_v)`` from ``sample_noise(seed, j, V)``, which returns v
with probability r_v / sum(r). If the residual is numerically all zero (p == q), the sample falls
back to p (in exact arithmetic that rejection cannot happen).

Layout (vLLM V1): ``draft_token_ids`` [T] holds the requests' drafts back to back;
``cu_num_draft_tokens`` [B] holds the inclusive cumulative counts (so request i owns drafts
``cu[i-1]:cu[i]``, with cu[-1] = 0); ``target_logits`` [T + B, V] holds k_i + 1 rows per request
in the same order: row ``cu[i-1] + i + j`` is draft position j, row ``cu[i] + i`` the bonus
position. Zero-length drafts are allowed (one row: the plain decoding sample).

The PyTorch reference (``verify_reference``) runs anywhere; the Triton path
(``_rejection_triton.py``) is one launch for a greedy batch and two for a stochastic one: a
split-vocabulary pass reads every logits row once (argmax; max and sum of exponentials only for
stochastic rows), its last program per request runs the acceptance test, and stochastic requests
read the one row they sample from once more. Offsets, temperatures and row-to-request lookup are
computed in-kernel: no host synchronisation when ``max_k`` is given. ``verify`` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import VerifyOutput, check_verify
from ._common import use_triton
from .philox import accept_uniforms, sample_noise


def flatten_drafts(
    drafts: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request draft lists into vLLM's flattened layout.

    Parameters
    ----------
    drafts : sequence of sequences of int
        Draft tokens per request (lengths may differ, including 0).
    device : torch.device or str
        Where to put the result.

    Returns
    -------
    draft_token_ids : torch.Tensor
        int64 [T], T = total draft tokens.
    cu_num_draft_tokens : torch.Tensor
        int64 [B], inclusive cumulative counts.
    """
    parts = [torch.as_tensor(d, dtype=torch.int64).reshape(-1) for d in drafts]
    counts = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return flat.to(device), torch.cumsum(counts, 0).to(device)


def row_request_index(cu_num_draft_tokens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index of every logits row (int64 [T + B]); no host synchronisation."""
    cu = cu_num_draft_tokens.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    rows_per_req = cu - starts + 1
    b = cu.shape[0]
    return torch.repeat_interleave(
        torch.arange(b, device=cu.device), rows_per_req, output_size=num_rows
    )


def verify_reference(
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
    """PyTorch reference of :func:`verify` (same arguments, same result)."""
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
    cu = cu_num_draft_tokens.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    kk = (cu - starts).clamp(max=max_k)
    req = torch.arange(b, device=dev)
    out = torch.full((b, max_k + 1), -1, dtype=torch.int64, device=dev)
    if b == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return VerifyOutput(
            out, empty, empty.clone(), torch.zeros(0, dtype=torch.int64, device=dev)
        )

    if temperature is None:
        greedy = torch.ones(b, dtype=torch.bool, device=dev)
        inv_t = torch.ones(b, dtype=torch.float32, device=dev)
    else:
        t32 = temperature.to(torch.float32)
        greedy = t32 <= 0
        inv_t = torch.where(greedy, torch.ones_like(t32), 1.0 / t32)
    row_req = row_request_index(cu, n_rows)
    x = target_logits.to(torch.float32) * inv_t[row_req, None]  # [R, V]
    m = x.max(dim=-1).values
    amax = x.argmax(dim=-1)
    s = torch.exp(x - m[:, None]).sum(dim=-1)

    n_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    rejected = torch.zeros(b, dtype=torch.bool, device=dev)
    sample_pos = kk.clone()
    stochastic = not bool(greedy.all())
    for j in range(max_k):
        active = (j < kk) & ~rejected
        didx = (starts + j).clamp(max=max(draft_token_ids.shape[0] - 1, 0))
        row = (starts + req + j).clamp(max=n_rows - 1)
        d = (
            draft_token_ids[didx].to(torch.int64)
            if draft_token_ids.numel()
            else torch.full_like(starts, -1)
        )
        valid = active & (d >= 0) & (d < vocab)
        dc = torch.where(valid, d, torch.zeros_like(d))
        ok = d == amax[row]
        if stochastic:
            p = torch.exp(x[row, dc] - m[row]) / s[row]
            if draft_probs is None or draft_probs.shape[0] == 0:
                q = torch.ones_like(p)
            else:
                q = draft_probs[didx, dc].to(torch.float32)
            u = accept_uniforms(seeds, torch.full_like(starts, j))
            ok_s = (q > 0) & (u * q < p)
            ok = torch.where(greedy, ok, ok_s)
        ok = valid & ok
        out[:, j] = torch.where(ok, d, out[:, j])
        n_acc += ok.to(torch.int64)
        newly = active & ~ok
        sample_pos = torch.where(newly, torch.full_like(sample_pos, j), sample_pos)
        rejected |= newly

    srow = starts + req + sample_pos
    token = amax[srow]
    if stochastic:
        xs = x[srow]  # [B, V]
        ps = torch.exp(xs - m[srow, None]) / s[srow, None]
        sdidx = (starts + sample_pos).clamp(max=max(draft_token_ids.shape[0] - 1, 0))
        if draft_probs is None:
            if draft_token_ids.numel():
                dsel = draft_token_ids[sdidx].to(torch.int64)
            else:
                dsel = torch.full_like(starts, -1)
            vocab_ids = torch.arange(vocab, device=dev)
            q = (vocab_ids[None, :] == dsel[:, None]).to(torch.float32)
        elif draft_probs.shape[0] == 0:
            q = torch.zeros_like(ps)
        else:
            q = draft_probs[sdidx].to(torch.float32)
        resid = torch.where(rejected[:, None], (ps - q).clamp(min=0.0), ps)
        noise = sample_noise(seeds, sample_pos, vocab)
        score_r = resid / noise
        score_p = ps / noise
        best_r = score_r.max(dim=-1)
        pick = torch.where(best_r.values > 0, best_r.indices, score_p.argmax(dim=-1))
        token = torch.where(greedy, token, pick)
    out[req, n_acc] = token
    return VerifyOutput(out, n_acc + 1, n_acc, amax)


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    max_k: int | None = None,
    validate: bool | None = None,
    backend: str = "auto",
) -> VerifyOutput:
    """Verify a batch of draft tokens against the target's logits (rejection sampling).

    Leviathan et al. 2023 / Chen et al. 2023 speculative sampling; greedy requests use exact
    argmax matching. See the module docstring for the layout and the random-number scheme.

    Parameters
    ----------
    target_logits : torch.Tensor
        float32/float16/bfloat16 [T + B, V]: k_i + 1 rows per request (draft positions then the
        bonus position), requests back to back. Each row needs at least one finite logit; -inf
        masks a token (e.g. after top-k/top-p). Computation is in float32.
    draft_token_ids : torch.Tensor
        int32/int64 [T]: the drafts, back to back. An id outside [0, V) is rejected.
    cu_num_draft_tokens : torch.Tensor
        int32/int64 [B]: inclusive cumulative draft counts (non-decreasing, last = T).
    draft_probs : torch.Tensor or None
        float [T, V]: q_j, the distribution each draft token was drawn from; None = one-hot on
        the draft token (n-gram, Jacobi and other deterministic proposers).
    temperature : torch.Tensor or None
        float [B]: 0 = greedy; T > 0 = stochastic with p = softmax(logits / T). None = all greedy.
    seeds : torch.Tensor or None
        int64 [B]: per-request Philox keys; required with ``temperature``. Pass a fresh seed per
        request per step (e.g. a hash of the request seed and the step).
    max_k : int or None
        Output width minus one; None computes max k_i (one host synchronisation on CUDA). Drafts
        past ``max_k`` are not verified.
    validate : bool or None
        Check values (monotone offsets, temperature >= 0); default: only for CPU tensors, since
        it synchronises. Shapes and dtypes are always checked.
    backend : {"auto", "torch", "triton"}
        "auto": Triton on CUDA tensors when it imports, else the PyTorch reference.

    Returns
    -------
    VerifyOutput
        Emitted tokens [B, max_k + 1] (-1 padded), counts, accepted counts, target argmax [T + B].

    Raises
    ------
    TypeError, ValueError
        A malformed argument (the message names it).
    RuntimeError
        ``backend="triton"`` where Triton cannot run.

    Examples
    --------
    >>> import torch
    >>> logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    >>> draft, cu = flatten_drafts([[1, 0]])
    >>> out = verify(logits, draft, cu)
    >>> out.output_token_ids.tolist(), out.num_accepted.tolist()
    ([[1, 2, -1]], [1])
    """
    args = (target_logits, draft_token_ids, cu_num_draft_tokens)
    kw = dict(
        draft_probs=draft_probs,
        temperature=temperature,
        seeds=seeds,
        max_k=max_k,
        validate=validate,
    )
    if use_triton(backend, [*args, draft_probs, temperature, seeds]):
        from ._rejection_triton import verify_triton

        return verify_triton(*args, **kw)
    return verify_reference(*args, **kw)
