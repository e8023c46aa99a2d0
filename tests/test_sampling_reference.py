"""Sampled verification and recovered tokens token for token against a float64 reference sampler.

The reference (:func:`reference_verify`, :func:`reference_residual_sample`) is speculative sampling as
the papers state it (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2), in float64 over whole rows, with ``q`` one-hot on the draft token for a
deterministic proposer: draft token ``x`` is accepted when ``r < min(1, p(x) / q(x)) = p(x)``; the first
rejected position emits a sample of ``max(p - q, 0)`` normalised; a fully accepted draft is followed by
a bonus sample of the last row's ``p``; a greedy request (temperature 0) accepts while ``x`` is the
argmax and emits the argmax. A sample of a distribution ``d`` from a uniform ``u`` is its inverse
cumulative distribution: the first ``v`` with ``u * C(V - 1) < C(v)``, ``C`` the cumulative sum. vLLM's
placeholder draft (id -1) has no ``q``: never accepted, the position emits a sample of the whole ``p``.

The module under test draws its uniforms from torch's global generator in a fixed order (acceptance
uniforms for every draft position, then one per sampled request that rejects, then one per sampled
request that emits a bonus token); the reference draws the same ones in the same order, so the tokens
must agree one for one. They may differ only where a uniform lies within float32 rounding of a
boundary of the reference's (float64) decision; such requests are counted and must be rare.

The steps mix temperatures (greedy, 0.01 ... 2.0) in one batch, draft counts 0..4, greedy neighbours,
placeholder drafts, a vocabulary of 2,500 (three blocks of the 1,024-column inverse transform, the
last one partial) and draft ids at 1,023 / 1,024 with much of the target's mass at block edges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from adaptive_spec.vllm.sampling import recovered_tokens

#: Below this distance (relative to the row's total) a float32 sampler and the float64 reference may
#: legitimately decide differently; float32 rounding moves a boundary by about 1e-7.
MARGIN = 1e-6
GREEDY_EPS = 1e-5  # vLLM's sampler._SAMPLING_EPS
V = 2500
EDGES = (0, 1022, 1023, 1024, 1025, 2047, 2048, V - 1)  # block edges of the inverse transform


def inverse_cdf(d: np.ndarray, u: float) -> tuple[int, float]:
    """The first index ``v`` with ``u * C(V - 1) < C(v)`` (``C = cumsum(d)``, float64) and the distance
    of ``u * C(V - 1)`` from the nearer end of ``v``'s interval, relative to the total."""
    c = np.cumsum(d, dtype=np.float64)
    total = c[-1]
    t = u * total
    v = int(np.searchsorted(c, t, side="right"))
    v = min(v, int(np.flatnonzero(d > 0)[-1]))
    lo = c[v - 1] if v > 0 else 0.0
    return v, float(min(t - lo, c[v] - t) / total)


@dataclass
class ReferenceRequest:
    """One request's output under the reference sampler: its tokens (-1 padded to ``width``) and the
    smallest distance of any of its random decisions from that decision's boundary (relative)."""

    tokens: list[int]
    margin: float


def reference_verify(
    rows: list[np.ndarray],
    drafts: list[list[int]],
    temperatures: list[float],
    width: int,
    rand: Callable[[int], np.ndarray],
) -> list[ReferenceRequest]:
    """Speculative sampling with deterministic drafts for a batch, in float64.

    ``rows[i]``: float64 [len(drafts[i]) + 1, V], request ``i``'s target logits (the draft positions,
    then the bonus position); ``temperatures[i]`` below :data:`GREEDY_EPS` means greedy; ``rand(n)``:
    ``n`` uniforms in [0, 1). Uniforms are drawn as: one per draft position of the batch (greedy
    requests' included, unused), then one per sampled request that rejects a position, then one per
    sampled request that accepts its whole draft (request order in each)."""
    total = sum(len(d) for d in drafts)
    u_accept = rand(total)
    probs, first_reject, margins = [], [], []
    o = 0
    for x, d, t in zip(rows, drafts, temperatures, strict=True):
        greedy = t < GREEDY_EPS
        p = None if greedy else np.exp((x - x.max(-1, keepdims=True)) / t)
        p = None if p is None else p / p.sum(-1, keepdims=True)
        probs.append(p)
        margin, reject = 1.0, len(d)
        for j, tok in enumerate(d):
            if greedy:
                accepted = tok == int(np.argmax(x[j]))
            elif tok < 0 or tok >= x.shape[1]:
                accepted = False  # a placeholder: no q, never accepted
            else:
                accepted = u_accept[o + j] < p[j, tok]  # r < min(1, p(x) / q(x)), q(x) = 1
                margin = min(margin, abs(u_accept[o + j] - p[j, tok]))
            if not accepted:
                reject = j
                break
        first_reject.append(reject)
        margins.append(margin)
        o += len(d)
    out = [list(d[:r]) for d, r in zip(drafts, first_reject, strict=True)]
    sampled = [i for i, t in enumerate(temperatures) if t >= GREEDY_EPS]
    rejecting = [i for i in sampled if first_reject[i] < len(drafts[i])]
    finishing = [i for i in sampled if first_reject[i] == len(drafts[i])]
    for group, u in ((rejecting, rand(len(rejecting))), (finishing, rand(len(finishing)))):
        for i, ui in zip(group, u, strict=True):
            j = first_reject[i]
            resid = probs[i][j].copy()
            if j < len(drafts[i]) and 0 <= drafts[i][j] < resid.shape[0]:
                resid[drafts[i][j]] = 0.0  # max(p - q, 0) with q one-hot on the draft token
            tok, m = inverse_cdf(resid, float(ui))
            out[i].append(tok)
            margins[i] = min(margins[i], m)
    for i, t in enumerate(temperatures):
        if t < GREEDY_EPS:
            out[i].append(int(np.argmax(rows[i][first_reject[i]])))
    return [
        ReferenceRequest(tokens + [-1] * (width - len(tokens)), m)
        for tokens, m in zip(out, margins, strict=True)
    ]


