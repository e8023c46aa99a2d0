"""Online model of engine step time.

The step time of a speculative engine is, to first order, linear in the batch size ``B`` and the number
of draft tokens verified ``V`` (plus a draft-model term when a draft model runs), but the coefficients
depend on the hardware and drift with load, so they are measured, never assumed: recursive least squares
with exponential forgetting (Haykin, *Adaptive Filter Theory*, ch. 10) on
``step_time ~ c0 + c1 * B + c2 * V + c3 * P + c4 * R``, where ``P`` counts prompt (prefill) tokens
computed in the step (prefill steps cost far more than decode steps and would otherwise be confused with
verification) and ``R`` the requests that verify at least one draft token: on vLLM's CPU build a
request's first draft token costs about twice the next ones (measured in ``docs/benchmarks.md``: at
batch 4, k = 1 for every request adds about 2 ms per draft token, k = 8 about 1 ms, i.e. about 1.1 ms
per speculating request plus 0.9 ms per draft token), a fixed cost per speculating request that a
purely linear model in ``V`` spreads over the tokens, which makes short low-acceptance drafts look cheap. Forgetting keeps the local linearisation near the current
operating point, where the true curve is not linear (NOTES.md: verifying 8 tokens costs about 1.15x one
token at batch 1 and 1.37x at batch 4 on the CPU here).

Coefficients are clipped at the floor ``min_coef`` when predicting, so the model never claims that
verification is free or that time can be negative, and a step time that is NaN, infinite, zero or
negative is ignored and counted, never learned from.
"""

from __future__ import annotations

import math

import numpy as np

FEATURES = ("bias", "batch_size", "verified_tokens", "prefill_tokens", "speculating_requests")
# Weak prior, relative to the first observed step time t0 (a Bayesian prior that measurements replace):
# intercept t0 (sd t0), per request 0 (sd t0 / 4), per verified token 2 % of t0 (sd 2 % of t0; NOTES.md
# measured 2-5 % per token on this CPU), per prefill token 0 (sd 1 % of t0), per speculating request 0
# (sd 5 % of t0).
PRIOR_MEAN = (1.0, 0.0, 0.02, 0.0, 0.0)
PRIOR_SD = (1.0, 0.25, 0.02, 0.01, 0.05)
# Expected step-time noise, relative to t0. RLS's P is the coefficient covariance divided by the noise
# variance, so the prior enters as (PRIOR_SD / NOISE_SD)^2.
NOISE_SD = 0.1


