"""``bandit:<learner>``: any learner of :mod:`adaptive_spec.bandits` plays speculative decoding.

:class:`BanditPolicy` wraps one registered learner (``ucb1``, ``thompson-beta``, ``linucb``, ...;
:func:`adaptive_spec.bandits.available_policies`) as a :class:`~adaptive_spec.core.protocol.SpecPolicy`,
so that each can be replayed (``adaptive-spec replay TRACE --policies bandit:thompson-beta,...``) and
benchmarked (``adaptive-spec bench --configs ...,bandit:linucb``) beside the adaptive controller. It
is lossless by construction: it only chooses arms; the engine verifies whatever is drafted.

**Arms**: :func:`~adaptive_spec.core.arms.arm_space` of the enabled proposers and ``max_k``, i.e.
``none`` plus every ``(proposer, k)`` with ``k`` in ``1..max_k``; one learner arm per engine arm
(arm id ``str(arm)``). Every request gets its own pull each step.

**Context**: the adaptive controller's per-request context (:mod:`adaptive_spec.core.acceptance`):
the temperature bucket (greedy / sampled), and per proposer the request's history bucket (its
moving-average acceptance of that proposer's drafts, scored on the committed tokens whether played
or not, :func:`~adaptive_spec.core.acceptance.history_bucket`) and the match bucket of the
proposer's match feature (:func:`~adaptive_spec.core.acceptance.match_thresholds`).

* Contextual learners (``linucb``, ``linucb-hybrid``, ``logistic-ts``) get one vector
  per request: ``[1, temperature bucket, 1 / batch size]`` followed by, per proposer, the one-hot
  history bucket (4) and the one-hot match bucket (4); dimension ``3 + 8 P``. ``1 / batch size``
  is a request's share of a plain step, which sets how much a draft token costs it relatively.
  ``linucb-hybrid`` also gets per-arm features (proposer one-hot, ``k / max_k``), so what one arm
  teaches carries over to its neighbours.
* Non-contextual learners get **one learner per context cell**, the cell being the temperature
  bucket and every proposer's match bucket (the controller's cell without the history bucket,
  which would multiply the cells by 4 per proposer, and without the draft position, which the
  arm's k stands for): at most ``2 * 4^P`` learners, created when a cell is first seen.

**Reward** of a request in a step, in [0, 1] (what every learner is given)::

    r = (accepted + 1) / t_i  *  (t0 / B) / (max_k + 1)

``accepted + 1`` are the tokens the step committed for the request (the accepted draft tokens and
the bonus token), ``t_i`` its share of the measured step time: the step's plain part split equally
over its ``B`` requests, and its speculation part in proportion to the draft tokens each request
verified (the split the step-cost model :class:`~adaptive_spec.core.cost_model.StepCostModel`
predicts: ``t0 = t(B, 0)`` for the plain part, ``(t(B, V) - t0) / V`` per draft token), so a
request's k is charged what it adds to the step. Multiplying by ``t0 / B``, a request's predicted
time in a plain step, expresses the rate in units of plain decoding at this batch size: ``none``
scores ``1 / (max_k + 1)``, and a batch whose size changes as requests finish does not look like
an arm getting better or worse. ``max_k + 1`` is the most a step can commit, so the rewards lie
in [0, 1] as the bounded learners require (clipped; measured noise can push a value past 1).
Summed over a step's requests this is the step's goodput relative to plain decoding, i.e. the
learners maximise goodput together; unlike BanditSpec's per-step reward (one arm for the whole
batch), every request is credited with its own tokens. A step that also prefills prompts is
charged its predicted decode time (its measured time is mostly prefill, whatever the arms).
Learners that take only binary rewards (``logistic-ts``) get one Bernoulli draw of ``r``.

**Feedback**: bandit feedback, the played arm's reward only, except for full-information learners
(``hedge``), which get every arm's reward: each proposer's offered draft is scored against the
committed tokens (accepted = the common prefix, a lower bound where the committed tokens run out)
and charged as above.

**Propensities**: exact (:meth:`Policy.probabilities_batch <adaptive_spec.bandits.Policy.probabilities_batch>`)
for the learners with a closed form, ``None`` for the sampling ones (Thompson variants).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_spec.bandits import POLICIES, Policy, make_policy
from adaptive_spec.core.acceptance import N_HIST, N_MATCH, history_bucket, match_thresholds
from adaptive_spec.core.arms import Arm, arm_space
from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.protocol import (
    Decision,
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
    acceptance_rows,
    matched_prefix,
)

__all__ = ["BanditPolicy", "RequestContext", "learner_name"]

_NO_DRAFT = np.zeros(0, dtype=np.int64)


def learner_name(text: str) -> str:
    """The registry name of a learner given as ``thompson-beta`` or ``thompson_beta``.

    Raises
    ------
    ValueError
        If no learner of :data:`adaptive_spec.bandits.POLICIES` has that name (the message lists
        them).
    """
    name = text.strip().replace("_", "-") if isinstance(text, str) else text
    if name not in POLICIES:
        raise ValueError(f"learner={text!r} is not known; allowed: {', '.join(sorted(POLICIES))}")
    return name


@dataclass(frozen=True, slots=True)
class RequestContext:
    """A request's context at a decision (the controller's buckets, one per proposer).

    Attributes
    ----------
    temperature_bucket : int
        0 greedy, 1 sampled.
    history_buckets : tuple of int, length P
        Per proposer, in ``0..N_HIST-1`` (0: no history yet).
    match_buckets : tuple of int, length P
        Per proposer, in ``0..N_MATCH-1``.
    """

    temperature_bucket: int
    history_buckets: tuple[int, ...]
    match_buckets: tuple[int, ...]

    def cell(self) -> int:
        """The non-contextual learners' cell: temperature and match buckets, mixed radix."""
        c = self.temperature_bucket
        for m in self.match_buckets:
            c = c * N_MATCH + m
        return c

    def vector(self, batch_size: int) -> np.ndarray:
        """The contextual learners' features, float64 ``[3 + (N_HIST + N_MATCH) P]``: intercept,
        temperature bucket, ``1 / batch_size``, then per proposer the one-hot history and match
        buckets."""
        P = len(self.match_buckets)
        x = np.zeros(3 + (N_HIST + N_MATCH) * P)
        x[0], x[1], x[2] = 1.0, float(self.temperature_bucket), 1.0 / max(batch_size, 1)
        for p, (h, m) in enumerate(zip(self.history_buckets, self.match_buckets, strict=True)):
            base = 3 + (N_HIST + N_MATCH) * p
            x[base + h] = 1.0
            x[base + N_HIST + m] = 1.0
        return x

    def as_list(self) -> list[float]:
        """The buckets as logged in the trace: temperature, histories, matches."""
        return [
            float(self.temperature_bucket),
            *map(float, self.history_buckets),
            *map(float, self.match_buckets),
        ]


