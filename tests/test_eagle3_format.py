"""The stored EAGLE-3 head: format, hashes, assembly into the directory vLLM loads, and the shipped one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptive_spec.commands.distill.eagle3_data import aux_layers
from adaptive_spec.commands.distill.eagle3_head import Eagle3Head
from adaptive_spec.vllm import eagle3
from adaptive_spec.vllm.drafts import tensor_sha256
from adaptive_spec.vllm.lora_adapter import LORA_MODULES
from adaptive_spec.vllm.models import is_valid_model_dir


@pytest.fixture(scope="module")
def tiny4(default_model_dir, tmp_path_factory) -> Path:
    from adaptive_spec.vllm.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("t4") / "tiny4", default_model_dir, layers=4)


def _store(target_dir: Path, out: Path) -> tuple[Eagle3Head, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    ids = torch.tensor([0, 2, 5, 9, 700, 4000])
    head = Eagle3Head.from_target(target, ids)
    eagle3.save_head(
        head.head_state_dict(),
        out,
        name="t",
        base_model="tiny",
        aux_layers=aux_layers(4),
        embed_sha256=tensor_sha256(target.model.embed_tokens.weight),
        lm_head_sha256=tensor_sha256(target.lm_head.weight),
        training={"steps": 0},
    )
    return head, target.lm_head.weight.detach()


def test_head_round_trip_and_assembly(tiny4, tmp_path):
    head, out_embed = _store(tiny4, tmp_path / "head")
    spec = eagle3.read_head_spec(tmp_path / "head")
    assert spec.draft_vocab == 6 and spec.aux_layers == (1, 2, 3)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "head" / eagle3.WEIGHTS_FILE))
    assert set(stored) == set(eagle3.HEAD_TENSORS)  # no embedding, no LM head: the target's
    assert stored["d2t"].tolist() == [0, 1, 3, 6, 696, 3995]
    d = eagle3.assemble_cached_head(tmp_path / "head", "float32", target_dir=tiny4, root=tmp_path)
    assert is_valid_model_dir(d, "float32") and eagle3.is_head_dir(d)
    assert eagle3.draft_method(d) == "eagle3" and eagle3.draft_method(tiny4) == "draft_model"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 6
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    w = load_file(str(d / "model.safetensors"))
    # the LM head: the target's output embedding at the draft vocabulary's target ids
    torch.testing.assert_close(w["lm_head.weight"], out_embed[[0, 2, 5, 9, 700, 4000]])
    torch.testing.assert_close(w["fc.weight"], head.fc.weight.detach().to(torch.bfloat16).float())
    # assembled once
    assert (
        eagle3.assemble_cached_head(tmp_path / "head", "float32", target_dir=tiny4, root=tmp_path)
        == d
    )


def test_wrong_target_and_corrupt_weights_are_refused(tiny4, default_model_dir, tmp_path):
    _store(tiny4, tmp_path / "head")
    with pytest.raises(ValueError, match="another token embedding"):
        eagle3.assemble_head(tmp_path / "head", default_model_dir, tmp_path / "out1", "float32")
    with (tmp_path / "head" / eagle3.WEIGHTS_FILE).open("r+b") as f:
        f.seek(200)
        f.write(b"garbage!")
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        eagle3.assemble_head(tmp_path / "head", tiny4, tmp_path / "out2", "float32")


def test_bad_spec_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a stored EAGLE-3 head"):
        eagle3.read_head_spec(tmp_path)
    (tmp_path / eagle3.SPEC_FILE).write_text('{"format": 9}')
    with pytest.raises(ValueError, match="format=9; allowed: 1"):
        eagle3.read_head_spec(tmp_path)
    with pytest.raises(ValueError, match="missing \\['d2t'"):
        eagle3.save_head(
            {},
            tmp_path / "x",
            name="x",
            base_model="x",
            aux_layers=(1, 2, 3),
            embed_sha256="",
            lm_head_sha256="",
        )
    with pytest.raises(FileNotFoundError, match="available"):
        eagle3.shipped_head_dir("nope")


def test_shipped_drafters_fit_the_budget():
    total = sum(
        p.stat().st_size
        for root in (eagle3.HEADS_DIR, eagle3.PACKAGE_DATA / "drafts")
        if root.is_dir()
        for p in root.rglob("*")
        if p.is_file()
    )
    assert total <= 30 * 2**20, f"shipped drafters take {total / 2**20:.1f} MiB; the limit is 30"
    spec = eagle3.read_head_spec(eagle3.shipped_head_dir())
    assert spec.base_model.startswith("SmolLM2-135M-Instruct"), spec.base_model
    held = spec.measured["held_out"]["all"]
    assert held["by_position"][0] > 0.3, held  # its recorded held-out agreement


def test_shipped_adapters_fit_the_shipped_head():
    from adaptive_spec.vllm.lora_adapter import load_lora_adapter

    ads = eagle3.head_adapters(eagle3.shipped_head_dir())  # checks each against the head's SHA-256
    assert sorted(ads) == ["chat", "code", "math"]
    for name, d in ads.items():
        ad = load_lora_adapter(d)
        assert ad.num_layers == 1 and {m for _, m in ad.weights} == set(LORA_MODULES)
        assert ad.weights[0, "q_proj"][0].shape == (2 * 576, ad.rank)  # embedding + fused state
        m = ad.measured  # the distillation report, base head and adapter on the same replies
        assert set(m["held_out"]) == set(m["held_out_base_head"]) >= {name, "all"}


@pytest.mark.slow
def test_shipped_head_assembles_for_the_embedded_model(default_model_dir):
    d = eagle3.default_head_path("float32")
    assert eagle3.default_head_path("float32") == d and eagle3.is_head_dir(d)
    path, adapters = eagle3.default_drafter("float32")
    assert path == str(d) and adapters == {}
    path, adapters = eagle3.default_drafter("float32", lora=True)
    assert path == str(d) and sorted(adapters) == ["chat", "code", "math"]
    # the serve plugin finds them from the directory vLLM loads
    assert eagle3.drafter_adapters(d) == adapters
    assert eagle3.drafter_adapters(default_model_dir) == {}