class StepCostModel:
    """Recursive least squares for step time (seconds) from ``(batch_size, verified_tokens)``.

    Parameters
    ----------
    forgetting : float in (0, 1]
        Weight kept by past observations at each update (1 = stationary).
    prior_scale : float > 0
        Multiplies the prior standard deviations (``PRIOR_SD``, relative to the first observed step time).
    min_coef : float >= 0
        Floor on the per-request and per-token coefficients when predicting (seconds).

    Raises
    ------
    ValueError
        For a parameter outside its range.
    """

    def __init__(
        self, forgetting: float = 0.995, prior_scale: float = 1.0, min_coef: float = 1e-6
    ) -> None:
        if not (0.0 < forgetting <= 1.0):
            raise ValueError(f"forgetting={forgetting!r} is invalid; allowed: 0 < forgetting <= 1")
        if not (prior_scale > 0 and math.isfinite(prior_scale)):
            raise ValueError(
                f"prior_scale={prior_scale!r} is invalid; allowed: a finite number > 0"
            )
        if not (min_coef >= 0 and math.isfinite(min_coef)):
            raise ValueError(f"min_coef={min_coef!r} is invalid; allowed: a finite number >= 0")
        self.forgetting = float(forgetting)
        self.prior_scale = float(prior_scale)
        self.min_coef = float(min_coef)
        self.theta = np.zeros(len(FEATURES))
        self.P = np.eye(len(FEATURES))
        self.n_updates = 0
        self.n_ignored = 0

    @staticmethod
    def _phi(
        batch_size: float,
        verified_tokens: float,
        prefill_tokens: float = 0.0,
        speculating_requests: float | None = None,
    ) -> np.ndarray:
        v = float(verified_tokens)
        r = (1.0 if v > 0 else 0.0) if speculating_requests is None else float(speculating_requests)
        return np.array([1.0, float(batch_size), v, float(prefill_tokens), r])

    def update(
        self,
        batch_size: int,
        verified_tokens: int,
        step_time_s: float,
        prefill_tokens: int = 0,
        speculating_requests: int | None = None,
    ) -> bool:
        """Learn from one step. ``speculating_requests`` (requests verifying >= 1 draft token) defaults to
        ``1 if verified_tokens > 0 else 0``. Returns False (and counts it) when the observation is
        ignored."""
        if (
            not isinstance(step_time_s, int | float)
            or not math.isfinite(step_time_s)
            or step_time_s <= 0
            or batch_size <= 0
            or verified_tokens < 0
            or prefill_tokens < 0
            or (speculating_requests is not None and speculating_requests < 0)
        ):
            self.n_ignored += 1
            return False
        if self.n_updates == 0:
            t0 = float(step_time_s)
            self.theta = np.array(PRIOR_MEAN) * t0
            self.P = np.diag((np.array(PRIOR_SD) * self.prior_scale / NOISE_SD) ** 2)
        x = self._phi(batch_size, verified_tokens, prefill_tokens, speculating_requests)
        lam = self.forgetting
        Px = self.P @ x
        gain = Px / (lam + x @ Px)
        err = step_time_s - x @ self.theta
        self.theta = self.theta + gain * err
        self.P = (self.P - np.outer(gain, Px)) / lam
        # Keep P symmetric and bounded (numerical hygiene for long runs with little excitation).
        self.P = 0.5 * (self.P + self.P.T)
        np.clip(self.P, -1e6, 1e6, out=self.P)
        self.n_updates += 1
        return True

    def coefficients(self) -> tuple[float, float, float, float, float]:
        """``(c0, c_batch, c_token, c_prefill, c_request)`` in seconds, floors applied."""
        c0, cb, cv, cp, cs = (max(float(c), self.min_coef) for c in self.theta)
        return c0, cb, cv, cp, cs

    def predict(
        self,
        batch_size: np.ndarray | float,
        verified_tokens: np.ndarray | float,
        prefill_tokens: np.ndarray | float = 0.0,
        speculating_requests: np.ndarray | float | None = None,
    ) -> np.ndarray:
        """Predicted step time (seconds) for each ``(batch_size, verified_tokens, prefill_tokens,
        speculating_requests)``; broadcasts. ``speculating_requests`` defaults to
        ``1 if verified_tokens > 0 else 0``."""
        c0, cb, cv, cp, cr = self.coefficients()
        v = np.asarray(verified_tokens, dtype=float)
        r = (
            (v > 0).astype(float)
            if speculating_requests is None
            else np.asarray(speculating_requests, dtype=float)
        )
        return (
            c0
            + cb * np.asarray(batch_size, dtype=float)
            + cv * v
            + cp * np.asarray(prefill_tokens, dtype=float)
            + cr * r
        )

    def state_dict(self) -> dict:
        return {
            "forgetting": self.forgetting,
            "prior_scale": self.prior_scale,
            "min_coef": self.min_coef,
            "theta": self.theta.tolist(),
            "P": self.P.tolist(),
            "n_updates": self.n_updates,
            "n_ignored": self.n_ignored,
        }

    def load_state_dict(self, state: dict) -> None:
        theta = np.asarray(state["theta"], dtype=float)
        P = np.asarray(state["P"], dtype=float)
        n = len(FEATURES)
        if theta.shape == (n - 1,) and P.shape == (n - 1, n - 1):
            # A state saved before the per-request term existed: that term starts at its prior.
            t0 = float(theta[0]) if theta[0] > 0 else 1.0
            theta = np.append(theta, PRIOR_MEAN[-1] * t0)
            grown = np.zeros((n, n))
            grown[: n - 1, : n - 1] = P
            grown[-1, -1] = (PRIOR_SD[-1] * float(state.get("prior_scale", 1.0)) / NOISE_SD) ** 2
            P = grown
        if (
            theta.shape != (n,)
            or P.shape != (n, n)
            or not (np.isfinite(theta).all() and np.isfinite(P).all())
        ):
            raise ValueError("cost model state has wrong shapes or non-finite values")
        # Validate every field before assigning any (a refused state leaves the model unchanged).
        checked = StepCostModel(
            forgetting=float(state["forgetting"]),
            prior_scale=float(state["prior_scale"]),
            min_coef=float(state["min_coef"]),
        )
        counts = (state["n_updates"], state["n_ignored"])
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"cost model state has counts {counts!r}; expected integers >= 0")
        self.forgetting = checked.forgetting
        self.prior_scale = checked.prior_scale
        self.min_coef = checked.min_coef
        self.theta, self.P = theta, P
        self.n_updates, self.n_ignored = counts
