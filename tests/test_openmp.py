"""Intel OpenMP preloaded for the commands that build an engine (adaptive_spec.openmp)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_spec.cli import build_parser
from adaptive_spec.openmp import OPT_OUT, intel_openmp_library, preload_env

LIB = Path("/env/lib/libiomp5.so")


def test_preload_env_puts_the_library_first_and_keeps_what_was_preloaded() -> None:
    env = preload_env({"PATH": "/bin"}, LIB, machine="x86_64")
    assert env is not None and env["LD_PRELOAD"] == str(LIB) and env["PATH"] == "/bin"
    env = preload_env({"LD_PRELOAD": "/x/libtcmalloc.so"}, LIB, machine="x86_64")
    assert env is not None and env["LD_PRELOAD"] == f"{LIB}:/x/libtcmalloc.so"


@pytest.mark.parametrize(
    ("environ", "library", "machine"),
    [
        ({}, None, "x86_64"),  # not installed (vLLM's CUDA build)
        ({}, LIB, "aarch64"),
        ({"LD_PRELOAD": "/opt/intel/libiomp5.so"}, LIB, "x86_64"),  # the user's own
        ({OPT_OUT: "0"}, LIB, "x86_64"),
        ({"ADAPTIVE_SPEC_INTEL_OPENMP_PRELOADED": "1"}, LIB, "x86_64"),  # started again already
    ],
)
def test_preload_env_declines(environ: dict[str, str], library: Path | None, machine: str) -> None:
    assert preload_env(environ, library, machine=machine) is None


def test_intel_openmp_library_looks_under_the_environment(tmp_path: Path) -> None:
    assert intel_openmp_library(tmp_path) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert intel_openmp_library(tmp_path) == tmp_path / "lib" / "libiomp5.so"


def test_engine_commands_are_marked_and_others_not() -> None:
    parser = build_parser()
    for argv in (["run"], ["bench"], ["calibrate"], ["distill", "--out", "d"]):
        assert parser.parse_args(argv).builds_engine is True, argv
    assert not getattr(parser.parse_args(["replay", "t.jsonl"]), "builds_engine", False)


_CHILD = """
import sys
from adaptive_spec.openmp import reexec_with_intel_openmp
reexec_with_intel_openmp(["-c", "import os; print('preloaded', os.environ['LD_PRELOAD'], "
                          "open('/proc/self/maps').read().count('libiomp5'))"])
print('not restarted')
"""


@pytest.mark.skipif(
    intel_openmp_library() is None or not sys.platform.startswith("linux"),
    reason="Intel OpenMP is installed with vLLM's x86 CPU build only",
)
def test_the_process_starts_again_with_the_library_mapped() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_SPEC_INTEL")}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "preloaded" and out[1].startswith(str(intel_openmp_library()))
    assert int(out[2]) > 0  # the runtime is mapped into the new process
    env[OPT_OUT] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "not restarted"
