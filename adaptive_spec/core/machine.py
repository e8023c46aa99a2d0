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


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa(flags: set[str] | None = None) -> str:
    """The widest matrix ISA of the CPU that decides bf16 and fp32 speed: ``amx``, ``avx512bf16``,
    ``avx512``, ``avx2`` or ``""``. Two CPUs with one model name can differ here (a virtual machine
    may hide AVX-512), and their step costs differ by several times."""
    f = cpu_flags() if flags is None else flags
    for isa, flag in (
        ("amx", "amx_bf16"),
        ("avx512bf16", "avx512_bf16"),
        ("avx512", "avx512f"),
        ("avx2", "avx2"),
    ):
        if flag in f:
            return isa
    return ""


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False when torch is missing)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether bf16 matrix products run natively here: a CUDA device, or a CPU with AMX or
    AVX512-BF16. Without them PyTorch emulates bf16 on the CPU, slower than float32."""
    if flags is None and cuda_available():
        return True
    return cpu_isa(flags) in ("amx", "avx512bf16")


def default_dtype() -> str:
    """The dtype the embedded default runs in on this machine: ``bfloat16`` where it is native
    (:func:`native_bf16`), else ``float32``. Measured on a 2-core AVX2 EPYC (no AVX-512): vLLM's
    CPU build decoded SmolLM2-135M at 47 tokens/s in float32 against 26 in bf16 (batch 4)."""
    return "bfloat16" if native_bf16() else "float32"


def resolve_dtype(value: str) -> str:
    """``auto`` -> :func:`default_dtype`; ``bfloat16`` / ``float32`` unchanged.

    Raises
    ------
    ValueError
        For any other value, naming it and what is allowed.
    """
    v = str(value).strip().lower()
    if v == "auto":
        return default_dtype()
    if v in ("bfloat16", "float32"):
        return v
    raise ValueError(
        f"dtype={value!r} is invalid; allowed: auto (bfloat16 where the hardware has it, else "
        "float32), bfloat16, float32"
    )


def dtype_arg(text: str) -> str:
    """argparse ``type=`` of the commands' ``--dtype``: :func:`resolve_dtype`, its error as
    argparse's (exit status 2, one line)."""
    import argparse

    try:
        return resolve_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device_name() -> str:
    """The accelerator's name when CUDA is available, else the CPU model and its ISA
    (:func:`cpu_isa`), e.g. ``AMD EPYC [avx2]``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    isa = cpu_isa()
    return f"{cpu_model()} [{isa}]" if isa else cpu_model()


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
