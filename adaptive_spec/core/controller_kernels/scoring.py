"""Scoring and allocation: each request's proposer and gains, and the batch's draft tokens.

The allocation is SmartSpec's goodput objective (Liu et al., "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput", 2024) over a measured step-cost curve: the batch takes
the prefix of its ``V`` best gains that maximises ``(N + sum of the V best gains) / t(V)``
(:mod:`adaptive_spec.core.controller` documents the quantities).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .records import CellLayout, Offers, Scored
from .tracking import differs


@njit(cache=True)
def score(offers: Offers, layout: CellLayout, table: np.ndarray, lam: float) -> tuple[Scored, int]:
    """Per request: every proposer's offered draft, its acceptance cell, its gains, and the proposer
    chosen by ``max_c E[tokens](c) - lam * c``.

    Parameters
    ----------
    offers : Offers
        The batch's drafts and features (``N`` requests, ``P`` proposers).
    layout : CellLayout
        The acceptance cells (``P`` rows of ``match_lut``).
    table : float64 [cells, K]
        Conditional acceptance per cell and position.
    lam : float
        Tokens per draft token: the marginal value of a draft token at the last allocation.

    Returns
    -------
    scored : Scored
        The per-request results (``gains`` 0 and ``g`` ``-inf`` where not offered).
    v_max : int
        Finite entries of ``scored.g``.
    """
    N = offers.cap.shape[0]
    P = layout.match_lut.shape[0]
    K = table.shape[1]
    out = Scored(
        np.empty((N, P, K), dtype=np.int64),
        np.empty((N, P), dtype=np.int64),
        np.empty((N, P), dtype=np.int64),
        np.empty((N, P), dtype=np.int64),
        np.empty((N, P, K)),
        np.empty((N, P, K)),
        np.empty(N, dtype=np.int64),
        np.empty((N, K)),
    )
    v_max = score_into(offers, layout, table, lam, out)
    return out, v_max


@njit(cache=True)
def score_into(
    offers: Offers, layout: CellLayout, table: np.ndarray, lam: float, out: Scored
) -> int:
    """:func:`score` into caller-owned arrays (their first ``N`` rows; any strides): the per-step
    path writes into buffers it keeps, so no output array is allocated and returned. Returns
    ``v_max``."""
    parts, dlen, mlen, cap, temp, hist = offers
    match_lut, n_temp, n_hist, n_match = layout
    drafts, avail, match, cells, alpha, gains, choice, g = out
    N = cap.shape[0]
    P = match_lut.shape[0]
    K = table.shape[1]
    v_max = 0
    off = 0
    for i in range(N):
        c = min(max(cap[i] - 1, 0), K)
        best = -np.inf
        bp = 0
        for p in range(P):
            n = dlen[i * P + p]
            for j in range(K):
                drafts[i, p, j] = parts[off + j] if j < n else -1
            off += n
            a = min(n, c)
            avail[i, p] = a
            m = match_lut[p, min(max(mlen[i * P + p], 0), 63)]
            match[i, p] = m
            cell = ((p * n_temp + temp[i]) * n_hist + hist[i, p]) * n_match + m
            cells[i, p] = cell
            prod = 1.0
            cum = 0.0
            vbest = -np.inf
            for j in range(K):
                al = table[cell, j]
                alpha[i, p, j] = al
                prod *= al
                if j < a:
                    gains[i, p, j] = prod
                    cum += prod
                    val = cum - lam * (j + 1)
                    if val > vbest:
                        vbest = val
                else:
                    gains[i, p, j] = 0.0
            if vbest > best:
                best = vbest
                bp = p
        choice[i] = bp
        for j in range(K):
            if j < avail[i, bp]:
                g[i, j] = gains[i, bp, j]
                v_max += 1
            else:
                g[i, j] = -np.inf
    return v_max


@njit(cache=True)
def allocate(
    g: np.ndarray, v_max: int, t_curve: np.ndarray
) -> tuple[np.ndarray, int, float, float]:
    """The draft tokens of the batch that maximise predicted goodput ``(N + sum of the V best gains)
    / t(V)``, as a k per request, and the marginal value of a draft token there.

    ``g``: float64 [N, K], non-increasing along K, ``-inf`` where not offered; ``v_max``: its finite
    entries; ``t_curve``: float64 [>= v_max + 1], predicted step time (s) for V = 0..v_max. Returns
    ``(ks int64 [N], V, lam, goodput at V)``; ties keep the smaller V and, among equal gains, the
    earlier request."""
    return allocate_base(g, v_max, t_curve, float(g.shape[0]))


@njit(cache=True)
def allocate_base(
    g: np.ndarray, v_max: int, t_curve: np.ndarray, base: float
) -> tuple[np.ndarray, int, float, float]:
    """:func:`allocate` with ``base`` in place of ``N``: the tokens the step commits without drafts
    that the objective counts (:func:`drain_gains`)."""
    N, K = g.shape
    ks = np.zeros(N, dtype=np.int64)
    if v_max == 0:
        return ks, 0, 0.0, base / t_curve[0]
    flat = -g.ravel()
    order = np.argsort(flat, kind="mergesort")
    c = 0.0
    best = base / t_curve[0]
    V = 0
    for v in range(1, v_max + 1):
        gain = -flat[order[v - 1]]
        if gain == -np.inf:
            break
        c += gain
        gp = (base + c) / t_curve[v]
        if gp > best:
            best = gp
            V = v
    for v in range(V):
        ks[order[v] // K] += 1
    nxt = min(V + 1, v_max)
    dt = (t_curve[nxt] - t_curve[V]) / max(nxt - V, 1) if nxt > V else t_curve[V] * 0.01
    lam = best * max(dt, 0.0)
    return ks, V, lam, best


@njit(cache=True)
def drain_gains(g: np.ndarray, cap: np.ndarray, margin: int, out: np.ndarray) -> float:
    """The gains that count while a batch drains (no request waits): the run ends when the request
    with the largest remaining budget does, so only the requests within ``margin`` tokens of that
    budget (``cap`` int64 [N], tokens each may still emit) keep their gains; the others' rows of
    ``out`` (float64 [N, K], written) are ``-inf``. Returns how many requests count (the objective's
    base in :func:`allocate_base`)."""
    N, K = g.shape
    rmax = 0
    for i in range(N):
        if cap[i] > rmax:
            rmax = cap[i]
    base = 0.0
    for i in range(N):
        keep = cap[i] >= rmax - margin
        if keep:
            base += 1.0
        for j in range(K):
            out[i, j] = g[i, j] if keep else -np.inf
    return base


@njit(cache=True)
def guard_terms(
    g: np.ndarray,
    gains: np.ndarray,
    ks: np.ndarray,
    kb: np.ndarray,
    choice: np.ndarray,
    bp: int,
) -> tuple[bool, float, float, float]:
    """What the safety rule weighs for one decision: whether it equals the baseline's, the expected
    tokens of both and the variance of the decision's.

    ``g`` float64 [N, K] and ``gains`` float64 [N, P, K] as from :func:`score`; ``ks`` / ``kb`` int64
    [N]: the decision's and the baseline's k; ``bp``: the baseline's proposer (-1: none). Returns
    ``(same, e_ctrl, var_ctrl, e_base)``: tokens counted as ``N`` plus the sum of accepted-token
    probabilities."""
    N = ks.shape[0]
    same = True
    e_ctrl = float(N)
    var = 0.0
    e_base = float(N)
    for i in range(N):
        if differs(ks[i], kb[i], choice[i], bp):
            same = False
        for j in range(ks[i]):
            x = g[i, j]
            e_ctrl += x
            var += x * (1.0 - x)
        if bp >= 0:
            for j in range(kb[i]):
                e_base += gains[i, bp, j]
    return same, e_ctrl, var, e_base


@njit(cache=True)
def mixed_curve(
    curve_g: np.ndarray, curve_s: np.ndarray, sampled: float, load: float, n: int
) -> np.ndarray:
    """``load * ((1 - sampled) * curve_g + sampled * curve_s)`` over V = 0..n-1 (the greedy part alone
    when ``sampled <= 0``, the sampled part alone when ``sampled >= 1``), as
    :meth:`adaptive_spec.core.cost_model.StepCostModel.curve` computes it: float64 [n], seconds."""
    t = np.empty(n)
    for v in range(n):
        if sampled <= 0.0:
            t[v] = load * curve_g[v]
        elif sampled >= 1.0:
            t[v] = load * curve_s[v]
        else:
            t[v] = load * ((1.0 - sampled) * curve_g[v] + sampled * curve_s[v])
    return t
