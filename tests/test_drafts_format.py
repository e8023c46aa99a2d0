"""Stored drafts: save/read/assemble a layer-cut draft, its validation, and the cached assembly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from adaptive_spec.commands.distill import build_layer_cut, layer_state, load_layers, shared_hashes
from adaptive_spec.vllm import drafts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_target(
    out: Path,
    tokenizer_dir: Path,
    *,
    layers: int = 3,
    tied: bool = True,
    seed: int = 0,
    intermediate: int = 128,
) -> Path:
    """A tiny float32 Llama target (hidden 64, head_dim 32) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "model.safetensors").exists():
        return out
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 if ("embed" in name or "lm_head" in name) else 0.15)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, tmp / f)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="module")
def tiny_tied(default_model_dir, tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("t") / "tied", default_model_dir)


@pytest.fixture(scope="module")
def target_model(tiny_tied):
    from adaptive_spec.commands.distill import load_target

    model, _ = load_target(tiny_tied, "cpu", "float32")
    return model


@pytest.fixture
def stored(target_model, tmp_path) -> Path:
    draft = build_layer_cut(target_model, 2)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    drafts.save_draft(
        layer_state(draft),
        tmp_path / "d",
        name="tiny",
        base_model="tiny",
        shared_sha256=shared_hashes(target_model),
        init_layers=(0, 1),
    )
    return tmp_path / "d"


def test_layer_cut_shares_target_modules(target_model):
    draft = build_layer_cut(target_model, 2)
    assert draft.model.embed_tokens is target_model.model.embed_tokens
    assert draft.lm_head is target_model.lm_head
    assert draft.model.norm is target_model.model.norm
    assert len(draft.model.layers) == 2
    assert all(p.requires_grad for p in draft.model.layers.parameters())
    assert not target_model.model.embed_tokens.weight.requires_grad
    # The untrained cut computes the target's first two layers exactly.
    ids = torch.randint(0, 49152, (1, 9))
    with torch.no_grad():
        h_t = target_model.model(ids, output_hidden_states=True).hidden_states
        h_d = draft.model(ids, output_hidden_states=True).hidden_states
        # The last entry is after the final norm.
        torch.testing.assert_close(h_d[1], h_t[1])
        torch.testing.assert_close(h_d[2], target_model.model.norm(h_t[2]))
    with pytest.raises(ValueError, match="num_layers=4"):
        build_layer_cut(target_model, 4)
    with pytest.raises(ValueError, match="layers="):
        build_layer_cut(target_model, 2, layers=[0, 7])


def test_save_read_roundtrip(stored, target_model):
    spec = drafts.read_draft_spec(stored)
    assert spec.num_layers == 2 and spec.init_layers == (0, 1)
    assert set(spec.shared_sha256) == set(drafts.SHARED_TENSORS)
    from safetensors.torch import load_file

    layers = load_file(str(stored / drafts.WEIGHTS_FILE))
    assert all(k.startswith("model.layers.") for k in layers)
    assert all(v.dtype == torch.bfloat16 for v in layers.values())


def test_save_draft_refuses_bad_layers(tmp_path):
    with pytest.raises(ValueError, match=r"only 'model\.layers"):
        drafts.save_draft(
            {"lm_head.weight": torch.zeros(2, 2)},
            tmp_path,
            name="x",
            base_model="x",
            shared_sha256={},
        )
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        drafts.save_draft(
            {"model.layers.1.mlp.up_proj.weight": torch.zeros(2, 2)},
            tmp_path,
            name="x",
            base_model="x",
            shared_sha256={},
        )


def test_assemble_matches_trained_draft(stored, tiny_tied, target_model, tmp_path):
    """The assembled directory is the draft: same logits as the training-time module with the stored
    (bf16-rounded) layers, and loadable by transformers as a plain Llama."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = drafts.assemble_draft(stored, tiny_tied, tmp_path / "m", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is True
    assert (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref = build_layer_cut(target_model, 2)
    load_layers(
        ref, {k: v.float() for k, v in load_file(str(stored / drafts.WEIGHTS_FILE)).items()}
    )
    ids = torch.randint(0, 49152, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits)
    with pytest.raises(FileExistsError):
        drafts.assemble_draft(stored, tiny_tied, out, "float32")


def test_assemble_refuses_other_target(stored, default_model_dir, tmp_path):
    other = make_target(tmp_path / "other", default_model_dir, seed=5)
    with pytest.raises(ValueError, match=r"another model\.embed_tokens\.weight"):
        drafts.assemble_draft(stored, other, tmp_path / "m", "float32")
    untied = make_target(tmp_path / "untied", default_model_dir, tied=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        drafts.assemble_draft(stored, untied, tmp_path / "m2", "float32")
    with pytest.raises(ValueError, match="dtype='float16'"):
        drafts.assemble_draft(stored, other, tmp_path / "m3", "float16")


def test_assemble_refuses_wrong_shapes(stored, default_model_dir, tmp_path):
    from safetensors.torch import load_file

    wide = make_target(tmp_path / "wide", default_model_dir, intermediate=96)
    sd = load_file(str(wide / "model.safetensors"))
    # Pretend the draft was trained on this target, whose MLP is narrower.
    spec = json.loads((stored / drafts.SPEC_FILE).read_text())
    spec["shared_sha256"] = {k: drafts.tensor_sha256(sd[k]) for k in drafts.SHARED_TENSORS}
    (stored / drafts.SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="draft layer 0 has tensors"):
        drafts.assemble_draft(stored, wide, tmp_path / "m", "float32")


def test_read_spec_errors(stored, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"draft\.json"):
        drafts.read_draft_spec(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(stored, bad)
    spec = json.loads((bad / drafts.SPEC_FILE).read_text())
    spec["format"] = 99
    (bad / drafts.SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="format=99"):
        drafts.read_draft_spec(bad)
    spec["format"] = drafts.SPEC_FORMAT
    spec["shared_sha256"] = {"x": "y"}
    (bad / drafts.SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="shared_sha256"):
        drafts.read_draft_spec(bad)
    # A tampered weights file is caught by its hash.
    tam = tmp_path / "tam"
    shutil.copytree(stored, tam)
    with (tam / drafts.WEIGHTS_FILE).open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ValueError, match="SHA-256"):
        drafts.assemble_draft(tam, tmp_path, tmp_path / "m", "float32")


def test_assemble_cached_builds_once_and_rebuilds_corrupt(stored, tiny_tied, tmp_path):
    root = tmp_path / "cache"
    a = drafts.assemble_cached(stored, "float32", target_dir=tiny_tied, root=root)
    from adaptive_spec.vllm.models import is_valid_model_dir

    assert is_valid_model_dir(a, "float32")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert drafts.assemble_cached(stored, "float32", target_dir=tiny_tied, root=root) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # Corrupt it: the next call (a fresh process would not have .verified) rebuilds.
    (a / ".verified").unlink()
    with (a / "model.safetensors").open("r+b") as f:
        f.seek(100)
        f.write(b"garbage!")
    b = drafts.assemble_cached(stored, "float32", target_dir=tiny_tied, root=root)
    assert b == a and is_valid_model_dir(b, "float32")
    assert not [p for p in root.iterdir() if p.name.startswith(".draft-") and p.is_dir()]
