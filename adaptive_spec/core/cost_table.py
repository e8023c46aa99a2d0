"""Measured step-cost table: engine step time over batch size x draft tokens verified.

The controller never fits step time freely: an online least-squares fit on
``[1, batch, draft tokens, prefill tokens, speculating requests]`` is ill-conditioned on real traffic
(the batch size barely moves within a run and the number of speculating requests follows the draft
tokens), and once drove the per-token price to zero or to thousands of tokens. Instead the cost is a
**table** measured on the engine itself (:mod:`adaptive_spec.vllm.calibrate`; the embedded default
ships one), the approach of vLLM's DSpark adaptive verification (profiled tables, forced monotone):

* rows: batch sizes ``B`` (requests in the step); columns: draft tokens verified in the step ``V``
  (summed over the batch). Column ``V = 0`` is a step with no speculation, so the jump from ``V = 0``
  to ``V = 1`` is the fixed cost of speculating at all in a step (the rejection sampler, the
  speculative metadata, multi-token attention), which a per-token price cannot express;
* each cell is the median of its measurements; unmeasured cells are interpolated (linearly in ``V``
  within a row, in ``B`` across rows) and extrapolated with the last measured slope, except that a
  batch size beyond the measured ones (a table calibrated on a smaller engine, used on a larger one)
  keeps the nearest measured row's price of draft tokens, ``t(B, V) - t(B, 0)``, on top of the
  no-draft step extrapolated in ``B``: extrapolating every column on its own slope once turned a
  3.8 ms cost of speculating at all at batch 4 into 15.2 ms at batch 16 (float32 on a 2-core Xeon,
  where batch 16 measured 1.6 ms);
* the table is made monotone non-decreasing in ``V`` (weighted isotonic regression per row,
  the pool-adjacent-violators algorithm of :func:`scipy.optimize.isotonic_regression`, compiled over
  all rows in one call: :func:`isotonic_rows`) and then in ``B`` (a running maximum, which keeps the
  rows monotone): more work never costs less, so noise cannot invent free draft tokens.

Prediction between grid points is linear in ``V`` (integer ``V``, so ``0 -> 1`` is the step, never
interpolated) and in ``B``; beyond the last grid point it extends the last segment's slope.

**Sampling.** A table may carry a second one of the same grid, ``sampled``: the step time when every
request in the step samples (temperature > 0). Verification costs more there: vLLM's rejection sampler
takes a softmax over the vocabulary of every verified row and draws recovered tokens for the rows
with draft tokens, where a greedy step takes argmaxes (on the embedded default at batch 16 this was
about 2-3 ms more per draft token). A step in which a share ``s`` of the requests samples is predicted
as ``(1 - s) * greedy + s * sampled``; without a sampled table the greedy one stands in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

#: Default grid of batch sizes (rows) and draft tokens verified per step (columns).
BATCH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
TOKEN_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)
FORMAT = "adaptive-spec-cost-table"
VERSION = 1


def _check_grid(values: Any, name: str, first: int) -> np.ndarray:
    arr = np.asarray(values)
    if (
        arr.ndim != 1
        or arr.size < 2
        or arr.dtype.kind not in "iu"
        or int(arr[0]) != first
        or (np.diff(arr) <= 0).any()
    ):
        raise ValueError(
            f"{name}={values!r} is invalid; allowed: strictly increasing integers starting at {first}"
        )
    return arr.astype(np.int64)


def _fill_row(x: np.ndarray, y: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Fill unknown entries of ``y`` (over grid ``x``) by linear interpolation between known ones and
    extrapolation with the nearest segment's slope (clipped at >= 0; constant with one known)."""
    if known.all():
        return y.copy()
    xs, ys = x[known].astype(float), y[known]
    if xs.size == 1:
        return np.full_like(y, ys[0])
    out = np.interp(x.astype(float), xs, ys)
    lo_slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    hi_slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    below, above = x < xs[0], x > xs[-1]
    out[below] = ys[0] - lo_slope * (xs[0] - x[below])
    out[above] = ys[-1] + hi_slope * (x[above] - xs[-1])
    return np.maximum(out, 1e-9)


