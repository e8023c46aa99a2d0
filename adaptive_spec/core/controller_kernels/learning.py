"""Learning: censored acceptance labels into discounted Beta counts, and each request's history.

Every offered draft of a decided request is scored against the tokens the target committed
(full-information updates for deterministic proposers whether chosen or not, cf. HedgeSpec /
"Not-a-Bandit", ICLR 2026): positions ``1..a`` accepted, position ``a + 1`` rejected if the draft
went on, later positions unknown (:mod:`adaptive_spec.core.acceptance`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .records import Decided, Learning


@njit(cache=True)
def add_counts(
    acc: np.ndarray,
    tri: np.ndarray,
    cells: np.ndarray,
    n_ones: np.ndarray,
    n_zero: np.ndarray,
    discount: float,
) -> None:
    """Discount every count once, then add censored labels (in place): row ``r`` has positions
    ``1..n_ones[r]`` accepted and ``n_zero[r]`` (0/1) rejected position after them, in cell
    ``cells[r]``. ``acc``, ``tri``: float64 [cells, K]."""
    K = acc.shape[1]
    if discount < 1.0:
        for c in range(acc.shape[0]):
            for j in range(K):
                acc[c, j] *= discount
                tri[c, j] *= discount
    for r in range(cells.shape[0]):
        c = cells[r]
        ones = min(n_ones[r], K)
        trials = min(ones + n_zero[r], K)
        for j in range(ones):
            acc[c, j] += 1.0
        for j in range(trials):
            tri[c, j] += 1.0


@njit(cache=True)
def posterior_mean(
    acc: np.ndarray, tri: np.ndarray, prior_a: np.ndarray, prior_b: np.ndarray
) -> np.ndarray:
    """Beta posterior mean of every cell and position, ``(acc + prior_a) / (tri + prior_a +
    prior_b)``: float64 [cells, K] from four C-contiguous float64 arrays of one shape whose last
    axis is K (:meth:`adaptive_spec.core.acceptance.AcceptanceModel.table`)."""
    K = acc.shape[-1]
    a, t, pa, pb = acc.ravel(), tri.ravel(), prior_a.ravel(), prior_b.ravel()
    out = np.empty(a.shape[0])
    for i in range(a.shape[0]):
        out[i] = (a[i] + pa[i]) / (t[i] + pa[i] + pb[i])
    return out.reshape((a.shape[0] // K, K))


@njit(cache=True)
def learn(
    rows: np.ndarray, lens: np.ndarray, tok: np.ndarray, dec: Decided, lrn: Learning
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Score every offered draft of the decided rows against the tokens the target committed, and
    learn from it (in place, only when something was judged): the acceptance counts
    (:func:`add_counts`) and each request's moving average of its per-position acceptance rate per
    proposer, with its history bucket.

    Parameters
    ----------
    rows : int64 [n]
        Decided rows that reported.
    lens, tok : int64 [n], int64 [sum(lens)]
        Their committed tokens, one row after another.
    dec : Decided
        The decision (its ``drafts``, ``avail``, ``cells`` and ``slots`` are read).
    lrn : Learning
        The counts and histories, updated in place.

    Returns
    -------
    row, proposer, n_ones, n_zero : int64 [m]
        The judged rows (for calibration reports).
    """
    out = np.empty((4, rows.shape[0] * dec.drafts.shape[1]), dtype=np.int64)
    m = learn_into(rows, lens, tok, dec, lrn, out)
    return out[0, :m], out[1, :m], out[2, :m], out[3, :m]


@njit(cache=True)
def learn_into(
    rows: np.ndarray,
    lens: np.ndarray,
    tok: np.ndarray,
    dec: Decided,
    lrn: Learning,
    out: np.ndarray,
) -> int:
    """:func:`learn` with the judged rows written to ``out`` int64 [4, >= n * P] (rows: row,
    proposer, n_ones, n_zero) instead of returned; returns how many there are."""
    drafts, avail, cells, slots = dec.drafts, dec.avail, dec.cells, dec.slots
    hist_rate, hist_n, hist_b, ema = lrn.hist_rate, lrn.hist_n, lrn.hist_b, lrn.ema
    n = rows.shape[0]
    P = drafts.shape[1]
    out_r, out_p, out_1, out_0 = out[0], out[1], out[2], out[3]
    m = 0
    start = 0
    for r in range(n):
        i = rows[r]
        L = lens[r]
        for p in range(P):
            a = avail[i, p]
            known = min(a, L)
            ones = 0
            while ones < known and drafts[i, p, ones] == tok[start + ones]:
                ones += 1
            zero = 1 if (ones < known and ones < a) else 0
            if ones + zero > 0:
                out_r[m] = i
                out_p[m] = p
                out_1[m] = ones
                out_0[m] = zero
                m += 1
        start += L
    if m == 0:  # nothing judged: no update, no discount (as a step without labels)
        return 0
    cl = np.empty(m, dtype=np.int64)
    for q in range(m):
        cl[q] = cells[out_r[q], out_p[q]]
    add_counts(lrn.acc, lrn.tri, cl, out_1[:m], out_0[:m], lrn.discount)
    for q in range(m):
        s = slots[out_r[q]]
        p = out_p[q]
        rate = out_1[q] / max(out_1[q] + out_0[q], 1)
        new = rate if hist_n[s, p] == 0 else (1.0 - ema) * hist_rate[s, p] + ema * rate
        hist_rate[s, p] = new
        hist_n[s, p] += 1.0
        hist_b[s, p] = 1 + (1 if new >= lrn.edge_low else 0) + (1 if new >= lrn.edge_high else 0)
    return m
