"""A probabilistic draft model next to deterministic proposers is refused at attach.

With ``speculative_config draft_sample_method="probabilistic"`` vLLM 0.32 hands its rejection sampler
the draft model's cached probabilities for every request with draft tokens, also for a request whose
drafts the controller took from n-gram, suffix or Jacobi: those tokens would be accepted with
``min(1, p / q)`` against the wrong ``q``. :func:`adaptive_spec.vllm.sampling.draft_probability_conflict`
names the conflict, and ``AdaptiveSpec`` refuses it with a one-line error that names the fix.

The unit tests check the rule; the engine test (a subprocess: a second engine configuration) builds
a tiny float32 draft-model engine with probabilistic draft sampling and checks that

* ``AdaptiveSpec(llm, ["none", "ngram", "draft"])`` raises ``AttachError`` naming the fix, attaching
  nothing, and ``["none", "draft"]`` attaches and samples;
* the refusal is needed: with the check bypassed and n-gram drafts substituted for every request at
  temperature 0.02, vLLM passes non-None draft probabilities to the rejection sampler on steps whose
  draft tokens are all n-gram's (if a later vLLM stops doing so, this check says the refusal can go).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.vllm.sampling import draft_probability_conflict

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 420
NOISE = 0.006  # as tests/test_correctness_draft.py: the same cached draft model


def _spec(method: str = "draft_model", sample: str = "probabilistic", rejection: str = "standard"):
    return types.SimpleNamespace(
        method=method, draft_sample_method=sample, rejection_sample_method=rejection
    )


@pytest.mark.parametrize(
    "proposers", [["none", "ngram", "draft"], ["jacobi"], ["none", "suffix", "lora:code"]]
)
def test_probabilistic_draft_sampling_with_other_proposers_is_a_conflict(proposers):
    why = draft_probability_conflict(_spec(), proposers)
    assert why is not None and "\n" not in why
    assert "fix: set speculative_config draft_sample_method to 'greedy'" in why
    others = [p for p in proposers if p not in ("none", "draft") and not p.startswith("lora:")]
    assert f"proposers {', '.join(others)}:" in why


@pytest.mark.parametrize(
    ("spec", "proposers"),
    [
        (_spec(sample="greedy"), ["none", "ngram", "jacobi", "suffix", "draft"]),
        (_spec(), ["none", "draft", "lora:code"]),  # the draft model's own drafts match their q
        (_spec(method="ngram"), ["none", "ngram", "jacobi"]),  # no drafter probabilities
        (_spec(method="eagle", rejection="synthetic"), ["none", "ngram"]),
        (types.SimpleNamespace(method="draft_model"), ["none", "ngram"]),  # vLLM's default: greedy
    ],
)
def test_configurations_without_the_conflict_pass(spec, proposers):
    assert draft_probability_conflict(spec, proposers) is None


# -- engine worker ---------------------------------------------------------------------------------
def _worker(target_dir: str, draft_dir: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    import adaptive_spec.vllm.sampling as sampling
    from adaptive_spec.core.arms import Arm
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.attach import AttachError
    from adaptive_spec.vllm.engine import build_llm
    from tests.scripted import MAX_K, ScriptedPolicy, fixed, generate

    out: dict[str, Any] = {}
    llm = build_llm(
        target_dir,
        dtype="float32",
        max_k=MAX_K,
        concurrency=4,
        method="draft_model",
        draft_model=draft_dir,
        max_model_len=512,
        enforce_eager=True,
        kv_cache_gib=0.25,
        speculative_extra={"draft_sample_method": "probabilistic"},
    )
    # Repeated tokens: the tiny model's outputs loop on them, so n-gram finds drafts; sampled (T > 0),
    # so that vLLM's drafter keeps its probabilities.
    prompts = [[7] * 12, [100, 200] * 6] * 2
    params = SamplingParams(temperature=0.02, max_tokens=12, ignore_eos=True)
    opts = {"calibrate": False, "policy_state": None}
    try:
        AdaptiveSpec(llm, ["none", "ngram", "draft"], **opts).detach()
        out["refused"] = None
    except AttachError as e:
        out["refused"] = str(e)
        out["attached_after_refusal"] = AdaptiveSpec.attached(llm) is not None
    with AdaptiveSpec(llm, ["none", "draft"], **opts) as spec:
        outs = generate(llm, prompts, params)
        out["draft_only_tokens"] = [len(o.token_ids) for o in outs]
        out["draft_only_faults"] = spec.stats().get("faults", 0)

    # The check bypassed: every request verifies n-gram drafts; what reaches vLLM's rejection sampler?
    sampling.draft_probability_conflict = lambda *a, **k: None
    policy = ScriptedPolicy(["ngram", "draft"], MAX_K, fixed(Arm("ngram", 2)))
    steps: list[list[Any]] = []
    with AdaptiveSpec(llm, ["none", "ngram", "draft"], policy=policy, **opts) as spec:
        policy.bind(spec)
        rs = spec.runner.rejection_sampler
        hooked = rs.forward

        def forward(metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
            n = int(sum(metadata.num_draft_tokens))
            rows = None if draft_probs is None else int(draft_probs.shape[0])
            steps.append([n, rows])
            return hooked(metadata, draft_probs, logits, sampling_metadata)

        rs.forward = forward
        generate(llm, prompts, params)
        out["ngram_drafted"] = spec.stats()["by_proposer"].get("ngram", {}).get("drafted", 0)
    out["steps"] = steps
    Path(out_path).write_text(json.dumps(out), encoding="utf-8")


@pytest.fixture(scope="module")
def engine_results(tiny_model_dir, tmp_path_factory) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed")
    from adaptive_spec.core.paths import cache_dir
    from tests.scripted import make_near_draft

    draft_dir = make_near_draft(
        tiny_model_dir, cache_dir() / f"tiny-llama-f32-near-draft-{NOISE}", noise=NOISE
    )
    out = tmp_path_factory.mktemp("lossless") / "results.json"
    cmd = [sys.executable, "-m", "tests.test_lossless_draft_probs", str(tiny_model_dir)]
    cmd += [str(draft_dir), str(out)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_attach_refuses_a_probabilistic_draft_model_next_to_ngram(engine_results):
    why = engine_results["refused"]
    assert why is not None, "AdaptiveSpec attached ngram next to a probabilistic draft model"
    assert "\n" not in why and "proposers ngram:" in why
    assert "fix: set speculative_config draft_sample_method to 'greedy'" in why
    assert engine_results["attached_after_refusal"] is False


@pytest.mark.vllm
def test_the_draft_model_alone_attaches_and_samples(engine_results):
    assert engine_results["draft_only_tokens"] == [12] * 4
    assert engine_results["draft_only_faults"] == 0


@pytest.mark.vllm
def test_vllm_passes_draft_model_probabilities_for_substituted_drafts(engine_results):
    assert engine_results["ngram_drafted"] > 0
    with_drafts = [(n, rows) for n, rows in engine_results["steps"] if n > 0]
    assert with_drafts, engine_results["steps"]
    # n-gram's draft tokens, the draft model's q: the reason for the refusal
    assert any(rows == n for n, rows in with_drafts), with_drafts


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
