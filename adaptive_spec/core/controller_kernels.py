"""Compiled kernels of the adaptive controller's per-step path (Numba, CPU).

The controller's decision and its learning are a few dozen array operations over tiny arrays
(``N`` requests x ``P`` proposers x ``K`` positions). As NumPy calls they cost 1-10 us each in
dispatch alone, about 0.3-0.6 ms per step at batch 16 on a 2-core CPU, which is 1-3 % of a decode step
of the embedded default. Here each of them is one loop nest, compiled once per machine (``cache=True``:
the machine code is kept next to this file or in Numba's user cache directory).

Inside an engine every call also pays for caches that the forward pass left cold (tens of
microseconds for a call's first touch of NumPy's or Numba's dispatch code), so the per-step path
makes one call each way: a decision is one :func:`decide_step` (posterior means, scoring, allocation,
the baseline's decision and the safety rule's terms), an observation one :func:`observe_step` (the
decision's baseline drafts registered, acceptance labels, histories, the safety tracker), each fed
by a single conversion of the caller's Python lists. The two return scalars only: the decision's
per-request arrays stay in a :class:`StepBuffers` the controller keeps, which the observation reads
(returning an array costs a few microseconds of boxing with cold caches, taking one about one). The
smaller kernels they are built from stay callable on their own. :mod:`adaptive_spec.core.controller` and
:mod:`adaptive_spec.core.safety` document the quantities; every kernel's docstring gives its shapes and
dtypes. The kernels allocate only their outputs (or write into the buffers they are given) and
never raise for well-formed inputs (the callers build them).

Floating-point sums run in the order a sequential loop gives, so results can differ from NumPy's
pairwise sums in the last bits; decisions compare sums with margins far above that.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "StepBuffers",
    "add_counts",
    "allocate",
    "allocate_base",
    "decide_step",
    "drain_gains",
    "guard_add_resolved",
    "learn",
    "learn_into",
    "observe_step",
    "posterior_mean",
    "records_complete",
    "records_open",
    "records_resolve",
    "register_baseline",
    "score",
    "score_into",
    "tracker_add",
    "tracker_commit",
    "tracker_resolve",
]


@njit(cache=True)
def score(
    parts: np.ndarray,
    dlen: np.ndarray,
    mlen: np.ndarray,
    cap: np.ndarray,
    temp: np.ndarray,
    hist: np.ndarray,
    match_lut: np.ndarray,
    table: np.ndarray,
    lam: float,
    P: int,
    K: int,
    n_temp: int,
    n_hist: int,
    n_match: int,
):
    """Per request: every proposer's offered draft, its acceptance cell, its gains, and the proposer
    chosen by ``max_c E[tokens](c) - lam * c``.

    Parameters
    ----------
    parts : int64 [sum(dlen)]
        The offered drafts concatenated, row-major over (request i, proposer p).
    dlen, mlen : int64 [N * P]
        Offered draft lengths (each <= K) and match features (>= 0).
    cap : int64 [N]
        Remaining output budget per request (drafts are cut to ``cap - 1``, at most K).
    temp : int64 [N]
        Temperature bucket (0 greedy, 1 sampled).
    hist : int64 [N, P]
        History bucket per request and proposer.
    match_lut : int64 [P, 64]
        Match bucket of each proposer and match feature 0..63 (features above 63 count as 63).
    table : float64 [cells, K]
        Conditional acceptance per cell and position; cell
        ``((p * n_temp + temp) * n_hist + hist) * n_match + match``
        (:meth:`adaptive_spec.core.acceptance.AcceptanceModel.cell`).

    Returns
    -------
    drafts : int64 [N, P, K] (-1 padded); avail : int64 [N, P] (offered length after the budget);
    match, cells : int64 [N, P]; alpha : float64 [N, P, K]; gains : float64 [N, P, K]
    (``prod_{i<=j} alpha_i`` where offered, else 0); choice : int64 [N]; g : float64 [N, K] (the
    chosen proposer's gains, ``-inf`` where not offered); v_max : int (finite entries of ``g``).
    """
    N = cap.shape[0]
    drafts = np.empty((N, P, K), dtype=np.int64)
    avail = np.empty((N, P), dtype=np.int64)
    match = np.empty((N, P), dtype=np.int64)
    cells = np.empty((N, P), dtype=np.int64)
    alpha = np.empty((N, P, K))
    gains = np.empty((N, P, K))
    choice = np.empty(N, dtype=np.int64)
    g = np.empty((N, K))
    v_max = score_into(
        parts, dlen, mlen, cap, temp, hist, match_lut, table, lam, P, K, n_temp, n_hist, n_match,
        drafts, avail, match, cells, alpha, gains, choice, g,
    )  # fmt: skip
    return drafts, avail, match, cells, alpha, gains, choice, g, v_max


@njit(cache=True)
def score_into(
    parts: np.ndarray,
    dlen: np.ndarray,
    mlen: np.ndarray,
    cap: np.ndarray,
    temp: np.ndarray,
    hist: np.ndarray,
    match_lut: np.ndarray,
    table: np.ndarray,
    lam: float,
    P: int,
    K: int,
    n_temp: int,
    n_hist: int,
    n_match: int,
    drafts: np.ndarray,
    avail: np.ndarray,
    match: np.ndarray,
    cells: np.ndarray,
    alpha: np.ndarray,
    gains: np.ndarray,
    choice: np.ndarray,
    g: np.ndarray,
) -> int:
    """:func:`score` into caller-owned arrays (their first ``N`` rows; any strides): the per-step
    path writes into buffers it keeps, so no output array is allocated and returned. Returns
    ``v_max``."""
    N = cap.shape[0]
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
def allocate(g: np.ndarray, v_max: int, t_curve: np.ndarray):
    """The draft tokens of the batch that maximise predicted goodput ``(N + sum of the V best gains)
    / t(V)``, as a k per request, and the marginal value of a draft token there.

    ``g``: float64 [N, K], non-increasing along K, ``-inf`` where not offered; ``v_max``: its finite
    entries; ``t_curve``: float64 [>= v_max + 1], predicted step time (s) for V = 0..v_max. Returns
    ``(ks int64 [N], V, lam, goodput at V)``; ties keep the smaller V and, among equal gains, the
    earlier request."""
    return allocate_base(g, v_max, t_curve, float(g.shape[0]))


@njit(cache=True)
def allocate_base(g: np.ndarray, v_max: int, t_curve: np.ndarray, base: float):
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
):
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
        if ks[i] != kb[i] or (bp >= 0 and ks[i] > 0 and choice[i] != bp):
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
def posterior_mean(acc: np.ndarray, tri: np.ndarray, prior_a: np.ndarray, prior_b: np.ndarray):
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
    rows: np.ndarray,
    lens: np.ndarray,
    tok: np.ndarray,
    drafts: np.ndarray,
    avail: np.ndarray,
    cells: np.ndarray,
    slots: np.ndarray,
    acc: np.ndarray,
    tri: np.ndarray,
    discount: float,
    hist_rate: np.ndarray,
    hist_n: np.ndarray,
    hist_b: np.ndarray,
    ema: float,
    edge_low: float,
    edge_high: float,
):
    """Score every offered draft of the decided rows against the tokens the target committed, and
    learn from it (in place, only when something was judged): the acceptance counts
    (:func:`add_counts`) and each request's moving
    average of its per-position acceptance rate per proposer, with its history bucket.

    ``rows`` int64 [n]: decided rows that reported; ``lens`` int64 [n] and ``tok`` int64 [sum(lens)]:
    their committed tokens; ``drafts`` int64 [N, P, K], ``avail`` / ``cells`` int64 [N, P] and
    ``slots`` int64 [N] of the decision; ``hist_*`` [slots, P]. Returns the judged rows as
    ``(row, proposer, n_ones, n_zero)`` int64 arrays (for calibration reports)."""
    out = np.empty((4, rows.shape[0] * drafts.shape[1]), dtype=np.int64)
    m = learn_into(
        rows, lens, tok, drafts, avail, cells, slots, acc, tri, discount, hist_rate, hist_n, hist_b,
        ema, edge_low, edge_high, out,
    )  # fmt: skip
    return out[0, :m], out[1, :m], out[2, :m], out[3, :m]


@njit(cache=True)
def learn_into(
    rows: np.ndarray,
    lens: np.ndarray,
    tok: np.ndarray,
    drafts: np.ndarray,
    avail: np.ndarray,
    cells: np.ndarray,
    slots: np.ndarray,
    acc: np.ndarray,
    tri: np.ndarray,
    discount: float,
    hist_rate: np.ndarray,
    hist_n: np.ndarray,
    hist_b: np.ndarray,
    ema: float,
    edge_low: float,
    edge_high: float,
    out: np.ndarray,
) -> int:
    """:func:`learn` with the judged rows written to ``out`` int64 [4, >= n * P] (rows: row,
    proposer, n_ones, n_zero) instead of returned; returns how many there are."""
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
    add_counts(acc, tri, cl, out_1[:m], out_0[:m], discount)
    for q in range(m):
        s = slots[out_r[q]]
        p = out_p[q]
        rate = out_1[q] / max(out_1[q] + out_0[q], 1)
        new = rate if hist_n[s, p] == 0 else (1.0 - ema) * hist_rate[s, p] + ema * rate
        hist_rate[s, p] = new
        hist_n[s, p] += 1.0
        hist_b[s, p] = 1 + (1 if new >= edge_low else 0) + (1 if new >= edge_high else 0)
    return m


@njit(cache=True)
def tracker_add(
    p_slot: np.ndarray,
    p_pos: np.ndarray,
    p_k: np.ndarray,
    p_step: np.ndarray,
    p_draft: np.ndarray,
    n_p: int,
    step: int,
    slots: np.ndarray,
    pos: np.ndarray,
    base_drafts: np.ndarray,
    kb: np.ndarray,
    differ: np.ndarray,
) -> int:
    """Append the baseline's draft of every row with ``differ[i]`` to the pending arrays (capacity
    checked by the caller); ``base_drafts`` int64 [N, >= max kb]. Returns the new count."""
    K = p_draft.shape[1]
    for i in range(slots.shape[0]):
        if differ[i]:
            p_slot[n_p] = slots[i]
            p_pos[n_p] = pos[i]
            p_k[n_p] = kb[i]
            p_step[n_p] = step
            for j in range(K):
                p_draft[n_p, j] = base_drafts[i, j] if j < kb[i] else -1
            n_p += 1
    return n_p


@njit(cache=True)
def tracker_commit(
    ring: np.ndarray, length: np.ndarray, slots: np.ndarray, lens: np.ndarray, flat: np.ndarray
) -> None:
    """Append ``lens[i]`` committed tokens of ``flat`` (in order) to each slot's ring (in place)."""
    H = ring.shape[1]
    off = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        base = length[s]
        for c in range(lens[i]):
            ring[s, (base + c) % H] = flat[off + c]
        off += lens[i]
        length[s] = base + lens[i]