#: Rounds of row and column isotonic regression in :func:`make_monotone`.
MONOTONE_ROUNDS = 3


@njit(cache=True)
def isotonic_rows(
    t: np.ndarray, w: np.ndarray, rows: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Weighted isotonic regression (non-decreasing) of each row of ``t`` listed in ``rows`` that has a
    strict decrease, in place; rows without one are already their own projection and stay as they are.

    ``t``, ``w``: float64 [n_rows, n], ``w > 0``; ``rows``: int64 [m]. Algorithm 1 of Busing (2022),
    "Monotone Regression: A Simple and Fast O(n) PAVA Implementation", J. Stat. Softw. 102(1), as
    :func:`scipy.optimize.isotonic_regression` runs it (ties pooled), so each regressed row equals
    SciPy's result to the last bit (tested); one compiled call instead of one library call per row,
    which cost ~15 us each on the controller's table refresh."""
    n = t.shape[1]
    x = np.empty(n)
    ww = np.empty(n)
    r = np.empty(n + 1, dtype=np.int64)
    for ri in range(rows.shape[0]):
        row = rows[ri]
        bad = False
        for j in range(n - 1):
            if t[row, j + 1] < t[row, j]:
                bad = True
                break
        if not bad:
            continue
        for j in range(n):
            x[j] = t[row, j]
            ww[j] = w[row, j]
        r[0] = 0
        r[1] = 1
        b = 0
        xb_prev = x[0]
        wb_prev = ww[0]
        i = 1
        while i < n:
            b += 1
            xb = x[i]
            wb = ww[i]
            if xb_prev >= xb:  # a down violation: pool the new element into the last block
                b -= 1
                sb = wb_prev * xb_prev + wb * xb
                wb += wb_prev
                xb = sb / wb
                while i < n - 1 and xb >= x[i + 1]:  # then every following one it violates
                    i += 1
                    sb += ww[i] * x[i]
                    wb += ww[i]
                    xb = sb / wb
                while b > 0 and x[b - 1] >= xb:  # and every earlier block it now violates
                    b -= 1
                    sb += ww[b] * x[b]
                    wb += ww[b]
                    xb = sb / wb
            x[b] = xb
            xb_prev = xb
            ww[b] = wb
            wb_prev = wb
            r[b + 1] = i + 1
            i += 1
        f = n - 1
        for k in range(b, -1, -1):  # each block's value over its elements
            s = r[k]
            xk = x[k]
            for j in range(f, s - 1, -1):
                t[row, j] = xk
            f = s - 1


def warm_up_isotonic() -> None:
    """Load (or compile, once per machine) :func:`isotonic_rows` now, so that the cost model's first
    refresh inside an engine step does not pay for it. Idempotent (cheap after the first call)."""
    isotonic_rows(np.array([[1.0, 0.0]]), np.ones((1, 2)), np.zeros(1, dtype=np.int64))


def make_monotone(
    seconds: np.ndarray, weights: np.ndarray | None = None, rows: Any = None
) -> np.ndarray:
    """Project a [n_batch, n_tokens] table onto tables non-decreasing in both axes.

    Weighted isotonic regression (:func:`isotonic_rows`) along tokens per row (only ``rows`` when
    given: the others are already monotone), then along batch sizes per column, alternated for
    :data:`MONOTONE_ROUNDS` rounds, then a running maximum along batch sizes, which makes the result
    exactly monotone in both axes (it keeps each row monotone) after moving at most what the rounds
    left. The weights (the measurements behind each cell) decide which side of a violation moves,
    also across batch sizes: a running maximum alone would let a row measured a few times (a small
    batch at the end of a run) lift the row the engine runs at, measured hundreds of times.
    ``weights`` float64 like ``seconds`` (> 0; default all 1). Returns a new array."""
    t = np.array(seconds, dtype=np.float64)
    w = (
        np.ones_like(t)
        if weights is None
        else np.maximum(np.asarray(weights, dtype=np.float64), 1e-3)  # a new, writable array
    )
    idx = (
        np.arange(t.shape[0], dtype=np.int64)
        if rows is None
        else np.asarray(rows, dtype=np.int64).reshape(-1)
    )
    every_row = np.arange(t.shape[0], dtype=np.int64)
    every_col = np.arange(t.shape[1], dtype=np.int64)
    wt = np.ascontiguousarray(w.T)
    for _ in range(MONOTONE_ROUNDS):
        isotonic_rows(t, w, idx)
        tt = np.ascontiguousarray(t.T)
        isotonic_rows(tt, wt, every_col)
        t = np.ascontiguousarray(tt.T)
        idx = every_row
    isotonic_rows(t, w, every_row)
    return np.maximum.accumulate(t, axis=0)


@dataclass(slots=True)
class StepCostTable:
    """Step time (seconds) over batch size x draft tokens verified, monotone in both.

    Parameters
    ----------
    batch_sizes : array of int64, shape [nb]
        Row grid, strictly increasing, starting at 1.
    draft_tokens : array of int64, shape [nv]
        Column grid, strictly increasing, starting at 0 (0 = no speculation in the step).
    seconds : array of float64, shape [nb, nv]
        Step time per cell; made monotone at construction (finite, > 0 required).
    counts : array of float64, shape [nb, nv], optional
        Measurements behind each cell (0: interpolated); weights of the monotone projection.
    prefill_s_per_token : float >= 0
        Extra seconds per prompt token computed in a step (for replay and reporting; decisions ignore it).
    key : dict
        What the table was measured on (model, dtype, threads, device, vllm); :meth:`matches` compares it.
    source : str
        Where it came from (``calibrated``, ``shipped``, ``prior``, ``learned``).
    sampled : StepCostTable, optional
        The same grid measured with every request sampling (temperature > 0); it has no ``sampled``
        of its own. ``None``: the greedy table stands in for sampled steps.

    Raises
    ------
    ValueError
        For a bad grid or a table of the wrong shape or with a non-finite or non-positive entry, or a
        ``sampled`` table on another grid.

    Examples
    --------
    >>> tab = StepCostTable.from_samples([4, 4, 4], [0, 1, 8], [0.020, 0.021, 0.0235])
    >>> [round(1e3 * float(t), 2) for t in tab.curve(4, 8)[[0, 1, 4, 8]]]
    [20.0, 21.0, 22.07, 23.5]
    """

    batch_sizes: np.ndarray
    draft_tokens: np.ndarray
    seconds: np.ndarray
    counts: np.ndarray | None = None
    prefill_s_per_token: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"
    sampled: StepCostTable | None = None
    _curves: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.batch_sizes = _check_grid(self.batch_sizes, "batch_sizes", 1)
        self.draft_tokens = _check_grid(self.draft_tokens, "draft_tokens", 0)
        t = np.asarray(self.seconds, dtype=float)
        shape = (self.batch_sizes.size, self.draft_tokens.size)
        if t.shape != shape or not np.isfinite(t).all() or (t <= 0).any():
            raise ValueError(
                f"seconds has shape {t.shape} or non-finite / non-positive entries; "
                f"allowed: finite step times > 0 of shape {shape}"
            )
        c = np.zeros(shape) if self.counts is None else np.asarray(self.counts, dtype=float)
        if c.shape != shape or not np.isfinite(c).all() or (c < 0).any():
            raise ValueError(f"counts must be finite, >= 0, of shape {shape}")
        if not (math.isfinite(self.prefill_s_per_token) and self.prefill_s_per_token >= 0):
            raise ValueError(
                f"prefill_s_per_token={self.prefill_s_per_token!r} is invalid; allowed: a finite number >= 0"
            )
        self.counts = c
        monotone = (np.diff(t, axis=1) >= 0).all() and (np.diff(t, axis=0) >= 0).all()
        self.seconds = t if monotone else make_monotone(t, c + 1.0)
        self._curves = {}
        if self.sampled is not None:
            sp = self.sampled
            if (
                not isinstance(sp, StepCostTable)
                or sp.sampled is not None
                or not np.array_equal(sp.batch_sizes, self.batch_sizes)
                or not np.array_equal(sp.draft_tokens, self.draft_tokens)
            ):
                raise ValueError(
                    "sampled must be a StepCostTable on the same batch_sizes and draft_tokens grid, "
                    "without a sampled table of its own"
                )

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_samples(
        cls,
        batch_size: Any,
        draft_tokens: Any,
        step_time_s: Any,
        *,
        batch_grid: Any = None,
        token_grid: Any = None,
        **kwargs: Any,
    ) -> StepCostTable:
        """Build a table from measured steps (each ``(B, V, seconds)``): a cell's value is the median
        of the steps nearest to it (B and V rounded to the nearest grid point on a log scale), empty
        cells filled as the module docstring says.

        Raises
        ------
        ValueError
            With no valid sample, or arrays of different lengths.
        """
        B = np.asarray(batch_size, dtype=float).reshape(-1)
        V = np.asarray(draft_tokens, dtype=float).reshape(-1)
        T = np.asarray(step_time_s, dtype=float).reshape(-1)
        if not (B.size == V.size == T.size):
            raise ValueError("batch_size, draft_tokens and step_time_s must have the same length")
        ok = np.isfinite(B) & np.isfinite(V) & np.isfinite(T) & (B >= 1) & (V >= 0) & (T > 0)
        if not ok.any():
            raise ValueError(
                "no valid step (B >= 1, V >= 0, finite time > 0) to build a table from"
            )
        B, V, T = B[ok], V[ok], T[ok]
        bg = np.asarray(BATCH_GRID if batch_grid is None else batch_grid, dtype=np.int64)
        vg = np.asarray(TOKEN_GRID if token_grid is None else token_grid, dtype=np.int64)
        # Keep the grids to what was measured plus one step beyond (extrapolation covers the rest).
        bi = nearest_index(bg, B)
        vi = nearest_index(vg, V)
        nb, nv = bg.size, vg.size
        med = np.full((nb, nv), np.nan)
        cnt = np.zeros((nb, nv))
        cell = bi * nv + vi
        for c in np.unique(cell):
            sel = T[cell == c]
            med.flat[c] = float(np.median(sel))
            cnt.flat[c] = sel.size
        return cls(bg, vg, fill_table(bg, vg, med), counts=cnt, **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCostTable:
        """Inverse of :meth:`to_dict`. Raises ValueError for a document that is not a cost table of
        this version or that has bad fields (nothing is half-built)."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError("not an adaptive-spec cost table (format field missing or different)")
        if data.get("version") != VERSION:
            raise ValueError(
                f"cost table version {data.get('version')!r}; this build reads {VERSION}"
            )
        try:
            bg = np.asarray(data["batch_sizes"], dtype=np.int64)
            vg = np.asarray(data["draft_tokens"], dtype=np.int64)
            key = dict(data.get("key") or {})
            source = str(data.get("source", "loaded"))
            sampled = None
            sd = data.get("sampled")
            if sd is not None:
                if not isinstance(sd, Mapping):
                    raise TypeError("sampled is not a mapping")
                sampled = cls(
                    bg,
                    vg,
                    np.asarray(sd["seconds"], dtype=float),
                    counts=None if sd.get("counts") is None else np.asarray(sd["counts"], float),
                    key=key,
                    source=source,
                )
            return cls(
                bg,
                vg,
                np.asarray(data["seconds"], dtype=float),
                counts=None if data.get("counts") is None else np.asarray(data["counts"], float),
                prefill_s_per_token=float(data.get("prefill_s_per_token", 0.0)),
                key=key,
                source=source,
                sampled=sampled,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"cost table has a missing or malformed field ({e})") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "key": dict(self.key),
            "source": self.source,
            "batch_sizes": self.batch_sizes.tolist(),
            "draft_tokens": self.draft_tokens.tolist(),
            "seconds": np.round(self.seconds, 7).tolist(),
            "counts": self.counts.tolist() if self.counts is not None else None,
            "prefill_s_per_token": self.prefill_s_per_token,
            "sampled": None
            if self.sampled is None
            else {
                "seconds": np.round(self.sampled.seconds, 7).tolist(),
                "counts": self.sampled.counts.tolist() if self.sampled.counts is not None else None,
            },
        }

    def copy(self) -> StepCostTable:
        return StepCostTable(
            self.batch_sizes.copy(),
            self.draft_tokens.copy(),
            self.seconds.copy(),
            counts=None if self.counts is None else self.counts.copy(),
            prefill_s_per_token=self.prefill_s_per_token,
            key=dict(self.key),
            source=self.source,
            sampled=None if self.sampled is None else self.sampled.copy(),
        )

    def with_monotone(
        self,
        seconds: np.ndarray,
        counts: np.ndarray,
        *,
        source: str,
        prefill_s_per_token: float = 0.0,
        sampled: StepCostTable | None = None,
    ) -> StepCostTable:
        """This table's grid and key with new ``seconds`` and ``counts`` (float64 [nb, nv]), without
        validating them again: for the cost model's refresh, whose ``seconds`` come out of
        :func:`make_monotone` (finite, > 0, monotone) and whose ``counts`` are sums of counts. The
        arrays are taken as they are (not copied); ``sampled`` must be on the same grid."""
        out = object.__new__(StepCostTable)
        out.batch_sizes = self.batch_sizes
        out.draft_tokens = self.draft_tokens
        out.seconds = seconds
        out.counts = counts
        out.prefill_s_per_token = prefill_s_per_token
        out.key = self.key
        out.source = source
        out.sampled = sampled
        out._curves = {}
        return out

    def for_sampling(self) -> StepCostTable:
        """The table of steps in which every request samples (this one when none was measured)."""
        return self if self.sampled is None else self.sampled

    def scaled(self, factor: float) -> StepCostTable:
        """The same shape with every cell times ``factor`` (> 0)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor={factor!r} is invalid; allowed: a finite number > 0")
        out = self.copy()
        out.seconds = out.seconds * factor
        out.prefill_s_per_token *= factor
        if out.sampled is not None:
            out.sampled.seconds = out.sampled.seconds * factor
        return out

    # -- prediction -------------------------------------------------------------------------------
    def row(self, batch_size: float) -> np.ndarray:
        """Step time at each column of the grid for ``batch_size`` requests, float64 [nv] (linear in B
        between rows, the last rows' slope beyond the grid)."""
        bg = self.batch_sizes.astype(float)
        b = max(float(batch_size), 1.0)
        if b <= bg[-1]:
            j = int(np.searchsorted(bg, b, side="left"))
            if bg[j] == b:
                return self.seconds[j]
            w = (b - bg[j - 1]) / (bg[j] - bg[j - 1])
            return (1 - w) * self.seconds[j - 1] + w * self.seconds[j]
        slope = (self.seconds[-1] - self.seconds[-2]) / (bg[-1] - bg[-2])
        return self.seconds[-1] + np.maximum(slope, 0.0) * (b - bg[-1])

    def curve(self, batch_size: int, max_tokens: int) -> np.ndarray:
        """Step time for ``V = 0..max_tokens`` draft tokens at ``batch_size``: float64 [max_tokens + 1],
        non-decreasing. Cached per ``(batch_size, max_tokens)`` (the table is immutable)."""
        key = (int(batch_size), int(max_tokens))
        c = self._curves.get(key)
        if c is None:
            c = self._curve(*key)
            if len(self._curves) > 512:
                self._curves.clear()
            self._curves[key] = c
        return c

    def _curve(self, batch_size: int, max_tokens: int) -> np.ndarray:
        r = self.row(batch_size)
        vg = self.draft_tokens.astype(float)
        v = np.arange(max(int(max_tokens), 0) + 1, dtype=float)
        out = np.interp(v, vg, r)
        beyond = v > vg[-1]
        if beyond.any():
            slope = max((r[-1] - r[-2]) / (vg[-1] - vg[-2]), 0.0)
            out[beyond] = r[-1] + slope * (v[beyond] - vg[-1])
        return out

    def predict(
        self, batch_size: float, draft_tokens: Any, prefill_tokens: Any = 0, sampled: float = 0.0
    ) -> np.ndarray | float:
        """Step time (seconds) of a step with ``batch_size`` requests verifying ``draft_tokens`` draft
        tokens (broadcasts over an array of V) and ``prefill_tokens`` prompt tokens; ``sampled``: the
        share of the requests that sample (0..1, see the module docstring)."""
        v = np.asarray(draft_tokens, dtype=float)
        r = self.row(batch_size)
        if sampled > 0 and self.sampled is not None:
            s = min(float(sampled), 1.0)
            r = (1.0 - s) * r + s * self.sampled.row(batch_size)
        vg = self.draft_tokens.astype(float)
        out = np.interp(v, vg, r)
        slope = max((r[-1] - r[-2]) / (vg[-1] - vg[-2]), 0.0)
        out = np.where(v > vg[-1], r[-1] + slope * (v - vg[-1]), out)
        out = out + self.prefill_s_per_token * np.asarray(prefill_tokens, dtype=float)
        return float(out) if out.ndim == 0 else out

    def speculation_overhead(self, batch_size: float, sampled: bool = False) -> float:
        """Seconds a step pays to verify its first draft token: ``t(B, 1) - t(B, 0)`` (of the
        sampled table with ``sampled``)."""
        r = (self.for_sampling() if sampled else self).row(batch_size)
        return float(r[1] - r[0])

    def measured_batch_max(self) -> int:
        """The largest batch size with a measured cell (0 when none is: a prior)."""
        if self.counts is None:
            return 0
        rows = np.flatnonzero(self.counts.sum(axis=1) > 0)
        return int(self.batch_sizes[rows[-1]]) if rows.size else 0

    def matches(self, key: Mapping[str, Any], fields: tuple[str, ...] = ("model", "dtype")) -> bool:
        """Whether this table was measured for the same ``fields`` of ``key``."""
        return all(self.key.get(f) == key.get(f) for f in fields)


def nearest_index(grid: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the nearest grid point to each ``x`` on a ``log1p`` scale (int64, same shape)."""
    lg = np.log1p(grid.astype(float))
    lx = np.log1p(np.maximum(np.asarray(x, dtype=float), 0.0))
    j = np.clip(np.searchsorted(lg, lx), 1, grid.size - 1)
    left = lx - lg[j - 1] <= lg[j] - lx
    return np.where(left, j - 1, j).astype(np.int64)


def fill_table(batch_grid: np.ndarray, token_grid: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Fill the NaN cells of a [nb, nv] table: within each row with a measured cell, along ``V``;
    then rows without any: between measured rows along ``B`` column by column (:func:`_fill_row`
    rules); beyond them, the no-draft column extrapolated along ``B`` plus the nearest measured row's
    price of draft tokens (``t(B, V) - t(B, 0)``; the module docstring says why).

    Raises
    ------
    ValueError
        If no cell is measured.
    """
    t = np.array(values, dtype=float)
    known = np.isfinite(t)
    if not known.any():
        raise ValueError("the table has no measured cell")
    rows_known = known.any(axis=1)
    for i in np.flatnonzero(rows_known):
        t[i] = _fill_row(token_grid, t[i], known[i])
    for j in range(t.shape[1]):
        t[:, j] = _fill_row(batch_grid, t[:, j], rows_known)
    measured = np.flatnonzero(rows_known)
    lo, hi = int(measured[0]), int(measured[-1])
    t[hi + 1 :] = t[hi + 1 :, :1] + (t[hi] - t[hi, 0])
    t[:lo] = np.maximum(t[:lo, :1] + (t[lo] - t[lo, 0]), 1e-9)
    return t


def prior_table(step_s: float = 0.02, *, key: Mapping[str, Any] | None = None) -> StepCostTable:
    """A generic prior shape for an engine nobody has measured: a decode step of ``step_s`` seconds at
    batch 1, +3 % per extra request, +5 % to speculate at all and +1.5 % per draft token (a CPU-like,
    deliberately pessimistic shape; calibration or online corrections replace it)."""
    bg = np.asarray(BATCH_GRID, dtype=np.int64)
    vg = np.asarray(TOKEN_GRID, dtype=np.int64)
    base = step_s * (1.0 + 0.03 * (bg.astype(float) - 1.0))
    spec = (vg > 0) * 0.05 + 0.015 * vg.astype(float)
    t = base[:, None] * (1.0 + spec[None, :])
    return StepCostTable(bg, vg, t, key=dict(key or {}), source="prior")
