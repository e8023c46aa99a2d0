"""JSON files of ``adaptive-spec bench``: atomic writes of results, and the command line of the worker
processes, which read a spec and write their results (``python -m <worker> SPEC.json OUT.json``)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON through a temporary file renamed over ``path`` (a reader never
    sees half a file; a crash keeps the previous one). Values JSON cannot hold are written as their
    ``str``; the parent directory is created. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)
    return path


def worker_main(
    module: str,
    run: Callable[[dict[str, Any], str], Any],
    argv: list[str] | None = None,
    *,
    quiet_vllm: bool = False,
) -> int:
    """Entry point of a worker process: ``python -m <module> SPEC.json OUT.json`` reads the spec and
    calls ``run(spec, out_path)``, which writes the results.

    Parameters
    ----------
    module : str
        The worker's module, for the usage line.
    run : callable
        ``run(spec, out_path)``.
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``).
    quiet_vllm : bool
        Run vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), logging warnings
        only unless ``VLLM_LOGGING_LEVEL`` says otherwise.

    Returns
    -------
    int
        0, or 2 (with the usage line on stderr) for a wrong number of arguments.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m {module} SPEC.json OUT.json", file=sys.stderr)
        return 2
    if quiet_vllm:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    spec = json.loads(Path(argv[0]).read_text())
    run(spec, argv[1])
    return 0