@njit(cache=True)
def tracker_resolve(
    ring: np.ndarray,
    length: np.ndarray,
    p_slot: np.ndarray,
    p_pos: np.ndarray,
    p_k: np.ndarray,
    p_step: np.ndarray,
    p_draft: np.ndarray,
    n_p: int,
    finished: np.ndarray,
):
    """Resolve the pending baseline drafts that the committed tokens decide (at the first mismatch,
    once ``k + 1`` tokens are known, or when the request finished; ``finished``: bool [slots] or
    empty), and compact the rest in place. Returns ``(new count, steps, emitted)``: the step of
    each resolved draft and the tokens the baseline would have committed with it."""
    H = ring.shape[1]
    steps = np.empty(n_p, dtype=np.int64)
    emitted = np.empty(n_p, dtype=np.int64)
    m = 0
    w = 0
    has_fin = finished.shape[0] > 0
    for q in range(n_p):
        s = p_slot[q]
        k = p_k[q]
        known = length[s] - p_pos[q]
        matched = 0
        missed = False
        while matched < k and matched < known:
            if ring[s, (p_pos[q] + matched) % H] != p_draft[q, matched]:
                missed = True
                break
            matched += 1
        done = missed or known >= k + 1 or (has_fin and finished[s])
        if done:
            steps[m] = p_step[q]
            emitted[m] = min(matched + 1, max(known, 1))
            m += 1
        else:
            if w != q:
                p_slot[w] = p_slot[q]
                p_pos[w] = p_pos[q]
                p_k[w] = p_k[q]
                p_step[w] = p_step[q]
                p_draft[w] = p_draft[q]
            w += 1
    return w, steps[:m], emitted[:m]


