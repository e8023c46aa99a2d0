"""``AdaptiveSpec(llm)`` under vLLM's defaults: the engine core in a child process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``) and, on the CPU build, the model runner in a worker process beside
it (the multiprocess executor). The controller is built in the engine-core process through the plugin's
utility method (:mod:`adaptive_spec.vllm.remote`), the runner side on the worker
(:mod:`adaptive_spec.vllm.workers`).

One engine per test process (tests/conftest.py builds in-process engines): the engine runs in a fresh
interpreter (tests/_mp_engine_script.py) that prints its results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')")

ROOT = Path(__file__).resolve().parent.parent


def _run_script(script: str, *args: str, timeout: float = 420.0) -> dict:
    env = dict(os.environ)
    env.pop(
        "VLLM_ENABLE_V1_MULTIPROCESSING", None
    )  # vLLM's default: the engine core in a child process
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"result": json.loads(lines[-1].removeprefix("RESULT ")), "stderr": proc.stderr}


def test_attach_under_the_default_multiprocess_engine(tiny_model_dir, tmp_path):
    out = _run_script("_mp_engine_script.py", str(tiny_model_dir), str(tmp_path))
    res = out["result"]
    assert res["client"] == "SyncMPClient"
    assert res["type"] == "RemoteAdaptiveSpec" and res["attached_is_spec"]
    # Greedy identity with no speculation, for a static Jacobi arm (argmax rows from the worker) and
    # the adaptive controller; after detach the engine is plain vLLM again.
    assert res["static_identity"] and res["adaptive_identity"] and res["detached_identity"]
    st = res["static_stats"]
    assert st["steps"] > 0 and st["by_proposer"]["jacobi"]["drafted"] > 0
    assert st["greedy_verify_steps"] > 0  # the verification shortcut ran on the worker
    ad = res["adaptive_stats"]
    assert ad["steps"] > 0 and ad["by_category"]["all"]["emitted"] == res["emitted_total"]
    assert res["faults"] == 0 and not res["attached_after_detach"]
    assert Path(res["saved"]).is_file()
    # The trace, written by the engine-core process: the worker's argmax rows reached the controller.
    steps = [r for r in res["trace"] if r.get("type") == "step"]
    rows = [q for s in steps for q in s.get("requests", []) if q.get("drafted")]
    assert rows and all(len(q["target_argmax"]) == q["drafted"] + 1 for q in rows)
    assert "nanobind: leaked" not in out["stderr"]


def test_eagle3_head_under_the_default_multiprocess_engine(tmp_path):
    """The head's KV-cache pass deferred on the worker (adaptive_spec.vllm.deferred_kv): greedy
    identity with and without the deferral, the same drafts accepted, no fault on the worker."""
    from tests.test_correctness_eagle3 import tiny_target_and_head

    target, head = tiny_target_and_head()
    out = _run_script("_mp_eagle3_script.py", str(target), str(head), str(tmp_path))
    runs = out["result"]["runs"]
    assert out["result"]["client"] == "SyncMPClient"
    for name, r in runs.items():
        assert r["identity"] and r["faults"] == 0, (name, r)
    idle, idle_off = runs["static:none defer=True"], runs["static:none defer=False"]
    assert idle["drafter_kv"]["deferred_steps"] > 0, idle
    assert idle_off.get("drafter_kv") is None, idle_off
    on, off = runs["static:draft:2 defer=True"], runs["static:draft:2 defer=False"]
    assert on["drafted"] > 0 and (on["drafted"], on["accepted"]) == (
        off["drafted"],
        off["accepted"],
    )
