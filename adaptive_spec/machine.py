"""What a measured cost table or a learned state was measured on: the machine and the engine.

A step-cost table is only valid for the model, dtype, thread count and device it was measured with;
:func:`engine_key` names those, and shipped tables and saved states are matched on it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """The accelerator's name when CUDA is available, else the CPU model."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return cpu_model()


def engine_key(
    model: str | os.PathLike[str], dtype: str, *, threads: int | None = None
) -> dict[str, Any]:
    """The key of tables and states: model directory name, dtype, torch threads, device."""
    if threads is None:
        try:
            import torch

            threads = int(torch.get_num_threads())
        except Exception:
            threads = os.cpu_count() or 1
    return {
        "model": Path(str(model)).name,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": int(threads),
        "device": device_name(),
    }


def key_slug(key: dict[str, Any]) -> str:
    """A file-name-safe name for ``key`` (model, dtype, threads and a short hash of the device)."""
    dev = hashlib.sha256(str(key.get("device", "")).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{key.get('model')}-{key.get('dtype')}")
    return f"{name}-t{key.get('threads')}-{dev}"
