"""Synthetic workloads with known acceptance processes, and a synthetic trace recorder.

A synthetic request is a random output sequence plus, for each proposer and position, a draft whose
accepted length ``m`` is drawn from that proposer's :class:`AcceptanceProcess` in the *regime* active
at that position. Regimes can change within a request (retrieval hit -> creative writing), across
requests (code -> chat), or adversarially (the best proposer flips every few tokens); arrivals can
ramp or spike. Everything that makes the optimum computable is known:

* :func:`static_arm_rate`: the long-run goodput of a static arm ``(proposer, k)`` in a regime at
  batch size B (every request in the same regime), exact for any cost profile;
* :func:`best_static_arm`: its maximiser;
* :func:`optimal_rate`: at batch size 1, the best goodput of any policy that sees which proposers
  offer a draft but not their accepted length (Dinkelbach's method on the renewal-reward ratio), and
  :func:`pseudo_regret` the per-step loss of an arm against it.

:func:`record_trace` writes a valid trace (engine schema, :mod:`adaptive_spec.core.trace`) of a policy run
over a synthetic workload, with counterfactual lines for every proposer, so replay tests need no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm, arm_space, check_proposer_name
from adaptive_spec.core.controller import DECISION_FEATURES
from adaptive_spec.core.protocol import SpecPolicy
from adaptive_spec.core.trace import TraceWriter

from .cost_profiles import CostProfile, is_draft_model
from .counterfactual import Counterfactuals, write_counterfactuals
from .replay import ReplayResult, replay
from .requests import ReplayRequest

KINDS = ("geometric", "bimodal", "fixed")


@dataclass(frozen=True, slots=True)
class AcceptanceProcess:
    """How many of a proposer's draft tokens the target accepts, when it offers a draft.

    Parameters
    ----------
    alpha : float in [0, 1]
        ``geometric``: per-position acceptance probability (m = leading successes, capped at max_k);
        ``bimodal``: probability that the whole draft is accepted (else m = 0);
        ``fixed``: unused (use ``length``).
    offer : float in [0, 1]
        Probability that the proposer offers a draft at a position (an n-gram lookup may find none).
    kind : {"geometric", "bimodal", "fixed"}
    length : int >= 0
        For ``fixed``: m = min(length, max_k) always.

    Raises
    ------
    ValueError
        For a parameter outside its range.
    """

    alpha: float
    offer: float = 1.0
    kind: str = "geometric"
    length: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.alpha <= 1.0):
            raise ValueError(f"alpha={self.alpha!r} is invalid; allowed: 0 <= alpha <= 1")
        if not (0.0 <= self.offer <= 1.0):
            raise ValueError(f"offer={self.offer!r} is invalid; allowed: 0 <= offer <= 1")
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not known; allowed: {', '.join(KINDS)}")
        if not isinstance(self.length, int) or self.length < 0:
            raise ValueError(f"length={self.length!r} is invalid; allowed: an integer >= 0")

    def pmf(self, max_k: int) -> np.ndarray:
        """``P(m = j | offered)`` for ``j = 0..max_k`` (float64 [max_k + 1], sums to 1)."""
        p = np.zeros(max_k + 1)
        if self.kind == "geometric":
            a = self.alpha
            j = np.arange(max_k)
            p[:max_k] = a**j * (1 - a)
            p[max_k] = a**max_k
        elif self.kind == "bimodal":
            p[0] = 1 - self.alpha
            p[max_k] += self.alpha
        else:
            p[min(self.length, max_k)] = 1.0
        return p

    def expected_accepted(self, k: int, max_k: int) -> float:
        """``E[min(k, m) | offered]``."""
        surv = 1.0 - np.cumsum(self.pmf(max_k))  # P(m > j), j = 0..max_k
        return float(surv[:k].sum())

    def sample(self, rng: np.random.Generator, max_k: int) -> int | None:
        """Draw m, or None when the proposer offers nothing."""
        if rng.random() >= self.offer:
            return None
        return int(rng.choice(max_k + 1, p=self.pmf(max_k)))


@dataclass(frozen=True, slots=True)
class Regime:
    """A named set of acceptance processes, one per proposer."""

    name: str
    processes: Mapping[str, AcceptanceProcess]

    def __post_init__(self) -> None:
        for p in self.processes:
            check_proposer_name(p)
            if p == "none":
                raise ValueError("a regime cannot define a process for proposer 'none'")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One synthetic request: output length, regime segments ``((start, regime), ...)`` with the first
    starting at 0, category, arrival time (s) and prompt length."""

    length: int
    segments: tuple[tuple[int, Regime], ...]
    category: str | None = None
    arrival_s: float = 0.0
    prompt_len: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length={self.length!r} is invalid; allowed: an integer >= 1")
        if not self.segments or self.segments[0][0] != 0:
            raise ValueError("segments must be non-empty and start at position 0")
        starts = [s for s, _ in self.segments]
        if starts != sorted(starts):
            raise ValueError(f"segment starts {starts} are not increasing")

    def regime_at(self, n: int) -> Regime:
        reg = self.segments[0][1]
        for s, r in self.segments:
            if s <= n:
                reg = r
        return reg