def reference_residual_sample(
    target: np.ndarray, draft_ids: list[int], draft_probs: np.ndarray | None, u: np.ndarray
) -> list[tuple[int, float]]:
    """Per position one sample of ``max(p - q, 0)`` (normalised) by inverse cumulative distribution
    from ``u``: ``q`` one-hot on the draft token when ``draft_probs`` is None (nothing for a
    placeholder id), else the given rows. Returns (token, margin) per position."""
    out = []
    for j, ui in enumerate(u):
        p = target[j].astype(np.float64)
        if draft_probs is None:
            resid = p.copy()
            if 0 <= draft_ids[j] < p.shape[0]:
                resid[draft_ids[j]] = 0.0
        else:
            resid = np.maximum(p - draft_probs[j].astype(np.float64), 0.0)
        out.append(inverse_cdf(resid, float(ui)))
    return out


def _edge_logits(n: int, g: torch.Generator) -> torch.Tensor:
    """float32 [n, V]: Gaussian logits with much of the mass on the block-edge columns, and on some
    rows one edge column made the likely token (drafts of it are mostly accepted)."""
    x = torch.randn(n, V, generator=g)
    x[:, list(EDGES)] += 5.0
    fav = torch.tensor(EDGES)[torch.randint(0, len(EDGES), (n,), generator=g)]
    boost = torch.rand(n, generator=g) < 0.5
    x[torch.arange(n)[boost], fav[boost]] += 9.0
    return x


def _drafts_for(x: torch.Tensor, g: torch.Generator) -> list[int]:
    out = []
    for row in x:
        r = float(torch.rand(1, generator=g))
        if r < 0.45:
            out.append(int(row.argmax()))  # the likely token: accepted by most requests
        elif r < 0.75:
            out.append(
                1023 if r < 0.6 else 1024
            )  # the last column of a block, the first of the next
        elif r < 0.82:
            out.append(-1)  # vLLM's placeholder
        else:
            out.append(int(torch.randint(0, V, (1,), generator=g)))
    return out


