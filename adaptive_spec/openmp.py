"""Intel OpenMP for vLLM's CPU engine: the commands that build an engine run with ``libiomp5`` preloaded.

vLLM's x86 CPU build installs Intel's OpenMP runtime (the ``intel-openmp`` package, ``libiomp5.so``
under the environment's ``lib/``) and asks for it in ``LD_PRELOAD``: without it, its CPU worker warns
that "speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant
performance loss". vLLM sets ``LD_PRELOAD`` itself only for the engine processes it starts; an engine
built in the calling process (as :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` needs it) runs with
whatever runtime the process started with, PyTorch's GNU OpenMP, because a library can only be
preloaded when a process starts.

So :func:`reexec_with_intel_openmp` starts the command again, once, with the library first in
``LD_PRELOAD`` (Intel's runtime implements the GNU OpenMP interface, so PyTorch's parallel regions run
on it). On the embedded default in float32 (2-core Xeon, c = 16, T = 1.0, three pairs of runs) the
adaptive controller's ratio to the engine without speculative decoding went from 0.934-0.971 to
0.957-0.982 with it; at c = 4 greedy it changed nothing beyond the noise (``docs/benchmarks.md``).

It does nothing where the library is not installed (vLLM's CUDA build does not install it), on other
machines than Linux x86-64, when ``LD_PRELOAD`` already names an Intel OpenMP runtime, or when the
environment variable ``ADAPTIVE_SPEC_INTEL_OPENMP`` is ``0`` (the opt-out). A library embedding
``AdaptiveSpec`` in its own process sets ``LD_PRELOAD`` itself, as vLLM's CPU installation guide
describes.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Set to ``0`` to keep the process's own OpenMP runtime.
OPT_OUT = "ADAPTIVE_SPEC_INTEL_OPENMP"
#: Set in the re-executed process, so that a preload that did not take never loops.
_MARK = "ADAPTIVE_SPEC_INTEL_OPENMP_PRELOADED"
LIBRARY = "libiomp5.so"


def intel_openmp_library(prefix: str | Path | None = None) -> Path | None:
    """Path of Intel's OpenMP runtime installed in the environment at ``prefix`` (default: this
    interpreter's ``sys.prefix``), or None where it is not installed."""
    path = Path(prefix if prefix is not None else sys.prefix) / "lib" / LIBRARY
    return path if path.is_file() else None


def preload_env(
    environ: Mapping[str, str], library: Path | None, machine: str | None = None
) -> dict[str, str] | None:
    """The environment to start the command again with, ``library`` first in ``LD_PRELOAD``, or None
    where no restart is wanted: no library, not Linux x86-64 (``machine`` defaults to this one's),
    an Intel OpenMP runtime already preloaded, the opt-out (``ADAPTIVE_SPEC_INTEL_OPENMP=0``), or a
    process that was already started again."""
    if library is None or environ.get(_MARK) or environ.get(OPT_OUT, "1").strip() == "0":
        return None
    machine = machine if machine is not None else platform.machine()
    if not sys.platform.startswith("linux") or machine.lower() not in ("x86_64", "amd64"):
        return None
    preload = environ.get("LD_PRELOAD", "")
    if "libiomp" in preload:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    env[_MARK] = "1"
    return env


def reexec_with_intel_openmp(args: Sequence[str]) -> None:
    """Replace this process with ``sys.executable *args`` run with Intel OpenMP preloaded, when
    :func:`preload_env` wants it; otherwise return. ``args`` are the interpreter's arguments, e.g.
    ``["-m", "adaptive_spec.cli", "run", ...]``. Call it before anything is written or started:
    the process is replaced (same PID, same standard streams). Raises ``OSError`` only if the
    interpreter cannot be executed."""
    env = preload_env(os.environ, intel_openmp_library())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)
