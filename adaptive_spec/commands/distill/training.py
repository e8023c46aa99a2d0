"""The training loop: AdamW with linear warm-up then cosine decay, checkpoints written atomically every
``save_every`` steps and on Ctrl-C / SIGTERM, and exact resumption (parameters, optimiser, schedule,
step, RNG state and history; batches drawn per step from seeded epochs)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .config import DistillConfig
from .forward import bf16_autocast, final_hidden
from .loss import distill_loss
from .sequences import TokenSequence, collate
from .teacher import teacher_batch

logger = logging.getLogger("adaptive_spec.commands.distill")


def warmup_cosine(warmup: int, steps: int) -> Callable[[int], float]:
    """The learning-rate factor at each step: linear warm-up over ``warmup`` steps, then cosine decay
    to 0.05 at ``steps``."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        prog = (step - warmup) / max(steps - warmup, 1)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))

    return lr_at


def batch_order(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the sequences in training batch ``step``: epochs of a seeded permutation, so a resumed
    run sees exactly the batches it would have seen."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed * 100003 + epoch).permutation(n)
    return [int(j) for j in perm[i * batch_size : (i + 1) * batch_size]]


class _Interrupt:
    """Turns SIGTERM into KeyboardInterrupt while training, so a checkpoint is written."""

    def __enter__(self) -> _Interrupt:
        self._old = None
        with contextlib.suppress(ValueError):  # not the main thread
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(*_: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _atomic_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run_steps(
    params: list[Any],
    opt: Any,
    sched: Any,
    one_step: Callable[[int], tuple[Any, Any]],
    save: Callable[[int, list[Any]], None],
    *,
    steps: int,
    step: int,
    history: list[Any],
    save_every: int,
    desc: str,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """The optimisation loop both distillation trainers share: from ``step`` to ``steps``, each step
    ``one_step(step) -> (loss, agree)`` (a scalar loss tensor; the agreement, a float or a list of
    floats per unrolled pass), backward, gradient clipping at 1, ``opt`` and ``sched`` steps, a history
    entry ``(step, loss, agree)`` and a progress bar; ``save(step, history)`` every ``save_every``
    steps, at the end, and on Ctrl-C / SIGTERM (which then propagates as KeyboardInterrupt).

    Returns ``steps_done``, ``seconds`` (wall time of this call), ``loss`` and ``agree`` (means over the
    last 20 steps) and ``history``.
    """
    import torch
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=steps, initial=step, desc=desc, disable=not progress)
    with _Interrupt():
        try:
            while step < steps:
                loss, agree = one_step(step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                step += 1
                value = float(loss.detach())
                history.append((step, value, agree))
                bar.update(1)
                shown = (
                    "/".join(f"{a:.2f}" for a in agree)
                    if isinstance(agree, list | tuple)
                    else f"{agree:.3f}"
                )
                bar.set_postfix(loss=f"{value:.3f}", agree=shown)
                if step % save_every == 0:
                    save(step, history)
                if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    logger.warning("time budget of %.0f s reached at step %d", time_budget_s, step)
                    break
        except KeyboardInterrupt:
            save(step, history)
            bar.close()
            raise
    save(step, history)
    bar.close()
    tail = history[-20:]
    agree_mean = None
    if tail:
        m = np.mean([h[2] for h in tail], axis=0)
        agree_mean = [float(x) for x in m] if np.ndim(m) else float(m)
    return {
        "steps_done": step,
        "seconds": round(time.perf_counter() - t0, 1),
        "loss": float(np.mean([h[1] for h in tail])) if tail else None,
        "agree": agree_mean,
        "history": history,
    }


def train_draft(
    draft: Any,
    params: list[Any],
    target: Any,
    train: Sequence[TokenSequence],
    cfg: DistillConfig,
    ckpt_dir: Path | None,
    *,
    pad_id: int,
    teacher_cache: dict[int, Any] | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train ``params`` of ``draft`` for ``cfg.steps`` steps (AdamW, linear warm-up then cosine decay,
    gradient clipping at 1), resuming from ``ckpt_dir/train.pt`` if present.

    Parameters
    ----------
    teacher_cache : dict, optional
        Sequence index -> the target's final hidden states of its training window (bf16 [T, H]).
    time_budget_s : float, optional
        Stop (with a checkpoint) after this much wall time.

    Returns
    -------
    dict
        ``steps_done``, ``seconds``, ``loss`` and ``agree`` (means over the last 20 steps), ``history``.

    Raises
    ------
    ValueError
        If there is no training data.
    """
    import torch

    if not train:
        raise ValueError(
            "no training sequences (every prompt was too long or produced no continuation)"
        )
    dev = cfg.device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.warmup, cfg.steps))
    step, history = 0, []
    path = ckpt_dir / "train.pt" if ckpt_dir is not None else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if path is not None and path.exists():
        state = torch.load(path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for p, v in zip(params, state["params"], strict=True):
                p.copy_(v.to(p.device))
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, history = int(state["step"]), list(state["history"])
        torch.set_rng_state(state["rng"])
        logger.info("resumed training at step %d from %s", step, path)

    def save(step: int, history: list[Any]) -> None:
        if path is None:
            return
        _atomic_save(
            {
                "params": [p.detach().cpu() for p in params],
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "step": step,
                "history": history,
                "rng": torch.get_rng_state(),
                "config": asdict(cfg),
            },
            path,
        )

    head_w = target.lm_head.weight

    def one_step(step: int) -> tuple[Any, float]:
        idx = batch_order(len(train), cfg.batch_size, step, cfg.seed)
        batch = [train[i] for i in idx]
        ids, att, lm = collate(batch, cfg.seq_len, pad_id)
        ids, att, lm = ids.to(dev), att.to(dev), lm.to(dev)
        sel = lm.nonzero(as_tuple=True)
        nxt = ids[sel[0], sel[1] + 1]
        teacher = teacher_batch(cfg, target, batch, idx, ids, att, sel, teacher_cache)
        with bf16_autocast(dev, cfg.autocast):
            sh = final_hidden(draft, ids, att)[sel]
            loss, st = distill_loss(
                sh,
                teacher.hidden,
                head_w,
                nxt,
                loss=cfg.loss,
                temperature=cfg.temperature,
                teacher_topk=teacher.topk,
            )
        return loss, st["agree"]

    draft.train()
    return run_steps(
        params, opt, sched, one_step, save, steps=cfg.steps, step=step, history=history,
        save_every=cfg.save_every, desc="distill", progress=progress, time_budget_s=time_budget_s,
    )  # fmt: skip