def spec_metadata(drafts: list[list[int]]):
    """vLLM's ``SpecDecodeMetadata`` for a step with these drafts (one list per request), in vLLM's
    layout: each request's draft positions then its bonus position, back to back. Returns it and
    the number of logits rows."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = [len(d) for d in drafts]
    tgt, bonus, o = [], [], 0
    for k in n:
        tgt += list(range(o, o + k))
        bonus.append(o + k)
        o += k + 1
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=n,
        cu_num_draft_tokens=torch.tensor(np.cumsum(n), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([k + 1 for k in n]), dtype=torch.int32),
        target_logits_indices=torch.tensor(tgt, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(o, dtype=torch.int32),
    ), o


def _batch(trial: int, g: torch.Generator):
    """One step: per request a draft count 0..4, a temperature (greedy neighbours included), target
    logits and drafts. Returns (metadata, logits float32 [T + B, V], drafts, temperatures, rows)."""
    temps_pool = [0.0, 0.01, 0.5, 0.8, 1.0, 1.3, 2.0]
    B = 10
    counts = torch.randint(0, 5, (B,), generator=g).tolist()
    counts[trial % B] = max(counts[trial % B], 1)  # every step has a draft token
    temps = [temps_pool[int(i)] for i in torch.randint(0, len(temps_pool), (B,), generator=g)]
    temps[(trial + 3) % B] = 1.0  # every step has a sampled request
    rows = [_edge_logits(k + 1, g) for k in counts]
    drafts = [_drafts_for(r[:-1], g) for r in rows]
    md, _ = spec_metadata(drafts)
    return md, torch.cat(rows), drafts, temps, rows


def _sampling_metadata(temps: list[float]):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temps)
    greedy = [t < GREEDY_EPS for t in temps]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _torch_rand(n: int) -> np.ndarray:
    return torch.rand(n, dtype=torch.float64).numpy() if n else np.zeros(0)


@pytest.mark.vllm
def test_sampled_verification_equals_the_reference_sampler_token_for_token():
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed")
    from adaptive_spec.vllm.sampling import verify_sampled

    g = torch.Generator().manual_seed(11)
    compared = near = 0
    seen = {"accepted": 0, "bonus_sampled": 0, "edge_tokens": 0, "placeholders": 0}
    for trial in range(30):
        md, logits, drafts, temps, rows = _batch(trial, g)
        width = int(md.max_spec_len) + 1
        torch.manual_seed(1000 + trial)
        got = verify_sampled(md, None, logits.clone(), _sampling_metadata(temps))
        assert got is not None, "verify_sampled declined a temperature-only step"
        torch.manual_seed(1000 + trial)
        ref = reference_verify(
            [r.double().numpy() for r in rows], drafts, temps, width, _torch_rand
        )
        assert got.sampled_token_ids.dtype == torch.int32
        assert tuple(got.sampled_token_ids.shape) == (len(drafts), width)
        for i, (mine, theirs) in enumerate(zip(got.sampled_token_ids.tolist(), ref, strict=True)):
            if theirs.margin < MARGIN:
                near += 1
                continue
            compared += 1
            assert mine == theirs.tokens, (
                f"step {trial} request {i} (temperature {temps[i]}, drafts {drafts[i]}): "
                f"{mine} != reference {theirs.tokens}"
            )
            emitted = [t for t in mine if t >= 0]
            seen["accepted"] += sum(a == b for a, b in zip(emitted, drafts[i], strict=False))
            seen["bonus_sampled"] += len(emitted) == len(drafts[i]) + 1 and temps[i] > 0
            seen["edge_tokens"] += sum(t in EDGES for t in emitted)
            seen["placeholders"] += -1 in drafts[i]
    assert near <= 0.01 * compared, (near, compared)
    # the comparison covered what it is meant to: accepted drafts, sampled bonus tokens, tokens on the
    # block edges, placeholder drafts
    assert min(seen.values()) > 20, seen


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot q", "draft probabilities"])
def test_recovered_tokens_equal_the_reference_residual_sampler(with_q: bool):
    g = torch.Generator().manual_seed(5)
    counts = [3, 0, 4, 1, 2, 4, 0, 3]
    T = sum(counts)
    reps = 40
    target = torch.softmax(_edge_logits(T * reps, g), -1)
    drafts = torch.tensor(_drafts_for(target, g), dtype=torch.int32)
    drafts[::7] = -1  # placeholders
    q = torch.softmax(_edge_logits(T * reps, g) * 0.7, -1) if with_q else None
    torch.manual_seed(3)
    got = recovered_tokens(counts * reps, drafts, q, target, {})
    torch.manual_seed(3)
    u = torch.rand(T * reps, dtype=torch.float64).numpy()
    ref = reference_residual_sample(
        target.numpy(), drafts.tolist(), None if q is None else q.numpy(), u
    )
    assert got.dtype == torch.int32
    sure = [j for j, (_, m) in enumerate(ref) if m >= MARGIN]
    assert len(sure) >= 0.99 * len(ref)
    assert [int(got[j]) for j in sure] == [ref[j][0] for j in sure]
    assert sum(int(got[j]) in EDGES for j in sure) > 50  # block edges were drawn


def test_a_placeholder_draft_excludes_nothing_from_the_recovered_token():
    """vLLM's placeholder draft (-1) has no q: its recovered token is a sample of the whole p (vLLM's
    kernel masks ``vocab_offset != -1``, never true). The last vocabulary entry carries half of p."""
    from scipy.stats import binomtest, chisquare

    Vs, N = 1500, 20000
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(Vs, generator=g), -1) * 0.5
    p[-1] += 0.5
    p = p / p.sum()
    torch.manual_seed(0)
    tok = recovered_tokens(
        [1] * N, torch.full((N,), -1, dtype=torch.int32), None, p.expand(N, Vs).contiguous(), {}
    )
    counts = torch.bincount(tok.long(), minlength=Vs)
    assert binomtest(int(counts[-1]), N, float(p[-1])).pvalue > 1e-3, (
        f"last token drawn {int(counts[-1])} times in {N}, expected {float(p[-1]) * N:.0f}"
    )
    # and the rest of p is sampled in proportion (pooled into 20 bins of the vocabulary)
    bins = torch.arange(Vs) * 20 // Vs
    obs = torch.zeros(20, dtype=torch.float64).index_add_(0, bins, counts.double())
    exp = torch.zeros(20, dtype=torch.float64).index_add_(0, bins, p.double() * N)
    assert chisquare(obs.numpy(), (exp * N / exp.sum()).numpy()).pvalue > 1e-3
