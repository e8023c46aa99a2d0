"""LoRA adapters on a stored EAGLE-3 head (``adaptive-spec distill --student eagle3 --lora``): loading the
stored head, the zero adapter, training only the adapter, the stored adapter reproducing the trained head,
the serving math, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptive_spec.commands.distill.eagle3_data import Features, aux_layers, target_to_draft
from adaptive_spec.commands.distill.eagle3_head import Eagle3Head
from adaptive_spec.commands.distill.eagle3_lora import (
    add_head_lora,
    domain_indices,
    head_lora_weights,
    load_head_lora,
    load_stored_head,
)
from adaptive_spec.commands.distill.eagle3_train import HeadTraining, train_head
from adaptive_spec.vllm import eagle3
from adaptive_spec.vllm.drafts import tensor_sha256
from adaptive_spec.vllm.lora_adapter import (
    LORA_MODULES,
    LoraAdapter,
    load_lora_adapter,
    lora_delta_reference,
    save_lora_adapter,
)

DRAFT_IDS = torch.tensor([0, 2, 5, 9, 700, 1000, 1500, 2000])


@pytest.fixture(scope="module")
def tiny4(default_model_dir, tmp_path_factory) -> Path:
    from adaptive_spec.vllm.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("t4") / "tiny4", default_model_dir, layers=4)


@pytest.fixture(scope="module")
def target(tiny4):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny4), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stored(target, tmp_path_factory) -> Path:
    """A head with random (non-trivial) weights, stored as the shipped one is."""
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, DRAFT_IDS)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "lm_head.weight":
                p.add_(0.05 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("head") / "head"
    eagle3.save_head(
        head.head_state_dict(),
        out,
        name="tiny-head",
        base_model="tiny",
        aux_layers=aux_layers(4),
        embed_sha256=tensor_sha256(target.model.embed_tokens.weight),
        lm_head_sha256=tensor_sha256(target.lm_head.weight),
    )
    return out


def _features(hidden: int, n: int = 6, length: int = 14) -> tuple[Features, list[str]]:
    g = torch.Generator().manual_seed(1)
    total = n * length
    feats = torch.randn(total, 3 * hidden, generator=g).bfloat16()
    labels = DRAFT_IDS[torch.randint(0, len(DRAFT_IDS), (total,), generator=g)]
    tokens = torch.randint(0, 3000, (total,), generator=g)
    cats = ["code", "chat"] * (n // 2)
    return Features(feats, labels, tokens, [i * length for i in range(n + 1)], [2] * n), cats


def _outputs(head: Eagle3Head, f: Features, idx: list[int]) -> list[torch.Tensor]:
    from adaptive_spec.commands.distill.eagle3_train import make_batch

    t2d = torch.as_tensor(target_to_draft(DRAFT_IDS.numpy(), 49152))
    b = make_batch(f, idx, t2d)
    with torch.no_grad():
        return [head.logits(h) for h in head.unroll(b.feats.float(), b.next_ids, 3, pad=b.pad)]


def test_stored_head_loads_back(target, stored):
    head, spec = load_stored_head(target, stored)
    assert spec.name == "tiny-head" and head.d2t.tolist() == (DRAFT_IDS - torch.arange(8)).tolist()
    from safetensors.torch import load_file

    saved = load_file(str(stored / eagle3.WEIGHTS_FILE))
    state = head.state_dict()
    for k, v in saved.items():
        torch.testing.assert_close(state[k].to(v.dtype), v, rtol=0, atol=0)
    # the LM head is the target's output embedding at the draft ids, never stored
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[DRAFT_IDS].float())


def test_head_of_another_target_is_refused(stored, default_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from adaptive_spec.vllm.tiny_model import make_tiny_model

    other_dir = make_tiny_model(tmp_path / "other", default_model_dir, layers=4, seed=5)
    other = AutoModelForCausalLM.from_pretrained(str(other_dir), dtype=torch.float32)
    with pytest.raises(ValueError, match="trained for another target"):
        load_stored_head(other, stored)


def test_zero_adapter_is_the_base_head_and_only_the_adapter_trains(target, stored, tmp_path):
    head, _ = load_stored_head(target, stored)
    f, cats = _features(head.shape.hidden)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    base_out = _outputs(head, f, [0, 1])
    params = add_head_lora(head, 4, 8.0, LORA_MODULES, seed=0)
    assert len(params) == 2 * len(LORA_MODULES)
    for a, b in zip(base_out, _outputs(head, f, [0, 1]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # B starts at zero: exactly the base head
    idx = domain_indices(cats, "code")
    assert idx == [0, 2, 4]
    t2d = torch.as_tensor(target_to_draft(DRAFT_IDS.numpy(), int(target.config.vocab_size)))
    cfg = HeadTraining(steps=4, batch_size=2, ttt_steps=2, lr=1e-2, warmup=0, autocast=False)
    res = train_head(head, f, idx, t2d, cfg, tmp_path / "ckpt", progress=False)
    assert res["steps_done"] == 4
    after = head.state_dict()
    for k, v in before.items():  # the head itself is frozen
        key = k if k in after else k.replace(".weight", ".base.weight")
        torch.testing.assert_close(after[key], v, rtol=0, atol=0)
    w = head_lora_weights(head)
    assert set(w) == {(0, m) for m in LORA_MODULES}
    assert all(float(b.abs().sum()) > 0 for _, b in w.values())  # the adapter moved
    assert w[0, "q_proj"][0].shape == (2 * head.shape.hidden, 4)  # q reads embedding + fused state


def test_stored_adapter_reproduces_the_trained_head_and_the_serving_math(target, stored, tmp_path):
    head, spec = load_stored_head(target, stored)
    f, cats = _features(head.shape.hidden)
    add_head_lora(head, 4, 8.0, LORA_MODULES, seed=0)
    t2d = torch.as_tensor(target_to_draft(DRAFT_IDS.numpy(), int(target.config.vocab_size)))
    cfg = HeadTraining(steps=3, batch_size=2, ttt_steps=2, lr=1e-2, warmup=0, autocast=False)
    train_head(head, f, domain_indices(cats, "chat"), t2d, cfg, None, progress=False)
    # stored in bf16: round the trained adapter the same way before comparing
    with torch.no_grad():
        for parent in (head.midlayer.self_attn, head.midlayer.mlp):
            for mod in parent.children():
                mod.lora_a.copy_(mod.lora_a.bfloat16().float())
                mod.lora_b.copy_(mod.lora_b.bfloat16().float())
    ad = LoraAdapter(
        "chat",
        4,
        8.0,
        head_lora_weights(head),
        base_draft={"name": spec.name, "weights_sha256": spec.weights_sha256},
    )
    save_lora_adapter(ad, tmp_path / "adapters" / "chat")
    back = load_lora_adapter(tmp_path / "adapters" / "chat")
    fresh, _ = load_stored_head(target, stored)
    load_head_lora(fresh, back)
    for a, b in zip(_outputs(head, f, [1, 3]), _outputs(fresh, f, [1, 3]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # what vLLM's hooks add (lora_delta_reference) is what the training wrapper adds
    x = torch.randn(3, 2 * head.shape.hidden)
    q = fresh.midlayer.self_attn.q_proj
    with torch.no_grad():
        torch.testing.assert_close(
            q(x) - q.base(x), lora_delta_reference(x, back, 0, "q_proj"), rtol=1e-5, atol=1e-5
        )
    # stored with the head, the adapter is found and checked against the head's weights
    assert eagle3.head_adapters(stored) == {}
    save_lora_adapter(back, stored / eagle3.ADAPTERS_DIR / "chat")
    try:
        assert eagle3.head_adapters(stored) == {"chat": stored / eagle3.ADAPTERS_DIR / "chat"}
        meta = json.loads((stored / "adapters" / "chat" / "adapter.json").read_text())
        meta["base_draft"]["weights_sha256"] = "0" * 64
        (stored / "adapters" / "chat" / "adapter.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match="trained on another head"):
            eagle3.head_adapters(stored)
    finally:
        import shutil

        shutil.rmtree(stored / eagle3.ADAPTERS_DIR)


def test_refusals_name_the_problem(target, stored):
    with pytest.raises(
        ValueError, match=r"--lora-domain=.math. has no training sequences.*chat, code"
    ):
        domain_indices(["code", "chat"], "math")
    head, _ = load_stored_head(target, stored)
    g = torch.Generator().manual_seed(0)
    deep = LoraAdapter(
        "deep",
        2,
        4.0,
        {(1, "o_proj"): (torch.randn(64, 2, generator=g), torch.randn(2, 64, generator=g))},
    )
    with pytest.raises(ValueError, match="has layers \\[1\\]; an EAGLE-3 head has layer 0 only"):
        load_head_lora(head, deep)
    with pytest.raises(ValueError, match="lora module='fc'"):
        add_head_lora(head, 2, 4.0, ["fc"])


def test_cli_checks_and_feature_reuse(tmp_path):
    from adaptive_spec.commands.cli import build_parser
    from adaptive_spec.commands.distill.command import _check_args, _config, reuse_features

    parser = build_parser()
    args = parser.parse_args(["distill", "--out", "x", "--lora-domain", "code"])
    with pytest.raises(ValueError, match="--lora-domain needs --student eagle3 and --lora NAME"):
        _check_args(args)
    src, dst = tmp_path / "run", tmp_path / "adapter"
    src.mkdir()
    dst.mkdir()
    args = parser.parse_args(
        ["distill", "--student", "eagle3", "--lora", "code", "--out", "x", "--data", "chat:4"]
    )
    _check_args(args)
    cfg = _config(args, Path("/t"), None)
    from dataclasses import asdict

    old = {**asdict(cfg), "data": ["chat:8"]}
    (src / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="other data settings \\(data: \\['chat:8'\\] there"):
        reuse_features(src, dst, cfg)
    (src / "config.json").write_text(json.dumps(asdict(cfg)))
    with pytest.raises(ValueError, match=r"lacks data\.npz"):
        reuse_features(src, dst, cfg)
    for name in ("data.npz", "features.pt"):
        (src / name).write_bytes(np.arange(3).tobytes())
    reuse_features(src, dst, cfg)
    assert (dst / "features.pt").read_bytes() == (src / "features.pt").read_bytes()
