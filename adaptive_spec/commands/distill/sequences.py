"""Token sequences for distillation: a chat-formatted prompt and the target's reply, with the target's
top-K next tokens where recorded; their training windows and batches, and their files.

Sequences are made in batches that can stop and resume (:func:`in_batches`): each batch is handed to a
callback (which saves what was made so far), and a rerun starts after what was saved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(slots=True)
class TokenSequence:
    """A chat-formatted prompt and the target's continuation.

    Attributes
    ----------
    tokens : np.ndarray
        int32 [prompt_len + continuation_len]: token ids.
    prompt_len : int
        Tokens of the formatted prompt; the draft is trained and scored on positions after it.
    category : str
    split : str
    topk_ids : np.ndarray, optional
        int32 [continuation_len, K]: the target's K most likely tokens at each continuation position
        (a sparse teacher distribution, from vLLM's logprobs), or None.
    topk_logprobs : np.ndarray, optional
        float16 [continuation_len, K]: their log-probabilities.
    """

    tokens: np.ndarray
    prompt_len: int
    category: str
    split: str = "train"
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


def in_batches(
    items: Sequence[Any],
    make: Callable[[int, list[Any]], list[TokenSequence]],
    *,
    batch_size: int,
    desc: str,
    done: list[TokenSequence] | None = None,
    on_batch: Callable[[list[TokenSequence]], None] | None = None,
    progress: bool = True,
) -> list[TokenSequence]:
    """One sequence per item, made ``batch_size`` items at a time after the ``len(done)`` already made.

    Parameters
    ----------
    items : sequence
        Prompts (or prompt/reply pairs), in order.
    make : callable
        ``make(start, batch) -> sequences``: one sequence per item of ``batch``, the items from index
        ``start`` of ``items`` on.
    desc : str
        Label of the tqdm progress bar.
    done : list of TokenSequence, optional
        Sequences already made for the first items (resume).
    on_batch : callable, optional
        ``f(sequences_so_far)`` after every batch (checkpointing).

    Returns
    -------
    list of TokenSequence
        ``done`` followed by the new sequences.
    """
    from tqdm.auto import tqdm

    out = list(done or [])
    bar = tqdm(total=len(items), initial=len(out), desc=desc, disable=not progress)
    for b0 in range(len(out), len(items), batch_size):
        batch = list(items[b0 : b0 + batch_size])
        out.extend(make(b0, batch))
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(out)
    bar.close()
    return out


def usable(seqs: Sequence[TokenSequence], split: str) -> list[TokenSequence]:
    """The sequences of ``split`` with at least two continuation tokens."""
    return [s for s in seqs if s.split == split and len(s.tokens) - s.prompt_len >= 2]


def window(seq: TokenSequence, seq_len: int) -> tuple[np.ndarray, int]:
    """The last ``seq_len`` tokens of a sequence and where its continuation starts inside them."""
    start = max(0, len(seq.tokens) - seq_len)
    return seq.tokens[start:], max(seq.prompt_len - start, 1)


def collate(seqs: Sequence[TokenSequence], seq_len: int, pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded batch.

    Returns
    -------
    input_ids : torch.Tensor
        int64 [B, T].
    attention_mask : torch.Tensor
        int64 [B, T].
    loss_mask : torch.Tensor
        bool [B, T]: position t predicts token t + 1, a continuation token.
    """
    import torch

    if not seqs:
        raise ValueError("collate: no sequences")
    wins = [window(s, seq_len) for s in seqs]
    width = max(len(w) for w, _ in wins)
    ids = torch.full((len(wins), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(wins), width), dtype=torch.long)
    lm = torch.zeros((len(wins), width), dtype=torch.bool)
    for r, (w, c) in enumerate(wins):
        ids[r, : len(w)] = torch.from_numpy(w.astype(np.int64))
        att[r, : len(w)] = 1
        lm[r, c - 1 : len(w) - 1] = True
    return ids, att, lm


def collate_topk(seqs: Sequence[TokenSequence], seq_len: int) -> tuple[Any, Any] | None:
    """The sparse teacher at the loss positions of :func:`collate`, in the same (row-major) order.

    Returns
    -------
    (ids, logprobs) or None
        int64 [N, K] and float32 [N, K]; None if a sequence has no top-K data.
    """
    import torch

    ids, lps = [], []
    for s in seqs:
        if s.topk_ids is None or s.topk_logprobs is None:
            return None
        w, c = window(s, seq_len)
        start = len(s.tokens) - len(w)
        # Window positions c-1 .. len(w)-2 predict continuation tokens j0 .. L-1.
        j0 = start + c - s.prompt_len
        ids.append(s.topk_ids[j0:])
        lps.append(s.topk_logprobs[j0:])
    return (
        torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        torch.from_numpy(np.concatenate(lps).astype(np.float32)),
    )


def save_sequences(seqs: Sequence[TokenSequence], path: str | Path) -> None:
    """Write sequences to an npz file, atomically: flat tokens, lengths, prompt lengths, categories,
    splits, and the flat top-K teacher rows (``topk_ids``, ``topk_logprobs``; one row per continuation
    token of every sequence that has them, ``has_topk`` per sequence)."""
    path = Path(path)
    lens = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
    flat = np.concatenate([s.tokens for s in seqs]) if seqs else np.zeros(0, np.int32)
    has = np.array([s.topk_ids is not None for s in seqs], dtype=bool)
    k = next((s.topk_ids.shape[1] for s in seqs if s.topk_ids is not None), 0)
    ids = [s.topk_ids for s in seqs if s.topk_ids is not None]
    lps = [s.topk_logprobs for s in seqs if s.topk_ids is not None]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        tokens=flat.astype(np.int32),
        lens=lens,
        prompt_lens=np.array([s.prompt_len for s in seqs], dtype=np.int64),
        categories=np.array([s.category for s in seqs], dtype=str),
        splits=np.array([s.split for s in seqs], dtype=str),
        has_topk=has,
        topk_ids=np.concatenate(ids).astype(np.int32) if ids else np.zeros((0, k), np.int32),
        topk_logprobs=np.concatenate(lps).astype(np.float16)
        if lps
        else np.zeros((0, k), np.float16),
    )
    os.replace(tmp, path)


def load_sequences(path: str | Path) -> list[TokenSequence]:
    """Read sequences written by :func:`save_sequences`."""
    z = np.load(path, allow_pickle=False)
    tokens, has = z["tokens"], z["has_topk"]
    tid, tlp = z["topk_ids"], z["topk_logprobs"]
    out, off, toff = [], 0, 0
    for i, (n, p) in enumerate(zip(z["lens"], z["prompt_lens"], strict=True)):
        n, p = int(n), int(p)
        seq = TokenSequence(
            np.asarray(tokens[off : off + n], dtype=np.int32),
            p,
            str(z["categories"][i]),
            str(z["splits"][i]),
        )
        if has[i]:
            m = n - p
            seq.topk_ids, seq.topk_logprobs = tid[toff : toff + m], tlp[toff : toff + m]
            toff += m
        out.append(seq)
        off += n
    return out
