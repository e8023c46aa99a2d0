"""Batched multi-LoRA: y += scale * (x @ A[idx]) @ B[idx] with a per-token adapter index.

Punica's BGMV (batched gather matrix-vector) operator (Chen et al. 2023, "Punica: Multi-Tenant
LoRA Serving", MLSys 2024): every token of a batch may use a different LoRA adapter (or none),
and the low-rank update is applied in two gathered products, *shrink* ``t = x @ A[idx]``
([T, r], kept in float32) and *expand* ``y += scale[idx] * t @ B[idx]``. SGMV, Punica's
segmented variant, is the same function for tokens sorted by adapter; this per-token form
covers it.

``lora_reference`` is the PyTorch reference (one dense product per adapter present);
``_lora_triton.py`` holds the shrink and expand kernels; ``lora_bgmv`` dispatches.
"""

from __future__ import annotations

import torch

from ._checks import check_lora
from ._common import use_triton


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """PyTorch reference of :func:`lora_bgmv` (in place on ``y``, which is returned)."""
    scale_t = check_lora(y, x, lora_a, lora_b, indices, scale)
    idx = indices.to(torch.int64)
    for a in torch.unique(idx[idx >= 0]).tolist():
        sel = idx == a
        t = x[sel].to(torch.float32) @ lora_a[a].to(torch.float32)
        delta = (t @ lora_b[a].to(torch.float32)) * scale_t[a]
        y[sel] = (y[sel].to(torch.float32) + delta).to(y.dtype)
    return y


def lora_bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Add each token's LoRA update: ``y[t] += scale[i] * (x[t] @ A[i]) @ B[i]``, i = indices[t].

    Parameters
    ----------
    y : torch.Tensor
        float32/float16/bfloat16 [T, d_out]: updated in place and returned.
    x : torch.Tensor
        float [T, d_in].
    lora_a : torch.Tensor
        float [L, d_in, r]: the adapters' A matrices (stacked).
    lora_b : torch.Tensor
        float [L, r, d_out]: the adapters' B matrices.
    indices : torch.Tensor
        int32/int64 [T]: adapter per token, -1 = no adapter (row left unchanged).
    scale : float or torch.Tensor
        LoRA scaling (alpha / r), one for all or float [L] per adapter.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    torch.Tensor
        ``y``. Accumulation is in float32; the result is rounded once to y's dtype.

    Raises
    ------
    TypeError, ValueError
        Malformed arguments; out-of-range indices (checked on CPU only).
    """
    if use_triton(backend, [y, x, lora_a, lora_b, indices]):
        from ._lora_triton import lora_triton

        return lora_triton(y, x, lora_a, lora_b, indices, scale)
    return lora_reference(y, x, lora_a, lora_b, indices, scale)
