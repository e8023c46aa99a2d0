"""Greedy identity, as this project defines it (``docs/correctness.md``).

In float32 greedy output with speculation must equal no speculation token for token. In bf16 vLLM's CPU
build is not batch-invariant (verifying k + 1 positions or batching changes matmul shapes and rounding),
so two runs may part at a numeric near-tie: the comparison accepts a divergence only when, at the first
divergent position, the no-speculation run's top-2 logprob margin is within ``tolerance`` (0.25 fits the
measured bf16 rounding); a divergence with a clear margin is a violation (a bug).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_TOLERANCE = 0.25
# vLLM returns logprobs in float32, computed from bf16-rounded logits: a margin of exactly two bf16
# quanta of 0.125 reads 0.25000006. The comparison allows that representation error, nothing more.
_SLACK = 1e-6


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix), None if equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def top2_margin(logprobs_at: dict[int, Any] | None) -> float | None:
    """Top-1 minus top-2 logprob from one position's vLLM logprobs dict (None if unavailable)."""
    if not logprobs_at or len(logprobs_at) < 2:
        return None
    vals = sorted((lp.logprob for lp in logprobs_at.values()), reverse=True)
    return float(vals[0] - vals[1])


def compare_greedy(
    reference: Sequence[Any], candidate: Sequence[Any], tolerance: float = DEFAULT_TOLERANCE
) -> dict[str, Any]:
    """Compare two lists of vLLM ``RequestOutput`` (same prompts, same order).

    ``reference`` is the no-speculation run and should carry ``logprobs >= 2`` so near-ties can be told
    apart; without them every divergence counts as a violation.

    Returns
    -------
    dict
        ``total``, ``identical``, ``near_tie``, ``violations``, ``tolerance`` and ``details`` (index,
        position, margin) for each divergence.

    Raises
    ------
    ValueError
        If the two lists differ in length.
    """
    if len(reference) != len(candidate):
        raise ValueError(
            f"reference has {len(reference)} outputs, candidate {len(candidate)}: not the same prompts"
        )
    res: dict[str, Any] = {
        "total": len(reference),
        "identical": 0,
        "near_tie": 0,
        "violations": 0,
        "tolerance": tolerance,
        "details": [],
    }
    for i, (r, c) in enumerate(zip(reference, candidate, strict=True)):
        a, b = list(r.outputs[0].token_ids), list(c.outputs[0].token_ids)
        pos = first_divergence(a, b)
        if pos is None:
            res["identical"] += 1
            continue
        lps = r.outputs[0].logprobs
        margin = top2_margin(lps[pos]) if lps is not None and pos < len(lps) else None
        tie = margin is not None and margin <= tolerance + _SLACK
        res["near_tie" if tie else "violations"] += 1
        res["details"].append({"index": i, "position": pos, "margin": margin, "near_tie": tie})
    return res
