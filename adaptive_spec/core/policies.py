"""Policy names, as accepted by ``AdaptiveSpec(policy=...)`` and the CLI's ``--policy``.

* ``adaptive`` (default): :class:`~adaptive_spec.core.controller.AdaptiveController`, posterior-mean
  acceptance (its deterministic proposers are scored every step whether chosen or not);
* ``adaptive-ucb``, ``adaptive-thompson``, ``adaptive-eps``: the same controller with an upper
  confidence bound, one Thompson draw per context cell and step, or epsilon-greedy exploration (the
  last logs exact propensities for off-policy evaluation); ``adaptive-greedy`` is ``adaptive``;
* ``static:<proposer>:<k>`` or ``none``: :class:`~adaptive_spec.core.baselines.StaticPolicy`;
* ``table:<proposer>:<start>-<end>=<k>,...``: vLLM's batch-size table
  (:class:`~adaptive_spec.core.baselines.BatchSizeTablePolicy`);
* ``smartspec:<proposer>``: SmartSpec-style goodput rule, per-request k for one proposer
  (:class:`adaptive_spec.core.peers.SmartSpecPolicy`; Liu et al. 2024);
* ``banditspec:<proposer>``: BanditSpec-style UCB over k per step for one proposer
  (:class:`adaptive_spec.core.peers.BanditSpecPolicy`; Hou et al. 2025);
* ``bandit:<learner>``: a learner of :mod:`adaptive_spec.bandits` (``ucb1``, ``thompson-beta``,
  ``linucb``, ...) over every arm ``(proposer, k)``, per request
  (:class:`adaptive_spec.core.bandit_policy.BanditPolicy`).
"""

from __future__ import annotations

from adaptive_spec.core.baselines import baseline_policy
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.protocol import SpecPolicy

POLICY_NAMES = (
    "adaptive",
    "adaptive-ucb",
    "adaptive-thompson",
    "adaptive-greedy",
    "adaptive-eps",
    "none",
    "static:<proposer>:<k>",
    "table:<proposer>:<start>-<end>=<k>,...",
    "smartspec:<proposer>",
    "banditspec:<proposer>",
    "bandit:<learner>",
)
_EXPLORATION = {
    "adaptive": "greedy",
    "adaptive-ucb": "ucb",
    "adaptive-thompson": "thompson",
    "adaptive-greedy": "greedy",
    "adaptive-eps": "eps-greedy",
}


def make_policy(
    name: str,
    proposers: list[str],
    max_k: int,
    *,
    seed: int = 0,
    cost_table: StepCostTable | None = None,
    baseline: str | None = None,
    alpha: float | None = None,
) -> SpecPolicy:
    """Build a policy from its name (see the module docstring). ``cost_table`` (the measured step
    costs) goes to the policies that price steps (adaptive, SmartSpec); ``baseline`` and ``alpha`` to
    the adaptive controller's safety rule (defaults: its own).

    Raises
    ------
    ValueError
        For an unknown name, or an arm/proposer/k the engine cannot run.
    """
    if not isinstance(name, str):
        raise ValueError(f"policy={name!r} is invalid; allowed: {', '.join(POLICY_NAMES)}")
    if name in _EXPLORATION:
        extra: dict = {}
        if alpha is not None:
            extra["alpha"] = alpha
        return AdaptiveController(
            proposers,
            max_k,
            exploration=_EXPLORATION[name],
            seed=seed,
            cost_table=cost_table,
            baseline=baseline,
            **extra,
        )
    base = baseline_policy(name, proposers, max_k)
    if base is not None:
        return base
    if name.startswith(("smartspec:", "banditspec:")):
        from adaptive_spec.core.peers import BanditSpecPolicy, SmartSpecPolicy

        kind, _, proposer = name.partition(":")
        if proposer not in proposers or proposer == "none":
            raise ValueError(
                f"policy={name!r}: proposer={proposer!r} is not enabled; enabled: {', '.join(p for p in proposers if p != 'none')}"
            )
        if kind == "smartspec":
            return SmartSpecPolicy(proposers, max_k, proposer=proposer, cost_table=cost_table)
        return BanditSpecPolicy(proposers, max_k, proposer=proposer)
    if name.startswith("bandit:"):
        from adaptive_spec.core.bandit_policy import BanditPolicy

        try:
            return BanditPolicy(
                proposers,
                max_k,
                learner=name.removeprefix("bandit:"),
                seed=seed,
                cost_table=cost_table,
            )
        except ValueError as e:
            raise ValueError(f"policy={name!r}: {e}") from None
    raise ValueError(f"policy={name!r} is not known; allowed: {', '.join(POLICY_NAMES)}")


def check_policy_name(name: str, proposers: list[str]) -> str:
    """Check a policy name against the proposers, without an engine: everything :func:`make_policy`
    checks except that each k fits ``num_speculative_tokens`` (unknown before the engine is configured).

    Raises
    ------
    ValueError
        For an unknown or malformed name, or a proposer that is not enabled.
    """
    if not isinstance(name, str):
        raise ValueError(f"policy={name!r} is invalid; allowed: {', '.join(POLICY_NAMES)}")
    # Static and table policies hold no per-k state: a bound that never binds leaves k unchecked. The
    # others do not take k from their name: the smallest engine will do.
    unbounded = 1 << 30 if name.startswith(("static:", "table:")) else 1
    make_policy(name, list(proposers), unbounded)
    return name


def policy_error_reason(err: ValueError, name: str) -> str:
    """The reason in a :func:`make_policy` error, without the policy's name and the list of names (for
    a caller whose own message names the setting and lists them)."""
    why = str(err).replace(f"; allowed: {', '.join(POLICY_NAMES)}", "")
    for head in (f"policy={name!r}: ", f"policy={name!r} "):
        why = why.removeprefix(head)
    return "not a known policy name" if why == "is not known" else why
