"""Training and evaluating an EAGLE-3 head (:mod:`.eagle3_head`) on the target's signals
(:mod:`.eagle3_data`).

Loss: training-time test (EAGLE-3, Li et al. 2025): the head is unrolled ``ttt_steps`` passes on its own
outputs, and step ``j`` is scored by cross-entropy against the target's greedy token over the draft
vocabulary, weighted ``0.8 ** j``. Positions count from the last prompt token on (where decoding drafts)
and where the target's token is in the draft vocabulary.

Evaluation is exact for greedy chain speculation: a chain from position ``p`` accepts ``m`` drafts when
unrolled steps ``0..m-1`` at ``p..p+m-1`` all match the target's greedy tokens (while drafts match, the
head's inputs are what they would be at inference), so acceptance by position and the mean accepted
length follow from teacher-forced unrolls.

The loop (AdamW, warm-up then cosine decay) writes its checkpoint atomically every ``save_every``
steps and on Ctrl-C / SIGTERM, and resumes exactly (parameters, optimiser, schedule, step, history).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .eagle3_data import Features
from .training import _atomic_save, batch_order, run_steps, warmup_cosine

logger = logging.getLogger("adaptive_spec.commands.distill")

STEP_DECAY = 0.8  # EAGLE-3's weight of unrolled step j: 0.8 ** j


@dataclass(frozen=True)
class HeadTraining:
    """Settings of a head's training run.

    Attributes
    ----------
    steps : int
        Optimiser steps.
    batch_size : int
        Sequences per step.
    ttt_steps : int
        Unrolled draft passes per position (training-time test).
    lr, warmup, weight_decay : float, int, float
        AdamW peak learning rate, linear warm-up steps, decoupled weight decay.
    save_every : int
        Checkpoint interval (steps).
    seed : int
    autocast : bool
        bf16 autocast on the CPU (float32 parameters).
    """

    steps: int = 2000
    batch_size: int = 8
    ttt_steps: int = 4
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    save_every: int = 100
    seed: int = 0
    autocast: bool = True


@dataclass
class HeadBatch:
    """One training batch (right-padded to the longest sequence).

    Attributes
    ----------
    feats : torch.Tensor
        bf16 [B, T, 3H].
    next_ids : torch.Tensor
        int64 [B, T]: token ``t + 1`` at position ``t`` (0 past the end).
    labels : torch.Tensor
        int64 [B, T]: draft id of the target's greedy token ``t + 2`` at ``t``, -1 where none.
    first : torch.Tensor
        int64 [B]: first scored position (the last prompt token).
    pad : torch.Tensor
        bool [B, T]: padding.
    """

    feats: Any
    next_ids: Any
    labels: Any
    first: Any
    pad: Any


def make_batch(f: Features, idx: Sequence[int], t2d: Any) -> HeadBatch:
    """The batch of sequences ``idx`` of ``f``; ``t2d`` is int64 [vocab]: draft id per target id
    (-1 outside the draft vocabulary)."""
    import torch

    parts = [f.sequence(i) for i in idx]
    T = max(p[0].shape[0] for p in parts)
    B, width = len(parts), parts[0][0].shape[1]
    feats = torch.zeros(B, T, width, dtype=torch.bfloat16)
    nxt = torch.zeros(B, T, dtype=torch.int64)
    labels = torch.full((B, T), -1, dtype=torch.int64)
    pad = torch.ones(B, T, dtype=torch.bool)
    first = torch.zeros(B, dtype=torch.int64)
    for r, (x, lab, tok, reply_from) in enumerate(parts):
        n = x.shape[0]
        feats[r, :n] = x
        nxt[r, : n - 1] = tok[1:]
        # at t the head predicts token t + 2, which the target chose at t + 1
        labels[r, : n - 1] = t2d[lab[1:]]
        pad[r, :n] = False
        first[r] = reply_from
    return HeadBatch(feats, nxt, labels, first, pad)


def head_loss(head: Any, b: HeadBatch, steps: int) -> tuple[Any, list[float], list[int]]:
    """The TTT loss of one batch and, per unrolled step, the agreement and the positions scored."""
    import torch
    import torch.nn.functional as F

    outs = head.unroll(b.feats, b.next_ids, steps, pad=b.pad)
    T = b.labels.shape[1]
    pos = torch.arange(T)[None]
    total, agree, counted = 0.0, [], []
    for j, h in enumerate(outs):
        ok = (b.labels >= 0) & (pos - j >= b.first[:, None]) & ~b.pad
        n = int(ok.sum())
        counted.append(n)
        if n == 0:
            agree.append(0.0)
            continue
        logits = head.logits(h[ok]).float()
        lab = b.labels[ok]
        total = total + (STEP_DECAY**j) * F.cross_entropy(logits, lab)
        agree.append(float((logits.argmax(-1) == lab).float().mean()))
    return total, agree, counted


def train_head(
    head: Any,
    f: Features,
    train_idx: Sequence[int],
    t2d: Any,
    cfg: HeadTraining,
    ckpt_dir: Path | None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``head`` in place on sequences ``train_idx`` of ``f``; resumes from ``ckpt_dir/head.pt``.

    Returns
    -------
    dict
        ``steps_done``, ``seconds``, ``loss`` and ``agree`` (mean over the last 20 steps; ``agree`` per
        unrolled step) and ``history`` (``(step, loss, agree per step)``).

    Raises
    ------
    ValueError
        Without training sequences.
    """
    import torch

    if not train_idx:
        raise ValueError("no training sequences: add prompts (--prompts, --data)")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.warmup, cfg.steps))
    step, history = 0, []
    path = ckpt_dir / "head.pt" if ckpt_dir is not None else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if path is not None and path.exists():
        state = torch.load(path, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, history = int(state["step"]), list(state["history"])
        logger.info("resumed head training at step %d from %s", step, path)

    def save(step: int, history: list[Any]) -> None:
        if path is not None:
            _atomic_save(
                {
                    "head": head.state_dict(),
                    "optim": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "step": step,
                    "history": history,
                },
                path,
            )

    def one_step(step: int) -> tuple[Any, list[float]]:
        order = batch_order(len(train_idx), cfg.batch_size, step, cfg.seed)
        b = make_batch(f, [train_idx[i] for i in order], t2d)
        b.feats = b.feats.to(_dtype(head))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            loss, agree, _ = head_loss(head, b, cfg.ttt_steps)
        return loss, list(agree)

    head.train()
    return run_steps(
        params, opt, sched, one_step, save, steps=cfg.steps, step=step, history=history,
        save_every=cfg.save_every, desc="train EAGLE-3 head", progress=progress,
    )  # fmt: skip


@dataclass
class ChainStats:
    """Greedy chain speculation with the head on held-out replies, per category.

    Attributes
    ----------
    by_position : list of float
        Acceptance by draft position (1-based position ``i`` at index ``i - 1``): the share of chains
        reaching position ``i`` whose draft ``i`` matches.
    tau : dict
        k -> mean accepted length per step (accepted drafts plus the bonus token) of greedy speculative
        decoding with ``k`` drafts per step over the replies.
    agreement : float
        First-pass agreement with the target's greedy token.
    """

    by_position: list[float] = field(default_factory=list)
    tau: dict[int, float] = field(default_factory=dict)
    agreement: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "by_position": [round(x, 4) for x in self.by_position],
            "tau": {str(k): round(v, 4) for k, v in self.tau.items()},
            "agreement": round(self.agreement, 4),
        }


