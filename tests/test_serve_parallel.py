"""``vllm serve`` with tensor parallelism 2 and with data parallelism 2 on the CPU, on the tiny float32 model
(2 attention heads: one per TP rank).

vLLM's CPU build binds one NUMA node per rank and refuses more ranks than nodes unless
``VLLM_CPU_OMP_THREADS_BIND`` names each rank's cores: ``"0|1"`` gives each rank (or each data-parallel
replica's single rank) one core.

Tensor parallelism (the multiprocess executor, one worker process per rank), with and without the plugin. The controller
runs with the scheduler in the engine-core process; the runner-side hooks run on both ranks
(:mod:`adaptive_spec.vllm.workers`). Checked: the same greedy text and token counts as the same server
without the plugin, ``/metrics`` counting what was served, and the final state save.

Data parallelism (one engine core, hence one controller, per replica; both share one state file): both
replicas serve, ``/metrics`` shows each engine, and the state file holds the sum of what both learned.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.test_serve_e2e import _ask, _series, _server, _total, _wait_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
#: One core per rank (vLLM's CPU build otherwise wants one NUMA node per rank).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.timeout(600)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism 2 needs 2 CPU cores")
def test_vllm_serve_tp2_with_adaptive_spec(tiny_model_dir, tmp_path):
    with _server(tiny_model_dir, tmp_path / "reference.log", TP_ENV, extra_args=TP_ARGS) as url:
        ref = _ask(url)
    assert all(n > 0 and text for text, n in ref)
    emitted = sum(n for _, n in ref)

    state = tmp_path / "policy.json"
    env = {
        **TP_ENV,
        "ADAPTIVE_SPEC": "1",
        "ADAPTIVE_SPEC_STATE": str(state),
        "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0.2",
    }
    log = tmp_path / "adaptive.log"
    with _server(tiny_model_dir, log, env, extra_args=TP_ARGS) as url:
        assert _ask(url) == ref  # greedy: the same text and token counts as vLLM alone under TP 2
        m = _wait_metrics(
            url, lambda m: _total(m, "adaptive_spec_emitted_tokens_total") == emitted, timeout=30
        )
        steps = _total(m, "adaptive_spec_step_time_seconds_count")
        assert steps > 0 and _total(m, "adaptive_spec_controller_time_seconds_count") == steps
        assert _total(m, "adaptive_spec_controller_faults_total") == 0
        assert _total(m, "adaptive_spec_drafted_tokens_total") > 0
        assert [dict(lbl)["engine"] for lbl in _series(m, "adaptive_spec_info")] == ["0"]
        _wait_metrics(url, lambda m: _total(m, "adaptive_spec_state_saves_total") >= 1)
    text = log.read_text()
    assert "adaptive-spec attached to engine 0" in text
    assert "the model runner runs in 2 worker process(es)" in text
    assert f"adaptive-spec: policy state saved to {state} at shutdown" in text


@pytest.mark.timeout(400)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="data parallelism 2 needs 2 CPU cores")
def test_vllm_serve_dp2_replicas_share_one_state_file(tiny_model_dir, tmp_path):
    state = tmp_path / "policy.json"
    env = {
        **TP_ENV,
        "ADAPTIVE_SPEC": "1",
        "ADAPTIVE_SPEC_STATE": str(state),
        "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0.2",
    }
    log = tmp_path / "adaptive.log"
    with _server(tiny_model_dir, log, env, extra_args=("--data-parallel-size", "2")) as url:
        out = _ask(url)
        assert all(n > 0 and text for text, n in out)
        emitted = sum(n for _, n in out)
        m = _wait_metrics(
            url, lambda m: _total(m, "adaptive_spec_emitted_tokens_total") == emitted, timeout=30
        )
        steps = {
            dict(lbl)["engine"]: v
            for lbl, v in _series(m, "adaptive_spec_step_time_seconds_count").items()
        }
        assert set(steps) == {"0", "1"} and all(steps.values()), steps  # a controller per replica
        assert _total(m, "adaptive_spec_controller_faults_total") == 0
        m = _wait_metrics(  # both went idle and merged
            url,
            lambda m: (
                len(_series(m, "adaptive_spec_state_saves_total")) == 2
                and min(_series(m, "adaptive_spec_state_saves_total").values()) >= 1
            ),
        )
        learned = {
            dict(lbl)["engine"]: v
            for lbl, v in _series(m, "adaptive_spec_policy_learned_steps").items()
        }
    text = log.read_text()
    assert "adaptive-spec attached to engine 0" in text
    assert "adaptive-spec attached to engine 1" in text
    # Both replicas merged into the one file: it holds what both learned (at least what either learned;
    # never more than both served: nothing counted twice). The pull is tested in test_serve_fleet.py.
    n = json.loads(state.read_text())["state"]["n_steps"]
    assert max(learned.values()) <= n <= sum(steps.values()), (n, learned, steps)
