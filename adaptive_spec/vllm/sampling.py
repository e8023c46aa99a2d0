"""Four costs of vLLM 0.32's rejection sampler that no draft token needs, removed losslessly.

With a ``speculative_config``, vLLM's model runner sends **every** step through
``RejectionSampler.forward``, also a step in which no request verifies a draft token. At temperature
> 0 that path draws the noise for "recovered" tokens (the token emitted at a rejected position) as one
exponential variate per request *and vocabulary entry*, ``[batch, vocab]``, whatever the number of
draft tokens: on a 2-core CPU, 20 ms per step at batch 16 with SmolLM2's 49,152-token vocabulary,
about a fifth of the step (measured with cProfile: the speculative engine decoded 69 tokens/s at k = 0
against 92 for the engine without speculation, c = 16, temperature 1.0, float32). Only the rows of
requests with draft tokens are ever read by the recovered-token kernel.

* :func:`sample_without_drafts`: when no request in the step has a draft token, the step's tokens are
  the bonus tokens alone; the rejection sampler's other work (empty target logits, the recovered-token
  noise) is skipped. A greedy step, or one whose requests have their own seeds or anything but a
  temperature shaping their distributions, is sampled by vLLM's own sampler exactly as the rejection
  sampler samples it (``predict_bonus_token=True``: penalties see the same token history; per-request
  generators draw the same numbers). Other sampled steps on the CPU use :func:`sample_rows`: inverse transform
  from one uniform per row, 1.2 ms at batch 16 against 2.5 ms for vLLM's sampler with its fused
  Gumbel-max kernel (2-core Xeon, float32, SmolLM2's vocabulary). Applies only when no
  log-probabilities are requested.
* :func:`verify_sampled`: a sampled step with draft tokens from a deterministic proposer (n-gram,
  suffix, Jacobi: no draft probabilities), temperature the only shaping, no seeded request. vLLM
  copies the target rows to float32 twice, computes every probability row, samples every bonus row and
  a recovered token for every draft position; here each target row is exponentiated once and only
  the rows that emit a token are sampled: 1.75 ms against 3.97 ms at batch 16 with 8 draft tokens
  (same machine).
* :func:`verify_greedy`: a step with draft tokens in which every request is greedy and nothing edits
  the logits (no penalties, logit bias, bad words, allowed-token mask, min-tokens, log-probabilities).
  vLLM copies the target rows to float32 (twice: once kept for log-probabilities), takes their argmax,
  and samples the bonus rows through its sampler (another float32 copy, and a raw-logits copy for
  log-probabilities nobody asked for): 2.0 ms of sampling per step at batch 16 with up to 32 draft
  tokens (bfloat16, 2-core Xeon, in the engine; full-batch steps with drafts took 0.9 ms less with the
  shortcut). Here one ``max`` over every row in the logits' own dtype
  (exact: float32 holds every bfloat16 and float16 value, and both take the first maximal index)
  gives the target and the bonus tokens, then the greedy acceptance rule picks the output.
* :func:`fix_recovered_token_sampling`: for steps with draft tokens, vLLM draws that noise for every
  request (then runs its kernel over the whole vocabulary per draft position): 2.0, 3.1 and 5.3-5.6 ms
  at 2, 4 and 8 draft tokens in a step at batch 16 (bfloat16, 2-core Xeon, in the engine). The replacement,
  :func:`recovered_tokens`, samples each draft position's residual distribution by inverse
  transform from one uniform. Process-wide, idempotent, CPU platform only.
* :func:`draft_probability_conflict`: not a shortcut but a guard. A draft model with
  ``draft_sample_method="probabilistic"`` makes vLLM verify every request's draft tokens against the
  draft model's cached probabilities, also tokens another proposer drafted; ``AdaptiveSpec`` refuses
  that configuration at attach.

None changes an output distribution, and greedy outputs stay token for token those of vLLM's rejection
sampler. ``tests/test_vllm_sampling.py`` checks that a greedy or seeded step without draft tokens
gives exactly the tokens vLLM's rejection sampler gives from the same random state, and a sampled one
the target's distribution; that :func:`verify_greedy` gives exactly its tokens on bfloat16 logits full
of ties; that :func:`verify_sampled` follows speculative sampling's exact output distribution, as
vLLM's rejection sampler does (chi-square against the exact probabilities and against vLLM's tokens),
gives greedy requests in a mixed step vLLM's tokens, and both decline every step they do not cover;
and that the recovered tokens follow the residual distribution. ``tests/test_sampling_reference.py``
checks :func:`verify_sampled` and :func:`recovered_tokens` token for token against a float64
reference speculative sampler (mixed temperatures, a 2,500-token vocabulary, drafts at block edges,
placeholders); ``tests/test_lossless_draft_probs.py`` the guard. ``docs/correctness.md`` lists them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_fixed = False


def sample_without_drafts(
    sampler: Any, metadata: Any, logits: torch.Tensor, sampling_metadata: Any
) -> Any | None:
    """The step's ``SamplerOutput`` from the bonus positions alone, or None when the step has a draft
    token or needs what only the rejection sampler computes (log-probabilities).

    ``metadata``: vLLM's ``SpecDecodeMetadata`` (``num_draft_tokens`` list[int] per request,
    ``bonus_logits_indices`` int tensor [batch]); ``logits``: float [num_tokens + batch, vocab]. The
    result's ``sampled_token_ids`` is int32 [batch, 1], as the rejection sampler returns for a step
    whose longest draft is 0."""
    if any(metadata.num_draft_tokens):
        return None
    if sampling_metadata.max_num_logprobs is not None or getattr(
        sampling_metadata, "logprob_token_ids", None
    ):
        return None
    sm = sampling_metadata
    if (
        logits.device.type == "cpu"
        and not sm.all_greedy
        and not sm.generators
        and _temperature_only(sm)
    ):
        from vllm.v1.outputs import SamplerOutput

        bonus = logits.index_select(0, metadata.bonus_logits_indices.to(torch.int64))
        tok = sample_rows(bonus, sm.temperature)
        return SamplerOutput(
            sampled_token_ids=tok.to(torch.int32).view(-1, 1), logprobs_tensors=None
        )
    out = sampler(
        logits=logits[metadata.bonus_logits_indices],
        sampling_metadata=sampling_metadata,
        predict_bonus_token=True,
    )
    out.sampled_token_ids = out.sampled_token_ids.to(torch.int32).view(-1, 1)
    out.logprobs_tensors = None
    return out


#: vLLM's marker for an output position after a rejection (``rejection_sampler.PLACEHOLDER_TOKEN_ID``).
PLACEHOLDER_TOKEN_ID = -1


def _logits_untouched(sampling_metadata: Any) -> bool:
    """Whether nothing edits a greedy step's logits before its argmax: no penalties, bad words,
    allowed-token mask, thinking budget, and every logits processor that can move an argmax is one
    of vLLM's built-in logit-bias or min-tokens processors with no request using it."""
    sm = sampling_metadata
    if not sm.no_penalties or sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids:
        return False
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    procs = getattr(sm, "logitsprocs", None)
    if procs is None:
        return True
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    for proc in procs.non_argmax_invariant:
        if type(proc) is LogitBiasLogitsProcessor and not proc.biases:
            continue
        if type(proc) is MinTokensLogitsProcessor and not proc.min_toks:
            continue
        return False
    return True