@njit(cache=True)
def guard_add_resolved(
    resolved: np.ndarray, base_tokens: float, base_time: float, run_tokens: float, run_time: float
) -> None:
    """Count one step whose baseline counterfactual is fully resolved into ``resolved`` float64 [4]
    (baseline tokens, baseline time, the run's tokens, the run's time; in place), unless a time is
    missing (NaN), infinite or the baseline's is not positive."""
    if np.isfinite(base_time) and base_time > 0 and np.isfinite(run_time):
        resolved[0] += base_tokens
        resolved[1] += base_time
        resolved[2] += run_tokens
        resolved[3] += run_time


@njit(cache=True)
def records_open(
    rec: np.ndarray, rec_step: np.ndarray, bounds: np.ndarray, step: int, count: int
) -> None:
    """Open the record of decision ``step`` with ``count`` unresolved baseline drafts (in place).

    ``rec`` float64 [R, 5]: per record [baseline tokens so far, unresolved drafts, baseline time,
    the run's tokens, the run's time] (times NaN until known); ``rec_step`` int64 [R]: the step a row
    holds (-1: free), row ``step % R``; ``bounds`` int64 [2]: the steps that may be open, ``[lo, hi)``.
    A record still open ``R`` steps later is dropped (its times never came)."""
    R = rec.shape[0]
    i = step % R
    rec_step[i] = step
    rec[i, 0] = 0.0
    rec[i, 1] = count
    rec[i, 2] = np.nan
    rec[i, 3] = 0.0
    rec[i, 4] = np.nan
    if step < bounds[0]:
        bounds[0] = step
    if step + 1 > bounds[1]:
        bounds[1] = step + 1
    if bounds[1] - bounds[0] > R:
        bounds[0] = bounds[1] - R


