"""The teacher: the target model, frozen. It labels reference replies with its top-K next tokens,
caches its final hidden states, and gives each training batch its teacher signal (``--teacher``):

* ``topk``: the top-K log-probabilities recorded with the data (no target pass during training);
* ``online``: the target's final hidden states, computed each step (its full distribution is one
  product with the shared LM head);
* ``cached``: the same hidden states computed once before training (:func:`build_teacher_cache`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import DistillConfig
from .forward import bf16_autocast, final_hidden
from .prompts import TextPair, format_prompt
from .sequences import TokenSequence, collate, collate_topk, in_batches, window


def load_target(target_dir: str | Path, device: str, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """The target (frozen, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype))
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def label_with_target(
    target: Any,
    tok: Any,
    pairs: Sequence[TextPair],
    *,
    topk: int,
    seq_len: int,
    batch_size: int,
    device: str,
    autocast: bool = True,
    done: list[TokenSequence] | None = None,
    on_batch: Callable[[list[TokenSequence]], None] | None = None,
    progress: bool = True,
) -> list[TokenSequence]:
    """Teacher-forced sequences: each prompt and its reference reply in the chat template, with the
    target's ``topk`` most likely next tokens and their log-probabilities at every reply position (one
    forward pass of the target per sequence: on a CPU far cheaper than generating the target's own
    replies). Sequences are cut to their last ``seq_len`` tokens.

    Returns
    -------
    list of TokenSequence
        ``split`` from the pairs; ``topk_ids[j, 0]`` is the target's greedy choice at reply token j.
    """
    import torch

    eos = tok.eos_token_id

    def make(_start: int, batch: list[TextPair]) -> list[TokenSequence]:
        seqs = []
        for p in batch:
            prompt = format_prompt(tok, p.prompt)
            reply = tok(p.reply, add_special_tokens=False)["input_ids"] + [eos]
            toks = (prompt + reply)[-seq_len:]
            plen = max(len(prompt) - (len(prompt) + len(reply) - len(toks)), 1)
            seqs.append(TokenSequence(np.asarray(toks, dtype=np.int32), plen, p.category, p.split))
        ids, att, lm = collate(seqs, seq_len, tok.pad_token_id or 0)
        with torch.no_grad(), bf16_autocast(device, autocast):
            h = final_hidden(target, ids.to(device), att.to(device))
            for r, s in enumerate(seqs):
                pos = lm[r].nonzero().squeeze(-1).to(device)
                logp = torch.log_softmax(
                    (h[r, pos] @ target.lm_head.weight.to(h.dtype).T).float(), -1
                )
                v, i = logp.topk(topk, -1)
                s.topk_ids = i.cpu().numpy().astype(np.int32)
                s.topk_logprobs = v.clamp_min(-30).cpu().numpy().astype(np.float16)
        return seqs

    return in_batches(
        pairs,
        make,
        batch_size=batch_size,
        desc="target labels",
        done=done,
        on_batch=on_batch,
        progress=progress,
    )


def build_teacher_cache(
    target: Any, seqs: Sequence[TokenSequence], cfg: DistillConfig, pad_id: int
) -> dict[int, Any]:
    """The target's final hidden states (bf16, on the CPU) of every training window."""
    import torch
    from tqdm.auto import tqdm

    cache = {}
    for b0 in tqdm(range(0, len(seqs), cfg.batch_size), desc="teacher cache"):
        batch = seqs[b0 : b0 + cfg.batch_size]
        ids, att, _ = collate(batch, cfg.seq_len, pad_id)
        with torch.no_grad(), bf16_autocast(cfg.device, cfg.autocast):
            h = final_hidden(target, ids.to(cfg.device), att.to(cfg.device))
        for r, s in enumerate(batch):
            n = len(window(s, cfg.seq_len)[0])
            cache[b0 + r] = h[r, :n].to("cpu", torch.bfloat16)
    return cache


@dataclass(slots=True)
class TeacherBatch:
    """The teacher's signal at the loss positions of one training batch (one of the two is set, or
    neither for a cross-entropy loss on the text's own next tokens).

    Attributes
    ----------
    hidden : torch.Tensor or None
        bf16/float [N, H]: the target's final hidden states (``online`` and ``cached`` teachers).
    topk : (torch.Tensor, torch.Tensor) or None
        int64 [N, K] ids and float32 [N, K] log-probabilities (``topk`` teacher).
    """

    hidden: Any = None
    topk: tuple[Any, Any] | None = None


def teacher_batch(
    cfg: DistillConfig,
    target: Any,
    batch: Sequence[TokenSequence],
    idx: Sequence[int],
    ids: Any,
    att: Any,
    sel: tuple[Any, Any],
    cache: dict[int, Any] | None = None,
) -> TeacherBatch:
    """The teacher's signal for a training batch (``cfg.teacher``; see the module docstring).

    Parameters
    ----------
    batch, idx : sequence
        The batch's sequences and their indices in the training set (the keys of ``cache``).
    ids, att : torch.Tensor
        int64 [B, T]: the batch from :func:`~adaptive_spec.commands.distill.sequences.collate`, on
        ``cfg.device``.
    sel : (torch.Tensor, torch.Tensor)
        Row and column indices of the loss positions (``loss_mask.nonzero(as_tuple=True)``).
    cache : dict, optional
        From :func:`build_teacher_cache`.

    Raises
    ------
    ValueError
        For the ``topk`` teacher on data without top-K log-probabilities.
    """
    import torch

    dev = cfg.device
    with torch.no_grad():
        if cfg.teacher == "topk":
            topk = collate_topk(batch, cfg.seq_len)
            if topk is None:
                raise ValueError("teacher='topk' needs top-K logprobs in the data (vLLM generator)")
            return TeacherBatch(topk=(topk[0].to(dev), topk[1].to(dev)))
        if cache is not None:
            width = target.lm_head.weight.shape[1]
            th = torch.zeros((*ids.shape, width), dtype=torch.bfloat16, device=dev)
            for r, i in enumerate(idx):
                h = cache[i].to(dev)
                th[r, : h.shape[0]] = h
            return TeacherBatch(hidden=th[sel])
        if cfg.teacher == "online" and cfg.loss != "ce":
            with bf16_autocast(dev, cfg.autocast):
                return TeacherBatch(hidden=final_hidden(target, ids, att)[sel])
    return TeacherBatch()
