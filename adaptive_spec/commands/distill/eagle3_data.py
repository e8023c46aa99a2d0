"""What an EAGLE-3 head trains on: the target's hidden states after three of its layers and its greedy
next token at every position of the training sequences, and the reduced draft vocabulary.

One teacher-forced pass of the target per sequence gives both (:func:`build_features`); they are cached
in one file per run (bf16 features, int32 labels), written atomically, and reloaded on resume.
The draft vocabulary (:func:`draft_vocabulary`) is the ``n`` target tokens the target predicts most
often on the training data (EAGLE-3's frequency-ranked reduced vocabulary), sorted by target id;
``d2t[i]`` is the offset from draft id ``i`` to its target id, as vLLM's EAGLE-3 loader reads it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .sequences import TokenSequence


def aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The three target layers whose outputs the head fuses (layer ``i``: the residual stream after
    ``i`` decoder layers, transformers' ``hidden_states[i]``): vLLM's EAGLE-3 default
    ``(2, L // 2, L - 3)`` for a target of ``L`` layers, or ``(1, L // 2, L - 1)`` where that default
    has repeats (a target of fewer than 8 layers).

    Raises
    ------
    ValueError
        For fewer than 4 layers (three distinct layers below the last are needed).
    """
    if num_layers < 4:
        raise ValueError(
            f"an EAGLE-3 head needs a target of >= 4 layers; this one has {num_layers}"
        )
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) < 3:
        layers = (1, num_layers // 2, num_layers - 1)
    return layers


@dataclass
class Features:
    """The target's signals over the training sequences, concatenated.

    Attributes
    ----------
    feats : torch.Tensor
        bf16 [N, 3 * hidden]: fused-layer hidden states, per token of every sequence.
    labels : torch.Tensor
        int64 [N]: the target's greedy next token at each position (its argmax given the prefix).
    tokens : torch.Tensor
        int64 [N]: the sequences' tokens.
    starts : list of int
        Offset of each sequence in the arrays (``starts[i]:starts[i + 1]``; one more entry than
        sequences).
    reply_from : list of int
        Per sequence, the first position whose next token is part of the reply (``prompt_len - 1``,
        counted inside the stored window).
    """

    feats: Any
    labels: Any
    tokens: Any
    starts: list[int]
    reply_from: list[int]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sequence(self, i: int) -> tuple[Any, Any, Any, int]:
        """Sequence ``i``: (feats [T, 3H], labels [T], tokens [T], reply_from)."""
        a, b = self.starts[i], self.starts[i + 1]
        return self.feats[a:b], self.labels[a:b], self.tokens[a:b], self.reply_from[i]


def _cache_key(ids: Any, reply_from: int) -> bytes:
    """A cached sequence's identity: its windowed token ids and where its reply starts."""
    return np.asarray(ids, dtype=np.int64).tobytes() + int(reply_from).to_bytes(4, "little")


def _save_features(f: Features, layers: Sequence[int], path: Path) -> None:
    """Write ``f`` to ``path`` atomically (a temporary file renamed into place)."""
    import torch

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(
        {
            "feats": f.feats,
            "labels": f.labels,
            "tokens": f.tokens,
            "starts": f.starts,
            "reply_from": f.reply_from,
            "layers": list(layers),
        },
        tmp,
    )
    os.replace(tmp, path)


def _load_cache(path: Path, layers: Sequence[int], width: int) -> tuple[Features, list[bytes]]:
    """A feature cache and the :func:`_cache_key` of each of its sequences.

    Raises
    ------
    ValueError
        For a cache of other fused layers or another hidden width (another target's).
    """
    import torch

    got = torch.load(path, weights_only=True)
    if list(got.get("layers", layers)) != list(layers) or got["feats"].shape[1] != width:
        raise ValueError(
            f"feature cache {path} holds layers {list(got.get('layers', []))} of width "
            f"{got['feats'].shape[1]}; this target needs layers {list(layers)} of width {width}: "
            "it was written for another target; delete it to rebuild"
        )
    f = Features(
        got["feats"], got["labels"], got["tokens"], list(got["starts"]), list(got["reply_from"])
    )
    keys = []
    for i in range(len(f)):
        _, _, tok, reply_from = f.sequence(i)
        keys.append(_cache_key(tok.numpy(), reply_from))
    return f, keys


def build_features(
    target: Any,
    seqs: Sequence[TokenSequence],
    *,
    seq_len: int,
    device: str = "cpu",
    path: Path | None = None,
    progress: bool = True,
    save_every_s: float = 300.0,
) -> Features:
    """Run the target over each sequence's last ``seq_len`` tokens and keep its fused-layer hidden states
    and greedy next tokens.

    With ``path``, the features are cached there (written atomically). A sequence already in the
    cache (same windowed tokens and reply start) is not run again, so a run with more data labels only
    the new sequences, and an interrupted labelling resumes: the sequences done so far are written
    every ``save_every_s`` seconds. The finished cache holds ``seqs`` in order.

    Raises
    ------
    ValueError
        For a cache written for another target (other fused layers or width): delete it to rebuild.
    """
    import time

    import torch
    from tqdm.auto import tqdm

    from .sequences import window

    layers = aux_layers(int(target.config.num_hidden_layers))
    width = 3 * int(target.config.hidden_size)
    wins = [window(s, seq_len) for s in seqs]
    keys = [_cache_key(ids, max(reply - 1, 0)) for ids, reply in wins]
    cache: dict[bytes, tuple[Any, Any]] = {}
    if path is not None and path.exists():
        old, old_keys = _load_cache(path, layers, width)
        if old_keys == keys:
            return old  # the cache is exactly this run's
        for i, k in enumerate(old_keys):
            x, lab, _, _ = old.sequence(i)
            cache[k] = (x, lab)
    todo, seen = [], set(cache)
    for i, k in enumerate(keys):
        if k not in seen:
            seen.add(k)
            todo.append(i)

    def assemble(order: Sequence[bytes]) -> Features:
        parts = [(k, *cache[k]) for k in order]
        starts = [0]
        for _, x, _ in parts:
            starts.append(starts[-1] + x.shape[0])
        if not parts:
            return Features(
                torch.zeros(0, width, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64), [0], [],
            )  # fmt: skip
        tokens = [
            torch.from_numpy(np.frombuffer(k[:-4], dtype=np.int64).copy()) for k, _, _ in parts
        ]
        return Features(
            torch.cat([x for _, x, _ in parts]),
            torch.cat([lab for _, _, lab in parts]),
            torch.cat(tokens),
            starts,
            [int.from_bytes(k[-4:], "little") for k, _, _ in parts],
        )

    last_save = time.monotonic()
    bar = tqdm(todo, desc="target hidden states", disable=not progress)
    if cache:
        bar.set_postfix(cached=sum(k in cache for k in keys))
    for i in bar:
        ids, _ = wins[i]
        x = torch.as_tensor(ids, dtype=torch.int64, device=device)[None]
        with torch.no_grad():
            out = target(input_ids=x, output_hidden_states=True)
        hs = out.hidden_states
        cache[keys[i]] = (
            torch.cat([hs[j][0] for j in layers], dim=-1).to("cpu", torch.bfloat16),
            out.logits[0].argmax(-1).to("cpu", torch.int64),
        )
        if path is not None and time.monotonic() - last_save > save_every_s:
            _save_features(assemble(list(cache)), layers, path)
            last_save = time.monotonic()
    f = assemble(keys)
    if path is not None:
        _save_features(f, layers, path)
    return f


def draft_vocabulary(labels: Any, vocab_size: int, n: int) -> tuple[np.ndarray, float]:
    """The draft vocabulary: the ``n`` most frequent target tokens among ``labels``, as target ids
    sorted ascending, and the share of ``labels`` it covers.

    Parameters
    ----------
    labels : array-like of int
        The target's greedy next tokens over the training data.
    vocab_size : int
        The target's vocabulary size.
    n : int
        Draft vocabulary size (1 <= n <= vocab_size).

    Raises
    ------
    ValueError
        For ``n`` outside 1..vocab_size.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft vocabulary size {n} is invalid; allowed: 1..{vocab_size}")
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=vocab_size)
    # Most frequent first; ties broken by the lower id, so the choice is deterministic.
    order = np.lexsort((np.arange(vocab_size), -counts))[:n]
    ids = np.sort(order)
    total = counts.sum()
    return ids.astype(np.int64), float(counts[ids].sum() / total) if total else 0.0


def target_to_draft(draft_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: each target id's draft id, or -1 outside the draft vocabulary."""
    t2d = np.full(vocab_size, -1, dtype=np.int64)
    t2d[draft_ids] = np.arange(len(draft_ids))
    return t2d
