"""Offline replay of step traces: counterfactual drafts, cost profiles, the oracle, regret,
off-policy evaluation and synthetic workloads (``docs/replay.md``).

Engine-agnostic (no vLLM): policies are driven through the same
:class:`~adaptive_spec.core.controller.SpecPolicy` interface the engine uses.
"""

from .compare import Comparison, compare_policies
from .cost_profiles import (
    PRESETS,
    CostProfile,
    LinearCoefficients,
    LinearCostProfile,
    RooflineCostProfile,
    fit_linear_profile,
    get_profile,
    step_features,
)
from .counterfactual import (
    Counterfactuals,
    build_counterfactuals,
    draft_model_counterfactual,
    expected_accepted_length,
    ngram_counterfactual,
    read_counterfactuals,
    suffix_counterfactual,
    torch_causal_lm,
    write_counterfactuals,
)
from .oracle import OracleBound, OraclePolicy, PerRequestStaticPolicy, oracle_bound, plan_request
from .policies import SIM_POLICY_NAMES, build_policy
from .regret import Regret, regret, regret_curve
from .replay import ReplayResult, replay
from .requests import ReplayRequest, recorded_goodput, requests_from_trace
from .trace_io import load_replay_trace

__all__ = [
    "PRESETS",
    "SIM_POLICY_NAMES",
    "Comparison",
    "CostProfile",
    "Counterfactuals",
    "LinearCoefficients",
    "LinearCostProfile",
    "OracleBound",
    "OraclePolicy",
    "PerRequestStaticPolicy",
    "Regret",
    "ReplayRequest",
    "ReplayResult",
    "RooflineCostProfile",
    "build_counterfactuals",
    "build_policy",
    "compare_policies",
    "draft_model_counterfactual",
    "expected_accepted_length",
    "fit_linear_profile",
    "get_profile",
    "load_replay_trace",
    "ngram_counterfactual",
    "oracle_bound",
    "plan_request",
    "read_counterfactuals",
    "recorded_goodput",
    "regret",
    "regret_curve",
    "replay",
    "requests_from_trace",
    "step_features",
    "suffix_counterfactual",
    "torch_causal_lm",
    "write_counterfactuals",
]
