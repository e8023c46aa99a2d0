"""Smoke test of ``adaptive-spec bench serve --quick`` end to end: two real servers (no speculation, and the
plugin with a static Jacobi arm, which drafts at every step) on the tiny float32 model, every load pattern
driven by vLLM's own serving-benchmark client.

Checks the harness, not speed: the JSON's schema, that every request sent is counted (answered or failed)
and agrees with the servers' own counters, that ratios are computed, that the plot exists, that the
merged figures reproduce vLLM's own for single-pass patterns, that the servers stopped cleanly, and that
the greedy texts are identical across configurations (float32: exact).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# find_spec, not importorskip: this process only reads the JSON (the harness runs in a subprocess).
for _mod, _why in (("vllm", "vLLM's CPU build"), ("pandas", "pandas (vLLM's custom dataset)")):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_why} is not installed (pip install -e '.[cpu]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
RUN_KEYS = {
    "config",
    "pattern",
    "kind",
    "sent",
    "completed",
    "failed",
    "lost",
    "errors",
    "duration_s",
    "total_output_tokens",
    "output_tok_s",
    "request_throughput",
    "mean_concurrency",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "passes",
    "server",
    "acceptance",
    "checks",
    "ratio_to_none",
    "ratio_to_best_static",
    "tpot_p99_to_none",
    "tpot_p99_to_best_static",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serve")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
    }  # the harness strips ADAPTIVE_SPEC* for its servers
    cmd = [
        sys.executable,
        "-m",
        "adaptive_spec.commands.cli",
        "bench",
        "serve",
        "--quick",
        "--out",
        str(out),
    ]
    p = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False
    )
    return p, out


@pytest.mark.timeout(1800)
def test_quick_end_to_end(quick_run):
    p, out = quick_run
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    data = json.loads((out / "bench_serve.json").read_text())
    assert data["schema"] == "adaptive-spec-bench-serve" and data["version"] == 1
    assert data["mode"] == "quick" and data["settings"]["dtype"] == "float32"
    names = [c["name"] for c in data["configs"]]
    assert names == ["none", "static:jacobi:2"]
    patterns = {x["name"]: x for x in data["patterns"]}
    assert {x["kind"] for x in patterns.values()} == {"steady", "ramp", "burst", "mixtemp"}
    n = data["settings"]["requests"]

    for name in names:
        server = data["servers"][name]
        assert "error" not in server and server["ready_s"] > 0
        assert server["stop"]["clean"], server["stop"]  # SIGTERM was enough, nothing left behind
        assert Path(server["log"]).is_file()
        for pat in patterns:
            run = data["runs"][name][pat]
            assert set(run) >= RUN_KEYS, sorted(RUN_KEYS - set(run))
            # Nothing lost: every request sent came back answered (or counted as failed).
            assert run["sent"] == n and run["lost"] == 0
            assert run["completed"] + run["failed"] == run["sent"]
            assert run["completed"] == n, run["errors"]
            assert run["checks"]["all_accounted"]
            assert run["checks"]["server_completed_matches"], run["checks"]
            assert run["checks"]["generation_tokens_match"], run["checks"]
            assert run["output_tok_s"] > 0 and run["request_throughput"] > 0
            for m in ("ttft_ms", "tpot_ms", "itl_ms"):
                assert set(run[m]) == {"mean", "p50", "p99"} and run[m]["p50"] > 0
            assert isinstance(run["ratio_to_none"], float)
            assert isinstance(run["ratio_to_best_static"], float)
            if len(run["passes"]) == 1:  # merged figures reproduce vLLM's own
                v = run["passes"][0]["vllm"]
                assert v["completed"] == run["completed"]
                assert v["total_output_tokens"] == run["total_output_tokens"]
                assert v["mean_tpot_ms"] == pytest.approx(run["tpot_ms"]["mean"])
                assert v["p99_ttft_ms"] == pytest.approx(run["ttft_ms"]["p99"])
                assert v["output_throughput"] == pytest.approx(run["output_tok_s"])

    for pat, info in patterns.items():
        assert data["runs"]["none"][pat]["ratio_to_none"] == pytest.approx(1.0)
        spec = data["runs"]["static:jacobi:2"][pat]
        assert data["pattern_summaries"][pat]["best_static"] == "static:jacobi:2"
        assert spec["ratio_to_best_static"] == pytest.approx(1.0)
        # The plugin drafted, vLLM verified: both sets of counters saw it and agree.
        acc = spec["acceptance"]
        assert acc["plugin"]["drafted_tokens"] > 0
        assert acc["vllm"]["draft_tokens"] == acc["plugin"]["drafted_tokens"]
        assert acc["vllm"]["accepted_tokens"] == acc["plugin"]["accepted_tokens"]
        assert acc["plugin"]["emitted_tokens"] == spec["total_output_tokens"]
        assert spec["checks"]["plugin_emitted_matches"]
        assert acc["plugin"]["faults"] == 0
        # Greedy texts identical to no speculation's (float32: exact).
        ident = spec["identity"]
        greedy = len(spec["greedy_indices"])
        assert greedy == n if info["kind"] != "mixtemp" else 0 < greedy < n
        assert ident["compared"] == greedy and ident["identical"] == greedy, ident["examples"]
    mix = next(x for x in patterns.values() if x["kind"] == "mixtemp")["name"]
    labels = [q["label"] for q in data["runs"]["none"][mix]["passes"]]
    assert labels == ["greedy", "hot"]
    assert [q["temperature"] for q in data["runs"]["none"][mix]["passes"]] == [0.0, 1.0]

    texts = json.loads(Path(data["texts"]).read_text())
    for pat in patterns:
        ref, got = texts["none"][pat], texts["static:jacobi:2"][pat]
        for i in data["runs"]["none"][pat]["greedy_indices"]:
            assert ref[str(i)] and ref[str(i)] == got[str(i)]

    checks = data["checks"]
    assert checks["ok"] and checks["requests_lost"] == 0 and not checks["problems"]
    assert checks["requests_sent"] == len(names) * len(patterns) * n
    plot = Path(data["plot"])
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table is printed last.
    assert "vLLM's serving benchmark per pattern" in p.stdout.split("results:")[-1]
