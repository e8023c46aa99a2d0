"""Off-policy evaluation (OPE) from logged propensities, for arms without counterfactuals.

Deterministic proposers can be scored after the fact (:mod:`adaptive_spec.sim.counterfactual`); a
sampled draft model, a LoRA adapter or a temperature > 0 request cannot. For those the value of a
target policy ``pi`` is estimated from what the logging policy ``mu`` did, using the propensity
``mu(a_i | x_i)`` the controller logs per request-step (exact with policy ``adaptive-eps``):

* IPS (inverse propensity scoring, Horvitz & Thompson 1952): ``mean(w_i r_i)``,
  ``w_i = pi(a_i | x_i) / mu(a_i | x_i)``; unbiased when ``mu > 0`` wherever ``pi > 0``;
* SNIPS (self-normalised IPS, Swaminathan & Joachims 2015): ``sum(w_i r_i) / sum(w_i)``; slightly
  biased, much lower variance;
* DR (doubly robust, Dudik, Langford & Li 2011): ``mean(q_pi(x_i) + w_i (r_i - q(x_i, a_i)))`` with a
  reward model ``q`` (per-action ridge regression, cross-fitted over two folds so that ``q`` never
  saw the row it corrects); unbiased if either the propensities or ``q`` are right.

Intervals: percentile bootstrap over rows (:func:`evaluate`). :func:`synthetic_logs` builds logs whose
true value is known, for checking the estimators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from adaptive_spec.core.arms import Arm, arm_space
from adaptive_spec.core.trace import Trace

ESTIMATORS = ("ips", "snips", "dr")


@dataclass(slots=True)
class LoggedBandit:
    """Logged bandit feedback.

    Attributes
    ----------
    contexts : numpy.ndarray of float64, shape [n, d]
    actions : numpy.ndarray of int64, shape [n]
        Index into ``action_names`` of the logged action.
    rewards : numpy.ndarray of float64, shape [n]
    propensities : numpy.ndarray of float64, shape [n]
        ``mu(a_i | x_i)`` in (0, 1].
    action_names : list of str
    available : numpy.ndarray of bool, shape [n, A], optional
        Actions that could be played at each row.

    Raises
    ------
    ValueError
        For inconsistent shapes, actions out of range or propensities outside (0, 1].
    """

    contexts: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    propensities: np.ndarray
    action_names: list[str]
    available: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.contexts = np.asarray(self.contexts, dtype=float).reshape(len(self.actions), -1)
        self.actions = np.asarray(self.actions, dtype=np.int64)
        self.rewards = np.asarray(self.rewards, dtype=float)
        self.propensities = np.asarray(self.propensities, dtype=float)
        n, A = self.actions.shape[0], len(self.action_names)
        if self.rewards.shape != (n,) or self.propensities.shape != (n,):
            raise ValueError("actions, rewards and propensities must have the same length n")
        if n and (self.actions.min() < 0 or self.actions.max() >= A):
            raise ValueError(f"actions must index action_names (0..{A - 1})")
        if n and (
            not np.isfinite(self.propensities).all()
            or (self.propensities <= 0).any()
            or (self.propensities > 1).any()
        ):
            raise ValueError("propensities must lie in (0, 1]")
        if self.available is not None and self.available.shape != (n, A):
            raise ValueError(f"available has shape {self.available.shape}; expected ({n}, {A})")

    def __len__(self) -> int:
        return int(self.actions.shape[0])


@dataclass(frozen=True, slots=True)
class OPEEstimate:
    """A point estimate with a bootstrap interval, and the effective sample size of the weights
    (``(sum w)^2 / sum w^2``: low values flag a poorly supported target policy)."""

    estimator: str
    value: float
    low: float
    high: float
    n: int
    ess: float


def _check_target(logs: LoggedBandit, target_probs: np.ndarray) -> np.ndarray:
    tp = np.asarray(target_probs, dtype=float)
    n, A = len(logs), len(logs.action_names)
    if tp.shape != (n, A):
        raise ValueError(f"target_probs has shape {tp.shape}; expected ({n}, {A})")
    if (tp < -1e-12).any() or not np.allclose(tp.sum(axis=1), 1.0, atol=1e-6):
        raise ValueError("target_probs rows must be probability distributions (>= 0, summing to 1)")
    return tp


def importance_weights(logs: LoggedBandit, target_probs: np.ndarray) -> np.ndarray:
    """``w_i = pi(a_i | x_i) / mu(a_i | x_i)`` (float64 [n])."""
    tp = _check_target(logs, target_probs)
    return tp[np.arange(len(logs)), logs.actions] / logs.propensities


def ips(logs: LoggedBandit, target_probs: np.ndarray) -> float:
    """Inverse propensity scoring estimate of the target policy's mean reward."""
    return float(np.mean(importance_weights(logs, target_probs) * logs.rewards))


