"""The EAGLE-3 feature cache: the target labels each training sequence once, a run with more data
labels only the new sequences, an interrupted labelling resumes, and another target's cache is refused."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptive_spec.commands.distill import eagle3_data as D
from adaptive_spec.commands.distill.sequences import TokenSequence


class _Counting(torch.nn.Module):
    """A tiny Llama target that counts its forward passes."""

    def __init__(self, layers: int = 4, hidden: int = 16, seed: int = 0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=97, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        )  # fmt: skip
        self.model = LlamaForCausalLM(cfg).eval()
        self.config = cfg
        self.calls = 0

    def forward(self, **kw):
        self.calls += 1
        return self.model(**kw)


def _seqs(n: int, seed: int = 0) -> list[TokenSequence]:
    rng = np.random.default_rng(seed)
    return [
        TokenSequence(rng.integers(3, 97, int(rng.integers(10, 30))).astype(np.int32), 4, "chat")
        for _ in range(n)
    ]


def _same(a: D.Features, b: D.Features) -> None:
    assert a.starts == b.starts and a.reply_from == b.reply_from
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.feats, b.feats)


def test_more_data_labels_only_the_new_sequences(tmp_path):
    target, seqs = _Counting(), _seqs(7)
    path = tmp_path / "features.pt"
    fresh = D.build_features(target, seqs, seq_len=24, progress=False)
    assert target.calls == 7

    target.calls = 0
    D.build_features(target, seqs[:4], seq_len=24, path=path, progress=False)
    assert target.calls == 4
    # a larger run, with the earlier sequences in another order: only 3 are new
    order = [5, 2, 0, 6, 3, 1, 4]
    grown = D.build_features(
        target, [seqs[i] for i in order], seq_len=24, path=path, progress=False
    )
    assert target.calls == 7
    again = D.build_features(
        fresh_target := _Counting(), seqs, seq_len=24, path=path, progress=False
    )
    assert fresh_target.calls == 0  # all cached (the cache now holds the grown run, reordered)
    _same(again, fresh)
    for j, i in enumerate(order):
        for x, y in zip(grown.sequence(j), fresh.sequence(i), strict=True):
            assert x == y if isinstance(x, int) else torch.equal(x, y)
    # the same run again reads the cache as it is, without a pass
    target.calls = 0
    _same(D.build_features(target, seqs, seq_len=24, path=path, progress=False), fresh)
    assert target.calls == 0


def test_interrupted_labelling_resumes(tmp_path, monkeypatch):
    target, seqs = _Counting(), _seqs(6, seed=1)
    path = tmp_path / "features.pt"
    real = target.forward

    def dies_at_five(**kw):
        if target.calls == 4:
            raise KeyboardInterrupt
        return real(**kw)

    monkeypatch.setattr(target, "forward", dies_at_five)
    with pytest.raises(KeyboardInterrupt):
        # save_every_s=0: the sequences done so far are written after each one
        D.build_features(target, seqs, seq_len=24, path=path, progress=False, save_every_s=0.0)
    monkeypatch.undo()
    assert path.exists() and target.calls == 4
    target.calls = 0
    got = D.build_features(target, seqs, seq_len=24, path=path, progress=False)
    assert target.calls == 2
    _same(got, D.build_features(_Counting(), seqs, seq_len=24, progress=False))


def test_another_targets_cache_is_refused(tmp_path):
    path = tmp_path / "features.pt"
    D.build_features(_Counting(hidden=16), _seqs(2), seq_len=24, path=path, progress=False)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="written for another target; delete it to rebuild"):
        D.build_features(_Counting(hidden=24), _seqs(2), seq_len=24, path=path, progress=False)
    with pytest.raises(ValueError, match="holds layers \\[1, 2, 3\\] of width 48"):
        D.build_features(_Counting(layers=8), _seqs(2), seq_len=24, path=path, progress=False)
    assert path.read_bytes() == before


def test_feature_reuse_lets_reference_data_grow(tmp_path):
    from adaptive_spec.commands.cli import build_parser
    from adaptive_spec.commands.distill.command import _check_args, _config, reuse_features

    parser = build_parser()

    def cfg_for(*extra: str):
        args = parser.parse_args(["distill", "--student", "eagle3", "--out", "x", *extra])
        _check_args(args)
        return _config(args, Path("/t"), None)

    src, dst = tmp_path / "run", tmp_path / "bigger"
    src.mkdir()
    dst.mkdir()
    small = cfg_for("--generator", "none", "--data", "chat:4,code:2")
    (src / "config.json").write_text(json.dumps(asdict(small)))
    for name in ("data.npz", "features.pt"):
        (src / name).write_bytes(b"x")
    # more of the same sources: allowed
    reuse_features(src, dst, cfg_for("--generator", "none", "--data", "chat:40,code:9"))
    assert (dst / "features.pt").read_bytes() == b"x"
    # another source, or generated replies: refused, with the setting named
    with pytest.raises(
        ValueError, match="data: \\['chat:4', 'code:2'\\] there, \\['chat:4'\\] here"
    ):
        reuse_features(src, dst, cfg_for("--generator", "none", "--data", "chat:4"))
    with pytest.raises(ValueError, match="generator: 'none' there, 'vllm' here"):
        reuse_features(src, dst, cfg_for("--generator", "vllm", "--data", "chat:4,code:2"))