@njit(cache=True)
def records_resolve(
    rec: np.ndarray, rec_step: np.ndarray, steps: np.ndarray, emitted: np.ndarray
) -> None:
    """Count resolved baseline drafts (``steps`` / ``emitted`` int64 [m]: their decision and the
    tokens the baseline would have committed with them) in their records (:func:`records_open`)."""
    R = rec.shape[0]
    for q in range(steps.shape[0]):
        s = steps[q]
        i = s % R
        if rec_step[i] == s:
            rec[i, 0] += emitted[q]
            rec[i, 1] -= 1.0


@njit(cache=True)
def records_complete(
    rec: np.ndarray, rec_step: np.ndarray, bounds: np.ndarray, resolved: np.ndarray
):
    """Close the records whose drafts are all resolved and whose times are known, oldest first:
    each is counted into ``resolved`` (:func:`guard_add_resolved`) and its row freed (its values
    stay readable until reused). Returns the closed steps, int64."""
    R = rec.shape[0]
    lo, hi = bounds[0], bounds[1]
    done = np.empty(hi - lo, dtype=np.int64)
    m = 0
    new_lo = hi
    for s in range(lo, hi):
        i = s % R
        if rec_step[i] != s:
            continue
        if rec[i, 1] <= 0 and not np.isnan(rec[i, 2]):
            guard_add_resolved(resolved, rec[i, 0], rec[i, 2], rec[i, 3], rec[i, 4])
            rec_step[i] = -1
            done[m] = s
            m += 1
        elif new_lo == hi:
            new_lo = s
    bounds[0] = new_lo
    return done[:m]


@njit(cache=True)
def _mixed_curve(curve_g: np.ndarray, curve_s: np.ndarray, sampled: float, load: float, n: int):
    """``load * ((1 - sampled) * curve_g + sampled * curve_s)`` over V = 0..n-1 (the greedy part alone
    when ``sampled <= 0``, the sampled part alone when ``sampled >= 1``), as
    :meth:`adaptive_spec.core.cost_model.StepCostModel.curve` computes it."""
    t = np.empty(n)
    for v in range(n):
        if sampled <= 0.0:
            t[v] = load * curve_g[v]
        elif sampled >= 1.0:
            t[v] = load * curve_s[v]
        else:
            t[v] = load * ((1.0 - sampled) * curve_g[v] + sampled * curve_s[v])
    return t


class StepBuffers:
    """The per-step path's outputs, kept from one decision to its observation: :func:`decide_step`
    writes them and :func:`observe_step` reads them, so neither allocates, returns or takes one array
    per quantity (each costs microseconds of boxing when the caches are cold after a forward pass).

    For ``P`` proposers and ``K`` positions, rows ``0..N-1`` of: ``drafts`` int64 [cap, P, K] (offered
    drafts, -1 padded), ``alpha`` float64 [cap, P, K] (scored conditional acceptance), ``g`` float64
    [cap, K] (the chosen proposer's gains, ``-inf`` where not offered) and ``ints`` int64
    [cap, 3 P + 6] whose columns are ``avail`` [0, P), ``match`` [P, 2 P), ``cells`` [2 P, 3 P), then
    the scored ``choice``, the baseline's ``kb``, the ``played`` proposer, the played ``ks``, the
    requests' positions ``pos`` and their ``slots`` (column indices ``c_choice`` .. ``c_slots``).
    ``learned`` int64 [4, cap * P] receives :func:`learn_into`'s judged rows. Capacity doubles as
    batches grow (:meth:`ensure`)."""

    def __init__(self, P: int, K: int) -> None:
        self.P, self.K, self.cap = int(P), int(K), 0
        c = 3 * self.P
        self.c_choice, self.c_kb, self.c_played, self.c_ks, self.c_pos, self.c_slots = range(
            c, c + 6
        )
        self.ensure(16)

    def ensure(self, n: int) -> None:
        """Room for ``n`` requests (the contents are per step: not kept when growing)."""
        if n <= self.cap:
            return
        cap = max(n, 2 * self.cap)
        P, K = self.P, self.K
        self.drafts = np.full((cap, P, K), -1, dtype=np.int64)
        self.alpha = np.zeros((cap, P, K))
        self.g = np.full((cap, K), -np.inf)
        self.ints = np.zeros((cap, 3 * P + 6), dtype=np.int64)
        self.learned = np.zeros((4, cap * P), dtype=np.int64)
        self.cap = cap


