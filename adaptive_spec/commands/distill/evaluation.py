"""Evaluation of a draft on held-out sequences of the target's greedy replies: greedy agreement and the
mean accepted length tau at k = 1..8 of greedy speculative decoding, exact from teacher-forced draft
predictions (while the drafts match, the draft's context is the target's, so a step starting at
position j accepts the run of consecutive matches there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .forward import bf16_autocast, final_hidden
from .sequences import TokenSequence, collate

K_REPORT = tuple(range(1, 9))


@dataclass
class AcceptanceStats:
    """Greedy acceptance of a draft on one category.

    Attributes
    ----------
    positions : int
        Continuation positions scored.
    agree : int
        Positions where the draft's greedy token is the target's.
    steps, emitted : dict
        Per k: verification steps and tokens committed in a simulated greedy speculative decode.
    """

    positions: int = 0
    agree: int = 0
    steps: dict[int, int] = field(default_factory=lambda: dict.fromkeys(K_REPORT, 0))
    emitted: dict[int, int] = field(default_factory=lambda: dict.fromkeys(K_REPORT, 0))

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else 0.0

    def tau(self, k: int) -> float:
        """Mean accepted length (tokens committed per verification, bonus included) at ``k``."""
        return self.emitted[k] / self.steps[k] if self.steps[k] else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "agreement": round(self.agreement, 4),
            "tau": {str(k): round(self.tau(k), 4) for k in K_REPORT},
        }


def simulate_greedy(match: np.ndarray, k: int) -> tuple[int, int]:
    """Steps and tokens committed by greedy speculative decoding with ``k`` drafts per step.

    ``match[j]`` is True when the draft, given the target's first tokens up to continuation position j,
    predicts token j. Decoding starts after the first continuation token (the target's prefill emits it):
    a step at position j accepts the run of matches ``match[j], match[j+1], ...`` (at most k) and commits
    it plus one target token.

    Parameters
    ----------
    match : np.ndarray
        bool [L]: per continuation position (index 0 = the first continuation token).
    k : int >= 1

    Returns
    -------
    (steps, emitted)
    """
    if k < 1:
        raise ValueError(f"k={k!r} is invalid; allowed: an integer >= 1")
    n = len(match)
    j, steps, emitted = 1, 0, 0
    while j < n:
        a = 0
        while a < k and j + a < n and match[j + a]:
            a += 1
        e = min(a + 1, n - j)
        steps += 1
        emitted += e
        j += e
    return steps, emitted


def evaluate(
    draft: Any,
    seqs: Sequence[TokenSequence],
    *,
    device: str,
    batch_size: int = 8,
    seq_len: int = 1024,
    pad_id: int = 0,
    autocast: bool = True,
) -> dict[str, AcceptanceStats]:
    """Greedy acceptance of ``draft`` against the target's continuations, per category and overall
    (``"all"``), from teacher-forced draft predictions (see the module docstring)."""
    import torch

    stats: dict[str, AcceptanceStats] = {}
    draft.eval()
    for b0 in range(0, len(seqs), batch_size):
        batch = list(seqs[b0 : b0 + batch_size])
        ids, att, lm = collate(batch, seq_len, pad_id)
        ids, att = ids.to(device), att.to(device)
        with torch.no_grad(), bf16_autocast(device, autocast):
            h = final_hidden(draft, ids, att)
            pred = (h @ draft.lm_head.weight.to(h.dtype).T).argmax(-1).cpu()
        for r, s in enumerate(batch):
            pos = torch.nonzero(lm[r]).squeeze(-1)
            nxt = ids[r, pos + 1].cpu()
            # match index 0 = the first continuation token, predicted from the last prompt token.
            match = (pred[r, pos] == nxt).numpy()
            for cat in (s.category, "all"):
                st = stats.setdefault(cat, AcceptanceStats())
                st.positions += len(match)
                st.agree += int(match.sum())
                for k in K_REPORT:
                    steps, em = simulate_greedy(match, k)
                    st.steps[k] += steps
                    st.emitted[k] += em
    draft.train()
    return stats


def format_report(
    rows: dict[str, dict[str, AcceptanceStats]], ks: Sequence[int] = (1, 2, 4, 8)
) -> str:
    """A plain-text table: per model and category, agreement and tau at ``ks``."""
    head = f"{'draft':<16}{'category':<12}{'positions':>10}{'agree':>8}" + "".join(
        f"{'tau@' + str(k):>8}" for k in ks
    )
    lines = [head, "-" * len(head)]
    for model, per in rows.items():
        for cat in sorted(per, key=lambda c: (c == "all", c)):
            st = per[cat]
            lines.append(
                f"{model:<16}{cat:<12}{st.positions:>10}{st.agreement:>8.3f}"
                + "".join(f"{st.tau(k):>8.3f}" for k in ks)
            )
    return "\n".join(lines)
