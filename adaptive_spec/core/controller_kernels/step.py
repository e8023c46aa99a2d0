"""The per-step path: one compiled call per decision and one per observation.

Inside an engine every call pays for caches that the forward pass left cold (tens of microseconds
for a call's first touch of NumPy's or Numba's dispatch code), so a decision is one
:func:`decide_step` (posterior means, scoring, allocation, the baseline's decision and the safety
rule's terms) and an observation one :func:`observe_step` (the decision's baseline drafts
registered, acceptance labels, histories, the safety tracker), each fed by a single conversion of
the caller's Python lists. The two return scalars only: the decision's per-request arrays stay in a
:class:`StepBuffers` the controller keeps, which the observation reads (returning an array costs a
few microseconds of boxing with cold caches, taking one about one).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .learning import learn_into, posterior_mean
from .records import (
    Batch,
    CellLayout,
    Decided,
    Learning,
    Objective,
    Observation,
    Offers,
    Scored,
    StepArrays,
    Tracked,
)
from .scoring import allocate_base, drain_gains, guard_terms, mixed_curve, score_into
from .tracking import (
    records_complete,
    records_open,
    records_resolve,
    register_baseline,
    tracker_commit,
    tracker_resolve,
)

# Columns of StepBuffers.ints after avail, match and cells ([0, 3 P)), from 3 P on.
_CHOICE, _KB, _PLAYED, _KS, _POS, _SLOTS = range(6)


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
    ``learned`` int64 [4, cap * P] receives :func:`learn_into`'s judged rows. :attr:`arrays` holds
    the five as the kernels take them. Capacity doubles as batches grow (:meth:`ensure`)."""

    def __init__(self, P: int, K: int) -> None:
        self.P, self.K, self.cap = int(P), int(K), 0
        c = 3 * self.P
        self.c_choice, self.c_kb, self.c_played = c + _CHOICE, c + _KB, c + _PLAYED
        self.c_ks, self.c_pos, self.c_slots = c + _KS, c + _POS, c + _SLOTS
        self.ensure(16)

    def ensure(self, n: int) -> None:
        """Room for ``n`` requests (the contents are per step: not kept when growing)."""
        if n <= self.cap:
            return
        cap = max(n, 2 * self.cap)
        P, K = self.P, self.K
        self.arrays = StepArrays(
            np.full((cap, P, K), -1, dtype=np.int64),
            np.zeros((cap, P, K)),
            np.full((cap, K), -np.inf),
            np.zeros((cap, 3 * P + 6), dtype=np.int64),
            np.zeros((4, cap * P), dtype=np.int64),
        )
        self.drafts, self.alpha, self.g, self.ints, self.learned = self.arrays
        self.cap = cap


@njit(cache=True)
def decided_rows(buf: StepArrays, N: int) -> Decided:
    """The decision that :func:`decide_step` wrote to the first ``N`` rows of ``buf`` (views)."""
    P = buf.drafts.shape[1]
    bi = buf.ints[:N]
    c0 = 3 * P
    return Decided(
        buf.drafts[:N],
        bi[:, :P],
        bi[:, 2 * P : c0],
        bi[:, c0 + _PLAYED],
        bi[:, c0 + _KS],
        bi[:, c0 + _KB],
        bi[:, c0 + _POS],
        bi[:, c0 + _SLOTS],
    )


