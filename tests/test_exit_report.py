"""The exit filter for nanobind's leak report (adaptive_spec.vllm.exit_report)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from adaptive_spec.vllm import exit_report

# A report in the shape nanobind prints it, between lines that must survive. Its last line ends
# without a newline, so whatever the process writes next is glued to it.
REPORT = (
    "nanobind: leaked 4 instances!\n"
    ' - leaked instance 0x7f823d448fa8 of type "triton._C.libtriton.ir.attribute"\n'
    "nanobind: leaked 64 types!\n"
    ' - leaked type "triton._C.libtriton.ir.location"\n'
    " - ... skipped remainder\n"
    "nanobind: leaked 514 functions!\n"
    ' - leaked function "add_flag"\n'
    " - ... skipped remainder\n"
    "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
    "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
)


def _filtered(text: str) -> str:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", exit_report.filter_source()],
        input=text.encode(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return out.stdout.decode()


def test_filter_drops_only_the_report():
    text = "before\n - leaked is not a report line here\n" + REPORT + "after: glued\nlast\n"
    assert _filtered(text) == "before\n - leaked is not a report line here\nafter: glued\nlast\n"
    assert _filtered(REPORT) == ""
    assert _filtered("plain\nlines\n") == "plain\nlines\n"


# A process that writes the report the way nanobind does: from C, on file descriptor 2, after
# the exit handlers have run (the printing handler is registered first, so it runs last).
_CHILD = textwrap.dedent(
    """
    import atexit, os, sys, types
    report = sys.argv[1]
    atexit.register(lambda: os.write(2, report.encode()))
    atexit.register(lambda: print("from a late handler", file=sys.stderr, flush=True))
    if sys.argv[2] == "loaded":
        sys.modules["triton._C.libtriton"] = types.ModuleType("triton._C.libtriton")
    from adaptive_spec.vllm import exit_report
    exit_report.install()
    exit_report.install()  # once per process
    print("result", flush=True)
    print("a warning", file=sys.stderr, flush=True)
    """
)


def _child(bindings: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, REPORT + "\n", bindings],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_installed_filter_hides_the_report_and_keeps_the_rest():
    out = _child("loaded")
    assert out.returncode == 0 and out.stdout == "result\n"
    assert out.stderr == "a warning\nfrom a late handler\n"


def test_report_shown_on_request_or_without_the_bindings():
    shown = _child("loaded", ADAPTIVE_SPEC_SHOW_EXIT_REPORT="1")
    assert "nanobind: leaked 514 functions!" in shown.stderr
    assert shown.stderr.startswith("a warning\nfrom a late handler\n")
    untouched = _child("absent")
    assert untouched.stderr == "a warning\nfrom a late handler\n" + REPORT + "\n"
