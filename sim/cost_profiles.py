"""Cost profiles: the engine step time a replay charges, as a function of what the step computes.

A step is described by ``B`` (requests in the step, batch size), ``V`` (draft tokens verified),
``D`` (draft-model forward passes: the largest k among requests drafting with a draft model, whose
passes run batched and sequentially) and ``P`` (prompt tokens prefilled in the step).

* :class:`LinearCostProfile`: ``t = c0 + c_batch * B + c_token * V + c_draft_pass * D +
  c_prefill_token * P``. :func:`fit_linear_profile` fits it to a trace's measured ``step_time_s`` by
  bounded (non-negative) least squares with one round of outlier removal (scipy ``lsq_linear``).
* :class:`RooflineCostProfile`: a memory-bound accelerator (the regime speculative decoding was
  designed for, Leviathan et al. 2023): a step costs ``base_s`` while the tokens it processes
  (``B + V + P``) stay under ``flat_tokens``, then ``per_token_s`` per extra token (compute-bound);
  a draft pass costs ``draft_ratio * base_s``.

:data:`PRESETS` holds named profiles, each with its source. Every profile provides
:meth:`CostProfile.minorants`: linear functions with non-negative coefficients that lie below it
everywhere; the oracle bound (:mod:`adaptive_spec.sim.oracle`) needs them to be a valid bound.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.trace import Trace

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


def _check_step(B: np.ndarray, V: np.ndarray, D: np.ndarray, P: np.ndarray) -> None:
    if (B < 0).any() or (V < 0).any() or (D < 0).any() or (P < 0).any():
        raise ValueError(
            "batch_size, verified_tokens, draft_passes and prefill_tokens must be >= 0"
        )


class CostProfile(ABC):
    """Step time model for replay. Subclasses give :meth:`step_time` and :meth:`minorants`."""

    name: str = "profile"
    source: str = ""

    @abstractmethod
    def step_time(
        self,
        batch_size: np.ndarray | float,
        verified_tokens: np.ndarray | float,
        draft_passes: np.ndarray | float = 0,
        prefill_tokens: np.ndarray | float = 0,
    ) -> np.ndarray | float:
        """Step time in seconds; broadcasts over numpy arrays.

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


