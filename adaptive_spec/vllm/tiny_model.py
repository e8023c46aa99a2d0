"""A tiny float32 Llama model with SmolLM2's tokenizer, generated locally for fast engine tests and for
``adaptive-spec bench serve --quick``.

Two layers, hidden 64, 2 heads of dim 32 (vLLM's CPU attention needs head_dim >= 32). Weights are random
with a large scale so that logits have clear top-2 margins (far above float32 kernel noise), and greedy
decoding of a random model falls into repetitive loops, which gives the n-gram and Jacobi proposers
something to accept. Nothing is downloaded: the tokenizer is copied from the embedded default model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TINY_MODEL_NAME = "tiny-llama-f32-v1"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make_tiny_model(out: Path, tokenizer_dir: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write the tiny model to ``out`` (kept if it already exists) and return ``out``.

    Parameters
    ----------
    out : Path
        Model directory to create (written to a temporary sibling, then renamed).
    tokenizer_dir : Path
        A model directory whose tokenizer files are copied (SmolLM2's).
    seed : int
        Seeds the random weights.
    layers : int
        Decoder layers.
    """
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 if "lm_head" in name or "embed" in name else 0.15)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def tiny_model_path() -> Path:
    """The tiny model in the cache (``adaptive_spec.vllm.models.cache_dir()``), built on first use under a file
    lock from the embedded default model's tokenizer (which converts the default model if needed)."""
    from filelock import FileLock

    from adaptive_spec.vllm.models import cache_dir, default_model_path

    out = cache_dir() / TINY_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        return make_tiny_model(out, default_model_path("bfloat16"))
