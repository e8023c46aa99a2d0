"""LoRA adapters for a layer-cut draft: the adapter object and its on-disk format.

A LoRA adapter (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models") adds
``scale * (x @ A) @ B`` to the output of a linear layer ``y = x W^T``, with ``A`` [d_in, r],
``B`` [r, d_out] and ``scale = alpha / r``. :class:`LoraAdapter` holds one adapter's pairs per decoder
layer and module; :class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager` applies adapters inside vLLM's
drafter.

On-disk format of one adapter (``adapter.json`` + ``adapter.safetensors``): tensors
``layers.{i}.{module}.A`` [d_in, r] and ``layers.{i}.{module}.B`` [r, d_out] for module in
``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj`` (Hugging Face Llama names), and the
rank, alpha and the draft they were trained on. ``adaptive-spec distill --lora NAME`` trains them.
Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_SPEC = "adapter.json"
ADAPTER_FORMAT = 1
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_KEY = re.compile(r"^layers\.(\d+)\.([a-z_]+)\.(A|B)$")


def check_adapter_name(name: str) -> str:
    """Return ``name`` if it is a valid adapter name (letters, digits, ``_ . -``), else raise ValueError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"adapter name={name!r} is invalid; allowed: a non-empty string of letters, digits, '_', '.', '-'"
        )
    return name


@dataclass
class LoraAdapter:
    """A LoRA adapter for a layer-cut draft.

    Attributes
    ----------
    name : str
        Adapter name (the arm is ``lora:<name>``).
    rank : int
        r, the inner dimension of every ``A``/``B`` pair.
    alpha : float
        LoRA alpha; the update is scaled by ``alpha / rank``.
    weights : dict
        ``(layer, module) -> (A, B)`` with ``A`` float [d_in, r] and ``B`` float [r, d_out];
        module among :data:`LORA_MODULES`.
    base_draft : dict
        ``{"name": ..., "weights_sha256": ...}`` of the draft it was trained on.
    training, measured : dict
        Free-form records.
    """

    name: str
    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    base_draft: dict[str, str] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)

    @property
    def num_layers(self) -> int:
        return 1 + max(i for i, _ in self.weights) if self.weights else 0

    def validate(self) -> LoraAdapter:
        """Check names, rank and that every pair has shapes [d_in, r] and [r, d_out].

        Raises
        ------
        ValueError
            Naming the offending parameter and its value.
        """
        check_adapter_name(self.name)
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r} is invalid; allowed: an integer >= 1")
        if not (isinstance(self.alpha, int | float) and self.alpha > 0):
            raise ValueError(f"alpha={self.alpha!r} is invalid; allowed: a number > 0")
        if not self.weights:
            raise ValueError(f"adapter {self.name!r} has no weights")
        for (layer, module), (a, b) in self.weights.items():
            if module not in LORA_MODULES:
                raise ValueError(
                    f"adapter {self.name!r}: module={module!r}; allowed: {', '.join(LORA_MODULES)}"
                )
            if layer < 0:
                raise ValueError(f"adapter {self.name!r}: layer={layer}; allowed: >= 0")
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != self.rank or b.shape[0] != self.rank:
                raise ValueError(
                    f"adapter {self.name!r} layers.{layer}.{module}: A {tuple(a.shape)}, B {tuple(b.shape)}; "
                    f"expected A [d_in, {self.rank}] and B [{self.rank}, d_out]"
                )
        return self


def save_lora_adapter(adapter: LoraAdapter, directory: str | Path) -> Path:
    """Write ``adapter`` to ``directory`` (``adapter.safetensors`` in bf16 + ``adapter.json``), atomically
    per file.

    Raises
    ------
    ValueError
        If the adapter does not validate (:meth:`LoraAdapter.validate`).
    """
    from safetensors.torch import save_file

    adapter.validate()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        tensors[f"layers.{layer}.{module}.A"] = a.detach().to("cpu", torch.bfloat16).contiguous()
        tensors[f"layers.{layer}.{module}.B"] = b.detach().to("cpu", torch.bfloat16).contiguous()
    tmp = directory / f".{ADAPTER_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / ADAPTER_FILE)
    meta = {
        "format": ADAPTER_FORMAT,
        "name": adapter.name,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "target_modules": sorted({m for _, m in adapter.weights}),
        "num_layers": adapter.num_layers,
        "base_draft": adapter.base_draft,
        "training": adapter.training,
        "measured": adapter.measured,
    }
    tmp_json = directory / f".{ADAPTER_SPEC}.tmp"
    tmp_json.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_json, directory / ADAPTER_SPEC)
    return directory


def load_lora_adapter(directory: str | Path, name: str | None = None) -> LoraAdapter:
    """Read an adapter written by :func:`save_lora_adapter`.

    Parameters
    ----------
    directory : path
    name : str, optional
        Overrides the stored name.

    Raises
    ------
    FileNotFoundError
        If a file is missing.
    ValueError
        If the files are malformed or inconsistent (rank, shapes, tensor names).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    spec_path = directory / ADAPTER_SPEC
    if not spec_path.is_file() or not (directory / ADAPTER_FILE).is_file():
        raise FileNotFoundError(
            f"{directory} is not a LoRA adapter: it needs {ADAPTER_SPEC} and {ADAPTER_FILE}"
        )
    try:
        meta = json.loads(spec_path.read_text())
        if meta.get("format") != ADAPTER_FORMAT:
            raise ValueError(f"format={meta.get('format')!r}; allowed: {ADAPTER_FORMAT}")
        rank, alpha = int(meta["rank"]), float(meta["alpha"])
        stored_name = str(meta["name"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{spec_path} is malformed: {e}") from None
    raw = load_file(str(directory / ADAPTER_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{directory / ADAPTER_FILE} has tensor {key!r}; expected layers.<i>.<module>.A|B"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights = {}
    for k, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{directory}: layers.{k[0]}.{k[1]} lacks its A or B tensor")
        weights[k] = (ab["A"], ab["B"])
    return LoraAdapter(
        name=name if name is not None else stored_name,
        rank=rank,
        alpha=alpha,
        weights=weights,
        base_draft=dict(meta.get("base_draft", {})),
        training=dict(meta.get("training", {})),
        measured=dict(meta.get("measured", {})),
    ).validate()


def lora_delta_reference(
    x: torch.Tensor, adapter: LoraAdapter, layer: int, module: str
) -> torch.Tensor:
    """``scale * (x @ A) @ B`` for one module of one layer, in float32 (a dense reference for tests).

    Parameters
    ----------
    x : torch.Tensor
        float [T, d_in].

    Raises
    ------
    KeyError
        If the adapter has no weights for ``(layer, module)``.
    """
    a, b = adapter.weights[layer, module]
    return (x.float() @ a.float() @ b.float()) * adapter.scale


def adapters_from_dirs(
    dirs: dict[str, str | Path] | Sequence[str | Path],
) -> dict[str, LoraAdapter]:
    """Load several adapters: ``{name: dir}`` or a list of directories (names from their JSON)."""
    if isinstance(dirs, dict):
        return {n: load_lora_adapter(d, n) for n, d in dirs.items()}
    out = {}
    for d in dirs:
        ad = load_lora_adapter(d)
        out[ad.name] = ad
    return out
