"""Family 6: mixed batches and request lifecycle.

Requests with k = 0 next to k = max, requests one token from their limit, requests that finish or are
aborted in the middle of a run (after multi-token steps), stop strings (finished by the front end, which
aborts the request in the engine core), prefix-cache hits: every request's tokens equal its
no-speculation output, and once all requests are gone neither AdaptiveSpec, nor the controller, nor the
proposers hold per-request state. The 10,000-request leak check runs at the controller/proposer level
(no engine); a few hundred requests run through the engine.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.protocol import RequestOutcome, RequestView, StepOutcome, StepView
from adaptive_spec.proposers import JacobiProposer, NgramProposer, ProposalRequest
from tests.scripted import (
    MAX_K,
    OracleProposer,
    RecordingPolicy,
    ScriptedPolicy,
    core_prompts,
    cycling_correct,
    every_step,
    fixed,
    greedy,
    install_proposer,
    per_request,
    reference,
    references_for,
    stream,
)

PROMPTS = core_prompts()


def _assert_no_state(spec) -> None:
    st = spec.stats()
    assert st["tracked_requests"] == 0, (
        f"AdaptiveSpec still tracks {st['tracked_requests']} requests"
    )
    assert spec.policy.num_tracked_requests() == 0, "the policy still tracks requests"
    for name, p in spec.proposers.items():
        if hasattr(p, "__len__"):
            assert len(p) == 0, f"proposer {name} still holds state for {len(p)} requests"
    d = spec.driver
    assert not d._chosen and not d._last and not d._category and not d._tokens


@pytest.fixture(scope="module")
def ref(tiny_llm):
    return references_for(PROMPTS, reference(tiny_llm, PROMPTS, greedy()))


@pytest.mark.vllm
def test_mixed_batch_k0_next_to_kmax_and_limits(tiny_llm, ref):
    """One batch: k = 0, k = max with an oracle that drafts past the request's budget, Jacobi k = 1, a
    request one token from its limit forced to k = max, and one changing arm every step."""
    from adaptive_spec.vllm import AdaptiveSpec

    keys = [tuple(p) for p in PROMPTS]
    schedule = per_request(
        {
            keys[0]: fixed(NO_SPEC),
            keys[1]: fixed(Arm("ngram", MAX_K)),
            keys[2]: fixed(Arm("jacobi", 1)),
            keys[3]: fixed(Arm("ngram", MAX_K)),
        },
        every_step(["ngram", "jacobi"]),
    )
    limits = [16, 16, 16, 2, 5]
    policy = ScriptedPolicy(["ngram", "jacobi"], MAX_K, schedule)
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        policy.bind(spec)
        oracle = OracleProposer(ref, cycling_correct((9, 9, 1)), ignore_budget=True, max_k=MAX_K)
        install_proposer(spec, "ngram", oracle)
        res = stream(tiny_llm, PROMPTS, [greedy(n) for n in limits])
    for p, n, r in zip(PROMPTS, limits, res, strict=True):
        assert r.token_ids == ref[tuple(p)][:n]
        assert r.finish_reason == "length" and r.outputs_after_finish == 0
    # k = max really was verified next to k = 0 in one step.
    mixed = [
        o
        for o in policy.log.outcomes
        if {r.drafted for r in o.requests} >= {0, MAX_K} and len(o.requests) > 1
    ]
    assert mixed
    _assert_no_state(spec)


@pytest.mark.vllm
def test_abort_stop_string_and_short_requests_leave_no_state(tiny_llm, ref):
    """Requests aborted after multi-token steps, one ended by a stop string (the front end aborts it in
    the engine core), others finishing after 1 and 3 tokens: the rest are unaffected and nothing leaks."""
    from adaptive_spec.vllm import AdaptiveSpec

    text_ref = reference(tiny_llm, PROMPTS, greedy())
    stop = text_ref[3].text[-6:-3]  # completes inside the looping request's output
    params = [greedy(), greedy(1), greedy(), greedy(stop=[stop]), greedy(3)]
    policy = RecordingPolicy(AdaptiveController(["ngram", "jacobi"], MAX_K, seed=1))
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        install_proposer(spec, "ngram", OracleProposer(ref, cycling_correct((9, 1)), max_k=MAX_K))
        res = stream(tiny_llm, PROMPTS, params, abort_after={0: 5, 2: 1})
        assert res[0].aborted and res[2].aborted
        for i in (0, 2):
            assert res[i].token_ids == ref[tuple(PROMPTS[i])][: len(res[i].token_ids)]
        assert res[1].token_ids == ref[tuple(PROMPTS[1])][:1]
        assert res[4].token_ids == ref[tuple(PROMPTS[4])][:3]
        assert res[3].finish_reason == "stop" and res[3].stop_reason == stop
        _assert_no_state(spec)
        # Later requests are unaffected by the aborted ones' leftovers.
        again = stream(tiny_llm, PROMPTS[:2], greedy())
        assert [r.token_ids for r in again] == [ref[tuple(p)] for p in PROMPTS[:2]]
    _assert_no_state(spec)
    released = set(policy.log.released)
    seen = {r.req_id for o in policy.log.outcomes for r in o.requests}
    assert seen <= released, "requests the controller saw but was never told were gone"


@pytest.mark.vllm
def test_prefix_cache_hits(tiny_llm):
    """The same prompt twice in one batch and again in a later batch, and a prompt sharing only a
    prefix: cache hits happen and every output equals the no-speculation output."""
    from adaptive_spec.vllm import AdaptiveSpec

    block = int(tiny_llm.llm_engine.vllm_config.cache_config.block_size)
    rng = random.Random(3)
    base = [rng.randrange(3, 49000) for _ in range(2 * block + 5)]
    shared = [*base[: 2 * block], *[rng.randrange(3, 49000) for _ in range(7)]]
    prompts = [base, shared]
    outs = reference(tiny_llm, prompts, greedy(12))
    refs = references_for(prompts, outs)
    policy = ScriptedPolicy(["ngram", "jacobi"], MAX_K, every_step(["ngram", "jacobi"]))
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        policy.bind(spec)
        install_proposer(spec, "ngram", OracleProposer(refs, cycling_correct((9, 2)), max_k=MAX_K))
        first = stream(tiny_llm, [base, base, shared], greedy(12))
        second = stream(tiny_llm, [base], greedy(12))
    for p, r in zip([base, base, shared, base], [*first, *second], strict=True):
        assert r.token_ids == refs[tuple(p)]
    assert all((r.num_cached_tokens or 0) >= block for r in [*first, *second]), [
        r.num_cached_tokens for r in [*first, *second]
    ]
    _assert_no_state(spec)


@pytest.mark.vllm
def test_hundreds_of_requests_through_engine_leave_no_state(tiny_llm):
    """160 short requests (1-3 tokens, some with stop tokens, some aborted) through the adaptive
    controller: nothing is left behind."""
    from vllm import SamplingParams

    from adaptive_spec.vllm import AdaptiveSpec

    rng = random.Random(7)
    n = 160
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    params = []
    for i in range(n):
        kw = {"max_tokens": rng.randint(1, 3), "temperature": 0.0}
        if i % 5 == 0:
            kw["stop_token_ids"] = [rng.randrange(3, 49000)]
        if i % 7 == 0:
            kw["temperature"], kw["seed"] = 0.8, i
        params.append(SamplingParams(**kw))
    aborts = {i: 1 for i in range(3, n, 11)}
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy="adaptive", seed=2) as spec:
        res = stream(tiny_llm, prompts, params, abort_after=aborts)
        assert all(r.finish_reason or r.aborted for r in res)
        assert spec.stats()["faults"] == 0
        _assert_no_state(spec)


def test_no_state_leak_controller_and_proposers_10k():
    """10,000 requests through AdaptiveController, NgramProposer and JacobiProposer without an engine,
    as AdaptiveSpec drives them: finished (a final outcome, then release) or aborted (release only, no
    final outcome); at most 64 alive at once. Per-request state stays bounded by the live requests and
    is empty at the end."""
    rng = np.random.default_rng(0)
    ctrl = AdaptiveController(["ngram", "jacobi"], MAX_K, seed=0)
    props = {"ngram": NgramProposer(max_k=MAX_K), "jacobi": JacobiProposer(max_k=MAX_K)}
    live: dict[str, dict] = {}
    next_id, total, steps = 0, 10_000, 0
    peak = 0
    while next_id < total or live:
        while len(live) < 64 and next_id < total:
            toks = rng.integers(0, 50, size=int(rng.integers(1, 12))).astype(np.int64)
            live[f"r{next_id}"] = {
                "toks": toks,
                "left": int(rng.integers(1, 7)),
                "end": int(rng.integers(0, 2)),
                "last": None,
            }
            next_id += 1
        rids = list(live)
        preqs = [
            ProposalRequest(
                rid,
                live[rid]["toks"],
                max_new_tokens=live[rid]["left"] + 1,
                vocab_size=50,
                last_draft=None if live[rid]["last"] is None else live[rid]["last"][0],
                last_target_argmax=None if live[rid]["last"] is None else live[rid]["last"][1],
                last_accepted=0 if live[rid]["last"] is None else live[rid]["last"][2],
            )
            for rid in rids
        ]
        views = [RequestView(rid, 0, live[rid]["left"] + 1) for rid in rids]
        for name, p in props.items():
            for v, d in zip(views, p.propose(preqs, [MAX_K] * len(preqs)), strict=True):
                v.drafts[name] = d
        dec = ctrl.decide(StepView(views, batch_size=len(views)))
        outcomes = []
        for rid, v, arm in zip(rids, views, dec.arms, strict=True):
            st = live[rid]
            draft = v.drafts.get(arm.proposer, np.zeros(0, np.int64))[: arm.k]
            argmax = rng.integers(0, 50, size=len(draft) + 1).astype(np.int64)
            acc = 0
            while acc < len(draft) and rng.random() < 0.5:
                argmax[acc] = draft[acc]
                acc += 1
            emitted = [int(t) for t in argmax[: acc + 1]][: st["left"]]
            st["toks"] = np.concatenate([st["toks"], np.asarray(emitted, np.int64)])
            st["left"] -= len(emitted)
            st["last"] = (draft, argmax, acc) if len(draft) else None
            done = st["left"] <= 0
            if done and st["end"] == 1:  # aborted: no final outcome, only a release
                ctrl.release(rid)
                for p in props.values():
                    p.release(rid)
                del live[rid]
                continue
            outcomes.append(RequestOutcome(rid, arm, len(draft), acc, emitted, done))
        ctrl.observe(StepOutcome(outcomes, 0.01, len(views), sum(o.drafted for o in outcomes)))
        for o in outcomes:
            if o.finished:
                ctrl.release(o.req_id)
                for p in props.values():
                    p.release(o.req_id)
                del live[o.req_id]
        peak = max(peak, ctrl.num_tracked_requests(), len(props["jacobi"]))
        assert ctrl.num_tracked_requests() <= len(live)
        steps += 1
    assert next_id == total
    assert ctrl.num_tracked_requests() == 0
    assert len(props["jacobi"]) == 0
    assert peak <= 64
    assert steps > 100
