"""Family 5: proposer totality and zero-draft degradation.

Cross-proposer sweep (every product proposer, both n-gram backends on the CPU): for hypothesis-generated
contexts (empty, 1-3 tokens, no match, a match only at the very end, long single-token runs, ids at
the vocabulary's edges or outside it) and a 50,000-token context, ``propose`` returns per request 0..k
valid ids, cut to the remaining budget, in bounded time, and never raises. (The proposers' own fuzz
tests live in ``test_proposers_*``; this sweep checks the shared contract across all of them.)

Engine level: a step where every request has zero drafts is plain decoding (no verification, same
tokens, no fault), zero drafts for some requests next to full drafts for others degrade per request,
and degenerate prompts (1-3 tokens, a 300-token run of one token) give no-speculation's tokens.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.trace import read_trace
from adaptive_spec.proposers import JacobiProposer, NgramProposer, ProposalRequest
from tests.scripted import (
    MAX_K,
    EmptyProposer,
    OracleProposer,
    ScriptedPolicy,
    core_prompts,
    cycling_correct,
    every_step,
    fixed,
    generate,
    greedy,
    install_proposer,
    reference,
    references_for,
)

VOCAB = 1000
PROPOSER_FACTORIES = {
    "ngram": lambda: NgramProposer(min_n=1, max_n=4, max_k=MAX_K),
    "ngram-torch": lambda: NgramProposer(min_n=2, max_n=4, max_k=MAX_K, backend="torch"),
    "jacobi": lambda: JacobiProposer(max_k=MAX_K),
    "jacobi-no-init": lambda: JacobiProposer(max_k=MAX_K, init="none", pool_size=4),
}


@st.composite
def contexts(draw) -> np.ndarray:
    kind = draw(
        st.sampled_from(["empty", "short", "no-match", "match-at-end", "run", "edges", "garbage"])
    )
    if kind == "empty":
        return np.zeros(0, dtype=np.int64)
    if kind == "short":
        return np.asarray(
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)), dtype=np.int64
        )
    if kind == "no-match":
        n = draw(st.integers(2, 300))
        return np.random.default_rng(n).permutation(VOCAB)[:n].astype(np.int64)
    if kind == "match-at-end":
        # The suffix n-gram occurs earlier only where its continuation runs into the suffix itself.
        head = np.random.default_rng(draw(st.integers(0, 99))).permutation(VOCAB)[:20]
        gram = list(head[-draw(st.integers(1, 4)) :])
        return np.asarray([*head, *gram], dtype=np.int64)
    if kind == "run":
        return np.full(draw(st.integers(1, 5000)), draw(st.integers(0, VOCAB - 1)), dtype=np.int64)
    if kind == "edges":
        return np.asarray(
            draw(st.lists(st.sampled_from([0, 1, VOCAB - 2, VOCAB - 1]), min_size=1, max_size=40)),
            dtype=np.int64,
        )
    # ids outside the vocabulary (a corrupted history): drafts must still be valid ids
    return np.asarray(
        draw(st.lists(st.integers(-5, VOCAB + 5), min_size=1, max_size=40)), dtype=np.int64
    )


def _check(out, reqs, ks, max_k) -> None:
    assert isinstance(out, list) and len(out) == len(reqs)
    for d, r, k in zip(out, reqs, ks, strict=True):
        assert isinstance(d, np.ndarray) and d.dtype == np.int64 and d.ndim == 1
        assert len(d) <= max(0, min(k, max_k, r.max_new_tokens - 1)), (len(d), k, r.max_new_tokens)
        assert ((d >= 0) & (d < r.vocab_size)).all(), d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(PROPOSER_FACTORIES)),
    batch=st.lists(
        st.tuples(contexts(), st.integers(0, MAX_K + 3), st.sampled_from([0, 1, 2, 3, 100])),
        min_size=1,
        max_size=4,
    ),
    steps=st.integers(1, 3),
    feedback=st.booleans(),
)
def test_every_proposer_is_total(name, batch, steps, feedback):
    """Several consecutive steps per request (stateful proposers), with or without the previous step's
    verification fed back (inconsistent lengths included)."""
    prop = PROPOSER_FACTORIES[name]()
    rng = np.random.default_rng(len(batch))
    toks = [c for c, _, _ in batch]
    last = [None] * len(batch)
    for _ in range(steps):
        reqs = []
        for i, (_, _, budget) in enumerate(batch):
            ld, lt, la = last[i] if (feedback and last[i] is not None) else (None, None, 0)
            reqs.append(ProposalRequest(f"r{i}", toks[i], budget, VOCAB, ld, lt, la))
        ks = [k for _, k, _ in batch]
        t0 = time.perf_counter()
        out = prop.propose(reqs, ks)
        ml = [prop.match_length(r) for r in reqs]
        assert time.perf_counter() - t0 < 5.0
        _check(out, reqs, ks, MAX_K)
        assert all(isinstance(m, int) and m >= 0 for m in ml)
        for i, d in enumerate(out):
            argmax = rng.integers(0, VOCAB, size=len(d) + rng.integers(0, 3)).astype(np.int64)
            acc = int(rng.integers(0, len(d) + 1))
            last[i] = (d, argmax, acc)
            toks[i] = np.concatenate([toks[i], argmax[: acc + 1] % VOCAB]).astype(np.int64)
    for i in range(len(batch)):
        prop.release(f"r{i}")
    if hasattr(prop, "__len__"):
        assert len(prop) == 0


@pytest.mark.parametrize("name", sorted(PROPOSER_FACTORIES))
def test_fifty_thousand_token_context_bounded_time(name):
    prop = PROPOSER_FACTORIES[name]()
    rng = np.random.default_rng(1)
    body = rng.integers(0, VOCAB, size=50_000).astype(np.int64)
    body[-3:] = body[1000:1003]  # a match far back (outside a small search window)
    runs = np.full(50_000, 7, dtype=np.int64)
    reqs = [ProposalRequest("a", body, 100, VOCAB), ProposalRequest("b", runs, 100, VOCAB)]
    t0 = time.perf_counter()
    for _ in range(3):
        out = prop.propose(reqs, [MAX_K, MAX_K])
        _check(out, reqs, [MAX_K, MAX_K], MAX_K)
    assert time.perf_counter() - t0 < 10.0
    if name.startswith("ngram"):
        assert out[1].tolist() == [7] * MAX_K  # a single-token run drafts the run


# -- engine level ----------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("policy_kind", ["scripted-kmax", "adaptive"])
def test_all_zero_draft_steps_are_plain_decoding(tiny_llm, tmp_path, policy_kind):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = core_prompts()
    ref = references_for(prompts, reference(tiny_llm, prompts, greedy()))
    policy = (
        ScriptedPolicy(["ngram", "jacobi"], MAX_K, fixed(Arm("jacobi", MAX_K)))
        if policy_kind == "scripted-kmax"
        else "adaptive"
    )
    path = tmp_path / "t.jsonl"
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy, trace=path) as spec:
        install_proposer(spec, "ngram", EmptyProposer())
        install_proposer(spec, "jacobi", EmptyProposer())
        outs = generate(tiny_llm, prompts, greedy())
    assert references_for(prompts, outs) == ref
    trace = read_trace(path)
    assert all(s["num_verified_tokens"] == 0 for s in trace.steps)
    assert all(r["arm"] == "none" and r["emitted"] == 1 for s in trace.steps for r in s["requests"])
    st_ = spec.stats()
    assert st_["faults"] == 0 and set(st_["by_arm"]) == {"none"}
    assert st_["by_arm"]["none"]["acceptance_rate"] == 0.0


@pytest.mark.vllm
def test_zero_drafts_for_some_requests_degrade_per_request(tiny_llm, tmp_path):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = core_prompts()
    ref = references_for(prompts, reference(tiny_llm, prompts, greedy()))
    starved = {tuple(prompts[0]), tuple(prompts[3])}
    policy = ScriptedPolicy(["ngram", "jacobi"], MAX_K, fixed(Arm("ngram", MAX_K)))
    path = tmp_path / "t.jsonl"
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy, trace=path) as spec:
        policy.bind(spec)
        install_proposer(
            spec,
            "ngram",
            OracleProposer(ref, cycling_correct((9, 1)), empty_for=starved, max_k=MAX_K),
        )
        outs = generate(tiny_llm, prompts, greedy())
    assert references_for(prompts, outs) == ref
    trace = read_trace(path)
    for s in trace.steps:
        for r in s["requests"]:
            key = tuple(trace.requests[r["req_id"]]["prompt_token_ids"])
            if key in starved:
                assert r["drafted"] == 0 and r["emitted"] == 1
    mixed = [s for s in trace.steps if {r["drafted"] for r in s["requests"]} >= {0, MAX_K}]
    assert mixed, "no step verified k = max next to a request with zero drafts"


@pytest.mark.vllm
def test_degenerate_prompts_through_the_engine(tiny_llm):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = [[5], [5, 6], [5, 6, 7], [9] * 300]
    ref = references_for(prompts, reference(tiny_llm, prompts, greedy(10)))
    for policy in ("adaptive", None):
        sp = policy or ScriptedPolicy(["ngram", "jacobi"], MAX_K, every_step(["ngram", "jacobi"]))
        with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=sp) as spec:
            if policy is None:
                sp.bind(spec)
            outs = generate(tiny_llm, prompts, greedy(10))
        assert references_for(prompts, outs) == ref
        assert spec.stats()["faults"] == 0
