"""The layer-cut student: ``n`` decoder layers of the target, initialised from its first ``n`` (or
chosen ones) and trained, with the target's embedding, final norm and LM head frozen and shared; the
draft format of :mod:`adaptive_spec.vllm.drafts`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


def build_layer_cut(target: Any, num_layers: int, layers: Sequence[int] | None = None) -> Any:
    """A draft made of ``num_layers`` decoder layers copied from ``target`` (its first ones, or
    ``layers``), in float32 and trainable, sharing the target's embedding, final norm and LM head
    (the same frozen modules, not copies).

    Raises
    ------
    ValueError
        If ``num_layers`` is not in 1..(target layers) or ``layers`` has another length.
    """
    import torch
    from transformers import AutoModelForCausalLM

    total = target.config.num_hidden_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} is invalid; allowed: an integer in 1..{total}")
    src = list(layers) if layers is not None else list(range(num_layers))
    if len(src) != num_layers or any(not 0 <= i < total for i in src):
        raise ValueError(f"layers={src!r}: expected {num_layers} indices in 0..{total - 1}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in src]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.model.rotary_emb = target.model.rotary_emb
    dev = target.model.embed_tokens.weight.device
    layers_copy = torch.nn.ModuleList()
    for j, i in enumerate(src):
        layer = copy.deepcopy(target.model.layers[i]).to(device=dev, dtype=torch.float32)
        if hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = j
        for p in layer.parameters():
            p.requires_grad_(True)
        layers_copy.append(layer)
    draft.model.layers = layers_copy
    draft.config.num_hidden_layers = num_layers
    draft._adaptive_spec_init_layers = tuple(src)
    return draft


def layer_state(draft: Any) -> dict[str, Any]:
    """The draft's own tensors, named as in a full checkpoint (``model.layers.{i}.*``)."""
    return {f"model.layers.{k}": v for k, v in draft.model.layers.state_dict().items()}


def load_layers(draft: Any, state: dict[str, Any]) -> None:
    """Load ``model.layers.*`` tensors (from :func:`layer_state` or ``draft.safetensors``) into a draft.

    Raises
    ------
    ValueError
        If names or shapes do not match.
    """
    prefix = "model.layers."
    sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        missing, unexpected = draft.model.layers.load_state_dict(sub, strict=False)
    except RuntimeError as e:
        raise ValueError(f"draft layers do not fit: {e}") from None
    if missing or unexpected:
        raise ValueError(
            f"draft layers do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )


def shared_hashes(target: Any) -> dict[str, str]:
    """:func:`adaptive_spec.vllm.drafts.tensor_sha256` of the target's shared tensors."""
    from adaptive_spec.vllm.drafts import tensor_sha256

    out = {
        "model.embed_tokens.weight": tensor_sha256(target.model.embed_tokens.weight),
        "model.norm.weight": tensor_sha256(target.model.norm.weight),
    }
    if not getattr(target.config, "tie_word_embeddings", False):
        out["lm_head.weight"] = tensor_sha256(target.lm_head.weight)
    return out


@dataclass
class LayerCutStudent:
    """The layer-cut student (:class:`~.student.Student`): all its decoder layers train.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        From :func:`build_layer_cut`.
    target : transformers.PreTrainedModel
        The target whose embedding, final norm and LM head it shares.
    target_dir : Path
        The target's directory (its name is the stored draft's base model).
    export : str, optional
        Also assemble a loadable draft model directory here when saving.
    """

    model: Any
    target: Any
    target_dir: Path
    export: str | None = None
    baseline_name: ClassVar[str] = "untrained-cut"

    @classmethod
    def cut(
        cls, target: Any, num_layers: int, *, target_dir: Path, export: str | None = None
    ) -> LayerCutStudent:
        """A student of the target's first ``num_layers`` layers (:func:`build_layer_cut`)."""
        return cls(build_layer_cut(target, num_layers), target, target_dir, export)

    def trainable(self) -> list[Any]:
        return list(self.model.model.layers.parameters())

    def save(
        self, out: str | Path, *, name: str, training: dict[str, Any], measured: dict[str, Any]
    ) -> None:
        """Store the draft (:func:`adaptive_spec.vllm.drafts.save_draft`) and, with ``export``, a
        loadable model directory."""
        from adaptive_spec.vllm import drafts

        drafts.save_draft(
            layer_state(self.model),
            out,
            name=name,
            base_model=self.target_dir.name.replace("-bfloat16", "").replace("-float32", ""),
            shared_sha256=shared_hashes(self.target),
            init_layers=self.model._adaptive_spec_init_layers,
            training=training,
            measured=measured,
        )
        if self.export:
            drafts.assemble_draft(out, self.target_dir, self.export, "bfloat16")
