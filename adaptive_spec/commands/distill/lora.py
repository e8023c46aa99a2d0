"""LoRA adapters (Hu et al. 2022) on a stored layer-cut draft: the draft frozen, a low-rank update
trained on its linear layers, in the layout :mod:`adaptive_spec.vllm.lora_draft` serves in vLLM."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .config import DistillConfig
from .layer_cut import build_layer_cut, load_layers

_LORA_CLS: Any = None


def lora_linear(base: Any, rank: int, alpha: float, seed: int) -> Any:
    """Training-time LoRA around a frozen ``torch.nn.Linear``: ``y = base(x) + scale * (x @ A) @ B``
    with ``scale = alpha / rank``, the function :class:`adaptive_spec.vllm.lora_draft.LoraDraftManager`
    applies in vLLM (Hu et al. 2022: ``A`` random, ``B`` zero at the start, so training starts from the
    base draft). ``A`` is [d_in, r] and ``B`` [r, d_out], the BGMV layout.
    """
    global _LORA_CLS
    import torch

    if _LORA_CLS is None:

        class LoraLinear(torch.nn.Module):
            def __init__(self, base: Any, rank: int, alpha: float, seed: int) -> None:
                super().__init__()
                self.base = base
                for p in base.parameters():
                    p.requires_grad_(False)
                g = torch.Generator().manual_seed(seed)
                d_in, d_out = base.in_features, base.out_features
                dev = base.weight.device
                a = torch.randn(d_in, rank, generator=g) / math.sqrt(d_in)
                self.lora_a = torch.nn.Parameter(a.to(dev))
                self.lora_b = torch.nn.Parameter(torch.zeros(rank, d_out, device=dev))
                self.scale = alpha / rank

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                delta = (x @ self.lora_a.to(x.dtype)) @ self.lora_b.to(x.dtype)
                return self.base(x) + delta * self.scale

        _LORA_CLS = LoraLinear
    return _LORA_CLS(base, rank, alpha, seed)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")  # under self_attn; the others under mlp


def check_lora_settings(rank: int, alpha: float, modules: Sequence[str]) -> None:
    """Raise ValueError for a bad rank or alpha, or an unknown module name."""
    from adaptive_spec.vllm.lora_draft import LORA_MODULES

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank={rank!r} is invalid; allowed: an integer >= 1")
    if not alpha > 0:
        raise ValueError(f"lora_alpha={alpha!r} is invalid; allowed: > 0")
    for m in modules:
        if m not in LORA_MODULES:
            raise ValueError(f"lora module={m!r} is unknown; allowed: {', '.join(LORA_MODULES)}")


def wrap_layer(
    layer: Any, index: int, rank: int, alpha: float, modules: Sequence[str], seed: int
) -> list[Any]:
    """Wrap ``modules`` of one Llama-style decoder layer (``self_attn`` / ``mlp`` children) with
    :func:`lora_linear`; returns their LoRA parameters."""
    from adaptive_spec.vllm.lora_draft import LORA_MODULES

    params = []
    for m in modules:
        parent = layer.self_attn if m in ATTN else layer.mlp
        wrapped = lora_linear(
            getattr(parent, m), rank, alpha, seed=seed * 1000 + index * 10 + LORA_MODULES.index(m)
        )
        setattr(parent, m, wrapped)
        params += [wrapped.lora_a, wrapped.lora_b]
    return params


def layer_lora_weights(layer: Any, index: int) -> dict[tuple[int, str], tuple[Any, Any]]:
    """``(index, module) -> (A, B)`` of the LoRA wrappers in one decoder layer."""
    out = {}
    for parent in (layer.self_attn, layer.mlp):
        for name, mod in parent.named_children():
            if hasattr(mod, "lora_a"):
                out[index, name] = (mod.lora_a.detach().cpu(), mod.lora_b.detach().cpu())
    return out


def copy_adapter_into(layer: Any, index: int, adapter: Any) -> None:
    """Copy ``adapter``'s weights of layer ``index`` into the LoRA wrappers of ``layer`` (a wrapper
    the adapter has no weights for gets ``B = 0``).

    Raises
    ------
    ValueError
        If a matrix does not fit its wrapper (the message names both shapes).
    """
    import torch

    for parent in (layer.self_attn, layer.mlp):
        for name, mod in parent.named_children():
            if not hasattr(mod, "lora_a"):
                continue
            pair = adapter.weights.get((index, name))
            with torch.no_grad():
                if pair is None:
                    mod.lora_b.zero_()
                    continue
                a, b = pair
                if tuple(a.shape) != tuple(mod.lora_a.shape) or tuple(b.shape) != tuple(
                    mod.lora_b.shape
                ):
                    raise ValueError(
                        f"adapter {adapter.name!r} layers.{index}.{name}: shapes {tuple(a.shape)}, "
                        f"{tuple(b.shape)} do not fit {tuple(mod.lora_a.shape)}, {tuple(mod.lora_b.shape)}"
                    )
                mod.lora_a.copy_(a)
                mod.lora_b.copy_(b)


def add_lora(
    draft: Any, rank: int, alpha: float, modules: Sequence[str], seed: int = 0
) -> list[Any]:
    """Freeze ``draft`` and wrap its layers' ``modules`` (Hugging Face Llama names) with LoRA.

    Returns
    -------
    list of torch.nn.Parameter
        The trainable LoRA parameters.

    Raises
    ------
    ValueError
        For a bad rank/alpha or an unknown module name.
    """
    check_lora_settings(rank, alpha, modules)
    for p in draft.parameters():
        p.requires_grad_(False)
    params = []
    for i, layer in enumerate(draft.model.layers):
        params += wrap_layer(layer, i, rank, alpha, modules, seed)
    return params


def lora_weights(draft: Any) -> dict[tuple[int, str], tuple[Any, Any]]:
    """``(layer, module) -> (A, B)`` of the LoRA wrappers in ``draft``."""
    out = {}
    for i, layer in enumerate(draft.model.layers):
        out.update(layer_lora_weights(layer, i))
    return out


def load_lora_into(draft: Any, adapter: Any) -> None:
    """Wrap ``draft`` with LoRA modules holding ``adapter``'s weights (for evaluation).

    Raises
    ------
    ValueError
        If the adapter does not fit the draft.
    """
    add_lora(draft, adapter.rank, adapter.alpha, sorted({m for _, m in adapter.weights}))
    for i, layer in enumerate(draft.model.layers):
        copy_adapter_into(layer, i, adapter)


@dataclass
class LoraStudent:
    """A LoRA adapter on a stored layer-cut draft (:class:`~.student.Student`): only the adapter trains.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        The stored draft as a layer cut of the target (wrapped with LoRA by :meth:`trainable`).
    cfg : DistillConfig
        The run's settings: adapter name, rank, alpha, modules, seed.
    spec : adaptive_spec.vllm.drafts.DraftSpec
        The stored draft's spec (the adapter records its name and weights hash).
    """

    model: Any
    cfg: DistillConfig
    spec: Any
    baseline_name: ClassVar[str] = "base-draft"

    @classmethod
    def load(cls, target: Any, draft_dir: str | Path, cfg: DistillConfig) -> LoraStudent:
        """The stored draft in ``draft_dir`` as a layer cut of ``target``, to adapt.

        Raises
        ------
        ValueError
            If the stored layers do not fit the target.
        """
        from safetensors.torch import load_file

        from adaptive_spec.vllm import drafts

        spec = drafts.read_draft_spec(draft_dir)
        model = build_layer_cut(target, spec.num_layers)
        load_layers(model, load_file(str(Path(draft_dir) / drafts.WEIGHTS_FILE)))
        return cls(model, cfg, spec)

    def trainable(self) -> list[Any]:
        """Freeze the draft and wrap it with the adapter (:func:`add_lora`); its parameters."""
        c = self.cfg
        return add_lora(self.model, c.lora_rank, c.lora_alpha, c.lora_modules, seed=c.seed)

    def save(
        self, out: str | Path, *, name: str, training: dict[str, Any], measured: dict[str, Any]
    ) -> None:
        """Store the adapter (:func:`adaptive_spec.vllm.lora_draft.save_lora_adapter`), named by
        ``cfg.lora`` (``name`` is not used)."""
        from adaptive_spec.vllm.lora_draft import LoraAdapter, save_lora_adapter

        save_lora_adapter(
            LoraAdapter(
                name=self.cfg.lora,
                rank=self.cfg.lora_rank,
                alpha=self.cfg.lora_alpha,
                weights=lora_weights(self.model),
                base_draft={"name": self.spec.name, "weights_sha256": self.spec.weights_sha256},
                training=training,
                measured=measured,
            ),
            out,
        )