@dataclass(slots=True)
class LinearCostProfile(CostProfile):
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

    def step_time(self, batch_size, verified_tokens, draft_passes=0, prefill_tokens=0):
        B, V, D, P = (
            np.asarray(x, dtype=float)
            for x in (batch_size, verified_tokens, draft_passes, prefill_tokens)
        )
        _check_step(B, V, D, P)
        t = (
            self.c0
            + self.c_batch * B
            + self.c_token * V
            + self.c_draft_pass * D
            + self.c_prefill_token * P
        )
        return float(t) if np.ndim(t) == 0 else t

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
class RooflineCostProfile(CostProfile):
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

    def step_time(self, batch_size, verified_tokens, draft_passes=0, prefill_tokens=0):
        B, V, D, P = (
            np.asarray(x, dtype=float)
            for x in (batch_size, verified_tokens, draft_passes, prefill_tokens)
        )
        _check_step(B, V, D, P)
        tok = B + V + P
        t = self.base_s + self.per_token_s * np.maximum(0.0, tok - self.flat_tokens)
        t = t + self.draft_ratio * self.base_s * D
        return float(t) if np.ndim(t) == 0 else t

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
class TabulatedCostProfile(CostProfile):
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

    def step_time(self, batch_size, verified_tokens, draft_passes=0, prefill_tokens=0):
        B, V, D, P = (
            np.asarray(x, dtype=float)
            for x in (batch_size, verified_tokens, draft_passes, prefill_tokens)
        )
        _check_step(B, V, D, P)
        Bc = np.maximum(B, 1.0)
        T = 1.0 + V / Bc
        shape = np.broadcast(Bc, T).shape
        pts = np.stack([np.broadcast_to(np.log2(Bc), shape), np.broadcast_to(T, shape)], axis=-1)
        t = self._interp(pts.reshape(-1, 2)).reshape(shape)
        t = np.maximum(t, float(np.min(self.step_s)))
        lb, d = self._dinterp
        t = t + D * np.interp(np.log2(Bc), lb, d) + self.prefill_s_per_token * P
        return float(t) if np.ndim(t) == 0 else t

    def minorants(self) -> list[LinearCoefficients]:
        return [
            LinearCoefficients(
                float(np.min(self.step_s)),
                c_draft_pass=float(np.min(self.draft_step_s)),
                c_prefill_token=self.prefill_s_per_token,
            )
        ]

    def linearize(self, batch_size: int, verified_tokens: float) -> LinearCoefficients:
        """Secant slopes at ``batch_size`` between no speculation and ``verified_tokens``."""
        B = max(int(batch_size), 1)
        t0 = float(self.step_time(B, 0))
        V = max(float(verified_tokens), 1.0)
        cv = max((float(self.step_time(B, V)) - t0) / V, 0.0)
        cb = max((t0 - float(self.step_time(1, 0))) / max(B - 1, 1), 0.0)
        c0 = max(t0 - cb * B, 0.0)
        lb, d = self._dinterp
        cd = float(np.interp(np.log2(B), lb, d))
        return LinearCoefficients(c0, cb, cv, cd, self.prefill_s_per_token)

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
class TableCostProfile(CostProfile):
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

    def step_time(self, batch_size, verified_tokens, draft_passes=0, prefill_tokens=0):
        B, V, D, P = (
            np.asarray(x, dtype=float)
            for x in (batch_size, verified_tokens, draft_passes, prefill_tokens)
        )
        _check_step(B, V, D, P)
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
        t = self.scale * t + self.draft_pass_s * D
        return float(t) if np.ndim(t) == 0 else t

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
        B = max(int(batch_size), 1)
        t0 = float(self.step_time(B, 0))
        V = max(float(verified_tokens), 1.0)
        cv = max((float(self.step_time(B, V)) - t0) / V, 0.0)
        cb = max((t0 - float(self.step_time(1, 0))) / max(B - 1, 1), 0.0)
        return LinearCoefficients(
            max(t0 - cb * B, 0.0),
            cb,
            cv,
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


# Measured with sim/measure_profile.py on one NVIDIA H200 (PyTorch 2.11.0+cu130, bf16, CUDA graphs):
# a decoder with Llama-3-8B's shapes (random weights), KV cache of 1024 tokens, one step of B requests
# with T = k + 1 new tokens each; median of 20 replays. The draft is a 1B-shaped decoder (hidden 2048,
# 16 layers): about 0.25 of a target step per pass. Prefill: (9.378 - 6.550) ms / 128 tokens at B = 1.
# The jump from T = 1 to T = 2 at large B is PyTorch's attention: its grouped-query kernel for one
# query token is 3.7x faster per layer than for two or more (0.07 vs 0.26 ms at B = 64).
H200_LLAMA8B_MS = (
    (5.083, 5.585, 5.598, 5.632, 5.701),
    (5.332, 5.715, 5.748, 5.807, 5.882),
    (5.710, 7.349, 7.468, 7.725, 8.236),
    (7.419, 15.083, 15.185, 17.482, 24.145),
)


PRESETS: dict[str, CostProfile] = {
    # Linearised from step times measured in vLLM here: vLLM 0.32 CPU build, SmolLM2-135M bf16,
    # 2 threads: one step at batch 1 costs about 29 ms with no drafts and 35 ms verifying 8; at batch 4
    # about 35 ms with no drafts and 48 ms verifying 32 (8 per request). Least squares over these four
    # points: c0 = 28.8 ms, c_batch = 1.46 ms, c_token = 0.43 ms. A draft pass of a 2-layer cut costs
    # about 0.17 of a target pass (measured with transformers): 0.17 * 29 ms = 4.9 ms. The prefill
    # cost per prompt token (0.05 ms) is an assumption, not a measurement.
    "cpu-smollm2": LinearCostProfile(
        0.0288,
        0.00146,
        0.00043,
        0.0049,
        0.00005,
        name="cpu-smollm2",
        source="step times measured in vLLM 0.32 CPU (SmolLM2-135M bf16, 2 threads), linearised",
    ),
    # An assumed memory-bound GPU (not measured here): verifying k tokens costs the same as one until
    # a step holds 256 tokens, then compute-bound; a draft model 20x cheaper than the target.
    "gpu-flat": RooflineCostProfile(
        base_s=0.020,
        flat_tokens=256,
        per_token_s=0.020 / 256,
        draft_ratio=0.05,
        name="gpu-flat",
        source="assumed parameters: memory-bound accelerator, flat up to 256 tokens/step, draft ratio 0.05",
    ),
    # The same shape with a low threshold: verification stops being free at 32 tokens per step, so the
    # best k falls with batch size (the regime SmartSpec studies).
    "gpu-tight": RooflineCostProfile(
        base_s=0.020,
        flat_tokens=32,
        per_token_s=0.020 / 64,
        draft_ratio=0.05,
        name="gpu-tight",
        source="assumed parameters: flat up to 32 tokens/step, then 0.3 ms per token, draft ratio 0.05",
    ),
    "h200-llama8b": TabulatedCostProfile(
        batch_sizes=(1, 4, 16, 64),
        tokens_per_request=(1, 2, 3, 5, 9),
        step_s=tuple(tuple(v / 1e3 for v in row) for row in H200_LLAMA8B_MS),
        draft_step_s=(0.001250, 0.001333, 0.001435, 0.001877),
        prefill_s_per_token=(9.378 - 6.550) / 128 / 1e3,
        name="h200-llama8b",
        source="measured: sim/measure_profile.py on one H200, Llama-3-8B-shaped decoder in PyTorch "
        "(bf16, CUDA graphs, 1024-token KV cache), 1B-shaped draft; not vLLM's kernels",
    ),
}


@dataclass(slots=True)
class StepFeatures:
    """Per-step regressors of a trace (float arrays of equal length): batch size, verified tokens,
    draft passes, prefill tokens, and the measured step time (seconds)."""

    batch_size: np.ndarray
    verified_tokens: np.ndarray
    draft_passes: np.ndarray
    prefill_tokens: np.ndarray
    step_time_s: np.ndarray

    def matrix(self) -> np.ndarray:
        """Design matrix ``[n, 5]`` with a leading column of ones."""
        n = self.batch_size.shape[0]
        return np.column_stack(
            [
                np.ones(n),
                self.batch_size,
                self.verified_tokens,
                self.draft_passes,
                self.prefill_tokens,
            ]
        )


def is_draft_model(proposer: str) -> bool:
    """Whether a proposer runs a draft model (its passes are charged as ``D``)."""
    return proposer == "draft" or proposer.startswith("lora:")


def step_features(trace: Trace) -> StepFeatures:
    """Regressors of every step with a finite positive ``step_time_s``.

    Draft passes: the largest ``drafted`` among the step's requests whose arm is a draft model;
    prefill tokens: the step's ``num_prefill_tokens`` when logged, else the prompt lengths of the
    requests in their first step (``num_output_before == 0``).
    """
    rows = []
    for s in trace.steps:
        t = s.get("step_time_s")
        if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
            continue
        D = 0
        P = 0
        for r in s.get("requests", []):
            arm = str(r.get("arm", "none"))
            if arm != "none" and is_draft_model(arm.rsplit(":", 1)[0]):
                D = max(D, int(r.get("drafted") or 0))
            if r.get("num_output_before") == 0:
                meta = trace.requests.get(r["req_id"], {})
                P += len(meta.get("prompt_token_ids") or [])
        if isinstance(s.get("num_prefill_tokens"), int):
            P = s["num_prefill_tokens"]  # logged by the engine (chunked prefill included)
        B = int(s.get("batch_size") or len(s.get("requests", [])))
        V = int(s.get("num_verified_tokens") or 0)
        rows.append((B, V, D, P, float(t)))
    arr = np.asarray(rows, dtype=float).reshape(-1, 5)
    return StepFeatures(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4])


