"""The records the compiled kernels take: small :class:`typing.NamedTuple` groups of arrays.

Numba passes a named tuple of arrays and scalars to a compiled function in nopython mode as one
argument, and its dispatcher fingerprints it in C like a plain array (no Python-level type inference
per call), so a kernel takes a few records instead of dozens of positional arrays at no cost per
step. A record built inside a kernel from slices of a caller's buffers holds non-contiguous arrays;
the kernels it is handed to are compiled for that layout too.

For ``N`` requests, ``P`` proposers, ``K`` draft positions (the engine's ``num_speculative_tokens``),
``S`` request slots and ``C`` acceptance cells. Every integer array is int64, every real one float64.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class CellLayout(NamedTuple):
    """How a request's context maps to its acceptance cell
    (:meth:`adaptive_spec.core.acceptance.AcceptanceModel.cell`): cell
    ``((p * n_temp + temp) * n_hist + hist) * n_match + match``."""

    match_lut: np.ndarray  # int64 [P, 64]: match bucket of each proposer and match feature 0..63
    n_temp: int  # temperature buckets
    n_hist: int  # history buckets
    n_match: int  # match buckets


class Offers(NamedTuple):
    """The batch's offered drafts and per-request features, as scoring reads them."""

    parts: np.ndarray  # int64 [sum(dlen)]: the drafts, row-major over (request, proposer)
    dlen: np.ndarray  # int64 [N * P]: offered draft lengths (may exceed K: only K are read)
    mlen: np.ndarray  # int64 [N * P]: match features (>= 0; above 63 count as 63)
    cap: np.ndarray  # int64 [N]: remaining output budget (drafts are cut to cap - 1, at most K)
    temp: np.ndarray  # int64 [N]: temperature bucket (0 greedy, 1 sampled)
    hist: np.ndarray  # int64 [N, P]: history bucket per request and proposer


class Scored(NamedTuple):
    """Scoring's per-request results (:func:`~adaptive_spec.core.controller_kernels.scoring.score`)."""

    drafts: np.ndarray  # int64 [N, P, K]: offered drafts, -1 padded
    avail: np.ndarray  # int64 [N, P]: offered length after the budget
    match: np.ndarray  # int64 [N, P]: match bucket
    cells: np.ndarray  # int64 [N, P]: acceptance cell
    alpha: np.ndarray  # float64 [N, P, K]: conditional acceptance of each position
    gains: np.ndarray  # float64 [N, P, K]: prod_{i <= j} alpha_i where offered, else 0
    choice: np.ndarray  # int64 [N]: the proposer maximising max_c E[tokens](c) - lam * c
    g: np.ndarray  # float64 [N, K]: the chosen proposer's gains, -inf where not offered


class Learning(NamedTuple):
    """What learning updates in place: the acceptance counts and each slot's acceptance history."""

    acc: np.ndarray  # float64 [C, K]: discounted accepted counts
    tri: np.ndarray  # float64 [C, K]: discounted trials
    discount: float  # forgetting of every count per step that judged something, in (0, 1]
    hist_rate: np.ndarray  # float64 [S, P]: moving average of the per-position acceptance rate
    hist_n: np.ndarray  # float64 [S, P]: updates of hist_rate
    hist_b: np.ndarray  # int64 [S, P]: history bucket (1 + rate >= edge_low + rate >= edge_high)
    ema: float  # weight of the newest step in hist_rate, in (0, 1]
    edge_low: float  # history bucket edges (adaptive_spec.core.acceptance.HIST_EDGES)
    edge_high: float


class Decided(NamedTuple):
    """One decision's per-request arrays that learning and the safety tracker read."""

    drafts: np.ndarray  # int64 [N, P, K]: offered drafts, -1 padded
    avail: np.ndarray  # int64 [N, P]: offered length after the budget
    cells: np.ndarray  # int64 [N, P]: acceptance cell
    choice: np.ndarray  # int64 [N]: the played proposer (-1: none)
    ks: np.ndarray  # int64 [N]: the played k
    kb: np.ndarray  # int64 [N]: the baseline's k
    pos: np.ndarray  # int64 [N]: output position (tokens emitted before the step)
    slots: np.ndarray  # int64 [N]: the request's slot


