"""Run a command and, when a given line appears in its output, load the machine for a while.

    python scripts/noisy_neighbour.py --when "round 1/2: adaptive" --procs 2 --seconds 12 -- \
        adaptive-spec run --compare-static --seed 3

What a shared host does to a run: ``--procs`` busy processes (pure-Python loops, one core each) start
the moment a line of the command's output contains ``--when`` and stop ``--seconds`` later. The
command's output is passed through; the exit status is the command's. Used to check that the
controller's decisions survive a noisy start (``docs/results.md``, "The main job").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time


def _busy(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2147483648


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--when", required=True, help="start the load when an output line contains this"
    )
    ap.add_argument("--procs", type=int, default=2, help="busy processes (default 2)")
    ap.add_argument("--seconds", type=float, default=12.0, help="how long they run (default 12)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    started = False
    workers: list[mp.Process] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if not started and args.when in line:
            started = True
            stop_at = time.time() + args.seconds
            workers = [mp.Process(target=_busy, args=(stop_at,)) for _ in range(args.procs)]
            for w in workers:
                w.start()
            print(
                f"[noisy_neighbour] {args.procs} busy processes for {args.seconds:g} s", flush=True
            )
    rc = proc.wait()
    for w in workers:
        w.join()
    if not started:
        print(
            f"[noisy_neighbour] the line {args.when!r} never appeared: no load was applied",
            flush=True,
        )
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