def fit_linear_profile(
    data: Trace | StepFeatures, *, outlier_mads: float = 6.0, name: str = "fit"
) -> LinearCostProfile:
    """Fit :class:`LinearCostProfile` to measured step times.

    Bounded least squares (all coefficients >= 0, :func:`scipy.optimize.lsq_linear`), then one refit
    without the steps whose residual exceeds ``outlier_mads`` median absolute deviations (the stalls a
    shared machine shows). Columns that never vary (e.g. no draft passes in the trace) get coefficient
    0: the fit cannot know their cost, so replaying arms that need them charges nothing for them
    (``describe()["fit"]["unidentified"]`` lists them).

    Parameters
    ----------
    data : Trace or StepFeatures
    outlier_mads : float > 0
        Outlier threshold.
    name : str
        Profile name.

    Returns
    -------
    LinearCostProfile
        With ``fit`` = ``{"n_steps", "n_outliers", "r2", "rel_rmse", "unidentified"}``.

    Raises
    ------
    ValueError
        With fewer than 5 usable steps.
    """
    from scipy.optimize import lsq_linear

    f = step_features(data) if isinstance(data, Trace) else data
    X, y = f.matrix(), f.step_time_s
    if X.shape[0] < 5:
        raise ValueError(
            f"{X.shape[0]} steps with a positive step_time_s; need >= 5 to fit a cost profile"
        )
    varies = np.ones(X.shape[1], dtype=bool)
    varies[1:] = X[:, 1:].std(axis=0) > 0
    cols = np.flatnonzero(varies)
    scale = np.maximum(np.abs(X[:, cols]).max(axis=0), 1e-12)
    keep = np.ones(X.shape[0], dtype=bool)
    coef = np.zeros(X.shape[1])
    n_out = 0
    for _ in range(2):
        res = lsq_linear(X[keep][:, cols] / scale, y[keep], bounds=(0, np.inf), method="bvls")
        coef = np.zeros(X.shape[1])
        coef[cols] = res.x / scale
        resid = y - X @ coef
        mad = float(np.median(np.abs(resid - np.median(resid)))) or float(np.std(resid)) or 1e-12
        new_keep = np.abs(resid) <= outlier_mads * 1.4826 * mad
        if new_keep.all() or new_keep.sum() < 5 or (new_keep == keep).all():
            break
        keep = new_keep
        n_out = int((~keep).sum())
    pred = X @ coef
    ss_res = float(((y[keep] - pred[keep]) ** 2).sum())
    ss_tot = float(((y[keep] - y[keep].mean()) ** 2).sum())
    c = coef.tolist()
    if c[0] + c[1] <= 0:
        c[0] = float(np.min(y))
    fit = {
        "n_steps": int(X.shape[0]),
        "n_outliers": n_out,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "rel_rmse": math.sqrt(ss_res / max(keep.sum(), 1)) / float(np.mean(y[keep])),
        "unidentified": [COEF_NAMES[i] for i in range(1, 5) if not varies[i]],
    }
    return LinearCostProfile(
        *c, name=name, source="least squares on the trace's step_time_s", fit=fit
    )


