"""``adaptive-spec distill --student eagle3`` end to end on a tiny target: reference replies labelled by
the target, held-out replies from vLLM, training, report and stored head; then ``--init-from`` that head
on the first run's cached features (``--features-from``), which starts from its weights and its draft
vocabulary, reports its held-out acceptance before training, and records where it started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptive_spec.vllm import eagle3


@pytest.fixture(scope="module")
def tiny4(default_model_dir, tmp_path_factory) -> Path:
    from adaptive_spec.vllm.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("t4") / "tiny4", default_model_dir, layers=4)


def _argv(target: Path, ckpt: Path, out: Path, *extra: str) -> list[str]:
    return [
        "distill", "--student", "eagle3", "--target", str(target), "--generator", "none",
        "--data", "code:3", "--eval-prompts", "1", "--seq-len", "48", "--max-new-tokens", "6",
        "--steps", "2", "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "64",
        "--warmup", "0", "--no-autocast", "--threads", "1", "--no-progress",
        "--checkpoint-dir", str(ckpt), "--out", str(out), *extra,
    ]  # fmt: skip


def test_distill_eagle3_end_to_end_and_init_from(tiny4, tmp_path, capsys):
    from adaptive_spec.commands.cli import main

    first = tmp_path / "head1"
    assert main(_argv(tiny4, tmp_path / "ck1", first)) == 0
    out = capsys.readouterr().out
    assert "draft vocabulary 64 tokens" in out and "tau@4" in out
    spec = eagle3.read_head_spec(first)
    assert spec.training["steps_done"] == 2 and spec.training["generator"] == "none"
    assert "init_from" not in spec.training and "all" in spec.measured["held_out"]
    _, t1 = eagle3.load_head_tensors(first)
    assert len(t1["d2t"]) == 64
    for name in ("features.pt", "data.npz", "head.pt", "training.png"):
        assert (tmp_path / "ck1" / name).is_file(), name

    # From the stored head, on the first run's features: same draft vocabulary, its weights as the
    # start, its held-out acceptance reported before training.
    second = tmp_path / "head2"
    argv = _argv(
        tiny4, tmp_path / "ck2", second, "--init-from", str(first),
        "--features-from", str(tmp_path / "ck1"), "--lr", "1e-9",
    )  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "starting from head 'head1'" in out and "before training" in out
    spec2 = eagle3.read_head_spec(second)
    assert spec2.training["init_from"] == {
        "name": "head1",
        "weights_sha256": spec.weights_sha256,
    }
    before = spec2.measured["held_out_init"]["all"]
    assert before == spec.measured["held_out"]["all"]  # the same head on the same held-out data
    _, t2 = eagle3.load_head_tensors(second)
    assert torch.equal(t2["d2t"], t1["d2t"])
    # At a learning rate of 1e-9 two steps leave the started-from weights as they were (to bf16
    # storage): the run started from them, not from the target's layers.
    for k, v in t1.items():
        assert torch.allclose(t2[k].float(), v.float(), atol=1e-2), k
    assert json.loads((tmp_path / "ck2" / "config.json").read_text())["init_from"] == str(
        first.resolve()
    )


def test_init_from_is_refused_where_it_cannot_apply(tmp_path, capsys):
    from adaptive_spec.commands.cli import main

    for extra in (["--student", "layer-cut"], ["--student", "eagle3", "--lora", "code"]):
        assert main(["distill", "--out", str(tmp_path / "o"), "--init-from", "h", *extra]) == 2
        assert "--init-from='h' starts an EAGLE-3 head from a stored one" in capsys.readouterr().out
    # checked before any data is generated: a path that is not a stored head
    argv = ["distill", "--student", "eagle3", "--out", str(tmp_path / "o"), "--init-from"]
    assert main([*argv, str(tmp_path)]) == 2
    assert "holds no head.json: give a stored EAGLE-3 head" in capsys.readouterr().out
