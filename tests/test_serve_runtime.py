"""ServeRuntime (what the plugin runs inside ``vllm serve``'s engine core) on a real in-process engine:
greedy identity, the state saved when the engine goes idle and loaded by the next runtime, the metrics
snapshot, and a clean detach."""

from __future__ import annotations

import json
import time

import pytest

from adaptive_spec.vllm import prom
from adaptive_spec.vllm.plugin import ServeConfig, ServeRuntime
from tests.conftest import tiny_prompts

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)


def _generate(llm, prompts, max_tokens=32):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_runtime_on_engine_saves_loads_and_detaches(tiny_llm, tmp_path):
    core = tiny_llm.llm_engine.engine_core.engine_core
    before = {id(o): set(vars(o)) for o in (core, core.scheduler)}
    prompts = tiny_prompts(6, seed=5)
    ref = _generate(
        tiny_llm, prompts
    )  # the engine alone (vLLM's n-gram speculation; float32: exact)
    state = tmp_path / "policy.json"
    mdir = tmp_path / "metrics"
    cfg = ServeConfig(state=state, save_every_steps=4, save_every_s=3600, metrics_interval_s=0.05)

    rt = ServeRuntime(core, cfg, metrics_dir=mdir)
    try:
        assert not rt.state_loaded
        assert _generate(tiny_llm, prompts) == ref
        learned = rt.spec.policy.n_steps
        assert learned > 0
        # generate() returned: the engine is idle, so the newest state is (being) written.
        _wait_for(
            lambda: state.exists() and json.loads(state.read_text())["state"]["n_steps"] == learned
        )
        assert rt.saves >= 2  # periodic saves (every 4 steps) happened while busy
        _wait_for(lambda: prom.read_snapshots(mdir)[0]["steps"] == rt.spec.metrics.steps)
        snap = prom.read_snapshots(mdir)[0]
        assert snap["faults"] == 0 and snap["state"]["saves"] >= 1
        assert sum(p["emitted"] for p in snap["proposers"].values()) == sum(map(len, ref))
        assert sum(snap["arms"].values()) == sum(
            p["request_steps"] for p in snap["proposers"].values()
        )
        assert set(snap["estimated_acceptance"]) == {"ngram", "jacobi"}
        # Serialising on the engine thread is a small part of the work: relative to the run's own
        # step time (about 1.5 ms against 0.27 s here; no absolute bound, a busy machine moves both).
        assert 0 < rt.max_serialise_s < rt.spec.metrics.step_time_s
    finally:
        rt.close()
    for o in (core, core.scheduler):
        assert set(vars(o)) == before[id(o)], f"{type(o).__name__} keeps patched attributes"

    # A restarted runtime learns on from the saved state and still gives the same tokens.
    rt2 = ServeRuntime(core, cfg, metrics_dir=mdir)
    try:
        assert rt2.state_loaded and rt2.spec.policy.n_steps == learned
        assert prom.read_snapshots(mdir)[0]["state"]["loaded"] is True
        assert _generate(tiny_llm, prompts) == ref
        assert rt2.spec.policy.n_steps > learned
    finally:
        rt2.close()
    assert json.loads(state.read_text())["state"]["n_steps"] == rt2.spec.policy.n_steps
