"""Published adaptive-speculation rules, reimplemented as policies for side-by-side replay.

* :class:`SmartSpecPolicy`: SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving
  Large Language Models Using Goodput"): one fixed proposer; per request an acceptance rate estimated
  from that request's history (an exponential moving average); per step the proposed lengths that
  maximise predicted goodput ``sum_i E[tokens_i] / t(batch)``, with
  ``E[tokens | alpha, k] = (1 - alpha^(k+1)) / (1 - alpha)`` and the same measured step-cost table
  as the adaptive controller (the paper fits a step-time model; a table is the fair comparison).
* :class:`BanditSpecPolicy`: UCBSpec from BanditSpec (Hou et al. 2025, "BanditSpec: Adaptive
  Speculative Decoding via Bandit Algorithms", ICML 2025): a multi-armed bandit over speculation
  configurations (here the draft length k of one proposer), one pull per engine step for the whole
  batch, UCB1 index on the step's reward, here tokens emitted per second.

Both are written from the papers' descriptions, not from their code; the register names the lead
uses in :func:`adaptive_spec.core.policies.make_policy` are ``smartspec:<proposer>`` and
``banditspec:<proposer>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView, matched_prefix


def _pick_proposer(proposers: list[str], proposer: str | None) -> str:
    if proposer is None:
        if not proposers:
            raise ValueError("proposers is empty; these policies need one proposer besides 'none'")
        return proposers[0]
    if proposer not in proposers:
        raise ValueError(
            f"proposer={proposer!r} is not enabled; enabled: {', '.join(proposers) or 'none'}"
        )
    return proposer


@dataclass(slots=True)
class _Ema:
    successes: float
    trials: float


class SmartSpecPolicy(SpecPolicy):
    """SmartSpec's goodput rule (see the module docstring).

    Per request the acceptance rate ``alpha`` is the ratio of exponential moving averages of accepted
    draft tokens and of verified positions up to and including the first rejection (the per-position
    maximum-likelihood estimate under a constant acceptance rate). Per step, requests' draft tokens
    are added in order of marginal expected tokens ``alpha_i^j`` and the prefix with the highest
    predicted goodput is kept (a request's k is its number of added tokens). As in the paper, a
    request's estimate changes only when it speculates.

    Parameters
    ----------
    proposers : list of str
    max_k : int
    proposer : str, optional
        The fixed proposer (default: the first enabled one).
    ema : float in (0, 1]
        Weight of the newest step in the moving averages.
    prior_acceptance : float in (0, 1)
        Acceptance rate assumed before a request's first verification.
    cost_table : StepCostTable, optional
        The measured step-cost table, the same one the adaptive controller uses (a fair peer); it is
        tracked online the same way (:class:`~adaptive_spec.core.cost_model.StepCostModel`).
    score_unverified : bool
        Not in the paper: also score the proposer's full draft (offered at decision time) against the
        emitted tokens, so that a request whose k fell to 0 keeps learning (the free information a
        deterministic proposer gives; the adaptive controller uses it too). Default False: the
        paper's rule, under which a request's estimate freezes once its k is 0.

    Raises
    ------
    ValueError
        For a parameter outside its range or a proposer not enabled.

    Examples
    --------
    >>> import numpy as np
    >>> from adaptive_spec.core.protocol import RequestView, StepOutcome, StepView
    >>> pol = SmartSpecPolicy(["ngram"], 4)
    >>> pol.observe(StepOutcome([], 0.03, 1, 0))  # one measured step (30 ms) for the cost model
    >>> v = RequestView("r", 1, 100, drafts={"ngram": np.arange(4)})
    >>> pol.decide(StepView([v], batch_size=1)).arms[0].proposer
    'ngram'
    """

    name = "smartspec"

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        proposer: str | None = None,
        ema: float = 0.3,
        prior_acceptance: float = 0.5,
        cost_table: StepCostTable | None = None,
        score_unverified: bool = False,
    ) -> None:
        super().__init__(proposers, max_k)
        self.proposer = _pick_proposer(self.proposers, proposer)
        self.score_unverified = bool(score_unverified)
        self._drafts: dict[str, np.ndarray] = {}
        if not (0.0 < ema <= 1.0):
            raise ValueError(f"ema={ema!r} is invalid; allowed: 0 < ema <= 1")
        if not (0.0 < prior_acceptance < 1.0):
            raise ValueError(
                f"prior_acceptance={prior_acceptance!r} is invalid; allowed: 0 < p < 1"
            )
        self.ema = float(ema)
        self.prior = float(prior_acceptance)
        self.cost = StepCostModel(cost_table)
        self._req: dict[str, _Ema] = {}
        self._sampled = 0.0  # share of the last decided step's requests with temperature > 0
        self.name = f"smartspec:{self.proposer}"

    def acceptance(self, req_id: str) -> float:
        """Current acceptance-rate estimate of a request (clipped to [0.01, 0.99])."""
        st = self._req.get(req_id)
        a = self.prior if st is None or st.trials <= 0 else st.successes / st.trials
        return min(max(a, 0.01), 0.99)

    def decide(self, view: StepView) -> Decision:
        B = len(view.requests)
        caps = np.zeros(B, dtype=np.int64)
        alphas = np.zeros(B)
        if self.score_unverified:
            self._drafts = {}
        for i, r in enumerate(view.requests):
            d = r.drafts.get(self.proposer)
            caps[i] = 0 if d is None else max(0, min(int(d.size), self.max_k, r.max_new_tokens - 1))
            alphas[i] = self.acceptance(r.req_id)
            if self.score_unverified and d is not None and d.size:
                self._drafts[r.req_id] = np.asarray(d[: self.max_k])
        ks = np.zeros(B, dtype=np.int64)
        # The share of requests that sample prices the step with the table's sampled part.
        self._sampled = sum(1 for r in view.requests if r.temperature > 0) / B if B else 0.0
        if B and caps.sum() > 0:
            req_idx = np.repeat(np.arange(B), caps)
            pos = np.concatenate([np.arange(1, c + 1) for c in caps if c > 0])
            marg = alphas[req_idx] ** pos  # P(draft token j accepted) = alpha^j
            order = np.argsort(-marg, kind="stable")
            exp_tok = B + np.concatenate([[0.0], np.cumsum(marg[order])])
            verified = np.arange(order.size + 1)
            goodput = exp_tok / self.cost.curve(
                max(view.batch_size, B), int(verified[-1]), self._sampled
            )
            m = int(np.argmax(goodput))
            np.add.at(ks, req_idx[order[:m]], 1)
        arms = [NO_SPEC if k == 0 else Arm(self.proposer, int(k)) for k in ks]
        return Decision(arms, [1.0] * B, [[float(a)] for a in alphas])

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.update(
            outcome.batch_size,
            outcome.num_verified_tokens,
            outcome.step_time_s,
            prefill_tokens=outcome.num_prefill_tokens,
            sampled=self._sampled,
        )
        w = self.ema
        for o in outcome.requests:
            full = self._drafts.get(o.req_id) if self.score_unverified else None
            if full is not None and o.drafted < full.size:
                succ = matched_prefix(full, o.emitted_token_ids)
                n_emit = len(o.emitted_token_ids)
                trials = succ + (1 if succ < full.size and succ < n_emit else 0)
            elif o.drafted > 0 and o.arm.proposer == self.proposer:
                succ = o.accepted
                trials = o.accepted + (1 if o.accepted < o.drafted else 0)
            else:
                trials = 0
            if trials > 0:
                st = self._req.get(o.req_id)
                if st is None:
                    st = self._req[o.req_id] = _Ema(float(succ), float(trials))
                else:
                    st.successes = (1 - w) * st.successes + w * succ
                    st.trials = (1 - w) * st.trials + w * trials
            if o.finished:
                self._req.pop(o.req_id, None)
        self._drafts = {}

    def release(self, req_id: str) -> None:
        self._req.pop(req_id, None)

    def num_tracked_requests(self) -> int:
        return len(self._req)


class BanditSpecPolicy(SpecPolicy):
    """UCBSpec (see the module docstring): UCB1 over ``k`` for one proposer, per step.

    The arm's reward is the step's tokens per second (decode requests' emitted tokens over the step
    time). UCB1 needs rewards in [0, 1]: rewards are divided by the largest reward seen so far, so the
    index is ``mean_k / r_max + c * sqrt(2 ln t / n_k)``; untried arms are played first, in order.

    Parameters
    ----------
    proposers : list of str
    max_k : int
    proposer : str, optional
        The proposer whose k is chosen (default: the first enabled one).
    ks : sequence of int, optional
        Candidate k values (default ``0..max_k``), each in ``0..max_k``.
    c : float > 0
        Exploration scale.

    Raises
    ------
    ValueError
        For a parameter outside its range or a proposer not enabled.

    Examples
    --------
    >>> pol = BanditSpecPolicy(["ngram"], 2)
    >>> [int(k) for k in pol.ks]
    [0, 1, 2]
    """

    name = "banditspec"

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        proposer: str | None = None,
        ks: list[int] | None = None,
        c: float = 1.0,
    ) -> None:
        super().__init__(proposers, max_k)
        self.proposer = _pick_proposer(self.proposers, proposer)
        ks = list(range(max_k + 1)) if ks is None else list(ks)
        if not ks or any(not isinstance(k, int) or not 0 <= k <= max_k for k in ks):
            raise ValueError(
                f"ks={ks!r} is invalid; allowed: a non-empty list of integers in 0..{max_k}"
            )
        if not (isinstance(c, int | float) and math.isfinite(c) and c > 0):
            raise ValueError(f"c={c!r} is invalid; allowed: a finite number > 0")
        self.ks = np.asarray(ks, dtype=np.int64)
        self.c = float(c)
        self.counts = np.zeros(len(ks))
        self.sums = np.zeros(len(ks))
        self.r_max = 0.0
        self._pending: int | None = None
        self.name = f"banditspec:{self.proposer}"

    def _choose(self) -> int:
        untried = np.flatnonzero(self.counts == 0)
        if untried.size:
            return int(untried[0])
        t = self.counts.sum()
        scale = self.r_max if self.r_max > 0 else 1.0
        index = self.sums / self.counts / scale + self.c * np.sqrt(2.0 * math.log(t) / self.counts)
        return int(np.argmax(index))

    def decide(self, view: StepView) -> Decision:
        if not view.requests:
            return Decision([], [], [])
        j = self._choose()
        self._pending = j
        k = int(self.ks[j])
        arms = []
        for r in view.requests:
            d = r.drafts.get(self.proposer)
            avail = 0 if d is None else min(int(d.size), r.max_new_tokens - 1)
            kk = min(k, max(avail, 0))
            arms.append(NO_SPEC if kk == 0 else Arm(self.proposer, kk))
        return Decision(arms, [1.0] * len(arms), [[float(k)] for _ in arms])

    def observe(self, outcome: StepOutcome) -> None:
        j, self._pending = self._pending, None
        if j is None or not outcome.requests:
            return
        t = outcome.step_time_s
        if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
            return
        reward = sum(len(o.emitted_token_ids) for o in outcome.requests) / t
        self.r_max = max(self.r_max, reward)
        self.counts[j] += 1
        self.sums[j] += reward

    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "ks": self.ks.tolist(),
            "counts": self.counts.tolist(),
            "sums": self.sums.tolist(),
            "r_max": self.r_max,
        }