def make_requests(
    specs: Sequence[RequestSpec], max_k: int, *, seed: int = 0, vocab_size: int = 32000
) -> list[ReplayRequest]:
    """Draw output sequences and per-position drafts for ``specs``.

    Every proposer named in any regime gets a draft table; where the active regime has no process
    for it, it offers nothing there. A draft holds the ``m`` true next tokens, then a wrong token,
    then random tokens up to ``max_k``.

    Parameters
    ----------
    specs : sequence of RequestSpec
    max_k : int >= 1
    seed : int
    vocab_size : int > 10

    Returns
    -------
    list of ReplayRequest
        Ids ``s0, s1, ...``; budget = output length.
    """
    if not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 1")
    if vocab_size <= 10:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; allowed: > 10")
    rng = np.random.default_rng(seed)
    props = sorted({p for s in specs for _, r in s.segments for p in r.processes})
    out = []
    for i, spec in enumerate(specs):
        L = spec.length
        toks = rng.integers(10, vocab_size, size=L, dtype=np.int64)
        prompt = rng.integers(10, vocab_size, size=spec.prompt_len, dtype=np.int64)
        bounds = [s for s, _ in spec.segments] + [L]
        tables: dict[str, list[np.ndarray | None]] = {}
        for p in props:
            m = np.full(L, -1, dtype=np.int64)  # -1: offers nothing
            for (start, reg), end in zip(spec.segments, bounds[1:], strict=True):
                proc = reg.processes.get(p)
                n_seg = max(min(end, L) - start, 0)
                if proc is None or n_seg == 0:
                    continue
                offered = rng.random(n_seg) < proc.offer
                cdf = np.cumsum(proc.pmf(max_k))
                draw = np.minimum(
                    np.searchsorted(cdf, rng.random(n_seg) * cdf[-1], side="right"), max_k
                )
                m[start : start + n_seg] = np.where(offered, draw, -1)
            fill = rng.integers(10, vocab_size, size=(L, max_k), dtype=np.int64)
            table: list[np.ndarray | None] = []
            for n in range(L):
                if m[n] < 0:
                    table.append(np.zeros(0, dtype=np.int64))
                    continue
                mm = min(int(m[n]), L - n)
                d = fill[n]
                d[:mm] = toks[n : n + mm]
                if mm < max_k and n + mm < L and d[mm] == toks[n + mm]:
                    d[mm] = 10 + (d[mm] - 9) % (vocab_size - 10)  # any other token
                table.append(d)
            tables[p] = table
        out.append(
            ReplayRequest(
                req_id=f"s{i}",
                prompt_token_ids=prompt,
                output_token_ids=toks,
                max_tokens=L,
                category=spec.category,
                arrival_s=spec.arrival_s,
                drafts=tables,
            )
        )
    return out


def _offer_states(regime: Regime, proposers: Sequence[str]) -> list[tuple[frozenset[str], float]]:
    """Which proposers offer a draft, with probabilities (offers independent)."""
    props = [p for p in proposers if p in regime.processes]
    out = []
    for bits in product((0, 1), repeat=len(props)):
        pr = 1.0
        s = set()
        for p, b in zip(props, bits, strict=True):
            o = regime.processes[p].offer
            pr *= o if b else 1 - o
            if b:
                s.add(p)
        if pr > 0:
            out.append((frozenset(s), pr))
    return out


def static_arm_rate(
    regime: Regime, arm: Arm, profile: CostProfile, max_k: int, batch_size: int = 1
) -> float:
    """Long-run goodput (tokens/s) of playing ``arm`` for every request of a full batch in ``regime``.

    Exact for any profile: the number of requests whose proposer offers a draft is binomial.
    (Ignores prefill and the end of requests: the steady state of long requests.)
    """
    if arm.k == 0 or arm.proposer not in regime.processes:
        return batch_size / float(profile.step_time(batch_size, 0, 0, 0))
    proc = regime.processes[arm.proposer]
    acc = proc.expected_accepted(arm.k, max_k)
    B = batch_size
    j = np.arange(B + 1)
    pj = np.array([math.comb(B, int(x)) for x in j]) * proc.offer**j * (1 - proc.offer) ** (B - j)
    draft = is_draft_model(arm.proposer)
    t = np.array(
        [float(profile.step_time(B, arm.k * x, arm.k if (draft and x) else 0, 0)) for x in j]
    )
    tokens = B * (1.0 + proc.offer * acc)
    return tokens / float((pj * t).sum())