def snips(logs: LoggedBandit, target_probs: np.ndarray) -> float:
    """Self-normalised IPS estimate (0 when every weight is 0)."""
    w = importance_weights(logs, target_probs)
    s = w.sum()
    return float((w * logs.rewards).sum() / s) if s > 0 else 0.0


def reward_model(
    logs: LoggedBandit, *, ridge: float = 1.0, folds: int = 2, seed: int = 0
) -> np.ndarray:
    """Cross-fitted per-action ridge regression of reward on context.

    Returns ``q`` (float64 [n, A]): row i's predicted reward of every action from a model fitted on
    the other folds (an action never logged in those folds predicts their mean reward).

    Raises
    ------
    ValueError
        For ``ridge`` <= 0 or ``folds`` < 2.
    """
    if not ridge > 0:
        raise ValueError(f"ridge={ridge!r} is invalid; allowed: > 0")
    if not isinstance(folds, int) or folds < 2:
        raise ValueError(f"folds={folds!r} is invalid; allowed: an integer >= 2")
    n, A = len(logs), len(logs.action_names)
    X = np.column_stack([np.ones(n), logs.contexts])
    d = X.shape[1]
    fold = np.random.default_rng(seed).permutation(n) % folds
    q = np.zeros((n, A))
    for f in range(folds):
        train, test = fold != f, fold == f
        base = float(logs.rewards[train].mean()) if train.any() else 0.0
        for a in range(A):
            m = train & (logs.actions == a)
            if not m.any():
                q[test, a] = base
                continue
            Xa, ya = X[m], logs.rewards[m]
            theta = np.linalg.solve(Xa.T @ Xa + ridge * np.eye(d), Xa.T @ ya)
            q[test, a] = X[test] @ theta
    return q


def _dr_terms(logs: LoggedBandit, tp: np.ndarray, q: np.ndarray) -> np.ndarray:
    idx = np.arange(len(logs))
    w = tp[idx, logs.actions] / logs.propensities
    return (tp * q).sum(axis=1) + w * (logs.rewards - q[idx, logs.actions])


def doubly_robust(
    logs: LoggedBandit, target_probs: np.ndarray, q: np.ndarray | None = None
) -> float:
    """Doubly robust estimate; ``q`` defaults to :func:`reward_model`."""
    tp = _check_target(logs, target_probs)
    q = reward_model(logs) if q is None else np.asarray(q, dtype=float)
    return float(np.mean(_dr_terms(logs, tp, q)))


