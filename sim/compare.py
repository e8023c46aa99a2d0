"""Replay several policies over one workload and compare them with the hindsight comparators.

:func:`compare_policies` replays each named policy, every static arm (for the best static arm in
hindsight), the per-request best static arm and the oracle, computes the oracle bound, and reports
each policy's regret against (a) the best static arm, (b) the per-request best static arm and
(c) the oracle (:mod:`adaptive_spec.sim.regret`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.core.arms import arm_space

from .cost_profiles import CostProfile
from .oracle import OracleBound, oracle_bound
from .policies import build_policy
from .regret import Regret, regret
from .replay import ReplayResult, replay
from .requests import ReplayRequest


@dataclass(slots=True)
class Comparison:
    """Results of :func:`compare_policies`.

    Attributes
    ----------
    results : dict of str to ReplayResult
        The requested policies, in the order asked.
    static : dict of str to float
        Goodput of every static arm (``"static:<arm>"`` / ``"none"``).
    best_static : str
        Name of the best static arm in hindsight.
    per_request_static, oracle : ReplayResult
        The comparators' replays.
    bound : OracleBound
        Goodput no policy can exceed.
    """

    results: dict[str, ReplayResult]
    static: dict[str, float]
    best_static: str
    per_request_static: ReplayResult
    oracle: ReplayResult
    bound: OracleBound
    comparators: dict[str, float] = field(default_factory=dict)

    def regrets(self, name: str) -> dict[str, Regret]:
        """Regret of policy ``name`` against each comparator."""
        res = self.results[name]
        return {c: regret(res, c, g) for c, g in self.comparators.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "policies": {
                n: {
                    **r.as_dict(),
                    "regret": {
                        c: {"tokens": round(g.tokens, 2), "gap": round(g.gap, 5)}
                        for c, g in self.regrets(n).items()
                    },
                }
                for n, r in self.results.items()
            },
            "static_goodput": {k: round(v, 3) for k, v in self.static.items()},
            "best_static": self.best_static,
            "comparators": {k: round(v, 3) for k, v in self.comparators.items()},
            "oracle_bound_goodput": round(self.bound.goodput, 3),
        }


def compare_policies(
    requests: list[ReplayRequest],
    names: list[str],
    profile: CostProfile,
    *,
    proposers: list[str],
    max_k: int,
    max_batch: int,
    seed: int = 0,
    prior_key: Mapping[str, Any] | None = None,
) -> Comparison:
    """Replay ``names`` and the comparators over ``requests`` (see the module docstring).
    ``prior_key``: learning policies start from that model's shipped acceptance prior
    (:func:`~adaptive_spec.sim.policies.build_policy`).

    Raises
    ------
    ValueError
        For an unknown policy name or empty ``names``/``requests``.
    """
    if not names:
        raise ValueError("names is empty; give at least one policy")
    if not requests:
        raise ValueError("requests is empty; nothing to replay")
    props = [p for p in proposers if p != "none"]

    def run(name: str) -> ReplayResult:
        pol = build_policy(
            name,
            props,
            max_k,
            requests=requests,
            profile=profile,
            max_batch=max_batch,
            seed=seed,
            prior_key=prior_key,
        )
        res = replay(requests, pol, profile, max_batch=max_batch, proposers=props)
        res.policy = name
        return res

    static: dict[str, float] = {}
    static_runs: dict[str, ReplayResult] = {}
    for arm in arm_space(props, max_k):
        name = "none" if arm.k == 0 else f"static:{arm}"
        static_runs[name] = run(name)
        static[name] = static_runs[name].goodput
    best = max(static, key=lambda n: static[n])
    prs = run("per-request-static")
    orc = run("oracle")
    results = {}
    for n in names:
        if n in static_runs:
            results[n] = static_runs[n]
        elif n == "oracle":
            results[n] = orc
        elif n == "per-request-static":
            results[n] = prs
        else:
            results[n] = run(n)
    bound = oracle_bound(requests, profile, max_batch=max_batch, proposers=props, max_k=max_k)
    comparators = {
        "best-static": static[best],
        "per-request-static": prs.goodput,
        "oracle": orc.goodput,
    }
    return Comparison(results, static, best, prs, orc, bound, comparators)
