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
    """``adaptive-spec run --prompts 4 --max-tokens 24 --compare-static`` in a subprocess."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, "-m", "adaptive_spec.cli", "run", "--prompts", "4", "--max-tokens", "24"]
    cmd += [*extra, "--compare-static", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def test_run_compare_static_real_model(tmp_path: Path, default_model_dir: Path) -> None:
    out = tmp_path / "run"
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "goodput" in text and "tokens/s" in text
    for cat in ("code", "math", "chat", "summarize"):
        assert cat in text
    summary = json.loads((out / "summary.json").read_text())
    res = summary["results"]
    assert 0 < res["adaptive"]["output_tokens"] <= 4 * 24
    assert 0 < res["no_speculation"]["output_tokens"] <= 4 * 24
    ident = res["greedy_identity"]
    assert ident["total"] == 4 and ident["violations"] == 0, ident
    assert (out / "arms.png").stat().st_size > 1000
    lines = (out / "trace.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["schema"] == "adaptive-spec-trace"
    assert any('"type":"step"' in ln for ln in lines)


def test_run_with_shipped_draft_and_lora_arms(tmp_path: Path, default_model_dir: Path) -> None:
    """``--proposers none,ngram,jacobi,draft,lora`` loads the shipped draft and its adapters into the
    main job; output stays identical to speculation off (greedy)."""
    out = tmp_path / "run"
    proc = _run(out, "--proposers", "none,ngram,jacobi,draft,lora")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    res = summary["results"]
    ident = res["greedy_identity"]
    assert ident["total"] == 4 and ident["violations"] == 0, ident
    header = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
    props = header["proposers"]
    assert "draft" in props and {"lora:code", "lora:math", "lora:chat"} <= set(props), props
    # The draft model made drafts the controller could choose (whether it chose them depends on the
    # measured step times: not asserted), credited to the base draft or to an adapter.
    offered = set()
    for line in (out / "trace.jsonl").read_text().splitlines()[1:]:
        step = json.loads(line)
        for r in step.get("requests", []):
            offered |= {p for p, d in (r.get("cf_drafts") or {}).items() if d}
    assert offered & ({"draft"} | {p for p in props if p.startswith("lora:")}), offered
