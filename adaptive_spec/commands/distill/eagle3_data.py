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


def build_features(
    target: Any,
    seqs: Sequence[TokenSequence],
    *,
    seq_len: int,
    device: str = "cpu",
    path: Path | None = None,
    progress: bool = True,
) -> Features:
    """Run the target over each sequence's last ``seq_len`` tokens and keep its fused-layer hidden states
    and greedy next tokens (cached at ``path`` when given: reloaded if present, else written atomically).

    Raises
    ------
    ValueError
        For a cache file that does not match ``seqs`` (another run's): delete it to rebuild.
    """
    import torch
    from tqdm.auto import tqdm

    from .sequences import window

    if path is not None and path.exists():
        got = torch.load(path, weights_only=True)
        if len(got["starts"]) != len(seqs) + 1:
            raise ValueError(
                f"feature cache {path} holds {len(got['starts']) - 1} sequences, the run has "
                f"{len(seqs)}: delete it to rebuild"
            )
        return Features(
            got["feats"], got["labels"], got["tokens"], list(got["starts"]), list(got["reply_from"])
        )
    layers = aux_layers(int(target.config.num_hidden_layers))
    feats, labels, tokens, starts, reply_from = [], [], [], [0], []
    for s in tqdm(seqs, desc="target hidden states", disable=not progress):
        ids, reply = window(s, seq_len)
        x = torch.as_tensor(ids, dtype=torch.int64, device=device)[None]
        with torch.no_grad():
            out = target(input_ids=x, output_hidden_states=True)
        hs = out.hidden_states
        feats.append(torch.cat([hs[i][0] for i in layers], dim=-1).to("cpu", torch.bfloat16))
        labels.append(out.logits[0].argmax(-1).to("cpu", torch.int64))
        tokens.append(x[0].cpu())
        starts.append(starts[-1] + x.shape[1])
        reply_from.append(max(reply - 1, 0))
    f = Features(torch.cat(feats), torch.cat(labels), torch.cat(tokens), starts, reply_from)
    if path is not None:
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
