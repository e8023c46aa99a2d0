"""The main job end to end on the real embedded model (slow: one engine build in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``adaptive-spec run --prompts 4 --max-tokens 24 --compare-static --repeats 1`` in a subprocess
    (no learned state kept)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [
        sys.executable,
        "-m",
        "adaptive_spec.commands.cli",
        "run",
        "--prompts",
        "4",
        "--max-tokens",
        "24",
    ]
    cmd += [*extra, "--compare-static", "--repeats", "1", "--no-state", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)


def _check_comparison(res: dict, nospec: bool) -> None:
    cmp = res["comparison"]
    names = {"none", cmp["baseline"], "adaptive"} | ({"nospec"} if nospec else set())
    assert set(cmp["configs"]) == names
    for name, c in cmp["configs"].items():
        assert len(c["runs"]) == 1 and 0 < c["runs"][0]["output_tokens"] <= 4 * 24, name
        ident = c["identity"]
        assert ident["total"] == 4 and ident["violations"] == 0, (name, ident)
        assert c["ratio_to_none"] > 0
        run = c["runs"][0]
        assert run["steps"] > 0 and run["mean_step_ms"] > 0, (name, run)
        assert 0 <= run["accepted"] <= run["drafted"], (name, run)
        if name != "nospec":  # the engine without speculative decoding has no controller
            assert 0 <= run["controller_overhead"] < 1, (name, run)
        # Outputs that differ from the baseline's in the same round: at most those where either
        # differs from the reference (none at all for the baseline itself).
        div = c["diverged_from_baseline"]
        base_ident = cmp["configs"][cmp["baseline"]]["identity"]
        assert div["total"] == 4, (name, div)
        assert 0 <= div["requests"] <= (4 - ident["identical"]) + (4 - base_ident["identical"])
        if name == cmp["baseline"]:
            assert div["requests"] == 0
    assert all(r["drafted"] == 0 for r in cmp["configs"]["none"]["runs"])  # no placeholders
    assert cmp["configs"]["none"]["ratio_to_none"] == 1.0
    if nospec:
        # Built beside the main engine and run in the same rounds: every ratio to it is paired.
        assert cmp["nospec"]["paired"] is True and cmp["nospec"]["goodput_tok_s"] > 0, cmp["nospec"]
        assert cmp["configs"]["nospec"]["runs"][0]["drafted"] == 0
        assert cmp["configs"]["nospec"]["ratio_to_nospec"] == 1.0
        for c in cmp["configs"].values():
            assert c["ratio_to_nospec"] > 0
    else:
        assert "nospec" not in cmp


def test_run_compare_static_real_model(tmp_path: Path, default_model_dir: Path) -> None:
    out = tmp_path / "run"
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "goodput" in text and "tokens/s" in text
    for cat in ("code", "math", "chat", "summarize"):
        assert cat in text
    assert "engine without speculative decoding" in text
    # The trace comes from one more adaptive run after the timed rounds (a trace costs time that the
    # untraced configurations do not pay, so no timed run is traced).
    assert text.index("traced run: adaptive") > text.rindex("round 1/1")
    summary = json.loads((out / "summary.json").read_text())
    res = summary["results"]
    assert 0 < res["adaptive"]["output_tokens"] <= 4 * 24
    _check_comparison(res, nospec=True)
    assert (out / "arms.png").stat().st_size > 1000
    lines = (out / "trace.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["schema"] == "adaptive-spec-trace"
    assert any('"type":"step"' in ln for ln in lines)
    # The summary says which step-cost table the controller priced steps with, as the trace does.
    source = res["adaptive"]["stats"]["cost_table_source"]
    assert isinstance(source, str) and source and source == header["cost_table_source"]


def test_run_with_the_shipped_eagle3_head(tmp_path: Path, default_model_dir: Path) -> None:
    """``--proposers none,ngram,draft`` loads the shipped EAGLE-3 head (vLLM method ``eagle3``) into the
    main job; output stays identical to speculation off (greedy), and the head's drafts are accepted."""
    out = tmp_path / "run"
    proc = _run(out, "--proposers", "none,ngram,draft", "--no-nospec")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    res = summary["results"]
    _check_comparison(res, nospec=False)
    header = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
    assert "draft" in header["proposers"], header["proposers"]
    # The head made drafts the controller could choose; where it verified them, some were accepted.
    offered, drafted, accepted = 0, 0, 0
    for line in (out / "trace.jsonl").read_text().splitlines()[1:]:
        step = json.loads(line)
        for r in step.get("requests", []):
            offered += bool((r.get("cf_drafts") or {}).get("draft"))
            if str(r.get("arm", "")).startswith("draft:"):
                drafted += r["drafted"]
                accepted += r["accepted"]
    assert offered > 0
    assert drafted == 0 or accepted > 0, (drafted, accepted)