def evaluate(
    logs: LoggedBandit,
    target_probs: np.ndarray,
    *,
    estimators: tuple[str, ...] = ESTIMATORS,
    n_boot: int = 400,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, OPEEstimate]:
    """Point estimates and percentile-bootstrap intervals (rows resampled with replacement; the DR
    reward model is fitted once).

    Raises
    ------
    ValueError
        For an unknown estimator, ``n_boot`` < 10, ``level`` outside (0, 1) or empty logs.
    """
    for e in estimators:
        if e not in ESTIMATORS:
            raise ValueError(f"estimator={e!r} is not known; allowed: {', '.join(ESTIMATORS)}")
    if not isinstance(n_boot, int) or n_boot < 10:
        raise ValueError(f"n_boot={n_boot!r} is invalid; allowed: an integer >= 10")
    if not (0 < level < 1):
        raise ValueError(f"level={level!r} is invalid; allowed: 0 < level < 1")
    n = len(logs)
    if n == 0:
        raise ValueError("logs are empty: no request-step with a logged propensity")
    tp = _check_target(logs, target_probs)
    w = tp[np.arange(n), logs.actions] / logs.propensities
    wr = w * logs.rewards
    ess = float(w.sum() ** 2 / (w**2).sum()) if (w**2).sum() > 0 else 0.0
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    lo_q, hi_q = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    out: dict[str, OPEEstimate] = {}
    for e in estimators:
        if e == "ips":
            value, boots = float(wr.mean()), wr[idx].mean(axis=1)
        elif e == "snips":
            sw = w[idx].sum(axis=1)
            value = float(wr.sum() / w.sum()) if w.sum() > 0 else 0.0
            boots = np.where(sw > 0, wr[idx].sum(axis=1) / np.where(sw > 0, sw, 1.0), 0.0)
        else:
            terms = _dr_terms(logs, tp, reward_model(logs, seed=seed))
            value, boots = float(terms.mean()), terms[idx].mean(axis=1)
        lo, hi = np.percentile(boots, [lo_q, hi_q])
        out[e] = OPEEstimate(e, value, float(lo), float(hi), n, ess)
    return out


# -- synthetic logs with a known truth ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticBandit:
    """A contextual bandit with known mean rewards ``sigmoid(x . theta_a)``."""

    theta: np.ndarray  # [A, d + 1]

    def mean_reward(self, X: np.ndarray) -> np.ndarray:
        """[n, A] expected rewards for contexts ``X`` [n, d]."""
        Z = np.column_stack([np.ones(X.shape[0]), X]) @ self.theta.T
        return 1.0 / (1.0 + np.exp(-Z))


def _eps_greedy(scores: np.ndarray, epsilon: float) -> np.ndarray:
    A = scores.shape[1]
    p = np.full(scores.shape, epsilon / A)
    p[np.arange(scores.shape[0]), scores.argmax(axis=1)] += 1 - epsilon
    return p


def synthetic_logs(
    n: int,
    *,
    n_actions: int = 5,
    dim: int = 3,
    epsilon: float = 0.3,
    target_epsilon: float = 0.0,
    noise: float = 0.1,
    seed: int = 0,
) -> tuple[LoggedBandit, np.ndarray, float]:
    """Logs of an epsilon-greedy logging policy on a synthetic contextual bandit.

    The logging and target policies are greedy on two different noisy copies of the true model
    (the target's is the better one), mixed with uniform exploration ``epsilon`` / ``target_epsilon``.
    Rewards are the mean plus Gaussian noise (sigma ``noise``).

    Returns
    -------
    (logs, target_probs [n, A], true_value)
        ``true_value`` is the target policy's expected reward over the context distribution
        (Monte Carlo over 50,000 fresh contexts, standard error about 2e-3).
    """
    if not (0 < epsilon <= 1):
        raise ValueError(f"epsilon={epsilon!r} is invalid; allowed: 0 < epsilon <= 1 (support)")
    rng = np.random.default_rng(seed)
    theta = rng.normal(0, 1.0, size=(n_actions, dim + 1))
    bandit = SyntheticBandit(theta)
    theta_log = theta + rng.normal(0, 1.0, size=theta.shape)
    theta_tgt = theta + rng.normal(0, 0.3, size=theta.shape)

    def policy_probs(X: np.ndarray, th: np.ndarray, eps: float) -> np.ndarray:
        s = np.column_stack([np.ones(X.shape[0]), X]) @ th.T
        return _eps_greedy(s, eps)

    X = rng.normal(0, 1, size=(n, dim))
    mu = policy_probs(X, theta_log, epsilon)
    cum = mu.cumsum(axis=1)
    a = (rng.random((n, 1)) > cum).sum(axis=1)
    a = np.minimum(a, n_actions - 1)
    means = bandit.mean_reward(X)
    r = means[np.arange(n), a] + rng.normal(0, noise, size=n)
    logs = LoggedBandit(X, a, r, mu[np.arange(n), a], [f"a{i}" for i in range(n_actions)])
    tp = policy_probs(X, theta_tgt, target_epsilon)
    Xb = np.random.default_rng(seed + 10_000).normal(0, 1, size=(50_000, dim))
    truth = float(
        (policy_probs(Xb, theta_tgt, target_epsilon) * bandit.mean_reward(Xb)).sum(axis=1).mean()
    )
    return logs, tp, truth