@njit(cache=True)
def decide_step(
    parts: np.ndarray,
    ints: np.ndarray,
    slots: np.ndarray,
    hist_b: np.ndarray,
    match_lut: np.ndarray,
    table: np.ndarray,
    counts: np.ndarray,
    lam: float,
    P: int,
    K: int,
    n_temp: int,
    n_hist: int,
    n_match: int,
    curve_g: np.ndarray,
    curve_s: np.ndarray,
    sampled: float,
    load: float,
    kbase: int,
    bp: int,
    length: np.ndarray,
    premium: float,
    margin: int,
    b_drafts: np.ndarray,
    b_alpha: np.ndarray,
    b_g: np.ndarray,
    b_ints: np.ndarray,
):
    """One decision's arithmetic in one call: :func:`score`, :func:`allocate` over the step-cost
    curve, the baseline's k per request and :func:`guard_terms`.

    ``ints`` int64 [3 N + 2 N P]: the requests' output positions, budgets (``cap``) and temperature
    buckets (``temp``), then :func:`score`'s ``dlen`` and ``mlen``, concatenated (one conversion
    from the caller's lists); ``slots`` int64 [N] index ``hist_b`` int64 [slots, P] (history
    buckets) and ``length`` int64 [slots] (tokens the safety tracker holds per slot);
    ``curve_g`` / ``curve_s`` float64 [>= sum(dlen) + 1]: the cost table's greedy and sampled
    curves at this batch size, mixed by ``sampled`` and scaled by ``load`` (:func:`_mixed_curve`);
    ``kbase``: the baseline's k at this batch size, ``bp`` its proposer (-1: none); ``premium`` >= 0:
    the allocation prices speculation at ``1 + premium`` times the curve's increase over ``V = 0``
    (the predicted times returned stay the curve's); ``margin`` >= 0: the batch drains, and the
    allocation counts only the requests of :func:`drain_gains` (-1: every request). ``table`` float64 [cells, K] is :func:`score`'s
    acceptance table; an empty one (0 rows) stands for the posterior mean of ``counts`` float64
    [4, cells, K], the acceptance model's ``acc``, ``tri``, ``prior_a`` and ``prior_b``
    (:attr:`adaptive_spec.core.acceptance.AcceptanceModel.counts4`; :func:`posterior_mean`, computed
    here). The other arguments are :func:`score`'s.

    The per-request results go to the first ``N`` rows of a :class:`StepBuffers`' ``drafts``,
    ``alpha``, ``g`` and ``ints`` (``b_*``): :func:`score`'s ``drafts``, ``alpha``, ``g``,
    ``avail``, ``match``, ``cells`` and ``choice``, the baseline's ``kb``, the allocation's ``ks``,
    ``played`` (= ``choice``), ``pos`` and ``slots``. Returns ``v_max``, ``V``, ``lam``, ``Vb``,
    ``same``, ``e_ctrl``, ``var_ctrl``, ``e_base``, ``t_pred`` (s, at ``V``), ``tb_pred`` (s, at
    ``Vb``; NaN when ``Vb`` exceeds the offered tokens, for the caller to price) and the number of
    requests whose slot is out of step with ``pos`` (to resynchronise).
    """
    N = slots.shape[0]
    pos, cap, temp = ints[:N], ints[N : 2 * N], ints[2 * N : 3 * N]
    dlen, mlen = ints[3 * N : 3 * N + N * P], ints[3 * N + N * P : 3 * N + 2 * N * P]
    hist = np.empty((N, P), dtype=np.int64)
    n_stale = 0
    c0 = 3 * P  # StepBuffers.ints: choice, kb, played, ks, pos, slots
    for i in range(N):
        for p in range(P):
            hist[i, p] = hist_b[slots[i], p]
        if length[slots[i]] != pos[i]:
            n_stale += 1
        b_ints[i, c0 + 4] = pos[i]
        b_ints[i, c0 + 5] = slots[i]
    if table.shape[0] == 0:
        table = posterior_mean(counts[0], counts[1], counts[2], counts[3])
    gains = np.empty((N, P, K))
    choice = b_ints[:N, c0]
    g = b_g[:N]
    v_max = score_into(
        parts, dlen, mlen, cap, temp, hist, match_lut, table, lam, P, K, n_temp, n_hist, n_match,
        b_drafts[:N], b_ints[:N, :P], b_ints[:N, P : 2 * P], b_ints[:N, 2 * P : c0], b_alpha[:N],
        gains, choice, g,
    )  # fmt: skip
    t_curve = _mixed_curve(curve_g, curve_s, sampled, load, v_max + 1)
    t_alloc = t_curve
    if premium > 0.0:
        t_alloc = np.empty(v_max + 1)
        for v in range(v_max + 1):
            t_alloc[v] = t_curve[0] + (1.0 + premium) * (t_curve[v] - t_curve[0])
    if margin >= 0:
        g_alloc = np.empty((N, K))
        base = drain_gains(g, cap, margin, g_alloc)
        ks, V, lam_new, _ = allocate_base(g_alloc, v_max, t_alloc, base)
    else:
        ks, V, lam_new, _ = allocate_base(g, v_max, t_alloc, float(N))
    kb = np.zeros(N, dtype=np.int64)
    Vb = 0
    if bp >= 0:
        for i in range(N):
            kb[i] = min(kbase, b_ints[i, bp])
            Vb += kb[i]
    for i in range(N):
        b_ints[i, c0 + 1] = kb[i]
        b_ints[i, c0 + 2] = choice[i]
        b_ints[i, c0 + 3] = ks[i]
    same, e_ctrl, var_ctrl, e_base = guard_terms(g, gains, ks, kb, choice, bp)
    tb_pred = t_curve[Vb] if Vb <= v_max else np.nan
    return (
        v_max,
        V,
        lam_new,
        Vb,
        same,
        e_ctrl,
        var_ctrl,
        e_base,
        t_curve[V],
        tb_pred,
        n_stale,
    )


