"""vLLM's serving-benchmark client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs), called as
a library: the only place where the benchmark harness touches vLLM's client code.

vLLM's CPU wheel cannot start ``vllm bench serve`` itself (its console entry asks for the metadata of a
distribution named ``vllm``), so a pass parses the same arguments with vLLM's own parser and awaits
``main_async``, which returns vLLM's result dictionary.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


def preload() -> None:
    """Import vLLM's client (a few seconds), e.g. in a background thread while a server starts."""
    import vllm.benchmarks.serve  # noqa: F401


def client_namespace(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` with vLLM's own ``vllm bench serve`` parser (its validation and defaults).

    Raises
    ------
    SystemExit
        From argparse, for arguments vLLM's parser refuses.
    """
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser.parse_args(argv)


async def run_clients(namespaces: list[argparse.Namespace]) -> list[dict[str, Any]]:
    """Run one client per namespace concurrently in the running event loop; vLLM's result dictionaries
    in order."""
    from vllm.benchmarks.serve import main_async

    return list(await asyncio.gather(*(main_async(ns) for ns in namespaces)))
