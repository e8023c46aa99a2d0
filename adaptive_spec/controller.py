"""The adaptive controller: per request and per step, which proposer drafts and how many tokens (k).

Engine-agnostic: the vLLM integration (:mod:`adaptive_spec.vllm`) and the replay simulator
(:mod:`adaptive_spec.sim`) both drive a :class:`SpecPolicy` through the same two verbs:

* ``decide(view) -> Decision``: given the running requests (with the drafts every cheap proposer offers
  now), choose an arm ``(proposer, k)`` per request;
* ``observe(outcome)``: learn from what the target emitted and how long the step took.

:class:`AdaptiveController` is the default policy. It keeps

* an **acceptance model** per proposer: a Bayesian logistic regression
  (:class:`adaptive_spec.bandits.LogisticThompson`) predicting the per-position acceptance probability
  ``alpha_j`` (the target accepts draft token j given it accepted 1..j-1) from request features. It learns
  from every drafted position (censored after the first rejection), and, for every proposer whose full
  draft was computed, from the tokens the target actually emitted: a draft token at position j would have
  been accepted exactly when it equals the emitted token there (full-information updates, cf. HedgeSpec /
  "Not-a-Bandit", ICLR 2026). Rewards never involve batch-mates;
* a **step-cost model** (:class:`adaptive_spec.cost_model.StepCostModel`): step time from batch size,
  verified tokens, prefill tokens and the number of requests verifying drafts (a fixed cost per
  speculating request), learned online.

Decision (SmartSpec's goodput, Liu et al. 2024, generalised to a choice of proposer): the expected number
of tokens a request emits with ``k`` drafts from proposer ``p`` is ``1 + sum_{j<=k} prod_{i<=j} alpha_i``;
the controller picks per-request ``(p, k)`` maximising ``sum_i E[tokens_i] / E[step time]``. Per request it
takes the upper concave hull of its best expected tokens against draft tokens, merges all hulls by
marginal tokens per draft token, and keeps the prefix with the highest predicted goodput. Exploration
comes from the acceptance model's posterior: a Thompson draw per request and position (``"thompson"``,
the default), an upper confidence bound (``"ucb"``), or epsilon-greedy around the posterior mean
(``"eps-greedy"``, the only mode whose propensities are logged exactly).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from adaptive_spec.arms import NO_SPEC, Arm, check_proposer_name
from adaptive_spec.bandits import LogisticThompson
from adaptive_spec.cost_model import StepCostModel

# Request-level features, in this order (a documented context vector; see docs/architecture.md).
REQUEST_FEATURES = (
    "bias",
    "log_output_tokens",  # log1p(tokens generated so far) / 7
    "temperature",  # min(temperature, 2)
    "log_batch_size",  # log2(batch size) / 8
    "log_queue_len",  # log1p(waiting requests) / 5
    "ema_acceptance_all",  # this request's recent acceptance over all proposers
)
# Per-proposer features appended for a proposer's acceptance model.
PROPOSER_FEATURES = (
    "ema_acceptance",  # this request's recent per-position acceptance for this proposer (prior 0.5)
    "draft_available",  # draft tokens this proposer offers now / max_k
    "match_length",  # proposer-specific match length (n-gram suffix length) / 8
)
POSITION_FEATURES = ("position", "first_position")  # j / max_k, 1[j == 1]
FEATURE_DIM = len(REQUEST_FEATURES) + len(PROPOSER_FEATURES) + len(POSITION_FEATURES)
EXPLORATION_MODES = ("thompson", "ucb", "greedy", "eps-greedy")


@dataclass(slots=True)
class RequestView:
    """What a policy sees of one running request at decision time.

    ``drafts[p]`` is the full draft (int64 token ids, length 0..max_k) proposer ``p`` offers now; a
    proposer absent from ``drafts`` offers nothing. ``max_new_tokens`` is the remaining budget (drafts
    are capped at ``max_new_tokens - 1``).
    """

    req_id: str
    num_output_tokens: int
    max_new_tokens: int
    temperature: float = 0.0
    drafts: dict[str, np.ndarray] = field(default_factory=dict)
    match_lengths: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepView:
    """The batch a policy decides for. ``batch_size`` is the number of requests expected in the step
    that verifies these drafts; ``queue_len`` the number waiting."""

    requests: list[RequestView]
    batch_size: int
    queue_len: int = 0


@dataclass(slots=True)
class Decision:
    """Per request (same order as the view): the arm, its propensity (None when not known exactly),
    and the logged context vector."""

    arms: list[Arm]
    propensities: list[float | None]
    features: list[list[float]]


@dataclass(slots=True)
class RequestOutcome:
    """What one request's verification gave: ``drafted`` draft tokens verified, ``accepted`` of them
    accepted, ``emitted_token_ids`` the tokens committed (after EOS/stop/length truncation)."""

    req_id: str
    arm: Arm
    drafted: int
    accepted: int
    emitted_token_ids: list[int]
    finished: bool = False


@dataclass(slots=True)
class StepOutcome:
    """One engine step: per-request outcomes, wall time (seconds), requests in the step, draft tokens
    verified, and prompt (prefill) tokens computed."""

    requests: list[RequestOutcome]
    step_time_s: float
    batch_size: int
    num_verified_tokens: int
    num_prefill_tokens: int = 0


class SpecPolicy(ABC):
    """Base class: a policy decides arms for a batch and learns from outcomes.

    Subclasses implement :meth:`decide`; :meth:`observe`, :meth:`release` and the state methods default
    to no-ops for policies that do not learn.
    """

    name: str = "policy"

    def __init__(self, proposers: list[str], max_k: int) -> None:
        if not isinstance(max_k, int) or max_k < 0:
            raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 0")
        self.proposers = [check_proposer_name(p) for p in proposers if p != "none"]
        self.max_k = max_k

    @abstractmethod
    def decide(self, view: StepView) -> Decision: ...

    def observe(self, outcome: StepOutcome) -> None:  # noqa: B027 (optional hook)
        """Learn from one step's outcome (default: nothing)."""

    def release(self, req_id: str) -> None:  # noqa: B027 (optional hook)
        """Drop per-request state when a request finishes (default: nothing)."""

    def num_tracked_requests(self) -> int:
        return 0

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (optional hook)
        """Restore learned state (default: nothing)."""

    def drafter_preference(self, req_id: str, candidates: list[str]) -> str | None:
        """Which draft-model proposer (``draft`` or ``lora:<name>``) should make ``req_id``'s next
        drafts: the engine's drafter runs once per step with one adapter per request, so only the chosen
        one's drafts exist at the next decision. ``None`` (the default) leaves the choice to the caller
        (keep the adapter of the chosen arm, else the current one)."""
        return None


