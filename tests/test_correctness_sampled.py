"""The engine's output distribution at temperature > 0 (tiny float32 model, in-process engine).

600 requests of one prompt decode 3 tokens at T = 1.0, every request at k = 0 and again with Jacobi
drafting 2 tokens at every step, so that the second and third tokens come from sampled verification
(``verify_sampled``: mostly rejections and the token sampled at the first rejected position; the
tiny model accepts few Jacobi drafts) and the first from the sampler of a step without draft tokens.
Each position's token distribution must agree between the two runs (chi-square contingency over the
tokens drawn at least 20 times, the rest pooled). The same test tells T = 1.0 from T = 0.8 at k = 0:
it has the power to see a wrong distribution. The distribution of accepted drafts and bonus tokens is
checked against the exact one at the kernel level in ``tests/test_vllm_sampling.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from adaptive_spec.core.arms import NO_SPEC, Arm
from tests.scripted import MAX_K, ScriptedPolicy, fixed, generate

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)

N = 600
PROMPT = [100, 200] * 6
TOKENS = 3


def _sample(llm, arm, temperature):
    import torch
    from vllm import SamplingParams

    from adaptive_spec.vllm import AdaptiveSpec

    policy = ScriptedPolicy(["ngram", "jacobi"], MAX_K, fixed(arm))
    torch.manual_seed(0)
    with AdaptiveSpec(llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        policy.bind(spec)
        params = SamplingParams(temperature=temperature, max_tokens=TOKENS)
        outs = generate(llm, [PROMPT] * N, params)
    return [list(o.token_ids) for o in outs], spec.stats()


def _pvalue(a: list[list[int]], b: list[list[int]], pos: int) -> float:
    from scipy.stats import chi2_contingency

    ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
    keys = sorted(k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 20)
    rows = [[c[k] for k in keys] + [N - sum(c[k] for k in keys)] for c in (ca, cb)]
    return float(chi2_contingency(rows).pvalue)


@pytest.fixture(scope="module")
def samples(tiny_llm):
    k0, _ = _sample(tiny_llm, NO_SPEC, 1.0)
    drafted, stats = _sample(tiny_llm, Arm("jacobi", 2), 1.0)
    cooler, _ = _sample(tiny_llm, NO_SPEC, 0.8)
    return k0, drafted, cooler, stats


def test_sampled_verification_keeps_the_targets_distribution(samples):
    k0, drafted, _, stats = samples
    assert all(len(t) == TOKENS for t in k0 + drafted)
    assert stats["sampled_verify_steps"] > 0 and stats["faults"] == 0
    assert stats["by_proposer"]["jacobi"]["drafted"] >= N  # every request verified drafts
    for pos in range(TOKENS):
        assert _pvalue(k0, drafted, pos) > 1e-3, f"position {pos}"


def test_the_distribution_check_has_power(samples):
    k0, _, cooler, _ = samples
    assert min(_pvalue(k0, cooler, pos) for pos in range(TOKENS)) < 1e-3
