"""Every kernel loaded (or compiled) before the first engine step, with the per-step path's types."""

from __future__ import annotations

import numpy as np

from .learning import add_counts, learn, posterior_mean
from .records import (
    Batch,
    CellLayout,
    Committed,
    Decided,
    Learning,
    Objective,
    Observation,
    Offers,
    Pending,
    Records,
    Tracked,
)
from .scoring import allocate, guard_terms, score
from .step import StepBuffers, decide_step, observe_step
from .tracking import (
    guard_add_resolved,
    records_complete,
    records_open,
    records_resolve,
    register_baseline,
    tracker_add,
    tracker_commit,
    tracker_resolve,
)

_warm = False
_I64 = np.int64


def _ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=_I64)


def _pending(rows: int, K: int) -> Pending:
    return Pending(*(np.zeros(rows, dtype=_I64) for _ in range(4)), np.zeros((rows, K), dtype=_I64))


def _records() -> Records:
    return Records(np.zeros((8, 5)), np.full(8, -1, dtype=_I64), np.zeros(2, dtype=_I64))


def warm_up() -> None:
    """Load (or compile, on first use on a machine) every kernel now, with the argument types of the
    per-step path, so that no engine step pays for it: loading the cached machine code takes about
    0.3 s per process, compiling it about 10 s once per machine. Idempotent."""
    global _warm
    if _warm:
        return
    N, P, K = 2, 1, 2
    one = np.ones(1, dtype=_I64)
    layout = CellLayout(np.zeros((P, 64), dtype=_I64), 1, 2, 4)
    offers = Offers(
        np.ones(2, dtype=_I64),
        _ints(2, 0),
        np.zeros(2, dtype=_I64),
        np.full(2, 9, dtype=_I64),
        np.zeros(2, dtype=_I64),
        np.zeros((N, P), dtype=_I64),
    )
    score(offers, layout, np.full((8, K), 0.5), 0.0)
    g = np.array([[0.5, 0.25], [-np.inf, -np.inf]])
    ks, _, _, _ = allocate(g, 2, np.array([1.0, 1.1, 1.2]))
    guard_terms(g, np.zeros((N, P, K)), ks, ks, np.zeros(N, dtype=_I64), 0)
    acc, tri = np.zeros((8, K)), np.zeros((8, K))
    add_counts(acc, tri, np.zeros(1, dtype=_I64), one, one, 0.99)
    posterior_mean(np.zeros((1, 2, 4, 4, K)), *(np.ones((1, 2, 4, 4, K)) for _ in range(3)))
    # The tracker's Python API (adaptive_spec.core.safety.BaselineTracker), with contiguous arrays.
    slots, pos = np.arange(N, dtype=_I64), np.zeros(N, dtype=_I64)
    drafts = np.ones((N, P, K), dtype=_I64)
    zeros_np = np.zeros((N, P), dtype=_I64)
    decided = Decided(drafts, zeros_np, zeros_np, np.zeros(N, dtype=_I64), np.ones(N, dtype=_I64),
                      np.zeros(N, dtype=_I64), pos, slots)  # fmt: skip
    lrn = Learning(
        acc, tri, 0.99, np.zeros((N, P)), np.zeros((N, P)), zeros_np.copy(), 0.3, 0.2, 0.6
    )
    learn(np.zeros(1, dtype=_I64), one, one, decided, lrn)
    committed = Committed(np.zeros((N, 8), dtype=_I64), np.zeros(N, dtype=_I64))
    pending, records = _pending(4, K), _records()
    n = tracker_add(pending, 0, 0, slots[:1].copy(), pos[:1].copy(), np.ones((1, K), dtype=_I64),
                    one, np.ones(1, dtype=np.bool_))  # fmt: skip
    n, _, _ = register_baseline(pending, n, 1, decided, 0, False)
    tracker_commit(committed, np.zeros(1, dtype=_I64), one, one)
    _, steps, emitted = tracker_resolve(committed, pending, n, np.zeros(0, dtype=np.bool_))
    records_open(records, 0, 1)
    records_resolve(records, steps, emitted)
    records_complete(records, np.zeros(4))
    guard_add_resolved(np.zeros(4), 1.0, 0.1, 1.0, 0.1)
    # The fused per-step kernels, with the argument types the controller passes.
    buf = StepBuffers(P, K)
    counts = np.ones((4, 8, K))
    curve = np.array([1.0, 1.1, 1.2, 1.3, 1.4])
    batch = Batch(np.ones(2, dtype=_I64), _ints(0, 0, 9, 9, 0, 0, 2, 0, 0, 0), slots)
    decide_step(batch, zeros_np, committed.length, layout, np.full((8, K), 0.5), counts, 0.0,
                Objective(curve, curve, 0.5, 1.0, 0.5, 1), 1, 0, buf.arrays)  # fmt: skip
    lrn = Learning(counts[0], counts[1], 0.99, np.zeros((N, P)), np.zeros((N, P)), zeros_np.copy(),
                   0.3, 0.2, 0.6)  # fmt: skip
    observe_step(Observation(_ints(0, 1, 0, 1), 1, 1, 0.05, 2.0, 0.05), N, 2, 0, False, buf.arrays,
                 lrn, Tracked(committed, _pending(4, K), _records(), np.zeros(4)), 0)  # fmt: skip
    _warm = True