@dataclass(slots=True)
class _History:
    """A request's moving-average acceptance per proposer and how many steps scored it."""

    rate: np.ndarray  # float64 [P]
    n: np.ndarray  # float64 [P]


@dataclass(slots=True)
class _Pending:
    """One request's decision, kept for its outcome."""

    arm: int  # index into the arm space
    cell: int
    x: np.ndarray | None  # features (contextual learners)
    drafts: list[np.ndarray]  # each proposer's offered draft, cut to max_k


@dataclass(slots=True)
class _StepShares:
    """How one step's measured time is split over its requests (see the module docstring)."""

    time_s: float  # the step's (decode) time
    plain: float  # share of the step of one request's plain part, t0 / (B * t(B, V))
    per_draft: float  # share of the step of one verified draft token
    plain_time_s: float  # t0 / B: a request's predicted time in a plain step

    def reward(self, accepted: int, drafted: int, max_k: int) -> float:
        t_i = self.time_s * (self.plain + self.per_draft * drafted)
        r = (accepted + 1) / t_i * self.plain_time_s / (max_k + 1)
        return min(max(r, 0.0), 1.0)


class BanditPolicy(SpecPolicy):
    """One learner of :mod:`adaptive_spec.bandits` as a speculation policy (module docstring).

    Parameters
    ----------
    proposers : list of str
        Proposers it may choose from (``none`` is always an arm).
    max_k : int >= 0
        Largest k.
    learner : str
        A registry name (:func:`adaptive_spec.bandits.available_policies`; ``_`` may stand for ``-``).
    seed : int >= 0
        Seeds the learners (one seed per cell, derived from this one) and the Bernoulli draws.
    cost_table : StepCostTable, optional
        The measured step-cost table the reward's time split is predicted from (default: the
        generic prior shape, corrected online).
    ema : float in (0, 1]
        Weight of the newest step in a request's acceptance history (the controller's default).
    **learner_kwargs
        Passed to the learner (e.g. ``window=200`` for ``sw-ucb``); ``dim``, ``seed`` and, for
        ``linucb-hybrid``, ``arm_features`` are set here.

    Raises
    ------
    ValueError
        For an unknown learner or proposer, or a parameter outside its range.

    Examples
    --------
    >>> import numpy as np
    >>> from adaptive_spec.core.protocol import RequestView, StepView
    >>> pol = BanditPolicy(["ngram"], 2, learner="thompson_beta")
    >>> pol.name, [str(a) for a in pol.arms]
    ('bandit:thompson-beta', ['none', 'ngram:1', 'ngram:2'])
    >>> v = RequestView("r", 1, 100, drafts={"ngram": np.arange(2)}, match_lengths={"ngram": 3})
    >>> pol.decide(StepView([v], batch_size=1)).arms[0] in pol.arms
    True
    """

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        learner: str,
        seed: int = 0,
        cost_table: StepCostTable | None = None,
        ema: float = 0.3,
        **learner_kwargs: Any,
    ) -> None:
        super().__init__(proposers, max_k)
        self.learner = learner_name(learner)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer >= 0")
        if not (isinstance(ema, int | float) and 0.0 < ema <= 1.0):
            raise ValueError(f"ema={ema!r} is invalid; allowed: 0 < ema <= 1")
        self.name = f"bandit:{self.learner}"
        self.seed = int(seed)
        self.ema = float(ema)
        self.arms: list[Arm] = arm_space(self.proposers, max_k)
        self._arm_ids = [str(a) for a in self.arms]
        self._cls = POLICIES[self.learner]
        self.dim = 3 + (N_HIST + N_MATCH) * len(self.proposers)
        kwargs = dict(learner_kwargs)
        if self._cls.contextual:
            kwargs["dim"] = self.dim
            if self.learner == "linucb-hybrid" and "arm_features" not in kwargs:
                kwargs["arm_features"] = self._arm_features()
        self._kwargs = kwargs
        self._thresholds = [np.asarray(match_thresholds(p)) for p in self.proposers]
        self.cost = StepCostModel(cost_table)
        self.rng = np.random.default_rng(self.seed)
        self.learners: dict[int, Policy] = {}
        self._history: dict[str, _History] = {}
        self._pending: dict[str, _Pending] = {}
        self._sampled = 0.0
        self._learner(0)  # fail on bad learner arguments now, not at the first step

    # -- learners ------------------------------------------------------------------------------
    def _arm_features(self) -> np.ndarray:
        """Per-arm features for ``linucb-hybrid``: proposer one-hot and ``k / max_k``, ``[K, P + 1]``."""
        P = len(self.proposers)
        F = np.zeros((len(self.arms), P + 1))
        for j, a in enumerate(self.arms):
            if a.k > 0:
                F[j, self.proposers.index(a.proposer)] = 1.0
                F[j, P] = a.k / max(self.max_k, 1)
        return F

    def _learner(self, cell: int) -> Policy:
        """The learner of ``cell`` (0 for a contextual learner), created on first use with a seed
        derived from ``(seed, cell)``."""
        pol = self.learners.get(cell)
        if pol is None:
            cell_seed = int(np.random.SeedSequence([self.seed, cell]).generate_state(1)[0])
            pol = make_policy(self.learner, self._arm_ids, seed=cell_seed, **self._kwargs)
            self.learners[cell] = pol
        return pol

    # -- context -------------------------------------------------------------------------------
    def context(self, view: RequestView) -> RequestContext:
        """The request's :class:`RequestContext` now."""
        hist = self._history.get(view.req_id)
        P = len(self.proposers)
        h = np.zeros(P, dtype=np.int64) if hist is None else history_bucket(hist.rate, hist.n)
        m = []
        for p, thr in zip(self.proposers, self._thresholds, strict=True):
            feat = view.match_lengths.get(p, 0)
            m.append(min(int((feat >= thr).sum()), N_MATCH - 1))
        t = 1 if view.temperature > 0 else 0
        return RequestContext(t, tuple(int(b) for b in h), tuple(m))

    # -- decision ------------------------------------------------------------------------------
    def decide(self, view: StepView) -> Decision:
        reqs = view.requests
        N = len(reqs)
        self._sampled = sum(1 for r in reqs if r.temperature > 0) / N if N else 0.0
        if N == 0:
            return Decision([], [], [])
        ctxs = [self.context(r) for r in reqs]
        choice = np.zeros(N, dtype=np.int64)
        props: list[float | None] = [None] * N
        has_probs = self._cls.has_probabilities
        X: np.ndarray | None = None
        if self._cls.contextual:
            X = np.stack([c.vector(view.batch_size) for c in ctxs])
            pol = self._learner(0)
            choice[:] = pol.pull_batch_indices(X)
            if has_probs:
                props = pol.probabilities_batch(X)[np.arange(N), choice].tolist()
            cells = np.zeros(N, dtype=np.int64)
        else:
            cells = np.array([c.cell() for c in ctxs], dtype=np.int64)
            for cell in np.unique(cells).tolist():
                rows = np.flatnonzero(cells == cell)
                pol = self._learner(cell)
                choice[rows] = pol.pull_batch_indices(n=rows.size)
                if has_probs:
                    p = pol.probabilities_batch(n=rows.size)[np.arange(rows.size), choice[rows]]
                    for i, v in zip(rows.tolist(), p.tolist(), strict=True):
                        props[i] = v
        K = self.max_k
        for i, r in enumerate(reqs):
            drafts = [np.asarray(r.drafts.get(p, _NO_DRAFT))[:K] for p in self.proposers]
            x = None if X is None else X[i]
            self._pending[r.req_id] = _Pending(int(choice[i]), int(cells[i]), x, drafts)
        arms = [self.arms[j] for j in choice.tolist()]
        return Decision(arms, props, [c.as_list() for c in ctxs])

    # -- learning ------------------------------------------------------------------------------
    def _shares(self, outcome: StepOutcome) -> _StepShares | None:
        """The step's time split (module docstring), or None when its time is not usable."""
        t = outcome.step_time_s
        B = max(outcome.batch_size, 1)
        if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
            return None
        V = outcome.num_verified_tokens
        s = self._sampled
        t0 = self.cost.at(B, 0, s)
        tV = self.cost.at(B, V, s) if V > 0 else t0
        per_token = (tV - t0) / V if V > 0 else self.cost.at(B, 1, s) - t0
        if not (t0 > 0 and tV > 0):
            return None
        if outcome.num_prefill_tokens > 0:
            t = tV
        return _StepShares(t, t0 / (B * tV), max(per_token, 0.0) / tV, t0 / B)

    def _score_history(self, rid: str, pend: _Pending, emitted: list[int]) -> list[int]:
        """Score every offered draft against the committed tokens (the request's history) and
        return each proposer's matched prefix."""
        hist = self._history.get(rid)
        P = len(self.proposers)
        if hist is None:
            hist = self._history[rid] = _History(np.zeros(P), np.zeros(P))
        matched = []
        for p, d in enumerate(pend.drafts):
            m = matched_prefix(d, emitted) if d.size else 0
            matched.append(m)
            ones, zero = acceptance_rows(int(d.size), len(emitted), m)
            if ones + zero == 0:
                continue
            rate = ones / (ones + zero)
            prev = hist.rate[p]
            hist.rate[p] = rate if hist.n[p] == 0 else (1.0 - self.ema) * prev + self.ema * rate
            hist.n[p] += 1.0
        return matched

    def _full_rewards(self, shares: _StepShares, pend: _Pending, matched: list[int]) -> np.ndarray:
        """Every arm's reward for one request (full information), float64 ``[K]``."""
        out = np.empty(len(self.arms))
        for j, a in enumerate(self.arms):
            if a.k == 0:
                out[j] = shares.reward(0, 0, self.max_k)
                continue
            p = self.proposers.index(a.proposer)
            d = min(a.k, int(pend.drafts[p].size))
            out[j] = shares.reward(min(d, matched[p]), d, self.max_k)
        return out

    def observe(self, outcome: StepOutcome) -> None:
        shares = self._shares(outcome)
        by_cell: dict[int, list[tuple[_Pending, float, np.ndarray | None]]] = {}
        full = self._cls.full_information_only
        for o in outcome.requests:
            pend = self._pending.pop(o.req_id, None)
            if pend is None:
                continue
            matched = self._score_history(o.req_id, pend, o.emitted_token_ids)
            if shares is not None:
                r = shares.reward(o.accepted, o.drafted, self.max_k)
                R = self._full_rewards(shares, pend, matched) if full else None
                by_cell.setdefault(pend.cell, []).append((pend, r, R))
            self._finish(o)
        for cell in sorted(by_cell):
            self._learn(cell, by_cell[cell])
        if shares is not None:
            self.cost.update(
                outcome.batch_size,
                outcome.num_verified_tokens,
                outcome.step_time_s,
                prefill_tokens=outcome.num_prefill_tokens,
                sampled=self._sampled,
            )

    def _learn(self, cell: int, rows: list[tuple[_Pending, float, np.ndarray | None]]) -> None:
        pol = self._learner(cell)
        X = np.stack([p.x for p, _, _ in rows]) if self._cls.contextual else None
        if self._cls.full_information_only:
            pol.update_full(np.stack([R for _, _, R in rows]), X)
            return
        r = np.array([v for _, v, _ in rows])
        if self._cls.binary_rewards:
            r = (self.rng.random(r.size) < r).astype(np.float64)
        pol.update_batch([self._arm_ids[p.arm] for p, _, _ in rows], r, X)

    def _finish(self, o: RequestOutcome) -> None:
        if o.finished:
            self.release(o.req_id)

    def release(self, req_id: str) -> None:
        self._history.pop(req_id, None)
        self._pending.pop(req_id, None)

    def num_tracked_requests(self) -> int:
        return len(self._history)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The learners' states by cell (JSON-safe) and the step-cost model's."""
        return {
            "name": self.name,
            "learners": {str(c): pol.state_dict() for c, pol in sorted(self.learners.items())},
            "cost": self.cost.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises
        ------
        ValueError
            If the state is for another learner or arm space, or malformed.
        """
        if not isinstance(state, dict) or state.get("name") != self.name:
            got = state.get("name") if isinstance(state, dict) else state
            raise ValueError(f"state is for {got!r}, not {self.name!r}")
        learners: dict[int, Policy] = {}
        for key, sub in dict(state.get("learners", {})).items():
            pol = Policy.from_state_dict(sub)
            if pol.arms != self._arm_ids:
                raise ValueError(f"state's learner {key} has other arms than {self.name}")
            learners[int(key)] = pol
        if "cost" in state:
            self.cost.load_state_dict(state["cost"])
        self.learners = learners