class Pending(NamedTuple):
    """The safety tracker's pending baseline drafts: the first ``n_pending`` rows (capacity ``R``)."""

    slot: np.ndarray  # int64 [R]: the request's slot
    pos: np.ndarray  # int64 [R]: output position the draft starts at
    k: np.ndarray  # int64 [R]: draft length
    step: np.ndarray  # int64 [R]: the decision that registered it
    draft: np.ndarray  # int64 [R, K]: the baseline's draft, -1 padded


class Committed(NamedTuple):
    """The tokens committed per slot, the last ``H`` of each kept in a ring."""

    ring: np.ndarray  # int64 [S, H]: token at output position n in column n % H
    length: np.ndarray  # int64 [S]: tokens committed (absolute output position)


class Records(NamedTuple):
    """Per decision, row ``step % R``: the safety rule's record of the step
    (:func:`~adaptive_spec.core.controller_kernels.tracking.records_open`)."""

    rec: np.ndarray  # float64 [R, 5]: baseline tokens, unresolved drafts, baseline time (s),
    #                  the run's tokens, the run's time (s); times NaN until known
    step: np.ndarray  # int64 [R]: the decision a row holds (-1: free)
    bounds: np.ndarray  # int64 [2]: the decisions that may be open, [lo, hi)


class Tracked(NamedTuple):
    """Everything of the safety tracker (:class:`adaptive_spec.core.safety.BaselineTracker`) that an
    observation updates in place."""

    committed: Committed
    pending: Pending
    records: Records
    resolved: np.ndarray  # float64 [4]: the guard's resolved totals (guard_add_resolved)


class StepArrays(NamedTuple):
    """The per-step buffers (:class:`~adaptive_spec.core.controller_kernels.step.StepBuffers`), rows
    ``0..N-1`` per step, capacity ``M >= N``."""

    drafts: np.ndarray  # int64 [M, P, K]: offered drafts, -1 padded
    alpha: np.ndarray  # float64 [M, P, K]: scored conditional acceptance
    g: np.ndarray  # float64 [M, K]: the chosen proposer's gains, -inf where not offered
    ints: np.ndarray  # int64 [M, 3 P + 6]: avail, match, cells, then the StepBuffers.c_* columns
    learned: np.ndarray  # int64 [4, M * P]: learning's judged rows (row, proposer, n_ones, n_zero)


class Batch(NamedTuple):
    """A decision's batch, converted once from the caller's lists."""

    parts: np.ndarray  # int64 [sum(dlen)]: the offered drafts concatenated (Offers.parts)
    ints: np.ndarray  # int64 [3 N + 2 N P]: pos, cap, temp (each [N]), then dlen, mlen ([N * P])
    slots: np.ndarray  # int64 [N]: the requests' slots


class Objective(NamedTuple):
    """What the allocation maximises: predicted goodput over the step-cost curve."""

    curve_g: np.ndarray  # float64 [>= V + 1]: greedy step time (s) per verified draft tokens V
    curve_s: np.ndarray  # float64 [>= V + 1]: the same for sampled requests
    sampled: float  # share of sampled requests, mixing the two curves
    load: float  # the cost model's load factor, scaling the mixed curve
    premium: float  # >= 0: speculation priced at 1 + premium times the curve's increase
    margin: int  # >= 0: a draining batch counts the requests within margin tokens; -1: all


class Observation(NamedTuple):
    """One step's outcome for the decided requests, converted once from the caller's lists."""

    ints: np.ndarray  # int64: rows [n], lens [n], finished rows [n_fin], tokens [sum(lens)]
    n: int  # decided rows that reported
    n_fin: int  # of them, rows whose request finished
    base_time: float  # s, the baseline's time on this step (NaN: no valid step time)
    run_tokens: float  # tokens the decided requests committed
    run_time: float  # s, the measured step time
