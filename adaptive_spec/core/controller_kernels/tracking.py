"""The safety rule's bookkeeping: the baseline's counterfactual drafts and the per-decision records.

A decision registers the baseline's draft of every request whose played arm differs from it; the
tokens committed afterwards resolve it (at its first mismatch, once ``k + 1`` tokens are known, or
when the request finishes), and a decision's record is complete once all its drafts are resolved and
its step time is known (:mod:`adaptive_spec.core.safety` documents the rule, after Wu et al.,
"Conservative Bandits", ICML 2016).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .records import Committed, Decided, Pending, Records


@njit(cache=True)
def differs(k: int, kb: int, choice: int, bp: int) -> bool:
    """Whether a request's played arm (``k`` tokens of proposer ``choice``) differs from the
    baseline's (``kb`` tokens of proposer ``bp``, -1: none)."""
    return k != kb or (bp >= 0 and k > 0 and choice != bp)


@njit(cache=True)
def tracker_add(
    pending: Pending,
    n_p: int,
    step: int,
    slots: np.ndarray,
    pos: np.ndarray,
    base_drafts: np.ndarray,
    kb: np.ndarray,
    register: np.ndarray,
) -> int:
    """Append the baseline's draft of every row with ``register[i]`` (bool [N]) to the first
    ``n_p`` pending rows (capacity checked by the caller), made at decision ``step``: ``slots`` /
    ``pos`` / ``kb`` int64 [N], ``base_drafts`` int64 [N, >= max kb]. Returns the new count."""
    K = pending.draft.shape[1]
    for i in range(slots.shape[0]):
        if register[i]:
            pending.slot[n_p] = slots[i]
            pending.pos[n_p] = pos[i]
            pending.k[n_p] = kb[i]
            pending.step[n_p] = step
            for j in range(K):
                pending.draft[n_p, j] = base_drafts[i, j] if j < kb[i] else -1
            n_p += 1
    return n_p


@njit(cache=True)
def register_baseline(
    pending: Pending, n_p: int, step: int, dec: Decided, bp: int, all_same: bool
) -> tuple[int, int, np.ndarray]:
    """The rows whose played arm differs from the baseline's (none when ``all_same``: the decision is
    the baseline's), and their baseline drafts appended to the pending rows (:func:`tracker_add`;
    capacity for ``N`` more rows checked by the caller). ``dec``: the decision (its ``drafts`` of
    proposer ``bp`` are the baseline's). Returns ``(new count, number registered, same bool [N])``,
    ``same`` the rows whose tokens are the baseline's."""
    ks, kb, choice = dec.ks, dec.kb, dec.choice
    N = ks.shape[0]
    differ = np.zeros(N, dtype=np.bool_)
    count = 0
    if not all_same:
        for i in range(N):
            d = differs(ks[i], kb[i], choice[i], bp)
            differ[i] = d
            if d:
                count += 1
    if count:
        base_drafts = dec.drafts[:, max(bp, 0), :]
        n_p = tracker_add(pending, n_p, step, dec.slots, dec.pos, base_drafts, kb, differ)
    return n_p, count, ~differ


@njit(cache=True)
def tracker_commit(
    committed: Committed, slots: np.ndarray, lens: np.ndarray, flat: np.ndarray
) -> None:
    """Append ``lens[i]`` committed tokens of ``flat`` (in order) to each slot's ring (in place):
    ``slots`` / ``lens`` int64 [n], ``flat`` int64 [sum(lens)]."""
    ring, length = committed
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
    committed: Committed, pending: Pending, n_p: int, finished: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray]:
    """Resolve the first ``n_p`` pending baseline drafts that the committed tokens decide (at the
    first mismatch, once ``k + 1`` tokens are known, or when the request finished; ``finished``:
    bool [slots] or empty), and compact the rest in place. Returns ``(new count, steps, emitted)``:
    the decision of each resolved draft and the tokens the baseline would have committed with it
    (int64 [m] each)."""
    ring, length = committed
    p_slot, p_pos, p_k, p_step, p_draft = pending
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
def records_open(records: Records, step: int, count: int) -> None:
    """Open the record of decision ``step`` with ``count`` unresolved baseline drafts (in place; the
    times NaN until known). A record still open ``R`` decisions later is dropped (its times never
    came)."""
    rec, rec_step, bounds = records
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
def records_resolve(records: Records, steps: np.ndarray, emitted: np.ndarray) -> None:
    """Count resolved baseline drafts (``steps`` / ``emitted`` int64 [m]: their decision and the
    tokens the baseline would have committed with them) in their records (:func:`records_open`)."""
    rec, rec_step, _ = records
    R = rec.shape[0]
    for q in range(steps.shape[0]):
        s = steps[q]
        i = s % R
        if rec_step[i] == s:
            rec[i, 0] += emitted[q]
            rec[i, 1] -= 1.0


@njit(cache=True)
def records_complete(records: Records, resolved: np.ndarray) -> np.ndarray:
    """Close the records whose drafts are all resolved and whose times are known, oldest first:
    each is counted into ``resolved`` (:func:`guard_add_resolved`) and its row freed (its values
    stay readable until reused). Returns the closed decisions, int64."""
    rec, rec_step, bounds = records
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