@dataclass(slots=True)
class _ReqState:
    ema_all: float = 0.5
    ema: dict[str, float] = field(default_factory=dict)
    # Pending decision: per proposer, (full draft, feature row without position) at decision time.
    pending: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    pending_temperature: float = 0.0
    # Request features of the latest decision (for choosing the next drafter adapter).
    rf: np.ndarray | None = None


def matched_prefix(draft: np.ndarray, emitted: list[int] | np.ndarray) -> int:
    """Length of the longest common prefix of ``draft`` and ``emitted``."""
    n = min(len(draft), len(emitted))
    if n == 0:
        return 0
    eq = np.asarray(draft[:n]) == np.asarray(emitted[:n])
    return n if eq.all() else int(np.argmin(eq))


def acceptance_rows(draft_len: int, emitted_len: int, matched: int) -> tuple[int, int]:
    """Censored per-position labels of a draft against emitted tokens.

    Returns ``(n_ones, n_zero)``: positions ``1..n_ones`` are accepted, and ``n_zero`` (0 or 1) rejected
    positions follow. Positions after the first rejection, or beyond the emitted tokens, are unknown.
    """
    n_ones = matched
    n_zero = 1 if (matched < draft_len and matched < emitted_len) else 0
    return n_ones, n_zero


class AdaptiveController(SpecPolicy):
    """The default contextual-bandit controller (see the module docstring).

    Parameters
    ----------
    proposers : list of str
        Proposers it may choose from (``none`` is always allowed).
    max_k : int
        Largest k (the engine's ``num_speculative_tokens``).
    exploration : {"thompson", "ucb", "greedy", "eps-greedy"}
        How the acceptance model's uncertainty drives exploration.
    epsilon : float in [0, 1]
        Probability of a uniformly random arm per request in ``eps-greedy`` mode.
    discount : float in (0, 1]
        Forgetting of the acceptance models (1 = stationary).
    cost_forgetting : float in (0, 1]
        Forgetting of the step-cost model.
    ema : float in (0, 1]
        Weight of the newest observation in the per-request acceptance history features.
    ucb_alpha : float >= 0
        Width of the confidence bound in ``ucb`` mode (standard deviations of the logit).
    prior_var : float > 0
        Prior variance of each acceptance-model weight (features are O(1), so the prior logit has a
        standard deviation of about ``sqrt(prior_var * 3)``: calm early exploration).
    min_gain : float >= 0
        Smallest expected gain, in tokens per draft token, worth verifying: drafts below it are never
        scheduled even when the cost model believes verification is nearly free.
    seed : int
        Seeds every random draw.

    Raises
    ------
    ValueError
        For an unknown proposer or exploration mode, or a parameter outside its range.
    """

    name = "adaptive"

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        exploration: str = "thompson",
        epsilon: float = 0.05,
        discount: float = 0.999,
        cost_forgetting: float = 0.995,
        ema: float = 0.3,
        ucb_alpha: float = 1.0,
        min_gain: float = 0.05,
        prior_var: float = 0.3,
        seed: int = 0,
    ) -> None:
        super().__init__(proposers, max_k)
        if exploration not in EXPLORATION_MODES:
            raise ValueError(
                f"exploration={exploration!r} is not known; allowed: {', '.join(EXPLORATION_MODES)}"
            )
        if not (0.0 <= epsilon <= 1.0):
            raise ValueError(f"epsilon={epsilon!r} is invalid; allowed: 0 <= epsilon <= 1")
        if not (min_gain >= 0.0 and math.isfinite(min_gain)):
            raise ValueError(f"min_gain={min_gain!r} is invalid; allowed: a finite number >= 0")
        if not (0.0 < ema <= 1.0):
            raise ValueError(f"ema={ema!r} is invalid; allowed: 0 < ema <= 1")
        if not (0.0 < cost_forgetting <= 1.0):
            raise ValueError(
                f"cost_forgetting={cost_forgetting!r} is invalid; allowed: 0 < cost_forgetting <= 1"
            )
        if not (ucb_alpha >= 0.0 and math.isfinite(ucb_alpha)):
            raise ValueError(f"ucb_alpha={ucb_alpha!r} is invalid; allowed: a finite number >= 0")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer >= 0")
        self.exploration = exploration
        self.epsilon = float(epsilon)
        self.ema_weight = float(ema)
        self.ucb_alpha = float(ucb_alpha)
        self.min_gain = float(min_gain)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        self.models = {
            p: LogisticThompson(
                FEATURE_DIM, prior_var=prior_var, discount=discount, seed=seed + 1 + i
            )
            for i, p in enumerate(self.proposers)
        }
        self.cost = StepCostModel(forgetting=cost_forgetting)
        self._req: dict[str, _ReqState] = {}
        self._pos = np.array(
            [[j / max(max_k, 1), 1.0 if j == 1 else 0.0] for j in range(1, max_k + 1)], dtype=float
        ).reshape(max_k, 2)
        self.n_steps = 0

    # -- features ---------------------------------------------------------------------------
    def _request_features(self, r: RequestView, st: _ReqState, view: StepView) -> np.ndarray:
        return np.array(
            [
                1.0,
                math.log1p(max(r.num_output_tokens, 0)) / 7.0,
                min(max(float(r.temperature), 0.0), 2.0),
                math.log2(max(view.batch_size, 1)) / 8.0,
                math.log1p(max(view.queue_len, 0)) / 5.0,
                st.ema_all,
            ]
        )

    def _proposer_features(
        self, st: _ReqState, p: str, n_avail: int, match_length: int = 0
    ) -> np.ndarray:
        return np.array(
            [
                st.ema.get(p, 0.5),
                n_avail / max(self.max_k, 1),
                min(match_length, 8) / 8.0,
            ]
        )

    def _acceptance(self, p: str, base: np.ndarray) -> np.ndarray:
        """Per-position acceptance for rows ``base`` [n, d-2] -> [n, max_k]."""
        n = base.shape[0]
        X = np.concatenate(
            [np.repeat(base, self.max_k, axis=0), np.tile(self._pos, (n, 1))], axis=1
        )
        model = self.models[p]
        if self.exploration == "thompson":
            a = model.sample_proba(X)
        elif self.exploration == "ucb":
            a = model.ucb_proba(X, alpha=self.ucb_alpha)
        else:
            a = model.predict_proba(X)
        return a.reshape(n, self.max_k)

    # -- decision -----------------------------------------------------------------------------
    def decide(self, view: StepView) -> Decision:
        B = len(view.requests)
        K = self.max_k
        if B == 0:
            return Decision([], [], [])
        props = [p for p in self.proposers]
        P = len(props)
        # best[i, c] = expected tokens with c draft tokens (c = 0..K); who[i, c] = proposer index.
        best = np.full((B, K + 1), -np.inf)
        best[:, 0] = 1.0
        who = np.full((B, K + 1), -1, dtype=np.int64)
        feats: list[list[float]] = []
        states: list[_ReqState] = []
        avail = np.zeros((B, P), dtype=np.int64)
        per_prop_rows: dict[str, tuple[list[int], list[np.ndarray]]] = {p: ([], []) for p in props}
        for i, r in enumerate(view.requests):
            st = self._req.get(r.req_id)
            if st is None:
                st = self._req[r.req_id] = _ReqState()
            states.append(st)
            rf = self._request_features(r, st, view)
            st.rf = rf
            feats.append([float(v) for v in rf])
            st.pending = {}
            st.pending_temperature = float(r.temperature)
            cap = max(min(K, r.max_new_tokens - 1), 0)
            for pi, p in enumerate(props):
                d = r.drafts.get(p)
                n = 0 if d is None else min(len(d), cap)
                avail[i, pi] = n
                if d is not None and len(d) > 0:
                    base = np.concatenate(
                        [
                            rf,
                            self._proposer_features(
                                st, p, min(len(d), K), r.match_lengths.get(p, 0)
                            ),
                        ]
                    )
                    st.pending[p] = (np.asarray(d[:K], dtype=np.int64), base)
                    if n > 0:
                        per_prop_rows[p][0].append(i)
                        per_prop_rows[p][1].append(base)
        for pi, p in enumerate(props):
            idx, rows = per_prop_rows[p]
            if not idx:
                continue
            a = self._acceptance(p, np.stack(rows))  # [n, K]
            exp_tok = 1.0 + np.cumsum(np.cumprod(a, axis=1), axis=1)  # E[tokens | c drafts], c=1..K
            for row, i in enumerate(idx):
                n = avail[i, pi]
                cand = exp_tok[row, :n]
                better = cand > best[i, 1 : n + 1]
                best[i, 1 : n + 1] = np.where(better, cand, best[i, 1 : n + 1])
                who[i, 1 : n + 1] = np.where(better, pi, who[i, 1 : n + 1])
        ks = self._allocate(best, view.batch_size)
        arms: list[Arm] = []
        propensities: list[float | None] = []
        for i in range(B):
            k = int(ks[i])
            arm = NO_SPEC if k == 0 else Arm(props[int(who[i, k])], k)
            prop: float | None = None
            if self.exploration == "eps-greedy":
                options = [NO_SPEC] + [
                    Arm(p, c) for pi, p in enumerate(props) for c in range(1, int(avail[i, pi]) + 1)
                ]
                if self.rng.random() < self.epsilon:
                    arm = options[int(self.rng.integers(len(options)))]
                prop = (1.0 - self.epsilon) * (
                    1.0 if arm == (NO_SPEC if k == 0 else Arm(props[int(who[i, k])], k)) else 0.0
                )
                prop += self.epsilon / len(options)
            elif self.exploration == "greedy":
                prop = 1.0
            arms.append(arm)
            propensities.append(prop)
        self.n_steps += 1
        return Decision(arms, propensities, feats)

    def _allocate(self, best: np.ndarray, batch_size: int) -> np.ndarray:
        """Draft tokens per request maximising predicted goodput (see the module docstring)."""
        B, K1 = best.shape
        cur = np.zeros(B, dtype=np.int64)
        seg_req: list[np.ndarray] = []
        seg_slope: list[np.ndarray] = []
        seg_dc: list[np.ndarray] = []
        seg_de: list[np.ndarray] = []
        seg_new: list[np.ndarray] = []
        cs = np.arange(K1)
        # A request's first draft token also pays the per-request cost: in draft-token equivalents.
        _, _, c_tok, _, c_req = self.cost.coefficients()
        first_extra = c_req / c_tok if c_tok > 0 else 0.0
        active = np.ones(B, dtype=bool)
        rows = np.arange(B)
        for _ in range(K1 - 1):
            if not active.any():
                break
            base_e = best[rows, cur]
            dc = cs[None, :] - cur[:, None]
            cost = dc + np.where(cur == 0, first_extra, 0.0)[:, None]
            with np.errstate(invalid="ignore", divide="ignore"):
                slope = np.where(dc > 0, (best - base_e[:, None]) / np.maximum(cost, 1), -np.inf)
            slope[~np.isfinite(slope)] = -np.inf
            nxt = np.argmax(slope, axis=1)
            s = slope[rows, nxt]
            ok = active & (s > self.min_gain)
            if not ok.any():
                break
            seg_req.append(rows[ok])
            seg_slope.append(s[ok])
            seg_dc.append((nxt - cur)[ok])
            seg_new.append((cur == 0)[ok])
            seg_de.append((best[rows, nxt] - base_e)[ok])
            cur = np.where(ok, nxt, cur)
            active = ok
        ks = np.zeros(B, dtype=np.int64)
        if not seg_req:
            return ks
        req = np.concatenate(seg_req)
        slope = np.concatenate(seg_slope)
        dcs = np.concatenate(seg_dc)
        des = np.concatenate(seg_de)
        new = np.concatenate(seg_new)
        order = np.argsort(-slope, kind="stable")
        cum_v = np.concatenate([[0], np.cumsum(dcs[order])])
        cum_r = np.concatenate([[0], np.cumsum(new[order])])
        cum_e = B + np.concatenate([[0.0], np.cumsum(des[order])])
        goodput = cum_e / self.cost.predict(max(batch_size, B), cum_v, speculating_requests=cum_r)
        m = int(np.argmax(goodput))
        np.add.at(ks, req[order[:m]], dcs[order[:m]])
        return ks

    # -- learning -----------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        self.cost.update(
            outcome.batch_size,
            outcome.num_verified_tokens,
            outcome.step_time_s,
            outcome.num_prefill_tokens,
            speculating_requests=sum(1 for o in outcome.requests if o.drafted > 0),
        )
        X_by: dict[str, list[np.ndarray]] = {p: [] for p in self.proposers}
        y_by: dict[str, list[np.ndarray]] = {p: [] for p in self.proposers}
        K = self.max_k
        w = self.ema_weight
        for o in outcome.requests:
            st = self._req.get(o.req_id)
            if st is None or not st.pending:
                continue
            emitted = o.emitted_token_ids
            stochastic_draft = st.pending_temperature > 0
            rates = []
            for p, (draft, base) in st.pending.items():
                if p == o.arm.proposer and stochastic_draft and p.startswith(("draft", "lora:")):
                    # A sampled draft is judged by rejection sampling, not by equality: use the outcome.
                    n_ones = o.accepted
                    n_zero = 1 if o.accepted < o.drafted else 0
                else:
                    m = matched_prefix(draft, emitted)
                    n_ones, n_zero = acceptance_rows(len(draft), len(emitted), m)
                n = min(n_ones + n_zero, K)
                if n == 0:
                    continue
                y = np.zeros(n)
                y[: min(n_ones, n)] = 1.0
                X = np.concatenate([np.repeat(base[None, :], n, axis=0), self._pos[:n]], axis=1)
                X_by[p].append(X)
                y_by[p].append(y)
                rate = float(y.mean())
                st.ema[p] = (1 - w) * st.ema.get(p, 0.5) + w * rate
                rates.append(rate)
            if rates:
                st.ema_all = (1 - w) * st.ema_all + w * float(np.mean(rates))
            st.pending = {}
            if o.finished:
                self._req.pop(o.req_id, None)
        for p in self.proposers:
            if X_by[p]:
                self.models[p].learn_batch(np.concatenate(X_by[p]), np.concatenate(y_by[p]))

    def release(self, req_id: str) -> None:
        self._req.pop(req_id, None)

    def num_tracked_requests(self) -> int:
        return len(self._req)

    def drafter_preference(self, req_id: str, candidates: list[str]) -> str | None:
        """Thompson sampling (UCB / posterior mean in those modes) over the draft-model proposers:
        the candidate with the largest sampled expected accepted length at ``max_k`` for this request
        (its latest request features and its acceptance history with each candidate; an untried
        candidate starts at the prior). Candidates not in this controller's proposers are ignored;
        returns ``None`` when none is left."""
        cands = [p for p in candidates if p in self.models]
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        st = self._req.get(req_id) or _ReqState()
        rf = st.rf
        if rf is None:
            rf = np.zeros(len(REQUEST_FEATURES))
            rf[0] = 1.0
            rf[-1] = st.ema_all
        scores = []
        for p in cands:
            base = np.concatenate([rf, self._proposer_features(st, p, self.max_k)])
            a = self._acceptance(p, base[None, :])[0]
            scores.append(float(np.cumprod(a).sum()))
        return cands[int(np.argmax(scores))]

    def estimated_acceptance(self) -> dict[str, float]:
        """Posterior-mean first-position acceptance per proposer for a neutral request (for metrics)."""
        out = {}
        for p, model in self.models.items():
            base = np.zeros(FEATURE_DIM)
            base[0] = 1.0
            base[len(REQUEST_FEATURES)] = 0.5
            base[len(REQUEST_FEATURES) + 1] = 1.0
            base[-2] = 1.0 / max(self.max_k, 1)
            base[-1] = 1.0
            out[p] = float(model.predict_proba(base[None, :])[0])
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "proposers": list(self.proposers),
            "max_k": self.max_k,
            "feature_dim": FEATURE_DIM,
            "models": {p: m.state_dict() for p, m in self.models.items()},
            "cost": self.cost.state_dict(),
            "n_steps": self.n_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore learned state. Raises ValueError when the state does not fit this controller
        (other proposers, max_k or feature layout); nothing is changed then."""
        if not isinstance(state, dict) or state.get("name") != self.name:
            raise ValueError(f"policy state is not an {self.name!r} controller state")
        if state.get("feature_dim") != FEATURE_DIM or state.get("max_k") != self.max_k:
            raise ValueError(
                f"policy state has feature_dim={state.get('feature_dim')}, max_k={state.get('max_k')}; "
                f"this controller has feature_dim={FEATURE_DIM}, max_k={self.max_k}"
            )
        if not isinstance(state.get("models"), dict) or sorted(state["models"]) != sorted(
            self.models
        ):
            raise ValueError(
                f"policy state has proposers {sorted(state.get('models', {}))}; this controller has {sorted(self.models)}"
            )
        n_steps = state.get("n_steps", 0)
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"policy state has n_steps={n_steps!r}; expected an integer >= 0")
        new_models = {}
        for p in self.models:
            m = LogisticThompson(FEATURE_DIM)
            m.load_state_dict(state["models"][p])
            new_models[p] = m
        cost = StepCostModel()
        cost.load_state_dict(state["cost"])
        # Everything parsed and validated: only now replace the learned state (never half-loaded).
        self.models, self.cost = new_models, cost
        self.n_steps = n_steps
