"""NumPy single-request versions of the kernels the proposers call on the CPU hot path.

Each function equals its PyTorch reference in :mod:`adaptive_spec.kernels` for one request
(``tests/test_proposers_fastpath.py`` proves it on random inputs); they exist because a torch
call costs tens of microseconds of dispatch per op, too much for a per-step, per-request path.
"""

from __future__ import annotations

import numpy as np

from .base import EMPTY


def ngram_match_np(
    tokens: np.ndarray, k: int, min_n: int, max_n: int, window: int
) -> tuple[np.ndarray, int]:
    """Prompt lookup for one request; equals ``kernels.ngram_match_reference`` row by row.

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
    h = tokens[-window:] if tokens.shape[0] > window else tokens
    lw = h.shape[0]
    if lw < 2 or max_n < 1:
        return EMPTY, 0
    # end positions e whose match length reaches j + 1, for growing j (survivors shrink)
    alive = np.flatnonzero(h[:-1] == h[-1])
    if alive.size == 0:
        return EMPTY, 0
    best = 1
    for j in range(1, min(max_n, lw)):
        c = alive[alive >= j]
        nxt = c[h[c - j] == h[lw - 1 - j]]
        if nxt.size == 0:
            break
        alive, best = nxt, j + 1
    if best < min_n:
        return EMPTY, 0
    if k <= 0:
        return EMPTY, best
    e_star = int(alive[-1])
    period = lw - 1 - e_star
    t = np.arange(k)
    return h[e_star + 1 + t % period].astype(np.int64, copy=False), best


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
