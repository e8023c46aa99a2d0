"""The EAGLE-3 head's training-time-test unroll equals drafting pass by pass with a KV cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaptive_spec.commands.distill.eagle3_data import draft_vocabulary, target_to_draft
from adaptive_spec.commands.distill.eagle3_head import Eagle3Head, HeadShape, _rope
from adaptive_spec.commands.distill.eagle3_train import _greedy_chains

SHAPE = HeadShape(
    hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=20, rope_theta=100.0
)


def _head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    embed = torch.randn(50, SHAPE.hidden)
    head = Eagle3Head(SHAPE, embed, torch.arange(20) * 2)
    for p in head.parameters():  # norms away from 1, so that they are exercised
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return head.double()


def _pass(head: Eagle3Head, hidden, tok, pos, cache):
    """One draft pass at one position (inference order): appends its key/value to ``cache``."""
    s, a = head.shape, head.midlayer.self_attn
    emb = head.midlayer.input_layernorm(F.embedding(tok, head.embed).double())
    x = torch.cat((emb, head.midlayer.hidden_norm(hidden)), -1)
    q = a.q_proj(x).view(s.heads, 1, s.head_dim)
    k = a.k_proj(x).view(s.kv_heads, 1, s.head_dim)
    v = a.v_proj(x).view(s.kv_heads, 1, s.head_dim)
    ang = pos * head.inv_freq.double()
    ang = torch.cat((ang, ang))
    q, k = _rope(q, ang.cos(), ang.sin()), _rope(k, ang.cos(), ang.sin())
    cache.append((k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)))
    K = torch.cat([c[0] for c in cache], 1)
    V = torch.cat([c[1] for c in cache], 1)
    w = torch.softmax((q @ K.transpose(-1, -2)) / math.sqrt(s.head_dim), -1)
    o = a.o_proj((w @ V).reshape(-1))
    res = hidden + o
    pre = res + head.midlayer.mlp(head.midlayer.post_attention_layernorm(res))
    return pre, head.norm(pre)


@pytest.mark.parametrize("start", [0, 3, 6])
def test_unroll_equals_sequential_drafting(start):
    head = _head()
    T, steps = 10, 4
    feats = torch.randn(1, T, 3 * SHAPE.hidden, dtype=torch.double)
    nxt = torch.randint(0, 50, (1, T))
    outs = head.unroll(feats, nxt, steps)
    # first passes over the prefix 0..start (target features), then draft passes on the head's output
    cache: list = []
    fused = head.fc(feats[0])
    for t in range(start + 1):
        pre, normed = _pass(head, fused[t], nxt[0, t], t, cache)
    torch.testing.assert_close(outs[0][0, start], normed, atol=1e-5, rtol=1e-5)
    for j in range(1, steps):
        t = start + j
        if t >= T:
            break
        pre, normed = _pass(head, pre, nxt[0, t], t, cache)
        torch.testing.assert_close(outs[j][0, t], normed, atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_positions():
    head = _head(1)
    feats = torch.randn(1, 6, 3 * SHAPE.hidden, dtype=torch.double)
    nxt = torch.randint(0, 50, (1, 6))
    alone = head.unroll(feats, nxt, 3)
    padded = head.unroll(
        torch.cat((feats, torch.randn(1, 3, 3 * SHAPE.hidden, dtype=torch.double)), 1),
        torch.cat((nxt, torch.zeros(1, 3, dtype=torch.int64)), 1),
        3,
        pad=torch.tensor([[False] * 6 + [True] * 3]),
    )
    for a, b in zip(alone, padded, strict=True):
        torch.testing.assert_close(a[0], b[0, :6], atol=1e-5, rtol=1e-5)


def test_draft_vocabulary_most_frequent_sorted_with_coverage():
    labels = np.array([5, 5, 5, 2, 2, 9, 1])
    ids, cover = draft_vocabulary(labels, 12, 2)
    assert ids.tolist() == [2, 5]
    assert cover == pytest.approx(5 / 7)
    t2d = target_to_draft(ids, 12)
    assert t2d[5] == 1 and t2d[2] == 0 and t2d[9] == -1
    with pytest.raises(ValueError, match="draft vocabulary size 13"):
        draft_vocabulary(labels, 12, 13)


def test_greedy_chains_accept_runs_of_matches():
    # every draft matches: k + 1 tokens per step
    m = np.ones((4, 12), dtype=bool)
    steps, emitted = _greedy_chains(m, 0, 12, 4)
    assert (steps, emitted) == (3, 13)  # 5 + 5 + 3: the window ends inside the third chain
    none = np.zeros((4, 12), dtype=bool)
    assert _greedy_chains(none, 2, 12, 4) == (10, 10)


def _features(n: int = 6, length: int = 12, seed: int = 0):
    from adaptive_spec.commands.distill.eagle3_data import Features

    g = torch.Generator().manual_seed(seed)
    total = n * length
    feats = torch.randn(total, 3 * SHAPE.hidden, generator=g).bfloat16()
    labels = 2 * torch.randint(0, 20, (total,), generator=g)  # inside the draft vocabulary
    tokens = torch.randint(0, 50, (total,), generator=g)
    return Features(feats, labels, tokens, [i * length for i in range(n + 1)], [2] * n)


def test_head_training_resumes_exactly(tmp_path, monkeypatch):
    """Training 5 steps in one go equals 3 steps, an interruption (Ctrl-C writes a checkpoint), and a
    resume to 5 in a fresh head (same batches, optimiser and schedule state)."""
    from adaptive_spec.commands.distill import eagle3_train as T

    f, t2d = _features(), torch.as_tensor(target_to_draft(np.arange(20) * 2, 50))

    def fresh() -> Eagle3Head:
        return _head(1).float()

    cfg = T.HeadTraining(
        steps=5, batch_size=2, ttt_steps=2, warmup=1, save_every=10, autocast=False
    )
    whole = fresh()
    res = T.train_head(whole, f, range(6), t2d, cfg, tmp_path / "a", progress=False)
    assert res["steps_done"] == 5 and len(res["history"]) == 5
    assert len(res["agree"]) == 2  # one agreement per unrolled pass

    real_loss, calls = T.head_loss, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(T, "head_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.train_head(fresh(), f, range(6), t2d, cfg, tmp_path / "b", progress=False)
    monkeypatch.setattr(T, "head_loss", real_loss)
    resumed = fresh()  # the same target embedding (never checkpointed), other trained weights:
    with torch.no_grad():  # everything trained must come from the checkpoint
        for p in resumed.parameters():
            p.add_(0.25)
    res2 = T.train_head(resumed, f, range(6), t2d, cfg, tmp_path / "b", progress=False)
    assert res2["steps_done"] == 5 and [h[0] for h in res2["history"]] == [1, 2, 3, 4, 5]
    for (k, v), (k2, v2) in zip(
        whole.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.allclose(v, v2, atol=1e-6), k
