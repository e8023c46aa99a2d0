"""The suffix proposer inside a real in-process vLLM engine (tiny float32 model): greedy identity with
suffix drafts alone and in mixed batches, and a trace whose suffix drafts replay exactly."""

from __future__ import annotations

import pytest

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.controller import Decision, SpecPolicy, StepView
from tests.conftest import tiny_prompts

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)


def _generate(llm, prompts, max_tokens=40):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class MixedPolicy(SpecPolicy):
    """Per request and step a different arm (suffix, n-gram, none), so every batch mixes them."""

    name = "mixed"

    def __init__(self, proposers, max_k):
        super().__init__(proposers, max_k)
        self.arms = [Arm("suffix", 4), Arm("ngram", 2), NO_SPEC, Arm("suffix", 1), Arm("suffix", 3)]
        self.t = 0

    def decide(self, view: StepView) -> Decision:
        out = [self.arms[(self.t + i) % len(self.arms)] for i in range(len(view.requests))]
        self.t += 1
        return Decision(out, [None] * len(out), [[] for _ in out])


@pytest.fixture(scope="module")
def reference(tiny_llm):
    from adaptive_spec.vllm import AdaptiveSpec

    # repeated prompts: the second copy of each can draft from the first one's text
    prompts = tiny_prompts(4, length=24, seed=5) * 2
    with AdaptiveSpec(tiny_llm, ["none"], policy="none"):
        ref = _generate(tiny_llm, prompts)
    return prompts, ref


def test_static_suffix_is_lossless_and_drafts(tiny_llm, reference, tmp_path):
    from adaptive_spec.sim.counterfactual import check_logged, suffix_counterfactual

    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    path = tmp_path / "suffix.jsonl"
    with AdaptiveSpec(
        tiny_llm, ["none", "ngram", "suffix"], policy="static:suffix:4", trace=path
    ) as spec:
        out = _generate(tiny_llm, prompts)
    assert out == ref  # float32: exact greedy identity
    st = spec.stats()
    assert st["faults"] == 0
    assert st["by_proposer"]["suffix"]["drafted"] > 0
    trace = read_trace(path)
    assert trace.header["meta"]["suffix"]["max_k"] == 4
    res = check_logged(trace, suffix_counterfactual(trace), "suffix")
    assert res["compared"] > 20 and res["equal"] == res["compared"]


def test_mixed_batches_with_suffix_are_lossless(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    policy = MixedPolicy(["ngram", "suffix"], 4)
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "suffix"], policy=policy) as spec:
        out = _generate(tiny_llm, prompts)
    assert out == ref
    st = spec.stats()
    assert st["faults"] == 0 and st["by_proposer"]["suffix"]["drafted"] > 0
    assert policy.t > 10  # many steps, each mixing suffix, n-gram and plain requests


def test_adaptive_policy_accepts_suffix(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    with AdaptiveSpec(
        tiny_llm, ["none", "ngram", "suffix"], policy="adaptive", suffix={"token_budget": 4096}
    ) as spec:
        out = _generate(tiny_llm, prompts)
    assert out == ref and spec.stats()["faults"] == 0
    with pytest.raises(ValueError, match="suffix="):
        AdaptiveSpec(tiny_llm, ["none", "suffix"], suffix={"max_k": 2})
    with pytest.raises(ValueError, match="suffix="):
        AdaptiveSpec(tiny_llm, ["none", "suffix"], suffix={"bogus": 1})