@njit(cache=True)
def register_baseline(
    p_slot: np.ndarray,
    p_pos: np.ndarray,
    p_k: np.ndarray,
    p_step: np.ndarray,
    p_draft: np.ndarray,
    n_p: int,
    step: int,
    slots: np.ndarray,
    pos: np.ndarray,
    drafts: np.ndarray,
    ks: np.ndarray,
    kb: np.ndarray,
    choice: np.ndarray,
    bp: int,
    all_same: bool,
):
    """The rows whose played arm differs from the baseline's (none when ``all_same``: the decision is
    the baseline's), and their baseline drafts appended to the pending arrays (:func:`tracker_add`;
    capacity for ``N`` more rows checked by the caller). ``drafts`` int64 [N, P, K] as from
    :func:`score`; ``ks`` / ``kb`` / ``choice`` int64 [N]: played k, baseline k, played proposer.
    Returns ``(new count, number registered, same bool [N])``, ``same`` the complement of
    ``differ``: the rows whose tokens are the baseline's."""
    N = ks.shape[0]
    differ = np.zeros(N, dtype=np.bool_)
    count = 0
    if not all_same:
        for i in range(N):
            d = ks[i] != kb[i] or (bp >= 0 and ks[i] > 0 and choice[i] != bp)
            differ[i] = d
            if d:
                count += 1
    if count:
        n_p = tracker_add(
            p_slot, p_pos, p_k, p_step, p_draft, n_p, step, slots, pos,
            drafts[:, max(bp, 0), :], kb, differ,
        )  # fmt: skip
    return n_p, count, ~differ


