"""Fixes for vLLM 0.32.0's CPU build: one that speculative decoding at temperature > 0 needs, and a
guard that lets an engine start after Numba is loaded (:func:`guard_kernel_override_scan`).

The bug: vLLM's CPU replacement of the Triton ``expand_kernel``
(``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``) passes ``_ensure_int64(output)`` to the C++ op:
for a float tensor that is an int64 *copy*, so the real output is never written. The rejection sampler
uses ``expand_batch_to_tokens`` to spread each request's temperature over its draft positions, so with
drafts at temperature > 0 the target logits are divided by uninitialised memory: outputs are neither
seeded nor distributed as the target (found by ``tests/test_correctness_seeds.py``). Greedy requests
are unaffected.

:func:`fix_cpu_expand_kernel` replaces the rejection sampler module's ``_expand`` launcher (the only
caller of that kernel: ``expand_batch_to_tokens`` for temperature, top-k and top-p) with a correct
PyTorch implementation. (Re-registering through vLLM's kernel-override registry fails on this build with
``'_lib_fn_wrapper' object has no attribute 'get'``, seen on repeated registrations.)
It is process-wide and idempotent, applies on the CPU platform only, and changes nothing but the values
of that expansion: a correct one, for every dtype.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

_applied = False


def expand_reference(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """``output[start_i:end_i] = input_val[i]`` (with ``replace_from`` mapped to ``replace_to``) for each
    request ``i``, where ``end_i = cu_num_tokens[i]`` and ``start_i = cu_num_tokens[i - 1]`` (0 for i = 0).

    Shapes: ``output`` [num_tokens], ``input_val`` [batch], ``cu_num_tokens`` [batch] (int). Any dtype;
    values are cast to ``output.dtype``. Writes ``output`` in place.
    """
    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    n = int(cu[-1])
    output[:n] = vals.repeat_interleave(counts).to(output.dtype)


def fix_cpu_expand_kernel() -> bool:
    """Register :func:`expand_reference` for vLLM's ``expand_kernel`` on the CPU platform (once per
    process). Returns True if the override is in place."""
    global _applied
    if _applied:
        return True
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        import vllm.v1.sample.rejection_sampler as rejection_sampler

        if not callable(getattr(rejection_sampler, "_expand", None)):
            raise AttributeError("vllm.v1.sample.rejection_sampler._expand is missing")
        rejection_sampler._expand = expand_reference
    except Exception as e:  # never fail attaching because of the fix; report it
        logger.warning("could not install the CPU expand_kernel fix (%s: %s)", type(e).__name__, e)
        return False
    _applied = True
    logger.info(
        "installed the vLLM 0.32 CPU expand_kernel fix (per-token temperatures at temperature > 0)"
    )
    return True


_scan_guarded = False


def guard_kernel_override_scan() -> bool:
    """Let vLLM start after Numba is imported (process-wide, idempotent).

    vLLM 0.32 registers its CPU kernel overrides when each worker starts
    (``vllm.triton_utils.dispatcher.register_kernels``), and ``_rebind_kernels`` scans every attribute
    of every loaded module, reading ``vars(value).get("kernel")`` of any value with a ``__dict__``.
    llvmlite's ``binding.ffi.lib`` answers every attribute lookup, ``__dict__`` included, with a
    function wrapper, so once Numba (hence llvmlite) is loaded the scan fails with
    ``'_lib_fn_wrapper' object has no attribute 'get'`` and the engine does not start. The adaptive
    controller's per-step kernels are compiled with Numba (:mod:`adaptive_spec.core.controller_kernels`),
    so Numba is usually loaded before an engine is built. The guard hides that one attribute from the
    scan while it runs and puts it back; the overrides vLLM registers are unchanged. Returns True if
    the guard is in place (False where vLLM has no such scan)."""
    global _scan_guarded
    if _scan_guarded:
        return True
    try:
        from vllm.triton_utils import dispatcher
    except Exception:
        return False
    original = getattr(dispatcher, "_rebind_kernels", None)
    if not callable(original):
        return False

    def _rebind_kernels(overrides: Any) -> Any:
        ffi = sys.modules.get("llvmlite.binding.ffi")
        lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
        try:
            return original(overrides)
        finally:
            if lib is not None:
                ffi.lib = lib

    dispatcher._rebind_kernels = _rebind_kernels
    _scan_guarded = True
    return True