def evaluate_head(
    head: Any,
    f: Features,
    idx: Sequence[int],
    categories: Sequence[str],
    t2d: Any,
    *,
    k_max: int = 4,
    autocast: bool = False,
) -> dict[str, ChainStats]:
    """Acceptance by position and accepted length at k = 1..``k_max`` of the head on sequences
    ``idx`` of ``f`` (held out; the target's own greedy replies), per category and ``all``."""
    import torch

    head.eval()
    hits: dict[str, np.ndarray] = {}
    reach: dict[str, np.ndarray] = {}
    steps_tok: dict[str, dict[int, list[int]]] = {}
    for i, cat in zip(idx, categories, strict=True):
        b = make_batch(f, [i], t2d)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = head.unroll(b.feats.to(_dtype(head)), b.next_ids, k_max)
            preds = [head.logits(h[0]).argmax(-1) for h in outs]
        lab = b.labels[0]
        first = int(b.first[0])
        n = int((~b.pad[0]).sum()) - 1  # positions with a next token
        # match[j][t]: unrolled step j at position t drafts the target's token t + 2
        match = np.stack([((p == lab) & (lab >= 0)).numpy()[:n] for p in preds])
        for key in (cat, "all"):
            h = hits.setdefault(key, np.zeros(k_max))
            r = reach.setdefault(key, np.zeros(k_max))
            st = steps_tok.setdefault(key, {k: [0, 0] for k in range(1, k_max + 1)})
            for p in range(first, n):
                for j in range(k_max):
                    if p + j >= n:
                        break
                    r[j] += 1
                    if not match[j][p + j]:
                        break
                    h[j] += 1
            for k in range(1, k_max + 1):
                s, e = _greedy_chains(match, first, n, k)
                st[k][0] += s
                st[k][1] += e
    out = {}
    for key in hits:
        by_pos = [
            float(hits[key][j] / reach[key][j]) if reach[key][j] else 0.0 for j in range(k_max)
        ]
        tau = {k: st[1] / st[0] if st[0] else 0.0 for k, st in steps_tok[key].items()}
        out[key] = ChainStats(by_pos, tau, by_pos[0])
    return out


def _dtype(head: Any) -> Any:
    return head.fc.weight.dtype


def _greedy_chains(match: np.ndarray, first: int, n: int, k: int) -> tuple[int, int]:
    """Steps and tokens committed by greedy chain speculation with ``k`` drafts from position
    ``first`` to ``n`` (see :func:`evaluate_head`)."""
    p, steps, emitted = first, 0, 0
    while p < n:
        a = 0
        while a < k and p + a < n and match[a][p + a]:
            a += 1
        steps += 1
        emitted += a + 1
        p += a + 1
    return steps, emitted


__all__ = [
    "ChainStats",
    "HeadBatch",
    "HeadTraining",
    "evaluate_head",
    "head_loss",
    "make_batch",
    "train_head",
]