def best_static_arm(
    regime: Regime, profile: CostProfile, max_k: int, proposers: Sequence[str], batch_size: int = 1
) -> tuple[Arm, float]:
    """The static arm with the highest :func:`static_arm_rate`, and that rate."""
    arms = arm_space([p for p in proposers if p != "none"], max_k)
    rates = [static_arm_rate(regime, a, profile, max_k, batch_size) for a in arms]
    i = int(np.argmax(rates))
    return arms[i], float(rates[i])


def _arm_value(regime: Regime, arm: Arm, profile: CostProfile, max_k: int) -> tuple[float, float]:
    """(expected tokens, step time) of one batch-1 step playing an arm whose proposer offers a draft."""
    if arm.k == 0:
        return 1.0, float(profile.step_time(1, 0, 0, 0))
    proc = regime.processes[arm.proposer]
    D = arm.k if is_draft_model(arm.proposer) else 0
    return 1.0 + proc.expected_accepted(arm.k, max_k), float(profile.step_time(1, arm.k, D, 0))


def optimal_rate(
    regime: Regime,
    profile: CostProfile,
    max_k: int,
    proposers: Sequence[str],
    *,
    tol: float = 1e-10,
) -> float:
    """Best long-run goodput at batch size 1 of a policy that sees which proposers offer a draft.

    Dinkelbach's method: ``G <- E[tokens(a*)] / E[t(a*)]`` with ``a*(state) = argmax_a tokens(a) -
    G t(a)`` until ``G`` stops changing (converges superlinearly to the optimal ratio).
    """
    states = _offer_states(regime, [p for p in proposers if p != "none"])
    G = 1.0 / float(profile.step_time(1, 0, 0, 0))
    for _ in range(100):
        num = den = 0.0
        for s, pr in states:
            opts = [NO_SPEC] + [Arm(p, k) for p in sorted(s) for k in range(1, max_k + 1)]
            vals = [_arm_value(regime, a, profile, max_k) for a in opts]
            best = max(vals, key=lambda v: v[0] - G * v[1])
            num += pr * best[0]
            den += pr * best[1]
        new = num / den
        if abs(new - G) <= tol * G:
            return new
        G = new
    return G


def _budget_cap(max_k: int, remaining: int | None) -> int:
    """Largest k a request with ``remaining`` tokens to emit verifies (``remaining - 1``, as the
    engine's budget cap; ``max_k`` without a budget)."""
    return max_k if remaining is None else max(0, min(max_k, remaining - 1))


def _played_arm(
    arm: Arm, offered: set[str] | frozenset[str], known: Collection[str], cap: int
) -> Arm:
    """``arm`` as the step plays it: no speculation when its proposer offers no draft (or is not
    in ``known``), k cut to ``cap``."""
    if arm.k and (arm.proposer not in offered or arm.proposer not in known):
        return NO_SPEC
    if arm.k > cap:
        return NO_SPEC if cap == 0 else Arm(arm.proposer, cap)
    return arm


class RegimeOptimum:
    """The batch-1 optimum of a regime, precomputed: its rate (:func:`optimal_rate`), the value of
    every arm, and per step the best arm and the regret of any arm.

    Parameters
    ----------
    regime : Regime
    profile : CostProfile
    max_k : int
    proposers : sequence of str
    """

    def __init__(
        self, regime: Regime, profile: CostProfile, max_k: int, proposers: Sequence[str]
    ) -> None:
        self.regime = regime
        self.max_k = max_k
        self.proposers = [p for p in proposers if p != "none" and p in regime.processes]
        self.rate = optimal_rate(regime, profile, max_k, proposers)
        self._value = {NO_SPEC: _arm_value(regime, NO_SPEC, profile, max_k)}
        for p in self.proposers:
            for k in range(1, max_k + 1):
                self._value[Arm(p, k)] = _arm_value(regime, Arm(p, k), profile, max_k)

    def _score(self, arm: Arm) -> float:
        tok, t = self._value[arm]
        return tok - self.rate * t

    def best_arm(self, offered: set[str] | frozenset[str], remaining: int | None = None) -> Arm:
        """The optimal policy's arm when ``offered`` proposers offer a draft (k cut to
        ``remaining - 1``)."""
        cap = _budget_cap(self.max_k, remaining)
        opts = [NO_SPEC] + [
            Arm(p, k) for p in self.proposers if p in offered for k in range(1, cap + 1)
        ]
        return max(opts, key=self._score)

    def regret(
        self, offered: set[str] | frozenset[str], arm: Arm, remaining: int | None = None
    ) -> float:
        """Expected tokens lost by one step playing ``arm`` (see :func:`pseudo_regret`)."""
        played = _played_arm(arm, offered, self.proposers, _budget_cap(self.max_k, remaining))
        return max(self._score(self.best_arm(offered, remaining)) - self._score(played), 0.0)


