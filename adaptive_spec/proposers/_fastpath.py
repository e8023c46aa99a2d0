"""NumPy single-request versions of the kernels the proposers call on the CPU hot path.

Each function equals its PyTorch reference in :mod:`adaptive_spec.kernels` for one request
(``tests/test_proposers_fastpath.py`` proves it on random inputs); they exist because a torch
call costs tens of microseconds of dispatch per op, too much for a per-step, per-request path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .base import EMPTY

_NO_VOCAB_LIMIT = np.iinfo(np.int64).max


@njit(cache=True)
def ngram_draft(
    tokens: np.ndarray, k: int, min_n: int, max_n: int, window: int, vocab_size: int
) -> tuple[np.ndarray, int]:
    """Prompt lookup for one request, compiled (Numba): :func:`ngram_match_np`, with the draft cut
    before its first id outside ``[0, vocab_size)`` (what the proposer returns). ``tokens``: int64
    [n], C-contiguous. Returns ``(draft int64 [0..k], matched suffix length)``."""
    n_tok = tokens.shape[0]
    lo = n_tok - window if n_tok > window else 0
    lw = n_tok - lo
    empty = np.zeros(0, dtype=np.int64)
    if lw < 2 or max_n < 1:
        return empty, 0
    top = min(max_n, lw)
    last = tokens[n_tok - 1]
    best = 0
    e_star = -1
    for e in range(
        n_tok - 2, lo - 1, -1
    ):  # most recent first: a longer match must beat it strictly
        if tokens[e] != last:
            continue
        m = 1
        while m < top and e - m >= lo and tokens[e - m] == tokens[n_tok - 1 - m]:
            m += 1
        if m > best:
            best = m
            e_star = e
            if best == top:
                break
    if best < min_n:
        return empty, 0
    if k <= 0:
        return empty, best
    period = n_tok - 1 - e_star
    out = np.empty(k, dtype=np.int64)
    n_out = 0
    for t in range(k):  # what followed the match, copied with overlap (a period repeats)
        x = tokens[e_star + 1 + t % period]
        if x < 0 or x >= vocab_size:
            break
        out[t] = x
        n_out += 1
    return out[:n_out], best


@njit(cache=True)
def ngram_next_agrees(tokens: np.ndarray, n: int, window: int) -> bool:
    """Whether every earlier occurrence of the history's last ``n`` tokens within the last
    ``window`` tokens was followed by the same token, compiled (Numba). ``tokens``: int64 [m],
    C-contiguous; ``n`` >= 1 (a matched suffix length). False when the suffix does not occur.

    A suffix whose occurrences disagree on what came next is a weaker bet: on 32 mixed prompts at
    concurrency 4 the first n-gram draft token was accepted 0.40-0.52 of the time after such a
    match against 0.64-0.88 after one whose occurrences agree (greedy; 0.13-0.21 against
    0.38-0.73 at temperature 1). O(window * n)."""
    n_tok = tokens.shape[0]
    lo = n_tok - window if n_tok > window else 0
    if n < 1 or n_tok - lo < n + 1:
        return False
    found = False
    nxt = tokens[0]
    for e in range(n_tok - 2, lo + n - 2, -1):
        m = 0
        while m < n and tokens[e - m] == tokens[n_tok - 1 - m]:
            m += 1
        if m < n:
            continue
        if not found:
            found = True
            nxt = tokens[e + 1]
        elif tokens[e + 1] != nxt:
            return False
    return found


_ngram_warm = False


def warm_up_ngram() -> None:
    """Load (or compile, once per machine) :func:`ngram_draft` now rather than in an engine step."""
    global _ngram_warm
    if not _ngram_warm:
        ngram_draft(np.array([1, 2, 1, 2], dtype=np.int64), 2, 1, 2, 16, 10)
        ngram_next_agrees(np.array([1, 2, 1, 2], dtype=np.int64), 1, 16)
        _ngram_warm = True


def ngram_match_np(
    tokens: np.ndarray, k: int, min_n: int, max_n: int, window: int
) -> tuple[np.ndarray, int]:
    """Prompt lookup for one request; equals ``kernels.ngram_match_reference`` row by row.

    The scan is compiled (:func:`ngram_draft`): one request costs about a microsecond plus the
    scan, where the NumPy version it replaced cost 15-30 us of dispatch.

    Parameters
    ----------
    tokens : np.ndarray
        int64 [n] history.
    k : int
        Draft length cap (already cut to the budget).
    min_n, max_n, window : int
        As in :func:`adaptive_spec.kernels.ngram_match`.

    Returns
    -------
    draft : np.ndarray
        int64 [0..k].
    n : int
        Matched suffix length (0 if none).
    """
    return ngram_draft(
        np.ascontiguousarray(tokens, dtype=np.int64), k, min_n, max_n, window, _NO_VOCAB_LIMIT
    )


def jacobi_next_np(
    draft: np.ndarray, target_argmax: np.ndarray, accepted: int
) -> tuple[int, np.ndarray]:
    """One request's Jacobi step (``kernels.jacobi_step_reference``) from verification output.

    Returns the accepted prefix length a (leading matches of draft and target argmax, capped by
    ``accepted`` as reported by verification) and the next iterate ``target_argmax[a+1 : k+1]``.
    """
    k = min(draft.shape[0], target_argmax.shape[0] - 1)
    if k < 0:
        return 0, EMPTY
    neq = np.flatnonzero(draft[:k] != target_argmax[:k])
    a = int(neq[0]) if neq.size else k
    a = max(0, min(a, accepted, k))
    return a, target_argmax[a + 1 : k + 1].astype(np.int64, copy=False)


def lookahead_ngrams_np(trajectory: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """One request's ``kernels.lookahead_ngrams_reference``: [N-1, W] + [W] -> [W-N+1, N]."""
    levels, w = trajectory.shape
    n = levels + 1
    m = max(w - n + 1, 0)
    s = np.arange(m)
    cols = [trajectory[r, s + r] for r in range(levels)]
    cols.append(predictions[s + n - 1])
    grams = np.stack(cols, axis=-1) if m else np.zeros((0, n), dtype=np.int64)
    bad = (grams < 0).any(axis=-1)
    grams = grams.astype(np.int64, copy=True)
    grams[bad] = -1
    return grams


def pool_update_np(pool: np.ndarray, ptr: int, ngrams: np.ndarray) -> int:
    """One request's ``kernels.lookahead_pool_update_reference`` (in place); returns the new ptr."""
    c = pool.shape[0]
    for ng in ngrams:
        if (ng < 0).any():
            continue
        if (pool == ng).all(axis=1).any():
            continue
        pool[ptr % c] = ng
        ptr += 1
    return ptr


def pool_lookup_np(pool: np.ndarray, ptr: int, key: int) -> np.ndarray | None:
    """One request's ``kernels.lookahead_pool_lookup``: continuation of the newest n-gram keyed
    ``key`` (None when there is none)."""
    if key < 0:
        return None
    c = pool.shape[0]
    hits = np.flatnonzero(pool[:, 0] == key)
    if hits.size == 0:
        return None
    age = (ptr - 1 - hits) % c
    return pool[hits[int(np.argmin(age))], 1:]
