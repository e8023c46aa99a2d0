"""The draft-model proposer across the correctness families, in a subprocess.

A draft-model engine is a second vLLM engine configuration, and several engines in one process are
fragile, so this module runs itself as a worker (``python -m tests.test_correctness_draft``)
in a subprocess, bounded in time: the tiny float32 target with a draft model made from the target plus
small noise (:func:`tests.scripted.make_near_draft`: it agrees with the target on many tokens but not
all, so both accepted and rejected drafts occur). The worker runs every check, records each result in
a JSON file, and the tests below report one result each:

* identity and bookkeeping for the draft arm at k = 1, 2, max, k = 0, a schedule that changes proposer
  (draft, n-gram, Jacobi) and k every step, and the adaptive controller (family 1);
* the draft's proposals depend only on the context, also when the draft arm was skipped for some steps
  (its KV cache must not go stale);
* a stop token inside an accepted draft chunk (family 2), logprobs (family 3), no per-request state left
  (family 6), metrics recomputed from the trace (family 7).

Seeded sampling (family 4) needs temperature > 0 verification, broken on vLLM 0.32's CPU build (see
``test_correctness_seeds.py``); it runs in the worker only where that kernel is right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = (
    "identity-draft-k0",
    "identity-draft-k1",
    "identity-draft-k2",
    "identity-draft-kmax",
    "identity-every-step",
    "identity-adaptive",
    "draft-acceptance-mixed",
    "draft-proposals-context-only",
    "stop-token-inside-draft-chunk",
    "logprobs",
    "no-state-left",
    "metrics-from-trace",
    "seeds",
)
TIMEOUT_S = 420
NOISE = 0.006  # draft = target + this much weight noise: about 70 % greedy agreement


# -- worker ----------------------------------------------------------------------------------------
def _worker(target_dir: str, draft_dir: str, out_path: str, tmp: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from adaptive_spec.core.arms import NO_SPEC, Arm
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.engine import build_llm
    from tests.scripted import (
        MAX_K,
        ScriptedPolicy,
        check_bookkeeping,
        core_prompts,
        every_step,
        fixed,
        generate,
        greedy,
        reference,
        references_for,
        stream,
    )
    from tests.test_correctness_metrics import _check_stats_against_trace
    from tests.test_correctness_seeds import _expand_is_correct

    results: dict[str, dict[str, Any]] = {}

    def check(name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
            results[name] = {
                "ok": True,
                "detail": f"{detail or ''} ({time.perf_counter() - t0:.1f} s)",
            }
        except pytest.skip.Exception as e:
            results[name] = {"ok": None, "detail": str(e)}
        except BaseException as e:
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}",
            }
        Path(out_path).write_text(json.dumps(results, indent=1), encoding="utf-8")

    llm = build_llm(
        target_dir,
        dtype="float32",
        max_k=MAX_K,
        concurrency=4,
        method="draft_model",
        draft_model=draft_dir,
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_gib=0.25,
    )
    prompts = core_prompts()[1:]
    proposers = ["none", "ngram", "jacobi", "draft"]
    with_logprobs = greedy(12, logprobs=3)
    expected = reference(llm, prompts, with_logprobs)
    ref = references_for(prompts, expected)
    traces: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    streamed: dict[str, Any] = {}

    def run(name, policy, params=None, use_stream=False):
        path = Path(tmp) / f"{name}.jsonl"
        with AdaptiveSpec(llm, proposers, policy=policy, trace=path, trace_argmax=True) as spec:
            if isinstance(policy, ScriptedPolicy):
                policy.bind(spec)
            if use_stream:
                outs = stream(llm, prompts, params or greedy(12))
            else:
                outs = generate(llm, prompts, params or greedy(12))
        traces[name], specs[name], streamed[name] = read_trace(path), spec, outs
        return outs, spec, traces[name]

    def identity(name, policy, params=None, use_stream=False):
        def fn():
            outs, spec, trace = run(name, policy, params, use_stream)
            got = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
            assert got == ref, "tokens differ from no speculation"
            s = check_bookkeeping(trace, got)
            assert spec.stats()["faults"] == 0
            return f"{s}"

        return fn

    arms = ["draft", "ngram", "jacobi"]
    check("identity-draft-k0", identity("k0", ScriptedPolicy(arms, MAX_K, fixed(NO_SPEC))))
    for k, label in ((1, "k1"), (2, "k2"), (MAX_K, "kmax")):
        check(
            f"identity-draft-{label}",
            identity(label, ScriptedPolicy(arms, MAX_K, fixed(Arm("draft", k)))),
        )
    every = ScriptedPolicy(arms, MAX_K, every_step(arms))
    check("identity-every-step", identity("every", every, with_logprobs, use_stream=True))
    check("identity-adaptive", identity("adaptive", "adaptive"))

    def acceptance_mixed():
        rows = [r for s in traces["kmax"].steps for r in s["requests"] if r["drafted"] > 0]
        acc = sum(r["accepted"] for r in rows)
        drafted = sum(r["drafted"] for r in rows)
        assert 0 < acc < drafted, f"accepted {acc} of {drafted}: the draft must be partly right"
        assert any(r["accepted"] == r["drafted"] for r in rows) and any(
            r["accepted"] == 0 for r in rows
        )
        return f"accepted {acc}/{drafted}"

    check("draft-acceptance-mixed", acceptance_mixed)

    def proposals_context_only():
        def drafts_by_position(trace):
            out = {}
            for s in trace.steps:
                for r in s["requests"]:
                    d = (r["cf_drafts"] or {}).get("draft")
                    if d:
                        key = (
                            tuple(trace.requests[r["req_id"]]["prompt_token_ids"]),
                            r["num_output_before"],
                        )
                        out[key] = d
            return out

        always = drafts_by_position(traces["kmax"])
        mixed = drafts_by_position(traces["every"])
        common = set(always) & set(mixed)
        assert len(common) >= 3, f"only {len(common)} common positions"
        bad = [k for k in common if always[k] != mixed[k]]
        assert not bad, f"draft proposals differ after skipped steps at {bad[:3]}"
        return f"{len(common)} positions compared"

    check("draft-proposals-context-only", proposals_context_only)

    def stop_inside_chunk():
        stops = [ref[tuple(p)][5] for p in prompts]
        params = [greedy(12, stop_token_ids=[t]) for t in stops]
        expected = reference(llm, prompts, params)
        outs, spec, trace = run(
            "stop", ScriptedPolicy(arms, MAX_K, fixed(Arm("draft", MAX_K))), params, use_stream=True
        )
        for o, e in zip(outs, expected, strict=True):
            assert o.token_ids == list(e.token_ids) and o.finish_reason == e.finish_reason
            assert o.outputs_after_finish == 0
        total = sum(len(o.token_ids) for o in outs)
        assert spec.stats()["by_category"]["all"]["emitted"] == total
        rows = [r for s in trace.steps for r in s["requests"]]
        assert all(r["accepted"] <= r["emitted"] for r in rows)
        return f"{total} tokens"

    check("stop-token-inside-draft-chunk", stop_inside_chunk)

    def logprobs():
        assert "every" in streamed, "the every-step run failed"
        for o, e in zip(streamed["every"], expected, strict=True):
            assert o.token_ids == list(e.token_ids)
            assert len(o.logprobs) == len(o.token_ids) == len(e.logprobs)
            for got, want in zip(o.logprobs, e.logprobs, strict=True):
                assert set(got) == set(want)
                assert all(abs(got[t].logprob - want[t].logprob) <= 1e-4 for t in got)
                assert len({lp.logprob for lp in got.values()}) > 1
        return None

    check("logprobs", logprobs)

    def no_state_left():
        outs = stream(llm, prompts, greedy(12), abort_after={0: 3})
        with AdaptiveSpec(llm, proposers, policy="adaptive") as spec:
            stream(
                llm,
                prompts,
                [greedy(12), greedy(2), greedy(12, stop=["a"]), greedy(5)],
                abort_after={0: 3},
            )
            st = spec.stats()
            assert st["tracked_requests"] == 0 and spec.policy.num_tracked_requests() == 0
            assert len(spec.proposers["jacobi"]) == 0
        return f"{len(outs)} requests"

    check("no-state-left", no_state_left)

    def metrics_from_trace():
        assert "every" in traces, "the every-step run failed"
        _check_stats_against_trace(specs["every"].stats(), traces["every"])
        return None

    check("metrics-from-trace", metrics_from_trace)

    def seeds():
        if not _expand_is_correct():
            pytest.skip(
                "vLLM's CPU expand kernel corrupts per-token temperatures (test_correctness_seeds.py)"
            )
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.8, seed=77, max_tokens=12)
        schedule = fixed(Arm("draft", 2))
        a, *_ = run("seed-a", ScriptedPolicy(arms, MAX_K, schedule), [sp] * len(prompts))
        mates = [sp, *(SamplingParams(temperature=1.0, max_tokens=12) for _ in prompts[1:])]
        b, *_ = run("seed-b", ScriptedPolicy(arms, MAX_K, schedule), mates)
        assert list(a[0].token_ids) == list(b[0].token_ids)
        return None

    check("seeds", seeds)


# -- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_results(tiny_model_dir, tmp_path_factory) -> dict[str, dict[str, Any]]:
    pytest.importorskip(
        "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
    )
    from adaptive_spec.core.paths import cache_dir
    from tests.scripted import make_near_draft

    draft_dir = make_near_draft(
        tiny_model_dir, cache_dir() / f"tiny-llama-f32-near-draft-{NOISE}", noise=NOISE
    )
    tmp = tmp_path_factory.mktemp("draft")
    out = tmp / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.test_correctness_draft",
        str(tiny_model_dir),
        str(draft_dir),
        str(out),
        str(tmp),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"worker timed out after {TIMEOUT_S} s; output tail: {str(e.stdout or '')[-1500:]}"
    results = json.loads(out.read_text()) if out.exists() else {}
    results["_tail"] = {"ok": None, "detail": tail}
    return results


@pytest.mark.vllm
@pytest.mark.parametrize("name", CHECKS)
def test_draft_model_engine(draft_results, name):
    r = draft_results.get(name)
    if r is None:
        pytest.fail(f"the worker did not reach check {name!r}: {draft_results['_tail']['detail']}")
    if r["ok"] is None:
        pytest.skip(r["detail"])
    assert r["ok"], r["detail"]


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
