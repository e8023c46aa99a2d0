"""``adaptive-spec run``: resolving the draft and LoRA proposers from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from adaptive_spec.commands.run import resolve_drafts
from adaptive_spec.vllm.lora_draft import LORA_MODULES, LoraAdapter, save_lora_adapter


def _args(**kw) -> argparse.Namespace:
    base = {"model": None, "dtype": "bfloat16", "draft_model": None, "lora_adapter": []}
    base.update(kw)
    return argparse.Namespace(**base)


def _adapter(d: Path, name: str) -> Path:
    import torch

    w = {(0, m): (torch.zeros(8, 2), torch.zeros(2, 8)) for m in LORA_MODULES}
    return save_lora_adapter(LoraAdapter(name, 2, 4.0, w), d / name)


def test_no_draft_proposers_leave_everything_alone():
    args = _args()
    props, adapters = resolve_drafts(args, ["none", "ngram", "jacobi"])
    assert props == ["none", "ngram", "jacobi"] and adapters == {} and args.draft_model is None


def test_lora_expands_to_every_given_adapter(tmp_path):
    a, b = _adapter(tmp_path, "code"), _adapter(tmp_path, "math")
    args = _args(draft_model=str(tmp_path), lora_adapter=[f"code={a}", f"math={b}"])
    props, adapters = resolve_drafts(args, ["none", "draft", "lora", "lora:code"])
    assert props == ["none", "draft", "lora:code", "lora:math"]
    assert adapters == {"code": a, "math": b}


@pytest.mark.parametrize(
    ("kw", "proposers", "fragment"),
    [
        (
            {"lora_adapter": ["code"]},
            ["none"],
            "--lora-adapter='code' is invalid; expected NAME=DIR",
        ),
        ({"lora_adapter": ["code=/nonexistent"]}, ["none"], "'/nonexistent' is not a directory"),
        ({"lora_adapter": ["bad name=/tmp"]}, ["none"], "adapter name='bad name'"),
        ({"draft_model": "/tmp"}, ["lora"], "no LoRA adapter is available"),
        ({"draft_model": "/tmp"}, ["lora:code"], "proposer 'lora:code' has no adapter"),
        ({"model": "/some/model"}, ["draft"], "needs --draft-model"),
    ],
)
def test_refusals_name_the_flag(kw, proposers, fragment):
    with pytest.raises(ValueError) as e:
        resolve_drafts(_args(**kw), proposers)
    assert fragment in str(e.value)


def test_arm_plot_handles_draft_and_lora_arms(tmp_path):
    from adaptive_spec.commands.plots import plot_arm_choices

    arms = ["none", "ngram:2", "draft:4", "lora:code:3", "lora:math:1", "jacobi:1"]
    steps = [
        {"requests": [{"arm": arms[(i + j) % len(arms)]} for j in range(3)]} for i in range(40)
    ]
    out = plot_arm_choices(steps, tmp_path / "arms.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("none", ["none"]),
        ("static:ngram:4", ["none", "ngram"]),
        ("table:ngram:1-2=8,3-8=4", ["none", "ngram"]),
        ("static:jacobi:2", ["none", "jacobi"]),
        ("static:draft:2", ["none"]),  # not enabled: nothing to draft with
        ("adaptive", ["none", "ngram", "jacobi"]),
    ],
)
def test_compare_static_enables_only_the_proposer_a_static_configuration_plays(policy, expected):
    """In ``--compare-static``, ``none`` and the baseline do not pay for drafting (or argmax rows of)
    proposers they never play; the adaptive controller keeps every proposer it may choose."""
    from adaptive_spec.commands.compare_static import static_proposers

    assert static_proposers(policy, ["none", "ngram", "jacobi"]) == expected


@pytest.mark.slow
def test_lora_means_the_shipped_heads_adapters(default_model_dir):
    """Without --draft-model, ``lora`` expands to the adapters stored with the shipped head."""
    args = _args(dtype="float32")
    props, adapters = resolve_drafts(args, ["none", "draft", "lora"])
    assert props == ["none", "draft", "lora:chat", "lora:code", "lora:math"]
    assert sorted(adapters) == ["chat", "code", "math"] and args.draft_model
