"""Compiled kernels of the adaptive controller's per-step path (Numba, CPU).

The controller's decision and its learning are a few dozen array operations over tiny arrays
(``N`` requests x ``P`` proposers x ``K`` positions). As NumPy calls they cost 1-10 us each in
dispatch alone, about 0.3-0.6 ms per step at batch 16 on a 2-core CPU, which is 1-3 % of a decode step
of the embedded default. Here each of them is one loop nest, compiled once per machine (``cache=True``:
the machine code is kept next to these files or in Numba's user cache directory).

* :mod:`.records`: the argument records (named tuples of arrays) the kernels take;
* :mod:`.scoring`: scoring the offered drafts, the goodput allocation, the safety rule's terms;
* :mod:`.learning`: acceptance labels into the counts and the requests' histories;
* :mod:`.tracking`: the safety tracker's baseline drafts and per-decision records;
* :mod:`.step`: the per-step path, one call per decision (:func:`decide_step`) and one per
  observation (:func:`observe_step`), over the buffers a :class:`StepBuffers` keeps;
* :mod:`.warmup`: :func:`warm_up`, every kernel loaded before the first step.

The smaller kernels the per-step path is built from stay callable on their own.
:mod:`adaptive_spec.core.controller` and :mod:`adaptive_spec.core.safety` document the quantities;
every kernel's docstring gives its shapes and dtypes. The kernels allocate only their outputs (or
write into the buffers they are given) and never raise for well-formed inputs (the callers build
them).

Floating-point sums run in the order a sequential loop gives, so results can differ from NumPy's
pairwise sums in the last bits; decisions compare sums with margins far above that.
"""

from __future__ import annotations

from .learning import add_counts, learn, learn_into, posterior_mean
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
    Scored,
    StepArrays,
    Tracked,
)
from .scoring import (
    allocate,
    allocate_base,
    drain_gains,
    guard_terms,
    mixed_curve,
    score,
    score_into,
)
from .step import StepBuffers, decide_step, decided_rows, observe_step
from .tracking import (
    differs,
    guard_add_resolved,
    records_complete,
    records_open,
    records_resolve,
    register_baseline,
    tracker_add,
    tracker_commit,
    tracker_resolve,
)
from .warmup import warm_up

__all__ = [
    "Batch",
    "CellLayout",
    "Committed",
    "Decided",
    "Learning",
    "Objective",
    "Observation",
    "Offers",
    "Pending",
    "Records",
    "Scored",
    "StepArrays",
    "StepBuffers",
    "Tracked",
    "add_counts",
    "allocate",
    "allocate_base",
    "decide_step",
    "decided_rows",
    "differs",
    "drain_gains",
    "guard_add_resolved",
    "guard_terms",
    "learn",
    "learn_into",
    "mixed_curve",
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
    "warm_up",
]