def _temperature_only(sampling_metadata: Any) -> bool:
    """Whether a sampled step's distributions are ``softmax(logits / temperature)`` and nothing else:
    the logits untouched (:func:`_logits_untouched`), no top-k, top-p or min-p, and no
    log-probabilities requested."""
    sm = sampling_metadata
    if sm.top_k is not None or sm.top_p is not None:
        return False
    if sm.max_num_logprobs is not None or getattr(sm, "logprob_token_ids", None):
        return False
    if not _logits_untouched(sm):
        return False
    procs = getattr(sm, "logitsprocs", None)
    if procs is None:
        return True
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for proc in procs.argmax_invariant:
        if type(proc) is MinPLogitsProcessor and not proc.min_p_count:
            continue
        return False
    return True


def _greedy_eps() -> float:
    """vLLM's threshold below which a temperature means greedy (``sampler._SAMPLING_EPS``)."""
    try:
        from vllm.v1.sample.sampler import _SAMPLING_EPS
    except ImportError:  # pragma: no cover - the value of vLLM 0.32
        return 1e-5
    return float(_SAMPLING_EPS)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (float, any dtype [n, vocab]): the row's argmax (first maximal
    index) where its ``temperature`` (float [n]) is below vLLM's greedy threshold, else a sample of
    ``softmax(logits / temperature)`` by :func:`inverse_transform` from one uniform per row (global
    generator). Returns int64 [n].

    vLLM's CPU sampler runs a fused Gumbel-max kernel, one noise value per request and vocabulary
    entry: 2.2 ms for 16 rows of SmolLM2's 49,152 entries on 2 cores, against 0.9 ms here (one
    exponential per entry, block sums, one uniform per row). Same distribution, other random numbers."""
    n = int(logits.shape[0])
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    greedy = temperature.to(torch.float32) < _greedy_eps()
    g_rows = torch.nonzero(greedy).squeeze(1)
    r_rows = torch.nonzero(~greedy).squeeze(1)
    if g_rows.numel():
        out[g_rows] = logits.index_select(0, g_rows).max(dim=-1).indices
    if r_rows.numel():
        x = logits.index_select(0, r_rows).to(torch.float32)
        t = temperature.index_select(0, r_rows).to(torch.float32).unsqueeze(1)
        w = x.sub_(x.amax(dim=-1, keepdim=True)).div_(t).exp_()
        u = torch.rand(w.shape[0], dtype=torch.float64, device=logits.device)
        out[r_rows] = inverse_transform(w, u)
    return out


def verify_sampled(
    metadata: Any,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    sampling_metadata: Any,
    *,
    synthetic_mode: bool = False,
) -> Any | None:
    """The step's ``SamplerOutput`` by rejection sampling of deterministic drafts, or None where it
    does not apply: an all-greedy step (:func:`verify_greedy`), a step without draft tokens
    (:func:`sample_without_drafts`), draft probabilities (a draft model), anything but temperature
    shaping the distributions (:func:`_temperature_only`), a request with its own seed (vLLM's
    sampler then runs, so that a seeded request draws the same random numbers whatever its
    batch-mates), vLLM's synthetic acceptance mode, or logits on a GPU (vLLM's kernels there cost
    microseconds).

    Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with ``q`` one-hot on the draft
    token, as vLLM's rejection sampler applies it when ``draft_probs`` is None: a sampled request
    accepts draft token ``x`` at a position with probability ``p(x)``, ``p = softmax(logits /
    temperature)`` (``u < p(x)`` for a uniform ``u``, so a token of probability 0 is never accepted),
    and at its first rejected position emits a sample of ``p`` without ``x`` (renormalised); a greedy
    request in the same step accepts while the draft is the row's argmax and emits the argmax at the
    first mismatch; a request that accepts its whole draft emits a bonus token from its last row
    (:func:`sample_rows`). vLLM's placeholder drafts (negative ids) are rejected and the position's
    token is a sample of the whole ``p``.

    ``metadata``: vLLM's ``SpecDecodeMetadata`` (``draft_token_ids`` int32 [T], ``num_draft_tokens``
    list[int] per request, ``target_logits_indices`` int [T], ``bonus_logits_indices`` int [B],
    ``max_spec_len``); ``logits``: float (any dtype) [T + B, vocab]. Returns ``sampled_token_ids`` int32
    [B, max_spec_len + 1], -1 after each request's last token.

    vLLM copies every target row to float32 twice, computes full probability rows, samples every
    bonus row with its Gumbel kernel and a recovered token for every draft position; here each target
    row is exponentiated once, and only the rows that emit a token are sampled: the first rejected
    position of each request, or its bonus row."""
    sm = sampling_metadata
    if sm.all_greedy or synthetic_mode or draft_probs is not None or sm.generators:
        return None
    if logits.device.type != "cpu":  # vLLM's GPU kernels cost microseconds
        return None
    counts_l = [int(k) for k in metadata.num_draft_tokens]
    if not any(counts_l) or not _temperature_only(sm):
        return None
    from vllm.v1.outputs import SamplerOutput

    dev = logits.device
    B, vocab = len(counts_l), int(logits.shape[1])
    counts = torch.as_tensor(counts_l, dtype=torch.int64, device=dev)
    total = int(counts.sum())
    temp = sm.temperature.to(torch.float32)
    greedy = temp < _greedy_eps()
    req = torch.repeat_interleave(torch.arange(B, device=dev), counts)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(total, device=dev) - starts.index_select(0, req)
    draft = metadata.draft_token_ids.to(torch.int64)
    valid = (draft >= 0) & (draft < vocab)
    dc = draft.clamp(0, vocab - 1)
    x = logits.index_select(0, metadata.target_logits_indices.to(torch.int64)).to(torch.float32)
    any_greedy = bool(greedy.any())
    am = x.max(dim=-1).indices if any_greedy else None
    t_pos = torch.where(greedy, torch.ones_like(temp), temp).index_select(0, req).unsqueeze(1)
    w = x.sub_(x.amax(dim=-1, keepdim=True)).div_(t_pos).exp_()  # in place: x is a copy
    p_draft = w.gather(1, dc.unsqueeze(1)).squeeze(1).to(torch.float64) / w.sum(
        -1, dtype=torch.float64
    )
    ok = valid & (torch.rand(total, dtype=torch.float64, device=dev) < p_draft)
    if am is not None:
        ok = torch.where(greedy.index_select(0, req), valid & (draft == am), ok)
    # Accepted tokens per request: the first rejected position (the draft's length when none).
    accepted = counts.clone()
    miss = ~ok
    accepted.scatter_reduce_(0, req[miss], col[miss], reduce="amin")
    out = torch.full((B, int(metadata.max_spec_len) + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    keep = col < accepted.index_select(0, req)
    out[req[keep], col[keep]] = draft[keep].to(torch.int32)
    rejected = accepted < counts
    rej = torch.nonzero(rejected).squeeze(1)
    if rej.numel():
        pos = starts.index_select(0, rej) + accepted.index_select(0, rej)
        tok = torch.empty(rej.shape[0], dtype=torch.int64, device=dev)
        g = greedy.index_select(0, rej)
        if bool(g.any()):
            tok[g] = am.index_select(0, pos[g])
        r = torch.nonzero(~g).squeeze(1)
        if r.numel():
            rpos = pos.index_select(0, r)
            resid = w.index_select(0, rpos)
            d, v = dc.index_select(0, rpos), valid.index_select(0, rpos)
            resid[torch.arange(r.shape[0], device=dev)[v], d[v]] = 0.0  # p without the draft token
            u = torch.rand(r.shape[0], dtype=torch.float64, device=dev)
            tok[r] = inverse_transform(resid, u)
        out[rej, accepted.index_select(0, rej)] = tok.to(torch.int32)
    full = torch.nonzero(~rejected).squeeze(1)
    if full.numel():
        bonus_rows = metadata.bonus_logits_indices.to(torch.int64).index_select(0, full)
        tok = sample_rows(logits.index_select(0, bonus_rows), temp.index_select(0, full))
        out[full, counts.index_select(0, full)] = tok.to(torch.int32)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def verify_greedy(
    metadata: Any, logits: torch.Tensor, sampling_metadata: Any, *, synthetic_mode: bool = False
) -> Any | None:
    """The step's ``SamplerOutput`` by greedy verification, or None when a request samples, the logits
    are edited before sampling (:func:`_logits_untouched`), log-probabilities are requested, or vLLM's
    synthetic acceptance mode is on (vLLM's rejection sampler then runs as before).

    ``metadata``: vLLM's ``SpecDecodeMetadata`` (``draft_token_ids`` int32 [num_tokens],
    ``num_draft_tokens`` list[int] per request, ``target_logits_indices`` int [num_tokens],
    ``bonus_logits_indices`` int [batch], ``max_spec_len``); ``logits``: float (any dtype)
    [num_tokens + batch, vocab]. Returns ``sampled_token_ids`` int32 [batch, max_spec_len + 1]: per
    request the target's argmax at each position up to and including the first draft token it
    disagrees with, then :data:`PLACEHOLDER_TOKEN_ID`; the bonus token after a fully accepted draft.
    This is the greedy rule of speculative decoding (Leviathan et al. 2023) as vLLM's
    ``rejection_greedy_sample_kernel`` applies it."""
    sm = sampling_metadata
    if not sm.all_greedy or synthetic_mode:
        return None
    if sm.max_num_logprobs is not None or getattr(sm, "logprob_token_ids", None):
        return None
    if not _logits_untouched(sm):
        return None
    from vllm.v1.outputs import SamplerOutput

    counts = torch.as_tensor(list(metadata.num_draft_tokens), dtype=torch.int64)
    B = counts.shape[0]
    # The argmax of every row at once, in the logits' own dtype: no float32 copy.
    am = logits.max(dim=-1).indices
    bonus = am.index_select(0, metadata.bonus_logits_indices.to(torch.int64))
    out = torch.full((B, int(metadata.max_spec_len) + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    accepted = torch.zeros(B, dtype=torch.int64)
    total = int(counts.sum())
    if total:
        target = am.index_select(0, metadata.target_logits_indices.to(torch.int64))
        req = torch.repeat_interleave(torch.arange(B), counts)
        starts = torch.cumsum(counts, 0) - counts
        col = torch.arange(total) - starts.index_select(0, req)
        miss = metadata.draft_token_ids.to(torch.int64) != target
        # The first draft position the target disagrees with (the draft's length when none).
        accepted = counts.clone()
        accepted.scatter_reduce_(0, req[miss], col[miss], reduce="amin")
        # Positions up to the first disagreement emit the target's token (equal to the draft's
        # before it, the target's correction at it).
        keep = col <= accepted.index_select(0, req)
        out[req[keep], col[keep]] = target[keep].to(torch.int32)
    full = accepted == counts
    rows = torch.nonzero(full).squeeze(1)
    out[rows, counts[rows]] = bonus[rows].to(torch.int32)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def verify_with_shortcuts(
    rejection_sampler: Any,
    metadata: Any,
    draft_probs: Any,
    logits: torch.Tensor,
    sampling_metadata: Any,
    on_fault: Callable[[str, Exception], None],
) -> tuple[Any, str | None]:
    """The first exact shortcut of vLLM's rejection sampler that applies to this step: a step without
    draft tokens samples its bonus rows alone (:func:`sample_without_drafts`); a greedy step with
    untouched logits takes one argmax over every row (:func:`verify_greedy`); a sampled step with
    deterministic drafts, one exponential per entry of the target rows (:func:`verify_sampled`).

    Returns ``(output, counter)``: the sampler output and the name of the statistics counter of the
    shortcut taken (``plain_sampler_steps``, ``greedy_verify_steps``, ``sampled_verify_steps``), or
    ``(None, None)`` when none applies and vLLM's own sampler must run. A shortcut that raises is
    reported to ``on_fault(where, error)`` and the next one is tried."""
    synthetic = bool(getattr(rejection_sampler, "synthetic_mode", False))
    shortcuts: tuple[tuple[str, str, Callable[[], Any]], ...] = (
        (
            "sampler without drafts",
            "plain_sampler_steps",
            lambda: sample_without_drafts(
                rejection_sampler.sampler, metadata, logits, sampling_metadata
            ),
        ),
        (
            "greedy verification",
            "greedy_verify_steps",
            lambda: verify_greedy(metadata, logits, sampling_metadata, synthetic_mode=synthetic),
        ),
        (
            "sampled verification",
            "sampled_verify_steps",
            lambda: verify_sampled(
                metadata, draft_probs, logits, sampling_metadata, synthetic_mode=synthetic
            ),
        ),
    )
    for where, counter, shortcut in shortcuts:
        try:
            out = shortcut()
        except Exception as e:
            on_fault(where, e)
            out = None
        if out is not None:
            return out, counter
    return None, None


def recovered_tokens(
    num_draft_tokens: list[int],
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """One sample per draft position of the residual distribution ``max(p - q, 0) / Z`` that rejection
    sampling emits at a rejected position (Leviathan et al. 2023; Chen et al. 2023), by inverse
    transform: a uniform ``u`` per position, scaled to the residual's sum, located in the residual's
    cumulative sum (float64) with ``searchsorted``.

    ``num_draft_tokens``: per request (list of ``B`` ints); ``draft_token_ids``: int [T] (T = their
    sum), the drafts back to back; ``draft_probs``: float32 [T, vocab] or None for a deterministic
    proposer (q one-hot on the draft token: the residual is p without it; a placeholder draft id,
    negative or past the vocabulary, has no q and its residual is the whole p, as in vLLM's
    kernel); ``target_probs``: float32
    [T, vocab]; ``generators``: request index -> its own ``torch.Generator`` (a seeded request's
    uniforms come from it, the others' from the global generator, in one draw). Returns the tokens,
    the dtype of ``draft_token_ids`` [T]. A token of zero residual probability is never returned
    unless the whole residual is zero (then every draft token of that row is accepted with
    probability 1 and the row's token is never used; some id in range is returned).

    vLLM draws an exponential variate per vocabulary entry and request (an exponential race, about 1
    ms per request row of SmolLM2's 49,152 entries on 2 CPU cores) and runs its kernel over the whole
    vocabulary per position; this draws one number per position. The distribution is the same; the
    random numbers are not, so a seeded request's tokens differ from vLLM's own for the same seed (and
    are again reproducible for the same seed and the same draft tokens)."""
    n = int(draft_token_ids.shape[0])
    device = target_probs.device
    if n == 0:
        return torch.empty_like(draft_token_ids)
    if draft_probs is None:
        resid, exclude = target_probs, draft_token_ids.long()
    else:
        resid, exclude = (target_probs - draft_probs).clamp_min_(0.0), None
    u = uniforms(num_draft_tokens, generators, device)
    return inverse_transform(resid, u, exclude).to(draft_token_ids.dtype)


def uniforms(
    counts: list[int], generators: dict[int, torch.Generator], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Uniforms in [0, 1), float64 [sum(counts)]: ``counts[i]`` of them for request ``i``, back to
    back. A request with its own generator (``generators[i]``, a seeded request) draws its share from
    it, the others share one draw from the global generator (as vLLM's ``generate_uniform_probs``)."""
    n = int(sum(counts))
    u = torch.empty(n, dtype=torch.float64, device=device)
    seeded: list[tuple[int, int, torch.Generator]] = []
    free: list[tuple[int, int]] = []
    start = 0
    for i, k in enumerate(counts):
        if k > 0:
            gen = generators.get(i)
            if gen is None:
                free.append((start, start + k))
            else:
                seeded.append((start, start + k, gen))
            start += k
    if not seeded:
        u.uniform_()
    else:
        if free:
            draws = torch.rand(sum(b - a for a, b in free), dtype=torch.float64, device=device)
            j = 0
            for a, b in free:
                u[a:b] = draws[j : j + b - a]
                j += b - a
        for a, b, gen in seeded:
            u[a:b] = torch.rand(b - a, dtype=torch.float64, generator=gen, device=device)
    return u


_BLOCK = 1024


def inverse_transform(
    weights: torch.Tensor, u: torch.Tensor, exclude: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row of ``weights`` (float [n, vocab], >= 0, not normalised) the index ``v`` with
    ``C(v - 1) <= u * C(vocab - 1) < C(v)``, ``C`` the row's cumulative sum, computed in float64: a
    sample of ``weights / sum`` for ``u`` uniform in [0, 1) (float64 [n]). ``exclude`` (int [n] or
    None): a column per row counted as zero; an id outside ``[0, vocab)`` (vLLM's placeholder draft
    -1) excludes nothing. Returns int64 [n]; a zero-weight column is never returned unless the whole
    row is zero (then some index in range).

    Two levels, so that nothing of the row's size is allocated: float64 sums of blocks of 1,024
    columns (strided views of ``weights``), the block that holds the target, then the cumulative sum
    of that block alone. Where float64 rounding puts the target at or past a total, the last column
    of positive weight is taken."""
    w = weights.contiguous()
    n, vocab = w.shape
    dev = w.device
    full = vocab - vocab % _BLOCK
    parts = []
    if full:
        view = w.as_strided((n, full // _BLOCK, _BLOCK), (vocab, _BLOCK, 1))
        parts.append(view.sum(-1, dtype=torch.float64))
    if full < vocab:
        parts.append(w[:, full:].sum(-1, dtype=torch.float64, keepdim=True))
    sums = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    rows = torch.arange(n, device=dev)
    if exclude is not None:
        # Out-of-vocabulary ids (placeholders) exclude nothing: masked, never wrapped to the last column.
        inside = (exclude >= 0) & (exclude < vocab)
        exclude = torch.where(inside, exclude.long(), -1)
        ex = exclude.clamp_min(0)
        sums[rows, ex // _BLOCK] -= torch.where(inside, w[rows, ex].double(), 0.0)
        sums.clamp_min_(0.0)
    cs = sums.cumsum(-1)
    nb = cs.shape[1]
    target = u.unsqueeze(1) * cs[:, -1:]
    blk = torch.searchsorted(cs, target, right=True)
    if bool((blk >= nb).any()):  # target rounded to the total: the last block of positive weight
        last = (torch.arange(nb, device=dev) * (sums > 0)).argmax(-1, keepdim=True)
        blk = torch.where(blk >= nb, last, blk)
    prev = torch.where(blk > 0, cs.gather(1, (blk - 1).clamp_min(0)), 0.0)
    within = torch.arange(_BLOCK, device=dev)
    cols = blk * _BLOCK + within
    vals = w.gather(1, cols.clamp_max(vocab - 1)).masked_fill(cols >= vocab, 0.0)
    if exclude is not None:
        vals.masked_fill_(cols == exclude.unsqueeze(1), 0.0)
    inner = vals.cumsum(-1, dtype=torch.float64)
    pos = torch.searchsorted(inner, target - prev, right=True)
    last_in = (within * (vals > 0)).argmax(-1, keepdim=True)
    pos = torch.minimum(pos, last_in)
    return (blk * _BLOCK + pos).squeeze(1)


#: Proposers never verified against another proposer's draft probabilities: ``none`` (no draft
#: tokens) and the draft model, whose probabilities vLLM caches (``lora:<name>`` too: the draft model
#: with an adapter).
_DRAFTER_PROPOSERS = ("none", "draft")


def draft_probability_conflict(spec_config: Any, proposers: Sequence[str]) -> str | None:
    """Why verification would not be lossless with these proposers on this engine, or None.

    With ``draft_sample_method="probabilistic"`` vLLM 0.32's drafter (draft model, EAGLE) samples its
    draft tokens and keeps their probabilities ``q`` per request; the model runner then hands the
    rejection sampler those cached rows for every request with draft tokens
    (``GPUModelRunner._get_spec_decode_draft_probs``), whoever drafted them. A request whose drafts
    the controller took from the n-gram, suffix or Jacobi proposer would be verified with
    acceptance ``min(1, p(x) / q(x))`` against the draft model's ``q``, not the one-hot ``q`` of a
    deterministic draft: the output no longer follows the target's distribution. Drafts of the
    draft model itself (``draft``, ``lora:<name>``: the drafter's pass with the request's adapter)
    match their cached ``q``, cut to ``k`` or not.

    ``spec_config``: vLLM's ``SpeculativeConfig`` (``method``, ``draft_sample_method``,
    ``rejection_sample_method``);
    ``proposers``: the proposer names of :class:`~adaptive_spec.vllm.attach.AdaptiveSpec`. Returns a
    one-line reason that names the fix, for ``AttachError``."""
    if getattr(spec_config, "draft_sample_method", "greedy") != "probabilistic":
        return None
    if getattr(spec_config, "rejection_sample_method", "standard") != "standard":
        return None  # vLLM's drafter keeps no probabilities then
    if getattr(spec_config, "method", None) == "ngram":  # no drafter probabilities
        return None
    others = [p for p in proposers if p not in _DRAFTER_PROPOSERS and not p.startswith("lora:")]
    if not others:
        return None
    return (
        f"speculative_config draft_sample_method='probabilistic' cannot be mixed with proposers "
        f"{', '.join(others)}: vLLM would verify their draft tokens against the draft model's "
        "probabilities (not lossless); fix: set speculative_config draft_sample_method to 'greedy' "
        "(the default), or use only proposers none, draft, lora:<adapter>"
    )


def fix_recovered_token_sampling() -> bool:
    """Replace ``vllm.v1.sample.rejection_sampler.sample_recovered_tokens`` by
    :func:`recovered_tokens` (once per process, CPU platform only: on a GPU vLLM's kernel costs
    microseconds). Returns True if the replacement is in place; a failure is logged, never raised."""
    global _fixed
    if _fixed:
        return True
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        import vllm.v1.sample.rejection_sampler as rs

        original = rs.sample_recovered_tokens

        def sample_recovered_tokens(
            max_spec_len: int,
            num_draft_tokens: list[int],
            cu_num_draft_tokens: torch.Tensor,
            draft_token_ids: torch.Tensor,
            draft_probs: torch.Tensor | None,
            target_probs: torch.Tensor,
            sampling_metadata: Any,
            device: torch.device,
            use_fp64_gumbel: bool = False,
        ) -> torch.Tensor:
            return recovered_tokens(
                list(num_draft_tokens),
                draft_token_ids,
                draft_probs,
                target_probs,
                sampling_metadata.generators,
            )

        sample_recovered_tokens.__wrapped__ = original  # type: ignore[attr-defined]
        rs.sample_recovered_tokens = sample_recovered_tokens
    except Exception as e:  # never fail attaching because of it; report it
        logger.warning(
            "could not install the recovered-token sampler (%s: %s)", type(e).__name__, e
        )
        return False
    _fixed = True
    logger.info("installed the recovered-token sampler (one uniform per draft position)")
    return True
