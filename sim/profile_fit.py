"""Cost profiles from traces: the per-step regressors of a recorded run and a linear profile fitted
to its measured step times (bounded least squares with one round of outlier removal, scipy
``lsq_linear``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from adaptive_spec.core.trace import Trace

from .profile_models import COEF_NAMES, LinearCostProfile, is_draft_model


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
