"""Family 3: per-token outputs. With logprobs requested, every emitted token has exactly one entry, equal
(float32: within 1e-4, same ranks, same top-n set) to no speculation's, whether it came as an accepted
draft token, the correction at a rejection or the bonus token; none missing, none zero-filled; the
streamed deltas carry the same entries."""

from __future__ import annotations

import math

import pytest

from adaptive_spec.core.arms import Arm
from tests.scripted import (
    MAX_K,
    OracleProposer,
    ScriptedPolicy,
    core_prompts,
    cycling_correct,
    every_step,
    fixed,
    greedy,
    install_proposer,
    reference,
    references_for,
    stream,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)

PROMPTS = core_prompts()
TOP_N = 3


@pytest.fixture(scope="module")
def expected(tiny_llm):
    return reference(tiny_llm, PROMPTS, greedy(logprobs=TOP_N))


def _check_entry(got: dict, want: dict, token: int, where: str) -> None:
    assert token in got, f"{where}: sampled token {token} has no logprob"
    assert set(got) == set(want), f"{where}: top-{TOP_N} ids {sorted(got)} != {sorted(want)}"
    values = [lp.logprob for lp in got.values()]
    assert all(math.isfinite(v) and v <= 0.0 for v in values), f"{where}: {values}"
    assert len(set(values)) > 1, f"{where}: zero-filled or constant entry {values}"
    for t, lp in got.items():
        assert abs(lp.logprob - want[t].logprob) <= 1e-4, f"{where}: token {t} {lp} vs {want[t]}"
        assert lp.rank == want[t].rank, f"{where}: token {t} rank {lp.rank} vs {want[t].rank}"


@pytest.mark.parametrize(
    ("schedule", "oracle", "pattern"),
    [
        pytest.param(fixed(Arm("ngram", MAX_K)), True, (9, 9, 2), id="oracle-k4-accepted"),
        pytest.param(fixed(Arm("ngram", 2)), True, (0, 1, 9), id="oracle-k2-rejections"),
        pytest.param(every_step(["ngram", "jacobi"]), True, (9, 0, 3, 1), id="every-step"),
        pytest.param(fixed(Arm("jacobi", MAX_K)), False, (), id="jacobi-k4"),
    ],
)
def test_logprobs_equal_no_speculation(tiny_llm, expected, schedule, oracle, pattern):
    from adaptive_spec.vllm import AdaptiveSpec

    refs = references_for(PROMPTS, expected)
    policy = ScriptedPolicy(["ngram", "jacobi"], MAX_K, schedule)
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        policy.bind(spec)
        if oracle:
            install_proposer(
                spec, "ngram", OracleProposer(refs, cycling_correct(pattern), max_k=MAX_K)
            )
        res = stream(tiny_llm, PROMPTS, greedy(logprobs=TOP_N))
    drafted = sum(o.drafted for out in policy.log.outcomes for o in out.requests)
    accepted = sum(o.accepted for out in policy.log.outcomes for o in out.requests)
    assert drafted > 0 and (accepted > 0 or not oracle)
    for p, r, e in zip(PROMPTS, res, expected, strict=True):
        assert r.token_ids == list(e.token_ids)
        assert len(r.logprobs) == len(r.token_ids) == len(e.logprobs), (
            f"{len(r.logprobs)} logprob entries for {len(r.token_ids)} tokens"
        )
        for j, (got, want, t) in enumerate(zip(r.logprobs, e.logprobs, r.token_ids, strict=True)):
            _check_entry(got, want, t, f"prompt {p[:3]}... position {j}")