def pseudo_regret(
    regime: Regime,
    offered: set[str],
    arm: Arm,
    rate: float,
    profile: CostProfile,
    max_k: int,
    remaining: int | None = None,
) -> float:
    """Expected tokens lost by one batch-1 step playing ``arm`` when ``offered`` proposers offer a
    draft, against the optimal policy of goodput ``rate``: ``max_a (E tok(a) - rate t(a)) - (E tok(arm)
    - rate t(arm))`` (>= 0; its sum over steps is the regret in tokens).

    ``remaining``: tokens the request still has to emit; arms are then cut to ``k <= remaining - 1``
    (as the engine's budget cap does), so the end of a request is not counted as a loss. For many
    steps, :class:`RegimeOptimum` precomputes the same quantities.
    """
    cap = _budget_cap(max_k, remaining)
    opts = [NO_SPEC] + [
        Arm(p, k) for p in sorted(offered) if p in regime.processes for k in range(1, cap + 1)
    ]
    best = max(v[0] - rate * v[1] for v in (_arm_value(regime, a, profile, max_k) for a in opts))
    tok, t = _arm_value(regime, _played_arm(arm, offered, regime.processes, cap), profile, max_k)
    return max(best - (tok - rate * t), 0.0)


# -- named workloads ----------------------------------------------------------------------------

CODE = Regime(
    "code",
    {"ngram": AcceptanceProcess(0.85, offer=0.9), "jacobi": AcceptanceProcess(0.3)},
)
CHAT = Regime(
    "chat",
    {"ngram": AcceptanceProcess(0.25, offer=0.3), "jacobi": AcceptanceProcess(0.6)},
)
RETRIEVAL = Regime(
    "retrieval",
    {"ngram": AcceptanceProcess(0.92), "jacobi": AcceptanceProcess(0.2)},
)
CREATIVE = Regime(
    "creative",
    {"ngram": AcceptanceProcess(0.05, offer=0.2), "jacobi": AcceptanceProcess(0.45)},
)
TRAP = Regime(
    "trap",
    {
        "ngram": AcceptanceProcess(0.0, kind="fixed", length=1),
        "jacobi": AcceptanceProcess(0.5, kind="bimodal"),
    },
)


def stationary(regime: Regime, n_requests: int, length: int, **kw: float) -> list[RequestSpec]:
    """``n_requests`` requests of ``length`` tokens, all in one regime."""
    return [RequestSpec(length, ((0, regime),), regime.name, **kw) for _ in range(n_requests)]


def shift_across_requests(
    regimes: Sequence[Regime], n_per_regime: int, length: int
) -> list[RequestSpec]:
    """Consecutive blocks of requests, one regime per block (e.g. code then chat)."""
    return [RequestSpec(length, ((0, r),), r.name) for r in regimes for _ in range(n_per_regime)]


def shift_within_request(
    first: Regime, second: Regime, shift_at: int, n_requests: int, length: int
) -> list[RequestSpec]:
    """Each request starts in ``first`` and switches to ``second`` at position ``shift_at``."""
    seg = ((0, first), (shift_at, second))
    return [RequestSpec(length, seg, f"{first.name}->{second.name}") for _ in range(n_requests)]


