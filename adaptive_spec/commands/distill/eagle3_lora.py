"""LoRA adapters (Hu et al. 2022) on a stored EAGLE-3 head: the head frozen, a low-rank update trained
on its decoder layer's linear layers with the head's own loss (training-time test, :mod:`.eagle3_train`),
on one domain's sequences, in the layout :class:`adaptive_spec.vllm.lora_draft.LoraDraftManager` serves
inside vLLM's EAGLE-3 drafter (layer 0: ``q_proj``, ``k_proj``, ``v_proj`` over the head's 2 x hidden
attention input, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .lora import check_lora_settings, copy_adapter_into, layer_lora_weights, wrap_layer


def load_stored_head(target: Any, head_dir: str | Path) -> tuple[Any, Any]:
    """A stored head (:func:`adaptive_spec.vllm.eagle3.save_head`) as a trainable
    :class:`~.eagle3_head.Eagle3Head` on ``target`` (float32), and its spec.

    Raises
    ------
    ValueError
        If the weights fail their SHA-256, or ``target``'s token embedding is not the one the head
        was trained with.
    FileNotFoundError
        If ``head_dir`` is not a stored head.
    """
    import torch

    from adaptive_spec.vllm.drafts import tensor_sha256
    from adaptive_spec.vllm.eagle3 import load_head_tensors

    from .eagle3_head import Eagle3Head

    spec, tensors = load_head_tensors(head_dir)
    if tensor_sha256(target.model.embed_tokens.weight) != spec.embed_sha256:
        raise ValueError(
            f"head {spec.name!r} in {head_dir} was trained for another target ({spec.base_model!r}): "
            "give the target it was trained with (--target)"
        )
    d2t = tensors["d2t"].to(torch.int64)
    head = Eagle3Head.from_target(target, torch.arange(len(d2t)) + d2t)
    state = {k: (v if k == "d2t" else v.float()) for k, v in tensors.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"head {spec.name!r} in {head_dir}: tensors do not fit the target's head shape "
            f"(missing {sorted(set(missing) - {'lm_head.weight'})}, unexpected {sorted(unexpected)})"
        )
    return head, spec


def add_head_lora(
    head: Any, rank: int, alpha: float, modules: Sequence[str], seed: int = 0
) -> list[Any]:
    """Freeze ``head`` and wrap its decoder layer's ``modules`` (Hugging Face Llama names) with LoRA
    (:func:`~.lora.lora_linear`: ``B`` zero at the start, so the wrapped head starts as the base head).

    Returns
    -------
    list of torch.nn.Parameter
        The trainable LoRA parameters (``A`` [d_in, r], ``B`` [r, d_out] per module).

    Raises
    ------
    ValueError
        For a bad rank or alpha, or an unknown module name.
    """
    check_lora_settings(rank, alpha, modules)
    for p in head.parameters():
        p.requires_grad_(False)
    return wrap_layer(head.midlayer, 0, rank, alpha, modules, seed)


def head_lora_weights(head: Any) -> dict[tuple[int, str], tuple[Any, Any]]:
    """``(0, module) -> (A, B)`` of the LoRA wrappers in ``head`` (the head has one decoder layer)."""
    return layer_lora_weights(head.midlayer, 0)


def load_head_lora(head: Any, adapter: Any) -> None:
    """Wrap ``head`` with LoRA modules holding ``adapter``'s weights (for evaluation).

    Raises
    ------
    ValueError
        If the adapter has layers other than 0, or shapes that do not fit the head.
    """
    layers = {layer for layer, _ in adapter.weights}
    if layers - {0}:
        raise ValueError(
            f"adapter {adapter.name!r} has layers {sorted(layers)}; an EAGLE-3 head has layer 0 only"
        )
    add_head_lora(head, adapter.rank, adapter.alpha, sorted({m for _, m in adapter.weights}))
    copy_adapter_into(head.midlayer, 0, adapter)


def domain_indices(categories: Sequence[str], domain: str) -> list[int]:
    """Indices of the training sequences of ``domain``.

    Raises
    ------
    ValueError
        If no training sequence has that category (the message lists those there are).
    """
    idx = [i for i, c in enumerate(categories) if c == domain]
    if not idx:
        have = ", ".join(sorted(set(categories))) or "none"
        raise ValueError(
            f"--lora-domain={domain!r} has no training sequences; the run's categories: {have} "
            "(add a source of that domain to --data, or pick one of these)"
        )
    return idx


__all__ = [
    "add_head_lora",
    "domain_indices",
    "head_lora_weights",
    "load_head_lora",
    "load_stored_head",
]