@njit(cache=True)
def observe_step(
    ints: np.ndarray,
    n: int,
    n_fin: int,
    N: int,
    b_drafts: np.ndarray,
    b_ints: np.ndarray,
    b_learned: np.ndarray,
    bp: int,
    all_same: bool,
    step: int,
    counts: np.ndarray,
    discount: float,
    hist_rate: np.ndarray,
    hist_n: np.ndarray,
    hist_b: np.ndarray,
    ema: float,
    edge_low: float,
    edge_high: float,
    ring: np.ndarray,
    length: np.ndarray,
    p_slot: np.ndarray,
    p_pos: np.ndarray,
    p_k: np.ndarray,
    p_step: np.ndarray,
    p_draft: np.ndarray,
    n_p: int,
    rec: np.ndarray,
    rec_step: np.ndarray,
    bounds: np.ndarray,
    resolved: np.ndarray,
    base_time: float,
    run_tokens: float,
    run_time: float,
):
    """One observation's arithmetic in one call: the decision's baseline drafts registered with the
    safety tracker (:func:`register_baseline` for decision number ``step``, with ``bp`` and
    ``all_same`` as it takes them; capacity for ``N`` more pending rows checked by the caller),
    :func:`learn` on the decided rows that reported, their committed tokens appended to the safety
    tracker (:func:`tracker_commit`) and the pending baseline drafts they decide resolved
    (:func:`tracker_resolve`).

    The decision's ``N`` requests are the first rows of the :class:`StepBuffers` that
    :func:`decide_step` wrote (``b_drafts``, ``b_ints``: drafts, avail, cells, played proposer,
    played k, baseline k, positions and slots). ``ints`` int64: ``rows`` [n], ``lens`` [n] (as for
    :func:`learn`), ``finished_rows`` [n_fin] (decided rows whose request finished) and ``tok``
    [sum(lens)], concatenated (one conversion from the caller's lists). ``counts`` float64
    [>= 2, cells, K]: the acceptance counts ``acc`` and ``tri`` (:func:`learn`'s), updated in place.

    The step's record (:func:`records_open`: ``rec``, ``rec_step``, ``bounds``) is opened with the
    drafts registered; when ``base_time`` (s, the baseline's time on this step) is not NaN, the
    record gets it, ``run_tokens`` and ``run_time`` (s), and the tokens of the reporting rows that
    played the baseline's arm (NaN: the record is dropped, it could never count); the resolved
    drafts are counted in their records (:func:`records_resolve`) and the complete records closed
    into ``resolved`` float64 [4] (:func:`records_complete`). :func:`learn`'s judged rows go to
    ``b_learned`` (:func:`learn_into`). Returns how many rows were judged and the new pending
    count."""
    P = b_drafts.shape[1]
    c0 = 3 * P  # StepBuffers.ints: choice, kb, played, ks, pos, slots
    drafts, avail, cells = b_drafts[:N], b_ints[:N, :P], b_ints[:N, 2 * P : c0]
    kb, choice, ks = b_ints[:N, c0 + 1], b_ints[:N, c0 + 2], b_ints[:N, c0 + 3]
    pos, slots = b_ints[:N, c0 + 4], b_ints[:N, c0 + 5]
    n_p, count, same = register_baseline(
        p_slot, p_pos, p_k, p_step, p_draft, n_p, step, slots, pos, drafts, ks, kb, choice, bp,
        all_same,
    )  # fmt: skip
    records_open(rec, rec_step, bounds, step, count)
    rows, lens = ints[:n], ints[n : 2 * n]
    finished_rows, tok = ints[2 * n : 2 * n + n_fin], ints[2 * n + n_fin :]
    rs = np.empty(n, dtype=np.int64)
    base_same = 0.0
    for r in range(n):
        rs[r] = slots[rows[r]]
        if same[rows[r]]:
            base_same += lens[r]
    m = learn_into(
        rows, lens, tok, drafts, avail, cells, slots, counts[0], counts[1], discount,
        hist_rate, hist_n, hist_b, ema, edge_low, edge_high, b_learned,
    )  # fmt: skip
    if n:
        tracker_commit(ring, length, rs, lens, tok)
    if finished_rows.shape[0]:
        fin = np.zeros(ring.shape[0], dtype=np.bool_)
        for r in range(finished_rows.shape[0]):
            fin[slots[finished_rows[r]]] = True
    else:
        fin = np.zeros(0, dtype=np.bool_)
    n_p, steps, emitted = tracker_resolve(
        ring, length, p_slot, p_pos, p_k, p_step, p_draft, n_p, fin
    )
    i = step % rec.shape[0]
    if np.isnan(base_time):  # no valid step time: the record could never count
        rec_step[i] = -1
    else:
        rec[i, 0] += base_same
        rec[i, 2] = base_time
        rec[i, 3] = run_tokens
        rec[i, 4] = run_time
    records_resolve(rec, rec_step, steps, emitted)
    records_complete(rec, rec_step, bounds, resolved)
    return m, n_p


_warm = False