def alternating(
    regimes: Sequence[Regime], period: int, n_requests: int, length: int
) -> list[RequestSpec]:
    """Adversarial: the regime cycles every ``period`` positions inside each request."""
    seg = tuple((s, regimes[(s // period) % len(regimes)]) for s in range(0, length, period))
    return [RequestSpec(length, seg, "alternating") for _ in range(n_requests)]


def with_arrivals(specs: Sequence[RequestSpec], arrivals: Sequence[float]) -> list[RequestSpec]:
    """The same specs with arrival times (seconds, non-decreasing)."""
    if len(arrivals) != len(specs):
        raise ValueError(f"{len(arrivals)} arrivals for {len(specs)} requests")
    return [
        RequestSpec(s.length, s.segments, s.category, float(a), s.prompt_len)
        for s, a in zip(specs, arrivals, strict=True)
    ]


def ramp_arrivals(n: int, rate_start: float, rate_end: float, seed: int = 0) -> np.ndarray:
    """Poisson arrivals whose rate (requests/s) ramps linearly from ``rate_start`` to ``rate_end``."""
    if rate_start <= 0 or rate_end <= 0:
        raise ValueError("rates must be > 0 (requests per second)")
    rng = np.random.default_rng(seed)
    rates = np.linspace(rate_start, rate_end, n)
    return np.cumsum(rng.exponential(1.0 / rates))


def spike_arrivals(
    n: int, rate: float, spike_at: int, spike_size: int, seed: int = 0
) -> np.ndarray:
    """Poisson arrivals at ``rate`` with ``spike_size`` requests arriving at once after ``spike_at``."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[spike_at : spike_at + spike_size] = 0.0
    return np.cumsum(gaps)


@dataclass(frozen=True, slots=True)
class Workload:
    """A named synthetic workload: its request specs and the regimes it uses."""

    name: str
    specs: tuple[RequestSpec, ...]
    regimes: tuple[Regime, ...] = field(default=())


def named_workload(name: str, *, scale: int = 1, seed: int = 0) -> Workload:
    """Built-in workloads: ``code-chat``, ``retrieval-creative``, ``load-ramp``, ``load-spike``,
    ``adversarial``. ``scale`` multiplies the number of requests.

    Raises
    ------
    ValueError
        For an unknown name or ``scale`` < 1.
    """
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale={scale!r} is invalid; allowed: an integer >= 1")
    if name == "code-chat":
        specs = shift_across_requests([CODE, CHAT], 8 * scale, 96)
        return Workload(name, tuple(specs), (CODE, CHAT))
    if name == "retrieval-creative":
        specs = shift_within_request(RETRIEVAL, CREATIVE, 64, 12 * scale, 160)
        return Workload(name, tuple(specs), (RETRIEVAL, CREATIVE))
    if name == "load-ramp":
        base = stationary(CODE, 24 * scale, 64)
        arr = ramp_arrivals(len(base), 2.0, 60.0, seed=seed)
        return Workload(name, tuple(with_arrivals(base, arr)), (CODE,))
    if name == "load-spike":
        base = stationary(CHAT, 24 * scale, 64)
        arr = spike_arrivals(len(base), 3.0, 8 * scale, 10 * scale, seed=seed)
        return Workload(name, tuple(with_arrivals(base, arr)), (CHAT,))
    if name == "adversarial":
        specs = alternating([TRAP, CODE, CHAT], 12, 8 * scale, 144)
        return Workload(name, tuple(specs), (TRAP, CODE, CHAT))
    raise ValueError(
        f"workload={name!r} is not known; allowed: code-chat, retrieval-creative, load-ramp, load-spike, adversarial"
    )


WORKLOAD_NAMES = ("code-chat", "retrieval-creative", "load-ramp", "load-spike", "adversarial")


def record_trace(
    path: str | Path,
    requests: list[ReplayRequest],
    policy: SpecPolicy,
    profile: CostProfile,
    *,
    max_batch: int,
    step_time_noise: float = 0.0,
    seed: int = 0,
    meta: dict | None = None,
) -> tuple[Path, ReplayResult]:
    """Run ``policy`` over synthetic ``requests`` and write the run as a trace.

    The trace has the engine's schema (header with ``max_k``, ``proposers``, ``policy``,
    ``feature_names``; request and step lines; an end line) plus ``"counterfactual"`` lines carrying
    every proposer's drafts at every position (source ``synthetic``), so that a replay of it sees the
    same drafts as the recording run.

    Returns
    -------
    (path, ReplayResult)
    """
    path = Path(path)
    props = sorted({p for r in requests for p in r.drafts})
    writer = TraceWriter(
        path,
        {
            "max_k": policy.max_k,
            "proposers": ["none", *props],
            "policy": policy.name,
            "feature_names": list(DECISION_FEATURES),
            "meta": {"synthetic": True, "profile": profile.describe(), **(meta or {})},
        },
    )
    res = replay(
        requests,
        policy,
        profile,
        max_batch=max_batch,
        proposers=props,
        step_time_noise=step_time_noise,
        seed=seed,
        writer=writer,
    )
    writer.close({"metrics": res.metrics.as_dict()})
    cf = Counterfactuals(
        tables={r.req_id: dict(r.drafts) for r in requests},
        sources=dict.fromkeys(props, "synthetic"),
    )
    write_counterfactuals(path, path, cf)
    return path, res
