"""Every Triton kernel equals its PyTorch reference on random inputs.

On CUDA the checks of :mod:`adaptive_spec.kernels.check` run in this process at realistic
sizes. On CPU they run under ``TRITON_INTERPRET=1`` at small sizes in a subprocess: the
interpreter must be chosen before ``triton`` is first imported, which this test session may
already have done (vLLM and transformers import it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from adaptive_spec.kernels import triton_status
from adaptive_spec.kernels.check import CHECKS, _cmp_int, run_checks

TRITON_OK, TRITON_REASON = triton_status()
pytestmark = pytest.mark.skipif(
    not TRITON_OK, reason=f"Triton kernels not testable: {TRITON_REASON}"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    if torch.cuda.is_available():
        return run_checks("cuda")
    out = tmp_path_factory.mktemp("triton") / "checks.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-W", "ignore", "-m", "adaptive_spec.kernels.check"]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not out.exists():
        pytest.fail(f"kernel checks did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["results"]


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernel_equals_reference(results: dict, name: str) -> None:
    r = results[name]
    assert r["ok"], f"{name}: {r['detail']}"


NVIDIA_BACKEND = TRITON_OK and importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not NVIDIA_BACKEND, reason="Triton has no NVIDIA backend (ptxas) here")
def test_every_kernel_variant_compiles_for_sm90() -> None:
    """Ahead-of-time compilation catches what the interpreter does not (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-W", "ignore", "-m", "adaptive_spec.kernels.check", "--compile", "90"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if "compile sm_90" in ln]
    assert len(lines) >= 18, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, "\n".join(ln for ln in lines if ln.startswith("FAIL"))


def test_the_comparison_reports_differences() -> None:
    a = torch.tensor([[1, 2], [3, 4]])
    assert _cmp_int("x", a, a.clone()) is None
    b = a.clone()
    b[1, 0] = 9
    msg = _cmp_int("x", a, b)
    assert msg is not None and "1 of 4" in msg and "(1, 0)" in msg
    assert "shape" in (_cmp_int("x", a, a[:1]) or "")


def test_unknown_check_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        run_checks("cpu", ["nope"])