@njit(cache=True)
def decide_step(
    batch: Batch,
    hist_b: np.ndarray,
    length: np.ndarray,
    layout: CellLayout,
    table: np.ndarray,
    counts: np.ndarray,
    lam: float,
    objective: Objective,
    kbase: int,
    bp: int,
    buf: StepArrays,
) -> tuple[int, int, float, int, bool, float, float, float, float, float, int]:
    """One decision's arithmetic in one call: :func:`~.scoring.score`, :func:`~.scoring.allocate`
    over the step-cost curve, the baseline's k per request and :func:`~.scoring.guard_terms`.

    Parameters
    ----------
    batch : Batch
        The requests (``N`` of them).
    hist_b : int64 [slots, P]
        History buckets per slot and proposer.
    length : int64 [slots]
        Tokens the safety tracker holds per slot (a slot out of step with its request's position is
        counted, for the caller to resynchronise).
    layout : CellLayout
    table : float64 [cells, K]
        The acceptance table to score with; an empty one (0 rows) stands for the posterior mean of
        ``counts`` (:func:`~.learning.posterior_mean`, computed here).
    counts : float64 [4, cells, K]
        The acceptance model's ``acc``, ``tri``, ``prior_a`` and ``prior_b``
        (:attr:`adaptive_spec.core.acceptance.AcceptanceModel.counts4`).
    lam : float
        :func:`~.scoring.score`'s multiplier (the last decision's).
    objective : Objective
        The step-cost curves at this batch size (:func:`~.scoring.mixed_curve`), the premium on
        speculation (the allocation prices it at ``1 + premium`` times the curve's increase over
        ``V = 0``; the predicted times returned stay the curve's) and the drain margin (the
        allocation counts only the requests of :func:`~.scoring.drain_gains`; -1: every request).
    kbase, bp : int
        The baseline's k at this batch size and its proposer (-1: none).
    buf : StepArrays
        Written: the first ``N`` rows of ``drafts``, ``alpha``, ``g`` and ``ints`` (scoring's
        ``drafts``, ``alpha``, ``g``, ``avail``, ``match``, ``cells`` and ``choice``, the baseline's
        ``kb``, the allocation's ``ks``, ``played`` (= ``choice``), ``pos`` and ``slots``).

    Returns
    -------
    tuple
        ``v_max``, ``V``, ``lam``, ``Vb``, ``same``, ``e_ctrl``, ``var_ctrl``, ``e_base``, ``t_pred``
        (s, at ``V``), ``tb_pred`` (s, at ``Vb``; NaN when ``Vb`` exceeds the offered tokens, for the
        caller to price) and the number of requests whose slot is out of step with their position.
    """
    parts, ints, slots = batch
    b_drafts, b_alpha, b_g, b_ints, _ = buf
    N = slots.shape[0]
    P, K = b_drafts.shape[1], b_drafts.shape[2]
    pos, cap, temp = ints[:N], ints[N : 2 * N], ints[2 * N : 3 * N]
    dlen, mlen = ints[3 * N : 3 * N + N * P], ints[3 * N + N * P : 3 * N + 2 * N * P]
    hist = np.empty((N, P), dtype=np.int64)
    n_stale = 0
    c0 = 3 * P
    for i in range(N):
        for p in range(P):
            hist[i, p] = hist_b[slots[i], p]
        if length[slots[i]] != pos[i]:
            n_stale += 1
        b_ints[i, c0 + _POS] = pos[i]
        b_ints[i, c0 + _SLOTS] = slots[i]
    if table.shape[0] == 0:
        table = posterior_mean(counts[0], counts[1], counts[2], counts[3])
    gains = np.empty((N, P, K))
    choice = b_ints[:N, c0 + _CHOICE]
    g = b_g[:N]
    scored = Scored(
        b_drafts[:N],
        b_ints[:N, :P],
        b_ints[:N, P : 2 * P],
        b_ints[:N, 2 * P : c0],
        b_alpha[:N],
        gains,
        choice,
        g,
    )
    v_max = score_into(Offers(parts, dlen, mlen, cap, temp, hist), layout, table, lam, scored)
    curve_g, curve_s, sampled, load, premium, margin = objective
    t_curve = mixed_curve(curve_g, curve_s, sampled, load, v_max + 1)
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
        b_ints[i, c0 + _KB] = kb[i]
        b_ints[i, c0 + _PLAYED] = choice[i]
        b_ints[i, c0 + _KS] = ks[i]
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
def observe_step(
    obs: Observation,
    N: int,
    step: int,
    bp: int,
    all_same: bool,
    buf: StepArrays,
    lrn: Learning,
    tracked: Tracked,
    n_p: int,
) -> tuple[int, int]:
    """One observation's arithmetic in one call: the decision's baseline drafts registered with the
    safety tracker (:func:`~.tracking.register_baseline` for decision number ``step``, with ``bp`` and
    ``all_same`` as it takes them; capacity for ``N`` more pending rows checked by the caller),
    :func:`~.learning.learn` on the decided rows that reported, their committed tokens appended to
    the safety tracker (:func:`~.tracking.tracker_commit`) and the pending baseline drafts they
    decide resolved (:func:`~.tracking.tracker_resolve`).

    Parameters
    ----------
    obs : Observation
        The reporting rows of the decision and their committed tokens, and the step's times.
    N : int
        The decision's requests: the first rows of ``buf`` that :func:`decide_step` wrote
        (:func:`decided_rows`).
    step, bp, all_same
        The decision's number, the baseline's proposer (-1: none) and whether the decision was the
        baseline's.
    buf : StepArrays
        The decision; :func:`~.learning.learn`'s judged rows go to its ``learned``
        (:func:`~.learning.learn_into`).
    lrn : Learning
        The acceptance counts and histories, updated in place.
    tracked : Tracked
        The safety tracker's arrays (``n_p`` pending rows), updated in place.

    The step's record (:func:`~.tracking.records_open`) is opened with the drafts registered; when
    ``obs.base_time`` (s, the baseline's time on this step) is not NaN, the record gets it, the run's
    tokens and time, and the tokens of the reporting rows that played the baseline's arm (NaN: the
    record is dropped, it could never count); the resolved drafts are counted in their records
    (:func:`~.tracking.records_resolve`) and the complete records closed into ``tracked.resolved``
    (:func:`~.tracking.records_complete`).

    Returns
    -------
    m : int
        Rows judged.
    n_p : int
        The new pending count.
    """
    dec = decided_rows(buf, N)
    committed, pending, records, resolved = tracked
    n_p, count, same = register_baseline(pending, n_p, step, dec, bp, all_same)
    records_open(records, step, count)
    ints, n, n_fin = obs.ints, obs.n, obs.n_fin
    rows, lens = ints[:n], ints[n : 2 * n]
    finished_rows, tok = ints[2 * n : 2 * n + n_fin], ints[2 * n + n_fin :]
    slots = dec.slots
    rs = np.empty(n, dtype=np.int64)
    base_same = 0.0
    for r in range(n):
        rs[r] = slots[rows[r]]
        if same[rows[r]]:
            base_same += lens[r]
    m = learn_into(rows, lens, tok, dec, lrn, buf.learned)
    if n:
        tracker_commit(committed, rs, lens, tok)
    if finished_rows.shape[0]:
        fin = np.zeros(committed.ring.shape[0], dtype=np.bool_)
        for r in range(finished_rows.shape[0]):
            fin[slots[finished_rows[r]]] = True
    else:
        fin = np.zeros(0, dtype=np.bool_)
    n_p, steps, emitted = tracker_resolve(committed, pending, n_p, fin)
    rec, rec_step = records.rec, records.step
    i = step % rec.shape[0]
    if np.isnan(obs.base_time):  # no valid step time: the record could never count
        rec_step[i] = -1
    else:
        rec[i, 0] += base_same
        rec[i, 2] = obs.base_time
        rec[i, 3] = obs.run_tokens
        rec[i, 4] = obs.run_time
    records_resolve(records, steps, emitted)
    records_complete(records, resolved)
    return m, n_p
