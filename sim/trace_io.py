"""Load a trace for replay: requests, counterfactual drafts, and what the trace itself measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptive_spec.core.trace import Trace, read_trace

from .counterfactual import (
    Counterfactuals,
    build_counterfactuals,
    check_logged,
    read_counterfactuals,
    suffix_counterfactual,
)
from .requests import ReplayRequest, max_batch_size, recorded_goodput, requests_from_trace


@dataclass(slots=True)
class ReplayWorkload:
    """A trace ready for replay.

    Attributes
    ----------
    trace : Trace
    requests : list of ReplayRequest
        In the order they first appeared.
    counterfactuals : Counterfactuals
        Stored in the trace (``adaptive-spec record``) or recomputed on load.
    proposers : list of str
        The header's proposers (``none`` excluded).
    max_k, max_batch : int
        From the header / the largest logged batch.
    recorded_tokens, recorded_time_s : int, float
        What the recorded run committed and the summed positive step times.
    coverage : dict of str to float
        Per proposer, the share of decision positions where its draft is known.
    ngram_check : dict
        Recomputed vs logged n-gram drafts (:func:`~adaptive_spec.sim.counterfactual.check_logged`).
    suffix_check : dict
        The same for the suffix drafts (replayed in the trace's order when the trace stores none).
    """

    trace: Trace
    requests: list[ReplayRequest]
    counterfactuals: Counterfactuals
    proposers: list[str]
    max_k: int
    max_batch: int
    recorded_tokens: int
    recorded_time_s: float
    coverage: dict[str, float] = field(default_factory=dict)
    ngram_check: dict[str, int] = field(default_factory=dict)
    suffix_check: dict[str, int] = field(default_factory=dict)

    @property
    def recorded_goodput(self) -> float:
        return self.recorded_tokens / self.recorded_time_s if self.recorded_time_s > 0 else 0.0


def load_replay_trace(
    path: str | Path, *, ngram: bool = True, min_n: int = 2, max_n: int = 4, window: int = 2048
) -> ReplayWorkload:
    """Read a trace and its counterfactuals; recompute n-gram (and suffix) drafts if the trace has none
    stored.

    Parameters
    ----------
    path : str or Path
    ngram : bool
        Recompute n-gram drafts at every position when the trace stores none (needs the engine's
        ``min_n``/``max_n``/``window``).

    Raises
    ------
    ValueError
        For an unreadable trace (schema, version), a header without ``max_k``, or a trace without
        any complete request.
    """
    trace = read_trace(path)
    max_k = trace.header.get("max_k")
    if not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"{path}: header max_k={max_k!r}; expected an integer >= 1")
    cf = read_counterfactuals(path)
    proposers = [p for p in (trace.header.get("proposers") or []) if p != "none"]
    if ngram and "ngram" in proposers and "ngram" not in cf.sources:
        cf = build_counterfactuals(trace, min_n=min_n, max_n=max_n, window=window).merge(cf)
    if "suffix" in proposers and "suffix" not in cf.sources:
        cf = suffix_counterfactual(trace).merge(cf)
    check = check_logged(trace, cf, "ngram") if cf.sources.get("ngram") == "rerun" else {}
    suffix_check = check_logged(trace, cf, "suffix") if cf.sources.get("suffix") == "rerun" else {}
    reqs = requests_from_trace(trace, cf)
    if not reqs:
        raise ValueError(f"{path}: no request with output tokens; nothing to replay")
    tokens, secs = recorded_goodput(trace)
    coverage = {
        p: float(np.mean([r.coverage(p) for r in reqs if len(r) > 1] or [0.0])) for p in proposers
    }
    return ReplayWorkload(
        trace,
        reqs,
        cf,
        proposers,
        max_k,
        max_batch_size(trace),
        tokens,
        secs,
        coverage,
        check,
        suffix_check,
    )
