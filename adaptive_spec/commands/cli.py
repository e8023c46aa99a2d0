"""``adaptive-spec``: the command line.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import os

# The controller's matrices are tiny: multithreaded OpenBLAS only adds overhead and competes with the
# engine's own threads (measured: a 64x64x256 product took 4.3 ms threaded vs 60 us single-threaded on
# the 2-core CI machine). Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import importlib
import sys
from typing import NoReturn

# (subcommand, module): modules are imported lazily so `--help` stays fast.
SUBCOMMANDS = (
    ("run", "adaptive_spec.commands.run"),
    ("replay", "adaptive_spec.commands.replay"),
    ("record", "adaptive_spec.commands.record"),
    ("bench", "adaptive_spec.commands.bench.command"),
    ("calibrate", "adaptive_spec.commands.calibrate"),
    ("distill", "adaptive_spec.commands.distill.command"),
)


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``prog: error: message``, with exit status 2 (the
    usage block is left to ``--help``). Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="adaptive-spec",
        description=(
            "Adaptive speculative decoding for vLLM: a contextual-bandit controller chooses, per request "
            "and per step, the proposer (none, n-gram, Jacobi, draft model) and k, never slower than a "
            "safe baseline."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue  # this subcommand is not part of this build
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from adaptive_spec.vllm.exit_report import install as quiet_exit

    quiet_exit()  # no Triton leak report under the command's result
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
