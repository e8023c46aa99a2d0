"""Shared helpers for the kernels: lazy Triton detection, backend choice, argument checks.

Nothing here imports Triton at module import time, so ``adaptive_spec.kernels`` imports on a
machine where ``import triton`` fails.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_status() -> tuple[bool, str]:
    """Whether Triton can be imported here.

    Returns
    -------
    tuple of (bool, str)
        ``(True, "")`` when ``import triton`` and ``import triton.language`` succeed, else
        ``(False, reason)`` with the exception text.
    """
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # any failure (missing, broken CUDA libs) means "no Triton"
        return False, f"import triton failed: {type(exc).__name__}: {exc}"
    return True, ""


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (Triton kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: str, tensors: Iterable[torch.Tensor]) -> bool:
    """Pick the implementation for one call.

    Parameters
    ----------
    backend : {"auto", "torch", "triton"}
        ``"auto"``: Triton when every tensor is on CUDA and Triton imports, else the PyTorch
        reference. ``"torch"``: always the reference. ``"triton"``: always Triton; CPU tensors
        need ``TRITON_INTERPRET=1``.
    tensors : iterable of torch.Tensor
        The call's tensor arguments (``None`` entries are skipped).

    Returns
    -------
    bool
        True to run the Triton kernel.

    Raises
    ------
    ValueError
        Unknown ``backend``.
    RuntimeError
        ``backend="triton"`` but Triton is missing, or CPU tensors without the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; use one of {BACKENDS}")
    if backend == "torch":
        return False
    ts = [t for t in tensors if t is not None]
    on_cuda = bool(ts) and all(t.is_cuda for t in ts)
    ok, reason = triton_status()
    if backend == "auto":
        return on_cuda and ok
    if not ok:
        raise RuntimeError(f"backend='triton' requested but {reason}")
    if not on_cuda and not triton_interpret():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before the first kernel "
            "module is imported); use backend='torch' or CUDA tensors"
        )
    return True


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Validate a tensor argument's type, rank and dtype.

    Raises
    ------
    TypeError
        ``t`` is not a tensor.
    ValueError
        Wrong rank or dtype (the message names the parameter, the value and what is allowed).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {allowed}")
    return t


INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors must share one device; returns it.

    Raises
    ------
    ValueError
        Two tensors live on different devices.
    """
    dev: torch.device | None = None
    first = ""
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {first} is on {dev}; use one device")
    if dev is None:
        raise ValueError("no tensor given")
    return dev


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
