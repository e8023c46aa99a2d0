"""A quiet exit: drop the leak report that Triton's bindings print when the interpreter shuts down.

On vLLM's CPU build, ``import vllm`` loads Triton's compiled bindings (through PyTorch) although
vLLM then disables Triton on the CPU. In a process that served requests (the ``vllm serve`` API
server, ``adaptive-spec bench serve``), the interpreter's shutdown can leave those bindings' module
alive, and nanobind, the binding library, then prints a report of several hundred "leaked"
instances, types and functions to standard error. Nothing is lost (the process is ending), but the
result the user waited for scrolls away under it.

:func:`install` registers an exit handler. At exit, when Triton's bindings are loaded, the handler
puts a filter on file descriptor 2: a small child process copies every byte written to standard
error from then on to the original standard error, except the lines of nanobind's leak report.
Everything else that the process writes while it shuts down (warnings, tracebacks, vLLM's shutdown
log) still reaches the user, in order. Set ``ADAPTIVE_SPEC_SHOW_EXIT_REPORT=1`` to see the report.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading

#: Environment variable that turns the filter off (any value other than "", "0").
ENV_SHOW = "ADAPTIVE_SPEC_SHOW_EXIT_REPORT"
#: The module whose presence means nanobind's report may come.
BINDINGS_MODULE = "triton._C.libtriton"

# The report, as nanobind writes it: a header per kind ("nanobind: leaked 4 instances!"), one line
# per object (" - leaked function ..."), " - ... skipped remainder", and a two-line footer whose
# last line ends without a newline.
_FILTER = r"""
import sys
HEAD = b"nanobind: leaked "
ITEM = (b" - leaked ", b" - ... skipped remainder")
HINT = b"nanobind: this is likely caused by a reference counting issue"
LINK = b"See https://nanobind.readthedocs.io/en/latest/refleaks.html"
src, dst = sys.stdin.buffer, sys.stdout.buffer
in_report = False
for line in iter(src.readline, b""):
    if line.startswith(HEAD) or line.startswith(HINT):
        in_report = True
        continue
    if in_report and line.startswith(ITEM):
        continue
    if line.startswith(LINK):
        line = line[len(LINK):]
        in_report = False
        if not line.strip():
            continue
    else:
        in_report = False
    dst.write(line)
    dst.flush()
"""

_installed_pid: int | None = None
_lock = threading.Lock()


def filter_source() -> str:
    """The filter's Python source (reads standard input, writes standard output)."""
    return _FILTER


def _wanted(environ: os._Environ[str] | dict[str, str]) -> bool:
    if environ.get(ENV_SHOW, "") not in ("", "0"):
        return False
    return BINDINGS_MODULE in sys.modules


def _filter_stderr() -> None:
    """Route file descriptor 2 through the filter for the rest of this process's life."""
    if not _wanted(os.environ):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    try:
        original = os.dup(2)
    except OSError:
        return
    r, w = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FILTER],
            stdin=r,
            stdout=original,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C at the terminal must not cut what is still to come
        )
    except OSError:
        os.close(w)
        return
    finally:
        os.close(r)
        os.close(original)
    os.dup2(w, 2)
    os.close(w)


def install() -> None:
    """Filter nanobind's leak report from this process's standard error at exit (once per process;
    a forked child that inherited the handler does nothing unless it installs its own)."""
    global _installed_pid
    with _lock:
        pid = os.getpid()
        if _installed_pid == pid:
            return
        _installed_pid = pid

    def _at_exit() -> None:
        if os.getpid() == pid:
            _filter_stderr()

    atexit.register(_at_exit)
