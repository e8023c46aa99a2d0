"""The core: everything the controller decides and learns, with no vLLM and no command.

* the step protocol (:mod:`~adaptive_spec.core.protocol`: views, decisions, outcomes) and the arms
  (:mod:`~adaptive_spec.core.arms`);
* the step driver (:mod:`~adaptive_spec.core.driver`), which turns an engine step into a view, applies a
  decision and feeds metrics and the trace, in the engine and in replay alike;
* the policies: the adaptive controller (:mod:`~adaptive_spec.core.controller` and its compiled kernels),
  static baselines, the SmartSpec/BanditSpec peers and the registry (:mod:`~adaptive_spec.core.policies`);
* what the controller prices with: step-cost tables, the draft pass's cost, acceptance models and priors;
* the safety rule, saved state, the trace, and where files live.

Imports: :mod:`adaptive_spec.proposers`, ``adaptive_spec.kernels``, ``adaptive_spec.bandits``, numpy,
scipy, numba, river. Never vLLM, never a command.
"""
