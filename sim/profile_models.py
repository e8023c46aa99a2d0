"""Step-time models of a replay: what a step costs as a function of what it computes.

A step is described by ``B`` (requests in the step, batch size), ``V`` (draft tokens verified),
``D`` (draft-model forward passes: the largest k among requests drafting with a draft model, whose
passes run batched and sequentially, :func:`is_draft_model`) and ``P`` (prompt tokens prefilled in
the step).

* :class:`LinearCostProfile`: ``t = c0 + c_batch * B + c_token * V + c_draft_pass * D +
  c_prefill_token * P``; :func:`adaptive_spec.sim.profile_fit.fit_linear_profile` fits it to a
  trace's measured step times.
* :class:`RooflineCostProfile`: a memory-bound accelerator (the regime speculative decoding was
  designed for, Leviathan et al. 2023): a step costs ``base_s`` while the tokens it processes
  (``B + V + P``) stay under ``flat_tokens``, then ``per_token_s`` per extra token (compute-bound);
  a draft pass costs ``draft_ratio * base_s``.
* :class:`TabulatedCostProfile`: measured step times on a grid of batch size x tokens per request,
  interpolated.
* :class:`TableCostProfile`: the controller's own measured step-cost table.

Every profile provides :meth:`CostProfile.minorants`: linear functions with non-negative
coefficients that lie below it everywhere; the oracle bound (:mod:`adaptive_spec.sim.oracle`) needs
them to be a valid bound.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from adaptive_spec.core.cost_table import StepCostTable

COEF_NAMES = ("c0", "c_batch", "c_token", "c_draft_pass", "c_prefill_token")


@dataclass(frozen=True, slots=True)
class LinearCoefficients:
    """``t >= c0 + c_batch * B + c_token * V + c_draft_pass * D + c_prefill_token * P`` (seconds)."""

    c0: float
    c_batch: float = 0.0
    c_token: float = 0.0
    c_draft_pass: float = 0.0
    c_prefill_token: float = 0.0

    def __post_init__(self) -> None:
        for name in COEF_NAMES:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(
                    f"{name}={v!r} is invalid; allowed: a finite number >= 0 (seconds)"
                )

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in COEF_NAMES], dtype=float)


#: A step count: a number, or a numpy array of them (profiles broadcast over arrays).
StepCount = np.ndarray | float


def is_draft_model(proposer: str) -> bool:
    """Whether a proposer runs a draft model (its passes are charged as ``D``)."""
    return proposer == "draft" or proposer.startswith("lora:")


def step_counts(
    batch_size: StepCount,
    verified_tokens: StepCount,
    draft_passes: StepCount,
    prefill_tokens: StepCount,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(B, V, D, P)`` of a step as float64 arrays (0-d for numbers).

    Raises
    ------
    ValueError
        For a negative count.
    """
    B, V, D, P = (
        np.asarray(x, dtype=float)
        for x in (batch_size, verified_tokens, draft_passes, prefill_tokens)
    )
    if (B < 0).any() or (V < 0).any() or (D < 0).any() or (P < 0).any():
        raise ValueError(
            "batch_size, verified_tokens, draft_passes and prefill_tokens must be >= 0"
        )
    return B, V, D, P


def secant_coefficients(
    profile: CostProfile,
    batch_size: int,
    verified_tokens: float,
    c_draft_pass: float,
    c_prefill_token: float,
) -> LinearCoefficients:
    """Secant slopes of ``profile`` at ``batch_size`` (at least 1): per verified token between no
    speculation and ``verified_tokens`` (at least 1), per request between batch 1 and
    ``batch_size``; the intercept is what remains of the step time without speculation (>= 0).
    Draft passes and prefill tokens cost the given seconds."""
    B = max(int(batch_size), 1)
    t0 = float(profile.step_time(B, 0))
    V = max(float(verified_tokens), 1.0)
    cv = max((float(profile.step_time(B, V)) - t0) / V, 0.0)
    cb = max((t0 - float(profile.step_time(1, 0))) / max(B - 1, 1), 0.0)
    return LinearCoefficients(max(t0 - cb * B, 0.0), cb, cv, c_draft_pass, c_prefill_token)


