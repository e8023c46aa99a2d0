"""Policy names the replay accepts: everything :func:`adaptive_spec.core.policies.make_policy` builds, plus
the hindsight comparators and the published peers. Policies that price steps (the adaptive controller,
SmartSpec) get the replay's cost profile as their measured table (:func:`profile_table`), the same
cost model the oracle plans with. Given the recorded engine's key, the adaptive controller starts from
that model's shipped acceptance prior, as it does in the engine.

* ``oracle``: :class:`~adaptive_spec.sim.oracle.OraclePolicy` (needs the workload and cost profile);
* ``adaptive-hindsight``: the adaptive controller started with the acceptance counts it learns over the
  whole workload (:func:`hindsight_controller`): what the controller reaches when its acceptance model
  already knows every context cell's frequency on these requests, which separates what its context
  features can tell from what learning them online costs;
* ``per-request-static``: :class:`~adaptive_spec.sim.oracle.PerRequestStaticPolicy`;
* ``smartspec[:<proposer>]``, ``smartspec+[:<proposer>]``: :class:`~adaptive_spec.core.peers.SmartSpecPolicy`
  (``+``: also scores unverified drafts);
* ``banditspec[:<proposer>]``: :class:`~adaptive_spec.core.peers.BanditSpecPolicy`;
* ``bandit:<learner>`` (through ``make_policy``): a learner of :mod:`adaptive_spec.bandits` over every
  arm, :class:`~adaptive_spec.core.bandit_policy.BanditPolicy`, pricing its rewards' time split with the
  replay's cost profile like the adaptive controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.peers import BanditSpecPolicy, SmartSpecPolicy
from adaptive_spec.core.policies import POLICY_NAMES, make_policy
from adaptive_spec.core.priors import apply_prior
from adaptive_spec.core.protocol import SpecPolicy

from .cost_profiles import CostProfile, profile_table
from .oracle import OraclePolicy, PerRequestStaticPolicy
from .requests import ReplayRequest

SIM_POLICY_NAMES = (
    *POLICY_NAMES,
    "oracle",
    "adaptive-hindsight",
    "per-request-static",
    "smartspec[:<proposer>]",
    "smartspec+[:<proposer>]",
    "banditspec[:<proposer>]",
)


def build_policy(
    name: str,
    proposers: list[str],
    max_k: int,
    *,
    requests: list[ReplayRequest],
    profile: CostProfile,
    max_batch: int,
    seed: int = 0,
    prior_key: Mapping[str, Any] | None = None,
) -> SpecPolicy:
    """Build a policy by name (see the module docstring). ``prior_key`` (the recorded engine's model
    and dtype, ``adaptive_spec.core.machine.engine_key``): a learning policy starts from the shipped
    acceptance prior of that model, as :class:`~adaptive_spec.vllm.AdaptiveSpec` starts one that loads
    no saved state (:func:`adaptive_spec.core.priors.apply_prior`); without it, from the generic prior.

    Raises
    ------
    ValueError
        For an unknown name or a proposer that is not enabled.
    """
    if not isinstance(name, str):
        raise ValueError(f"policy={name!r} is invalid; allowed: {', '.join(SIM_POLICY_NAMES)}")
    if name == "oracle":
        return OraclePolicy(
            proposers, max_k, requests=requests, profile=profile, max_batch=max_batch
        )
    if name == "per-request-static":
        return PerRequestStaticPolicy(
            proposers, max_k, requests=requests, profile=profile, max_batch=max_batch
        )
    head, _, prop = name.partition(":")
    table = profile_table(profile, max_batch=max_batch, max_k=max_k)
    if name == "adaptive-hindsight":
        return hindsight_controller(
            proposers,
            max_k,
            requests=requests,
            profile=profile,
            max_batch=max_batch,
            seed=seed,
            prior_key=prior_key,
        )
    if head in ("smartspec", "smartspec+"):
        return SmartSpecPolicy(
            proposers,
            max_k,
            proposer=prop or None,
            score_unverified=head.endswith("+"),
            cost_table=table,
        )
    if head == "banditspec":
        return BanditSpecPolicy(proposers, max_k, proposer=prop or None)
    try:
        policy = make_policy(name, proposers, max_k, seed=seed, cost_table=table)
    except ValueError as e:
        if "is not known" in str(e):
            raise ValueError(
                f"policy={name!r} is not known; allowed: {', '.join(SIM_POLICY_NAMES)}"
            ) from None
        raise
    if prior_key is not None:
        # A policy without per-position acceptance counts gets none (apply_prior checks).
        apply_prior(policy, dict(prior_key))
    return policy


def hindsight_controller(
    proposers: list[str],
    max_k: int,
    *,
    requests: list[ReplayRequest],
    profile: CostProfile,
    max_batch: int,
    seed: int = 0,
    prior_key: Mapping[str, Any] | None = None,
) -> AdaptiveController:
    """The adaptive controller (default settings, ``profile`` as its cost table, the shipped prior of
    ``prior_key`` if given) whose acceptance model starts with the counts a first pass over
    ``requests`` learned without forgetting (discount 1): the posterior of every context cell is
    then its frequency on this very workload, shrunk to the prior.

    Replaying it bounds what better acceptance learning could add with the same context features
    (history and match buckets, position): its gap to ``oracle`` is what those features cannot tell.
    The first pass replays ``requests`` once (as long as one ``adaptive`` replay).

    Raises
    ------
    ValueError
        As :class:`~adaptive_spec.core.controller.AdaptiveController` for invalid ``proposers``/``max_k``.
    """
    from .replay import replay

    table = profile_table(profile, max_batch=max_batch, max_k=max_k)

    def fresh(**kw: Any) -> AdaptiveController:
        pol = AdaptiveController(proposers, max_k, cost_table=table, seed=seed, **kw)
        if prior_key is not None:
            apply_prior(pol, dict(prior_key))
        return pol

    learner = fresh(discount=1.0)
    replay(requests, learner, profile, max_batch=max_batch, proposers=proposers)
    pol = fresh()
    pol.acceptance.load_state_dict(learner.acceptance.state_dict(), max_weight=None)
    return pol
