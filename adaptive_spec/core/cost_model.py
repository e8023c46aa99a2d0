"""Online step-cost model: a measured table, one load factor for drift, slow per-cell corrections.

``t(B, V) = load * table(B, V)`` where ``table`` is a :class:`~adaptive_spec.core.cost_table.StepCostTable`
(calibrated on this engine, shipped for the embedded default, or a generic prior) and ``load`` is an
exponential moving average of ``log(observed / table)`` over decode steps: the machine getting slower
or faster (a noisy neighbour, thermal limits) moves ``load`` within a few steps. Because ``load``
multiplies every cell, it never changes which allocation has the best goodput: it rescales time.

The shape of the table is corrected slowly: each decode step's residual ``log(observed / (load *
table))`` is accumulated in the grid cell nearest to its ``(B, V)``; every ``refresh_every`` steps (up to
4 times that while the corrections stay below 2 %) the
residuals are centred (their weighted mean over the observed cells is drift, which the load factor
follows; only differences between cells say the shape is wrong),
each cell with data moves toward its observations by ``n / (n + w)`` of its mean residual (``w``: the
measurements behind the cell, between 1 and ``prior_weight``; each residual clipped to a factor of 3,
so a stall cannot move a cell far and a badly wrong cell is repaired over a few refreshes), cells
without data take the correction interpolated between the corrected cells of their row (rows without
data: the nearest row's), and the table is made monotone again (weighted by the measurements behind
each cell, :func:`~adaptive_spec.core.cost_table.make_monotone`, so a row observed a few times cannot
lift the row the engine runs at). A table that is wrong (e.g. claims that a draft token costs
100 ms) is thereby repaired wherever steps are observed; the controller's probes make sure some are.

A step in which a share ``s`` of the requests samples (temperature > 0) is predicted from the
table's greedy and sampled parts, ``(1 - s) * greedy + s * sampled`` (see
:mod:`adaptive_spec.core.cost_table`); its residual corrects both parts' shape alike.

Steps that also prefill prompt tokens are not learned from (their cost is dominated by the prefill);
their extra time per prompt token is tracked separately for reporting. A step time that is NaN,
infinite, zero or negative is ignored and counted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adaptive_spec.core.cost_table import (
    StepCostTable,
    make_monotone,
    nearest_index,
    prior_table,
    warm_up_isotonic,
)

#: Largest |log ratio| one observation may move the load factor by (a 1 s stall is not a new regime).
MAX_LOG_RATIO = math.log(3.0)
#: A shape correction below this (|log ratio| of every cell) lets the next one wait twice as long.
SMALL_CORRECTION = 0.02


class StepCostModel:
    """Step time in seconds from ``(batch_size, draft tokens verified)``, learned online.

    Parameters
    ----------
    table : StepCostTable, optional
        The measured table (default: :func:`~adaptive_spec.core.cost_table.prior_table`, scaled to the first
        decode step observed).
    load_rate : float in (0, 1]
        Weight of the newest decode step in the load factor's moving average (0.1: about 10 steps).
    refresh_every : int >= 1
        Decode steps between two corrections of the table's shape while they change it; after a
        correction that moved no cell by 2 % or more the interval doubles, up to 4 times this (a
        correction rebuilds the table: 0.3-1 ms on 2 CPU cores), and a larger one resets it.
    prior_weight : float > 0
        Largest weight of a cell's measured value: a cell backed by ``n`` measurements needs
        ``min(max(n, 1), prior_weight)`` observations to move halfway to their mean residual.

    Raises
    ------
    ValueError
        For a parameter outside its range.
    """

    def __init__(
        self,
        table: StepCostTable | None = None,
        *,
        load_rate: float = 0.1,
        refresh_every: int = 16,
        prior_weight: float = 8.0,
    ) -> None:
        if not (0.0 < load_rate <= 1.0):
            raise ValueError(f"load_rate={load_rate!r} is invalid; allowed: 0 < load_rate <= 1")
        if (
            isinstance(refresh_every, bool)
            or not isinstance(refresh_every, int)
            or refresh_every < 1
        ):
            raise ValueError(
                f"refresh_every={refresh_every!r} is invalid; allowed: an integer >= 1"
            )
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(
                f"prior_weight={prior_weight!r} is invalid; allowed: a finite number > 0"
            )
        self.load_rate = float(load_rate)
        self.refresh_every = refresh_every
        self._refresh_interval = refresh_every
        self.prior_weight = float(prior_weight)
        self.scale_on_first = table is None
        self.table = prior_table() if table is None else table
        self.log_load = 0.0
        self._reset_cells()
        self._reset_seen()
        self.n_updates = 0
        self.n_ignored = 0
        self.n_prefill = 0
        self.prefill_s_per_token = self.table.prefill_s_per_token
        self.n_refreshes = 0
        self._since_refresh = 0
        self.abs_log_residual = 0.05  # moving average of |log residual| after the load factor
        warm_up_isotonic()  # the refresh's compiled regression, loaded before the first step

    def _reset_cells(self) -> None:
        # Per (batch size, sampled part), the table's curve over V = 0..n (grown by doubling): the
        # per-step path slices it instead of interpolating the table again (cleared when the table
        # changes).
        self._curves: dict[tuple[int, bool], np.ndarray] = {}
        # The last part_curves() call's arguments and result (a decision and the observation after
        # it ask for the same batch size; cleared with the curves).
        self._last_parts: tuple[Any, ...] | None = None
        # Nearest grid row per batch size, nearest grid column per V (grown on demand).
        self._row_of: list[int] = nearest_index(self.table.batch_sizes, np.arange(257)).tolist()
        self._col_of: list[int] = nearest_index(self.table.draft_tokens, np.arange(257)).tolist()
        self._zero_cells()

    def _cell_index(self, batch_size: int, verified_tokens: int) -> tuple[int, int]:
        # The grid cell nearest (batch_size, verified_tokens) (the index lists grow on demand).
        b, v = max(int(batch_size), 0), max(int(verified_tokens), 0)
        if b >= len(self._row_of):
            self._row_of = nearest_index(self.table.batch_sizes, np.arange(2 * b + 1)).tolist()
        if v >= len(self._col_of):
            self._col_of = nearest_index(self.table.draft_tokens, np.arange(2 * v + 1)).tolist()
        return self._row_of[b], self._col_of[v]

    def _reset_seen(self) -> None:
        # Decode steps observed per cell by this model (not reset by a refresh).
        rows, cols = self.table.seconds.shape
        self._seen = [[0] * cols for _ in range(rows)]

    def _zero_cells(self) -> None:
        # Observations and summed log residuals per cell since the last refresh (nested lists: the
        # per-step path adds to one cell, cheaper than NumPy's scalar indexing).
        rows, cols = self.table.seconds.shape
        self._cell_w = [[0.0] * cols for _ in range(rows)]
        self._cell_r = [[0.0] * cols for _ in range(rows)]

    @property
    def load(self) -> float:
        """Current load factor (observed / table, 1.0 = as measured)."""
        return math.exp(self.log_load)

    # -- prediction --------------------------------------------------------------------------------
    def _part_curve(self, batch_size: int, max_tokens: int, sampled: bool) -> np.ndarray:
        sampled = sampled and self.table.sampled is not None
        c = self._curves.get((batch_size, sampled))
        if c is None or c.shape[0] <= max_tokens:
            n = max(64, max_tokens, 2 * (c.shape[0] if c is not None else 0))
            if len(self._curves) > 1024:
                self._curves.clear()
            part = self.table.for_sampling() if sampled else self.table
            c = self._curves[(batch_size, sampled)] = part.curve(batch_size, n)
        return c

    def _base_curve(self, batch_size: int, max_tokens: int, sampled: float = 0.0) -> np.ndarray:
        cg, cs, w = self.part_curves(batch_size, max_tokens, sampled)
        if w <= 0.0:
            return cg
        if w >= 1.0:
            return cs
        n = min(cg.shape[0], cs.shape[0])
        return (1.0 - w) * cg[:n] + w * cs[:n]

    def part_curves(
        self, batch_size: int, max_tokens: int, sampled: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """The table's greedy and sampled curves at ``batch_size`` (float64 [> max_tokens], without
        the load factor; cached, do not modify) and the weight of the sampled one: :meth:`curve` is
        ``load * ((1 - w) * greedy + w * sampled)`` (the greedy curve twice and ``w = 0`` when the
        table has no sampled part or no request samples)."""
        last = self._last_parts
        if (
            last is not None
            and last[0] == batch_size
            and last[1] >= max_tokens
            and last[2] == sampled
            and last[4] is self.table
        ):
            return last[3]
        b, n = int(batch_size), max(int(max_tokens), 0)
        if sampled <= 0.0 or self.table.sampled is None:
            cg = self._part_curve(b, n, False)
            out = (cg, cg, 0.0)
        else:
            cs = self._part_curve(b, n, True)
            if sampled >= 1.0:
                out = (cs, cs, 1.0)
            else:
                out = (self._part_curve(b, n, False), cs, float(sampled))
        self._last_parts = (batch_size, n, sampled, out, self.table)
        return out

    def curve(self, batch_size: int, max_tokens: int, sampled: float = 0.0) -> np.ndarray:
        """Predicted step time for ``V = 0..max_tokens``: float64 [max_tokens + 1], non-decreasing.
        ``sampled``: the share (0..1) of the step's requests with temperature > 0."""
        return (
            self.load
            * self._base_curve(int(batch_size), max(int(max_tokens), 0), sampled)[: max_tokens + 1]
        )

    def _base_at(self, batch_size: int, v: int, sampled: float) -> float:
        # One entry of _base_curve, without building the mixed curve.
        cg, cs, w = self.part_curves(batch_size, v, sampled)
        if w <= 0.0:
            return float(cg[v])
        if w >= 1.0:
            return float(cs[v])
        return float((1.0 - w) * cg[v] + w * cs[v])

    def at(self, batch_size: int, verified_tokens: int, sampled: float = 0.0) -> float:
        """Predicted step time (seconds) of one decode step (from the cached curve of
        ``batch_size``: the per-step path); ``sampled`` as in :meth:`curve`."""
        return self.load * self._base_at(int(batch_size), int(verified_tokens), sampled)

    def predict(
        self,
        batch_size: float,
        verified_tokens: Any,
        prefill_tokens: Any = 0,
        sampled: float = 0.0,
    ) -> np.ndarray | float:
        """Predicted step time (seconds); broadcasts over ``verified_tokens``."""
        base = self.table.predict(batch_size, verified_tokens, sampled=sampled)
        extra = self.prefill_s_per_token * np.asarray(prefill_tokens, dtype=float)
        out = self.load * base + extra
        return float(out) if np.ndim(out) == 0 else out

    def trusted(self, batch_size: int, verified_tokens: int) -> bool:
        """Whether the table cell nearest ``(batch_size, verified_tokens)`` is backed by at least
        ``prior_weight`` measurements or observations (an untrusted cell is worth probing)."""
        t = self.table
        if t.counts is None:
            return False
        bi, vi = self._cell_index(batch_size, verified_tokens)
        return bool(t.counts[bi, vi] + self._cell_w[bi][vi] >= self.prior_weight)

    def observed(self, batch_size: int, verified_tokens: int) -> int:
        """Decode steps this model has observed in the table cell nearest ``(batch_size,
        verified_tokens)`` (what was measured on this engine, not what the table was built from)."""
        bi, vi = self._cell_index(batch_size, verified_tokens)
        return self._seen[bi][vi]

    # -- learning ---------------------------------------------------------------------------------
    def update(
        self,
        batch_size: int,
        verified_tokens: int,
        step_time_s: float,
        prefill_tokens: int = 0,
        sampled: float = 0.0,
    ) -> bool:
        """Learn from one measured step (``sampled``: the share of its requests with temperature
        > 0). Returns False (and counts it) when it is ignored: a bad time or count. Prefill steps
        only update the prefill price."""
        if (
            isinstance(step_time_s, bool)
            or not isinstance(step_time_s, int | float)
            or not math.isfinite(step_time_s)
            or step_time_s <= 0
            or batch_size <= 0
            or verified_tokens < 0
            or prefill_tokens < 0
        ):
            self.n_ignored += 1
            return False
        if self.scale_on_first and self.n_updates == 0 and prefill_tokens == 0:
            # A prior table: scale it to the first decode step (only its shape is a guess).
            pred0 = float(self.table.predict(batch_size, verified_tokens, sampled=sampled))
            self.table = self.table.scaled(step_time_s / pred0)
            self._reset_cells()
        v = int(verified_tokens)
        pred = self._base_at(int(batch_size), v, sampled)  # the table, without load
        if prefill_tokens > 0:
            extra = (step_time_s - self.load * pred) / prefill_tokens
            w = 0.1 if self.n_prefill else 1.0
            self.prefill_s_per_token = max(
                (1 - w) * self.prefill_s_per_token + w * max(extra, 0.0), 0.0
            )
            self.n_prefill += 1
            return True
        r = math.log(step_time_s / pred)
        lr = min(max(r - self.log_load, -MAX_LOG_RATIO), MAX_LOG_RATIO)
        self.log_load += self.load_rate * lr
        resid = r - self.log_load
        self.abs_log_residual += 0.02 * (min(abs(resid), MAX_LOG_RATIO) - self.abs_log_residual)
        bi, vi = self._cell_index(batch_size, v)
        self._cell_w[bi][vi] += 1.0
        self._seen[bi][vi] += 1
        self._cell_r[bi][vi] += min(max(resid, -MAX_LOG_RATIO), MAX_LOG_RATIO)
        self.n_updates += 1
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_interval:
            moved = self.refresh()
            small = moved < SMALL_CORRECTION
            self._refresh_interval = (
                min(2 * self._refresh_interval, 4 * self.refresh_every)
                if small
                else self.refresh_every
            )
        return True

    def refresh(self) -> float:
        """Move the table's cells toward their observed residuals (see the module docstring).
        Returns the largest correction applied to a cell, as ``|log(new / old)|`` (0 when none)."""
        self._since_refresh = 0
        w, r = np.array(self._cell_w), np.array(self._cell_r)
        has = w > 0
        if not has.any():
            return 0.0
        mean = np.where(has, r / np.maximum(w, 1e-12), 0.0)
        # Only the shape is learned here: the residuals' weighted mean over the observed cells is a
        # uniform drift, the load factor's job (with one cell observed, nothing is learned).
        mean = np.where(has, mean - float(r[has].sum() / w[has].sum()), 0.0)
        # A cell's prior weight: the measurements behind it (at least 1, at most prior_weight).
        t_counts = self.table.counts if self.table.counts is not None else np.zeros_like(w)
        shrink = w / (w + np.clip(t_counts, 1.0, self.prior_weight))
        corr = np.where(has, shrink * mean, np.nan)
        # Cells without data: the correction interpolated (over grid positions) between the
        # corrected cells of their row, constant beyond them.
        vg = np.arange(corr.shape[1], dtype=float)
        for i in np.flatnonzero(has.any(axis=1)):
            known = np.flatnonzero(has[i])
            corr[i] = np.interp(vg, known.astype(float), corr[i, known])
        # Rows without data take the correction of the nearest row with data.
        rows = np.flatnonzero(has.any(axis=1))
        bidx = np.arange(corr.shape[0])
        corr = corr[rows[np.abs(bidx[:, None] - rows[None, :]).argmin(axis=1)]]
        t = self.table
        changed = np.flatnonzero(corr.any(axis=1))
        source = (
            t.source
            if t.source == "learned" or t.source.endswith("+learned")
            else ("learned" if t.source == "prior" else f"{t.source}+learned")
        )

        def corrected(part: StepCostTable, **extra: Any) -> StepCostTable:
            # The same shape correction for the greedy and the sampled part (module docstring).
            counts = (part.counts if part.counts is not None else np.zeros_like(w)) + w
            seconds = make_monotone(part.seconds * np.exp(corr), counts + 1.0, rows=changed)
            return t.with_monotone(seconds, counts, source=source, **extra)

        self.table = corrected(
            t,
            prefill_s_per_token=t.prefill_s_per_token,
            sampled=None if t.sampled is None else corrected(t.sampled),
        )
        # The applied corrections are in the table now; what the next window sees is measured anew.
        self._zero_cells()
        self._curves = {}
        self._last_parts = None
        self.n_refreshes += 1
        return float(np.abs(corr).max())

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.to_dict(),
            "log_load": self.log_load,
            "scale_on_first": self.scale_on_first,
            "n_updates": self.n_updates,
            "n_ignored": self.n_ignored,
            "prefill_s_per_token": self.prefill_s_per_token,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved model. The load factor restarts at 1 (the next steps measure it again): a
        state saved on a busier or quieter day keeps its table's shape only. Raises ValueError for a
        bad state (this model is unchanged then)."""
        if not isinstance(state, dict) or "table" not in state:
            raise ValueError("cost model state has no table")
        table = StepCostTable.from_dict(state["table"])
        counts = (state.get("n_updates", 0), state.get("n_ignored", 0))
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"cost model state has counts {counts!r}; expected integers >= 0")
        pre = float(state.get("prefill_s_per_token", table.prefill_s_per_token))
        if not (math.isfinite(pre) and pre >= 0):
            raise ValueError(f"cost model state has prefill_s_per_token={pre!r}")
        self.table = table
        self.scale_on_first = bool(state.get("scale_on_first", False)) and counts[0] == 0
        self.log_load = 0.0
        self.n_updates, self.n_ignored = counts
        self.prefill_s_per_token = pre
        self._reset_cells()
        self._reset_seen()
        self._since_refresh = 0
        self._refresh_interval = self.refresh_every