class CostProfile(ABC):
    """Step time model for replay. Subclasses give :meth:`step_time` and :meth:`minorants`."""

    name: str = "profile"
    source: str = ""

    @abstractmethod
    def step_time(
        self,
        batch_size: StepCount,
        verified_tokens: StepCount,
        draft_passes: StepCount = 0,
        prefill_tokens: StepCount = 0,
    ) -> StepCount:
        """Step time in seconds (float, or float64 array of the broadcast shape of the counts).

        Raises
        ------
        ValueError
            For a negative count.
        """

    @abstractmethod
    def minorants(self) -> list[LinearCoefficients]:
        """Linear functions (non-negative coefficients) below :meth:`step_time` for all ``B >= 1``."""

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        """Per-unit costs near an operating point (used to attribute step time to requests); default:
        the first minorant."""
        return self.minorants()[0]

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source}


class CountsCostProfile(CostProfile):
    """A profile computed on the step's counts as float64 arrays: subclasses give
    :meth:`_seconds`; :meth:`step_time` checks the counts (:func:`step_counts`) and returns a float
    for numbers."""

    def step_time(
        self,
        batch_size: StepCount,
        verified_tokens: StepCount,
        draft_passes: StepCount = 0,
        prefill_tokens: StepCount = 0,
    ) -> StepCount:
        t = self._seconds(*step_counts(batch_size, verified_tokens, draft_passes, prefill_tokens))
        return float(t) if np.ndim(t) == 0 else t

    @abstractmethod
    def _seconds(self, B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> np.ndarray:
        """Step time in seconds of counts ``B, V, D, P`` (float64, broadcast together; 0-d for a
        single step)."""


@dataclass(slots=True)
class LinearCostProfile(CountsCostProfile):
    """``t = c0 + c_batch B + c_token V + c_draft_pass D + c_prefill_token P`` (all seconds, >= 0).

    Examples
    --------
    >>> prof = LinearCostProfile(0.027, 0.002, 0.0005)
    >>> round(float(prof.step_time(4, 32)), 4)
    0.051
    """

    c0: float
    c_batch: float = 0.0
    c_token: float = 0.0
    c_draft_pass: float = 0.0
    c_prefill_token: float = 0.0
    name: str = "linear"
    source: str = "given as parameters"
    fit: dict = field(default_factory=dict)
    _coef: LinearCoefficients | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._coef = LinearCoefficients(
            self.c0, self.c_batch, self.c_token, self.c_draft_pass, self.c_prefill_token
        )
        if self.c0 + self.c_batch <= 0:
            raise ValueError("c0 + c_batch must be > 0: a step cannot be free")

    def _seconds(self, B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> np.ndarray:
        return (
            self.c0
            + self.c_batch * B
            + self.c_token * V
            + self.c_draft_pass * D
            + self.c_prefill_token * P
        )

    def minorants(self) -> list[LinearCoefficients]:
        return [self._coef]

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        return self._coef

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            **{n: getattr(self, n) for n in COEF_NAMES},
            **({"fit": self.fit} if self.fit else {}),
        }


@dataclass(slots=True)
class RooflineCostProfile(CountsCostProfile):
    """Flat-then-linear step time of a memory-bound accelerator.

    ``t = base_s + per_token_s * max(0, B + V + P - flat_tokens) + draft_ratio * base_s * D``

    Parameters
    ----------
    base_s : float > 0
        Time of a step whose tokens fit under the threshold (weights read once: memory-bound).
    flat_tokens : float >= 1
        Tokens per step up to which verification is free (the batch threshold).
    per_token_s : float >= 0
        Cost of each token beyond the threshold (compute-bound slope).
    draft_ratio : float >= 0
        Cost of one draft-model pass relative to ``base_s`` (e.g. 0.05 for a draft 20x cheaper).
    """

    base_s: float
    flat_tokens: float
    per_token_s: float
    draft_ratio: float = 0.05
    name: str = "roofline"
    source: str = "given as parameters"

    def __post_init__(self) -> None:
        checks = (
            ("base_s", self.base_s, self.base_s > 0),
            ("flat_tokens", self.flat_tokens, self.flat_tokens >= 1),
            ("per_token_s", self.per_token_s, self.per_token_s >= 0),
            ("draft_ratio", self.draft_ratio, self.draft_ratio >= 0),
        )
        for name, v, ok in checks:
            if not (isinstance(v, int | float) and math.isfinite(v) and ok):
                raise ValueError(
                    f"{name}={v!r} is out of range (see RooflineCostProfile's docstring)"
                )

    def _seconds(self, B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> np.ndarray:
        tok = B + V + P
        t = self.base_s + self.per_token_s * np.maximum(0.0, tok - self.flat_tokens)
        return t + self.draft_ratio * self.base_s * D

    def minorants(self) -> list[LinearCoefficients]:
        """Convex combinations of the two pieces with non-negative intercept: for lambda in [0, lmax],
        ``(1 - lambda) * base + lambda * (base + s (tokens - T))``, lmax = min(1, base / (s T))."""
        cd = self.draft_ratio * self.base_s
        out = [LinearCoefficients(self.base_s, c_draft_pass=cd)]
        s, T = self.per_token_s, self.flat_tokens
        if s > 0:
            lmax = min(1.0, self.base_s / (s * T))
            for lam in (0.5 * lmax, lmax):
                c0 = max(self.base_s - lam * s * T, 0.0)
                out.append(LinearCoefficients(c0, lam * s, lam * s, cd, lam * s))
        return out

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        cd = self.draft_ratio * self.base_s
        if batch_size + verified_tokens <= self.flat_tokens or self.per_token_s == 0:
            return LinearCoefficients(self.base_s, c_draft_pass=cd)
        s = self.per_token_s
        c0 = max(self.base_s - s * self.flat_tokens, 0.0)
        return LinearCoefficients(c0, s, s, cd, s)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "base_s": self.base_s,
            "flat_tokens": self.flat_tokens,
            "per_token_s": self.per_token_s,
            "draft_ratio": self.draft_ratio,
        }


@dataclass(slots=True)
class TabulatedCostProfile(CountsCostProfile):
    """Measured step times on a grid of batch size x tokens per request, interpolated.

    A step with ``B`` requests verifying ``V`` draft tokens in all is looked up at ``T = 1 + V / B``
    tokens per request, linearly in ``log2(B)`` and ``T`` between grid points and extrapolated
    linearly beyond them (:class:`scipy.interpolate.RegularGridInterpolator`); draft-model passes cost
    ``D`` times the measured single-token draft step at that batch size; prefill costs
    ``prefill_s_per_token`` per prompt token.

    Parameters
    ----------
    batch_sizes : tuple of int
        Increasing, >= 1.
    tokens_per_request : tuple of int
        Increasing, starting at 1 (no speculation).
    step_s : tuple of tuple of float
        ``[len(batch_sizes)][len(tokens_per_request)]`` seconds, > 0.
    draft_step_s : tuple of float
        One draft pass per batch size (seconds, >= 0).
    prefill_s_per_token : float >= 0
    """

    batch_sizes: tuple[int, ...]
    tokens_per_request: tuple[int, ...]
    step_s: tuple[tuple[float, ...], ...]
    draft_step_s: tuple[float, ...]
    prefill_s_per_token: float = 0.0
    name: str = "tabulated"
    source: str = "given as parameters"
    _interp: object = field(default=None, init=False, repr=False, compare=False)
    _dinterp: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from scipy.interpolate import RegularGridInterpolator

        b = np.asarray(self.batch_sizes, dtype=float)
        t = np.asarray(self.tokens_per_request, dtype=float)
        v = np.asarray(self.step_s, dtype=float)
        d = np.asarray(self.draft_step_s, dtype=float)
        if b.ndim != 1 or b.size < 2 or (np.diff(b) <= 0).any() or b[0] < 1:
            raise ValueError(f"batch_sizes={self.batch_sizes!r}: need >= 2 increasing values >= 1")
        if t.ndim != 1 or t.size < 2 or (np.diff(t) <= 0).any() or t[0] != 1:
            raise ValueError(
                f"tokens_per_request={self.tokens_per_request!r}: need >= 2 increasing values from 1"
            )
        if v.shape != (b.size, t.size) or not np.isfinite(v).all() or (v <= 0).any():
            raise ValueError(f"step_s must be {b.size} x {t.size} finite values > 0")
        if d.shape != b.shape or not np.isfinite(d).all() or (d < 0).any():
            raise ValueError(f"draft_step_s must hold {b.size} finite values >= 0")
        if not (math.isfinite(self.prefill_s_per_token) and self.prefill_s_per_token >= 0):
            raise ValueError(f"prefill_s_per_token={self.prefill_s_per_token!r}; allowed: >= 0")
        self._interp = RegularGridInterpolator(
            (np.log2(b), t), v, method="linear", bounds_error=False, fill_value=None
        )
        self._dinterp = (np.log2(b), d)

    def _seconds(self, B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> np.ndarray:
        Bc = np.maximum(B, 1.0)
        T = 1.0 + V / Bc
        shape = np.broadcast(Bc, T).shape
        pts = np.stack([np.broadcast_to(np.log2(Bc), shape), np.broadcast_to(T, shape)], axis=-1)
        t = self._interp(pts.reshape(-1, 2)).reshape(shape)
        t = np.maximum(t, float(np.min(self.step_s)))
        lb, d = self._dinterp
        return t + D * np.interp(np.log2(Bc), lb, d) + self.prefill_s_per_token * P

    def minorants(self) -> list[LinearCoefficients]:
        return [
            LinearCoefficients(
                float(np.min(self.step_s)),
                c_draft_pass=float(np.min(self.draft_step_s)),
                c_prefill_token=self.prefill_s_per_token,
            )
        ]

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        """Secant slopes (:func:`secant_coefficients`); a draft pass costs the measured one at
        ``batch_size``."""
        lb, d = self._dinterp
        cd = float(np.interp(np.log2(max(int(batch_size), 1)), lb, d))
        return secant_coefficients(self, batch_size, verified_tokens, cd, self.prefill_s_per_token)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "batch_sizes": list(self.batch_sizes),
            "tokens_per_request": list(self.tokens_per_request),
            "step_s": [list(r) for r in self.step_s],
            "draft_step_s": list(self.draft_step_s),
            "prefill_s_per_token": self.prefill_s_per_token,
        }


@dataclass(slots=True)
class TableCostProfile(CountsCostProfile):
    """The controller's own measured step-cost table (:class:`adaptive_spec.core.cost_table.StepCostTable`)
    as a replay profile: replay then prices steps exactly as the controller does (the same table the
    engine recorded in its trace header), so regret against the oracle is measured under one cost
    model. A draft-model pass costs ``draft_pass_s`` per pass (0 for an n-gram engine).

    Parameters
    ----------
    table : StepCostTable
    draft_pass_s : float >= 0
    scale : float > 0
        Multiplies every step (e.g. a load factor).
    """

    table: StepCostTable
    draft_pass_s: float = 0.0
    scale: float = 1.0
    name: str = "table"
    source: str = "the controller's measured step-cost table"

    def __post_init__(self) -> None:
        for n in ("draft_pass_s", "scale"):
            v = getattr(self, n)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{n}={v!r} is invalid; allowed: a finite number >= 0")
        if self.scale <= 0:
            raise ValueError(f"scale={self.scale!r} is invalid; allowed: > 0")

    def _seconds(self, B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> np.ndarray:
        if B.ndim == 0:
            t = np.asarray(self.table.predict(float(max(B, 1.0)), V, P))
        else:
            bb = np.broadcast_to(np.maximum(B, 1.0), np.broadcast(B, V, P).shape)
            vv = np.broadcast_to(V, bb.shape)
            pp = np.broadcast_to(P, bb.shape)
            t = np.array(
                [
                    self.table.predict(b, v, p)
                    for b, v, p in zip(bb.flat, vv.flat, pp.flat, strict=True)
                ]
            )
            t = t.reshape(bb.shape)
        return self.scale * t + self.draft_pass_s * D

    def minorants(self) -> list[LinearCoefficients]:
        sec = self.table.seconds * self.scale
        b = self.table.batch_sizes.astype(float)
        v = self.table.draft_tokens.astype(float)
        c_batch = max(float(np.min(np.diff(sec[:, 0]) / np.diff(b))), 0.0)
        c0 = max(float(sec[0, 0]) - c_batch * b[0], 0.0)
        c_token = max(float(np.min((sec[:, 1:] - sec[:, :1]) / v[None, 1:])), 0.0)
        return [
            LinearCoefficients(
                c0,
                c_batch,
                c_token,
                self.draft_pass_s,
                self.table.prefill_s_per_token * self.scale,
            )
        ]

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        """Secant slopes (:func:`secant_coefficients`)."""
        return secant_coefficients(
            self,
            batch_size,
            verified_tokens,
            self.draft_pass_s,
            self.table.prefill_s_per_token * self.scale,
        )

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "table": self.table.to_dict(),
            "draft_pass_s": self.draft_pass_s,
            "scale": self.scale,
        }