def warm_up() -> None:
    """Load (or compile, on first use on a machine) every kernel now, with the argument types of the
    per-step path, so that no engine step pays for it: loading the cached machine code takes about
    0.3 s per process, compiling it about 10 s once per machine. Idempotent."""
    global _warm
    if _warm:
        return
    i64 = np.int64
    N, P, K = 2, 1, 2
    one = np.ones(1, dtype=i64)
    score(
        np.ones(2, dtype=i64),
        np.array([2, 0], dtype=i64),
        np.zeros(2, dtype=i64),
        np.full(2, 9, dtype=i64),
        np.zeros(2, dtype=i64),
        np.zeros((N, P), dtype=i64),
        np.zeros((P, 64), dtype=i64),
        np.full((8, K), 0.5),
        0.0,
        P,
        K,
        1,
        2,
        4,
    )
    g = np.array([[0.5, 0.25], [-np.inf, -np.inf]])
    ks, _, _, _ = allocate(g, 2, np.array([1.0, 1.1, 1.2]))
    guard_terms(g, np.zeros((N, P, K)), ks, ks, np.zeros(N, dtype=i64), 0)
    acc, tri = np.zeros((8, K)), np.zeros((8, K))
    add_counts(acc, tri, np.zeros(1, dtype=i64), one, one, 0.99)
    posterior_mean(np.zeros((1, 2, 4, 4, K)), *(np.ones((1, 2, 4, 4, K)) for _ in range(3)))
    learn(
        np.zeros(1, dtype=i64),
        one,
        one,
        np.ones((1, P, K), dtype=i64),
        np.ones((1, P), dtype=i64),
        np.zeros((1, P), dtype=i64),
        np.zeros(1, dtype=i64),
        acc,
        tri,
        0.99,
        np.zeros((1, P)),
        np.zeros((1, P)),
        np.zeros((1, P), dtype=i64),
        0.3,
        0.2,
        0.6,
    )
    ring, length = np.zeros((1, 8), dtype=i64), np.zeros(1, dtype=i64)
    pend = [np.zeros(2, dtype=i64) for _ in range(4)]
    p_draft = np.zeros((2, K), dtype=i64)
    n = tracker_add(
        *pend,
        p_draft,
        0,
        0,
        np.zeros(1, dtype=i64),
        np.zeros(1, dtype=i64),
        np.ones((1, K), dtype=i64),
        one,
        np.ones(1, dtype=np.bool_),
    )
    tracker_commit(ring, length, np.zeros(1, dtype=i64), one, one)
    _, steps, emitted = tracker_resolve(
        ring, length, *pend, p_draft, n, np.zeros(0, dtype=np.bool_)
    )
    rec, rec_step, bounds = np.zeros((8, 5)), np.full(8, -1, dtype=i64), np.zeros(2, dtype=i64)
    records_open(rec, rec_step, bounds, 0, 1)
    records_resolve(rec, rec_step, steps, emitted)
    records_complete(rec, rec_step, bounds, np.zeros(4))
    guard_add_resolved(np.zeros(4), 1.0, 0.1, 1.0, 0.1)
    # The fused per-step kernels, with the argument types the controller passes.
    slots, pos = np.arange(N, dtype=i64), np.zeros(N, dtype=i64)
    curve = np.array([1.0, 1.1, 1.2, 1.3, 1.4])
    buf = StepBuffers(P, K)
    counts = np.ones((4, 8, K))
    decide_step(
        np.ones(2, dtype=i64),
        np.array([0, 0, 9, 9, 0, 0, 2, 0, 0, 0], dtype=i64),
        slots,
        np.zeros((N, P), dtype=i64),
        np.zeros((P, 64), dtype=i64),
        np.full((8, K), 0.5),
        counts,
        0.0,
        P,
        K,
        1,
        2,
        4,
        curve,
        curve,
        0.5,
        1.0,
        1,
        0,
        np.zeros(N, dtype=i64),
        0.5,
        1,
        buf.drafts,
        buf.alpha,
        buf.g,
        buf.ints,
    )
    pend = [np.zeros(4, dtype=i64) for _ in range(4)]
    p_draft = np.zeros((4, K), dtype=i64)
    # The tracker's own registration (its Python API), with contiguous arrays.
    ks, kb, choice = np.ones(N, dtype=i64), np.zeros(N, dtype=i64), np.zeros(N, dtype=i64)
    drafts = np.ones((N, P, K), dtype=i64)
    n, _, _ = register_baseline(*pend, p_draft, 0, 0, slots, pos, drafts, ks, kb, choice, 0, False)
    register_baseline(*pend, p_draft, n, 1, slots, pos, drafts, ks, kb, choice, 0, True)
    ring, length = np.zeros((N, 8), dtype=i64), np.zeros(N, dtype=i64)
    observe_step(
        np.array([0, 1, 0, 1], dtype=i64),
        1,
        1,
        N,
        buf.drafts,
        buf.ints,
        buf.learned,
        0,
        False,
        2,
        counts,
        0.99,
        np.zeros((N, P)),
        np.zeros((N, P)),
        np.zeros((N, P), dtype=i64),
        0.3,
        0.2,
        0.6,
        ring,
        length,
        *pend,
        p_draft,
        n,
        np.zeros((8, 5)),
        np.full(8, -1, dtype=i64),
        np.zeros(2, dtype=i64),
        np.zeros(4),
        0.05,
        2.0,
        0.05,
    )
    _warm = True