def get_profile(spec: str, trace: Trace | None = None) -> CostProfile:
    """A profile from its command-line spelling.

    ``auto`` (``table`` when the trace recorded one, else ``fit``), ``table`` (the controller's
    measured step-cost table from the trace header), ``fit`` (fit to ``trace``), a preset name
    (:data:`PRESETS`), ``linear:c0,c_batch,c_token[,c_draft_pass[,c_prefill_token]]``
    or ``roofline:base_s,flat_tokens,per_token_s[,draft_ratio]`` (seconds).

    Raises
    ------
    ValueError
        For an unknown spelling, bad numbers, or ``fit`` without a trace.
    """
    if spec == "auto":
        spec = "table" if trace is not None and trace.header.get("cost_table") else "fit"
    if spec == "table":
        table = trace.header.get("cost_table") if trace is not None else None
        if not table:
            raise ValueError(
                "profile='table' needs a trace whose header holds the controller's cost table "
                "(recorded by adaptive-spec with a cost-pricing policy); use --profile fit"
            )
        return TableCostProfile(
            StepCostTable.from_dict(table),
            source=f"the recorded run's step-cost table ({trace.header.get('cost_table_source')})",
        )
    if spec == "fit":
        if trace is None:
            raise ValueError("profile='fit' needs a trace to fit")
        return fit_linear_profile(trace)
    if spec in PRESETS:
        return PRESETS[spec]
    kind, _, rest = spec.partition(":")
    try:
        vals = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        vals = None
    if kind == "linear" and vals and 3 <= len(vals) <= 5:
        return LinearCostProfile(*vals, source="given on the command line")
    if kind == "roofline" and vals and 3 <= len(vals) <= 4:
        return RooflineCostProfile(*vals, source="given on the command line")
    raise ValueError(
        f"profile={spec!r} is not known; allowed: auto, table, fit, {', '.join(PRESETS)}, "
        "linear:c0,c_batch,c_token[,c_draft_pass[,c_prefill_token]], roofline:base_s,flat_tokens,per_token_s[,draft_ratio]"
    )


def profile_table(profile: CostProfile, *, max_batch: int = 256, max_k: int = 16) -> StepCostTable:
    """The step-cost table a controller would measure on an engine whose steps cost ``profile``:
    the profile evaluated on the table grid up to ``max_batch`` requests and ``max_batch * max_k``
    draft tokens (the table extrapolates beyond). A :class:`TableCostProfile` gives its own table.
    Replay gives this table to the policies that price steps, so that they and the oracle work
    under one cost model."""
    if isinstance(profile, TableCostProfile) and profile.scale == 1.0 and profile.draft_pass_s == 0:
        return profile.table
    from adaptive_spec.core.cost_table import BATCH_GRID, TOKEN_GRID

    bg = [b for b in BATCH_GRID if b <= max(max_batch, 2)]
    if len(bg) < 2:
        bg = [1, 2]
    vg = [v for v in TOKEN_GRID if v <= max(bg[-1] * max_k, 2)]
    B, V = np.meshgrid(np.asarray(bg, dtype=float), np.asarray(vg, dtype=float), indexing="ij")
    t = np.asarray(profile.step_time(B, V), dtype=float).reshape(B.shape)
    return StepCostTable(
        np.asarray(bg),
        np.asarray(vg),
        t,
        counts=np.full(t.shape, 8.0),
        source=f"profile:{profile.name}",
    )