# -- from a trace ---------------------------------------------------------------------------------


def logged_bandit_from_trace(trace: Trace, *, reward: str = "goodput") -> LoggedBandit:
    """Request-steps of a trace with a logged propensity and features, as bandit feedback.

    Parameters
    ----------
    trace : Trace
    reward : {"goodput", "tokens"}
        ``goodput``: tokens emitted over the request's share of the step time (tokens/s);
        ``tokens``: tokens emitted.

    Returns
    -------
    LoggedBandit
        Actions are ``str(Arm)`` over the trace's arm space; ``available`` marks the arms whose
        proposer offered at least k tokens (``cf_drafts``), plus ``none``.

    Raises
    ------
    ValueError
        For an unknown reward or a header without ``max_k``/``proposers``.
    """
    if reward not in ("goodput", "tokens"):
        raise ValueError(f"reward={reward!r} is not known; allowed: goodput, tokens")
    max_k = trace.header.get("max_k")
    props = [p for p in (trace.header.get("proposers") or []) if p != "none"]
    if not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"trace header max_k={max_k!r}; expected an integer >= 0")
    names = [str(a) for a in arm_space(props, max_k)]
    index = {a: i for i, a in enumerate(names)}
    X, acts, rews, props_l, avail = [], [], [], [], []
    for s in trace.steps:
        t = s.get("step_time_s")
        B = max(int(s.get("batch_size") or 1), 1)
        for r in s.get("requests", []):
            p, f = r.get("propensity"), r.get("features")
            if p is None or not f or r.get("arm") not in index:
                continue
            if (
                not (isinstance(t, int | float) and math.isfinite(t) and t > 0)
                and reward == "goodput"
            ):
                continue
            X.append(f)
            acts.append(index[r["arm"]])
            e = float(r.get("emitted", 0))
            rews.append(e / (t / B) if reward == "goodput" else e)
            props_l.append(float(p))
            row = np.zeros(len(names), dtype=bool)
            row[index["none"]] = True
            for prop, d in (r.get("cf_drafts") or {}).items():
                for k in range(1, min(len(d), max_k) + 1):
                    name = f"{prop}:{k}"
                    if name in index:
                        row[index[name]] = True
            row[index[r["arm"]]] = True
            avail.append(row)
    n = len(acts)
    d = len(X[0]) if X else 0
    return LoggedBandit(
        np.asarray(X, dtype=float).reshape(n, d),
        np.asarray(acts, dtype=np.int64),
        np.asarray(rews, dtype=float),
        np.asarray(props_l, dtype=float),
        names,
        np.asarray(avail, dtype=bool).reshape(n, len(names)),
    )


def static_target(logs: LoggedBandit, arm: Arm) -> np.ndarray:
    """Target probabilities of the static policy playing ``arm`` (cut to the longest available k of
    its proposer at each row, or ``none``), as :class:`~adaptive_spec.core.baselines.StaticPolicy` does."""
    names = logs.action_names
    index = {a: i for i, a in enumerate(names)}
    n = len(logs)
    tp = np.zeros((n, len(names)))
    avail = logs.available if logs.available is not None else np.ones((n, len(names)), dtype=bool)
    for i in range(n):
        k = arm.k
        while k > 0 and not (
            f"{arm.proposer}:{k}" in index and avail[i, index[f"{arm.proposer}:{k}"]]
        ):
            k -= 1
        tp[i, index[f"{arm.proposer}:{k}" if k else "none"]] = 1.0
    return tp
