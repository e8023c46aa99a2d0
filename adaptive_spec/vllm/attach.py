"""``AdaptiveSpec(llm)``: adaptive speculation inside an in-process vLLM 0.32 engine (V1 model runner).

:class:`AdaptiveSpec` is the public object: attaching checks the engine and the arguments
(:mod:`adaptive_spec.vllm.checks`), builds the policy, its saved state, the proposers (the LoRA
adapters of a draft model included, :mod:`adaptive_spec.vllm.lora_draft`), the step driver and the
step-cost table (:mod:`adaptive_spec.vllm.cost_source`), then installs the per-step hooks
(:mod:`adaptive_spec.vllm.hooks`, with the decision after each step in
:mod:`adaptive_spec.vllm.next_drafts`). It reports what it observed (:meth:`AdaptiveSpec.stats`),
saves what the policy learned (:meth:`AdaptiveSpec.save_state`) and leaves the engine plain vLLM again
(:meth:`AdaptiveSpec.detach`).

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

from adaptive_spec.core.arms import drafts_with_drafter
from adaptive_spec.core.controller import DECISION_FEATURES
from adaptive_spec.core.driver import StepDriver
from adaptive_spec.core.machine import engine_key
from adaptive_spec.core.metrics import SpecMetrics
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.priors import prior_key
from adaptive_spec.core.protocol import SpecPolicy
from adaptive_spec.core.trace import TraceWriter
from adaptive_spec.vllm.checks import (
    DRAFT_METHODS,
    ENGINE_METHODS,
    OWNER_ATTR,
    SUPPORTED_VLLM,
    AttachError,
    check_args,
    check_engine,
    check_not_attached,
    check_proposers,
    check_vllm_version,
    engine_core,
    local_model_runner,
    remote_engine_client,
)
from adaptive_spec.vllm.hooks import StepHooks
from adaptive_spec.vllm.next_drafts import NextDrafts
from adaptive_spec.vllm.patches import InstancePatches
from adaptive_spec.vllm.proposer_setup import make_lora, make_proposers

logger = logging.getLogger(__name__)

__all__ = ["DRAFT_METHODS", "ENGINE_METHODS", "SUPPORTED_VLLM", "AdaptiveSpec", "AttachError"]


class AdaptiveSpec:
    """Attach an adaptive speculation controller to an in-process vLLM 0.32 ``LLM``.

    The engine must be built with speculative decoding (``speculative_config`` with method ``ngram``,
    ``draft_model``, ``eagle`` or ``eagle3``): its ``num_speculative_tokens`` is the largest k.

    Parameters
    ----------
    llm : vllm.LLM
        With the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or in a child
        process (vLLM's default: a :class:`~adaptive_spec.vllm.remote.RemoteAdaptiveSpec` is returned).
        The model runner may live here (``uni`` executor) or in worker processes (``mp``, ``ray``:
        :mod:`adaptive_spec.vllm.workers`).
    proposers : sequence of str
        Arms' proposers among ``none``, ``ngram``, ``jacobi``, ``suffix``, ``draft`` (the engine's draft model; needs
        a draft-model engine) and ``lora:<name>`` (the drafter with LoRA adapter ``name`` from
        ``lora_adapters``; needs ``method="eagle3"`` or ``"draft_model"``).
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
    defer_drafter_kv : bool
        On an EAGLE engine (without LoRA adapters), steps that draft nothing
        with the head skip vLLM's KV-cache pass of the head and the next step that drafts writes those
        keys and values in one batch (:mod:`adaptive_spec.vllm.deferred_kv`): the same drafts, at a
        fraction of the cost while the controller plays other arms. ``False`` keeps vLLM's pass at
        every step.

    One controller per engine: a second AdaptiveSpec on an engine that has one is refused; after
    :meth:`detach` the engine is plain vLLM again (its own methods, not wrappers).

    Raises
    ------
    AttachError
        For an engine it cannot drive: another vLLM version, an engine core it cannot reach, the V2
        model runner, ``lora:<name>`` proposers with the runner in worker processes, no speculative config, an unsupported speculative method, or an engine that already
        has an AdaptiveSpec attached (detach that one first).
    StatePathError
        A ``ValueError`` for a ``policy_state`` that cannot be written there, or a refused file that
        cannot be moved aside.
    ValueError
        For an argument of the wrong kind (naming the parameter), an unknown proposer or policy name,
        invalid ``suffix`` options, ``draft`` without a draft model, ``lora:<name>`` without adapter
        ``name`` in ``lora_adapters`` or without an ``eagle3`` / ``draft_model`` engine, or an adapter
        that does not fit the drafter (rank, layers or shapes; raised at registration).
    """

    def __new__(cls, llm: Any = None, *args: Any, **kwargs: Any) -> Any:
        """An ``LLM`` whose engine core runs in a child process (vLLM's default) gets a
        :class:`~adaptive_spec.vllm.remote.RemoteAdaptiveSpec`: the controller is built in that process
        (through the plugin vLLM loaded there and a utility call) and driven from here."""
        if cls is AdaptiveSpec and remote_engine_client(llm) is not None:
            from adaptive_spec.vllm.remote import RemoteAdaptiveSpec

            return RemoteAdaptiveSpec(llm, *args, **kwargs)
        return super().__new__(cls)

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
        defer_drafter_kv: bool = True,
    ) -> None:
        # -- checks at attach time (adaptive_spec.vllm.checks): version, arguments, engine, proposers
        vllm_version = check_vllm_version()
        check_args(
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
        if not isinstance(defer_drafter_kv, bool):
            raise ValueError(
                f"defer_drafter_kv={defer_drafter_kv!r} is invalid; allowed: True or False"
            )
        core = engine_core(llm)
        check_not_attached(core)
        runner = local_model_runner(core)  # None: the runner lives in worker processes
        spec_config = check_engine(core, runner)
        lora_adapters = dict(lora_adapters or {})
        proposers = check_proposers(
            proposers, spec_config.method, lora_adapters, runner_in_process=runner is not None
        )
        # Lossless verification: no cached draft-model probabilities against other proposers' drafts.
        from adaptive_spec.vllm import sampling

        if (why := sampling.draft_probability_conflict(spec_config, proposers)) is not None:
            raise AttachError(why)
        from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel
        from adaptive_spec.vllm.sampling import fix_recovered_token_sampling

        fix_cpu_expand_kernel()  # vLLM 0.32 CPU: per-token temperatures at temperature > 0 (see module)
        fix_recovered_token_sampling()  # vLLM 0.32 CPU: one uniform per recovered token
        self.llm = llm
        self.core = core
        self.scheduler = core.scheduler
        self.runner = runner
        self.max_k = int(spec_config.num_speculative_tokens)
        self.engine_method = spec_config.method
        self.proposer_names = proposers
        self._policy_given = isinstance(policy, SpecPolicy)
        self.policy = self._make_policy(policy, seed, baseline)
        if calibrate not in (True, False, "auto"):
            raise ValueError(
                f"calibrate={calibrate!r} is invalid; allowed: True, False, 'auto'; fix: pass one of them"
            )
        mc = core.vllm_config.model_config
        self.engine_key = engine_key(mc.model, str(mc.dtype))
        drafter = spec_config.model if spec_config.method in DRAFT_METHODS else None
        self.prior_key = prior_key(self.engine_key, drafter)  # what the shipped priors match
        self._load_policy_state(policy_state, prior)
        self.vocab_size = int(mc.get_vocab_size())
        self.max_model_len = int(mc.max_model_len)
        self.proposers: dict[str, Any] = make_proposers(
            self.proposer_names, self.max_k, ngram_min, ngram_max, suffix, self._lora_name_of
        )
        # Draft-model proposers: the base draft and its LoRA adapters share the engine's one drafter.
        self.drafter_family = [p for p in proposers if drafts_with_drafter(p)]
        self.lora = make_lora(self.core, self.proposer_names, lora_adapters)
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
        self.hooks = StepHooks(
            core,
            runner,
            self.engine_method,
            self.driver,
            NextDrafts(
                self.scheduler,
                self.driver,
                self.policy,
                self.drafter_family,
                self.lora,
                self.max_model_len,
            ),
            lora=self.lora,
            category_of=category_of,
            defer_drafter_kv=defer_drafter_kv,
        )
        # Marks the engine as driven (one controller per engine); detach() removes it with the hooks.
        self._patches = InstancePatches()
        self._patches.set(core, OWNER_ATTR, self)
        self.hooks.install(self._patches)
        self._attached = True
        self.workers: Any = None
        self._worker_counts: Any = self.hooks  # the workers' counters at detach (zeros until then)
        try:
            if runner is None:
                self._link_workers()
            from adaptive_spec.vllm.cost_source import resolve_cost_table

            self.cost_table_source = resolve_cost_table(
                self.policy,
                self.engine_key,
                given=cost_table,
                calibrate=calibrate,
                policy_given=self._policy_given,
                state_loaded=self.state_loaded,
                max_num_seqs=int(core.vllm_config.scheduler_config.max_num_seqs),
                measure=self.calibrate,
            )
        except BaseException:
            self.detach()
            raise
        if trace is not None:
            self._open_trace(trace, trace_argmax, vllm_version)

    # -- construction -------------------------------------------------------------------------
    def _link_workers(self) -> None:
        """A multiprocess executor: install the runner side on every rank (:mod:`adaptive_spec.vllm.workers`)."""
        from adaptive_spec.vllm.workers import WorkerLink

        driver = self.driver
        self.workers = WorkerLink(
            self.core,
            self.engine_method,
            driver.argmax_wanted,
            lambda: driver.any_argmax_wanted,
            lambda: driver.record_all_argmax,
            defer_drafter_kv=self.hooks.defer_drafter_kv and self.hooks.plan_passes,
        )
        self.workers.install(self._patches)
        backend = self.core.vllm_config.parallel_config.distributed_executor_backend
        logger.info(
            "adaptive-spec: the model runner runs in %d worker process(es) (executor %r): the "
            "controller runs with the scheduler, argmax rows, verification shortcuts and draft "
            "timing on every rank; vLLM's n-gram drafter is skipped there, so a failed decision "
            "verifies no draft tokens that step; LoRA drafter adapters are unavailable",
            self.workers.ranks,
            backend,
        )

    def _make_policy(self, policy: str | SpecPolicy, seed: int, baseline: str | None) -> SpecPolicy:
        """The policy object: ``policy`` itself, or the one its name makes (errors name the parameter)."""
        if isinstance(policy, SpecPolicy):
            return policy
        try:
            return make_policy(
                policy, self.proposer_names, self.max_k, seed=seed, baseline=baseline
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

    def _load_policy_state(self, policy_state: str | Path | None, prior: bool) -> None:
        """Resolve ``policy_state`` (``"auto"``: the cache directory's file), check that it can be
        written, load it if it fits, else start from the shipped acceptance prior (``prior``)."""
        from adaptive_spec.core.state import (
            StatePathError,
            auto_state_path,
            load_or_set_aside,
            prepare_state_path,
        )

        auto = policy_state == "auto"
        if auto:
            policy_state = auto_state_path(self.policy, self.engine_key, self.proposer_names)
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

            self.prior_applied = apply_prior(self.policy, self.prior_key)

    def _lora_name_of(self, req_id: str) -> str | None:
        """The LoRA adapter of a request (the suffix proposer's tenant with ``scope="tenant"``)."""
        r = self.scheduler.requests.get(req_id)
        return getattr(getattr(r, "lora_request", None), "lora_name", None)

    def _open_trace(self, trace: str | Path, trace_argmax: bool, vllm_version: str) -> None:
        """Start the JSONL step trace; its header says what a replay needs (:mod:`adaptive_spec.core.trace`)."""
        mc = self.core.vllm_config.model_config
        cost = getattr(self.policy, "cost", None)
        table = getattr(cost, "table", None)
        self.tracer = TraceWriter(
            trace,
            {
                "max_k": self.max_k,
                "proposers": self.proposer_names,
                "policy": self.policy.name,
                "feature_names": list(DECISION_FEATURES),
                "cost_table": table.to_dict() if table is not None else None,
                "cost_table_source": self.cost_table_source,
                "meta": {
                    "vllm": vllm_version,
                    "engine_method": self.engine_method,
                    "model": str(mc.model),
                    "dtype": str(mc.dtype),
                    "threads": os.environ.get("OMP_NUM_THREADS"),
                    "executor": str(
                        self.core.vllm_config.parallel_config.distributed_executor_backend
                    ),
                    "engine_key": self.engine_key,
                    "prior_key": self.prior_key,
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

    def calibrate(self, **kwargs: Any) -> Any:
        """Measure this engine's step-cost table with dummy steps now (the engine must be idle); see
        :func:`adaptive_spec.vllm.calibrate.calibrate` for the parameters. Returns the table; it does
        not install it (``AdaptiveSpec(calibrate=True)`` does)."""
        from adaptive_spec.vllm.calibrate import calibrate

        t0 = time.perf_counter()
        table = calibrate(self, key=self.engine_key, **kwargs)
        self.calibration_s = time.perf_counter() - t0
        return table

    @classmethod
    def attach_engine_core(
        cls, core: Any, proposers: Sequence[str] = ("none", "ngram", "jacobi"), **kwargs: Any
    ) -> AdaptiveSpec:
        """Attach to a vLLM ``EngineCore`` directly (inside the engine-core process of ``vllm serve``,
        where there is no ``LLM`` object). Same parameters and errors as the constructor."""
        return cls(core, proposers, **kwargs)

    @staticmethod
    def attached(llm: Any) -> AdaptiveSpec | None:
        """The AdaptiveSpec attached to ``llm`` (a ``vllm.LLM`` or an ``EngineCore``), or None; for an
        ``LLM`` whose engine core is a child process, the RemoteAdaptiveSpec attached from here."""
        if remote_engine_client(llm) is not None:
            from adaptive_spec.vllm.remote import RemoteAdaptiveSpec

            return RemoteAdaptiveSpec.attached(llm)
        return getattr(engine_core(llm), OWNER_ATTR, None)

    # -- lifecycle ----------------------------------------------------------------------------
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
            self._patches.restore()
            if self.workers is not None:
                with contextlib.suppress(Exception):
                    self._worker_counts = self.workers.counters()
                self.workers.remove()
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

    # -- results ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per arm, per proposer and per category: request-steps, drafted, accepted, acceptance rate, mean
        accepted length (tokens committed per verification) and attributed goodput (tokens/s); plus step
        totals, controller overhead, faults, the steps without draft tokens sampled without the
        rejection sampler (``plain_sampler_steps``, :mod:`adaptive_spec.vllm.sampling`), the greedy steps
        with drafts verified without it (``greedy_verify_steps``), the sampled steps with deterministic
        drafts verified without it (``sampled_verify_steps``), where the policy's step-cost table
        came from (``cost_table_source``, None for a policy that prices no steps), on an EAGLE engine the
        drafter passes asked for (``drafter_passes``, ``drafter_plan``, and ``drafter_kv``: the steps
        whose KV-cache pass was deferred, :mod:`adaptive_spec.vllm.deferred_kv`), with LoRA adapters the
        adapter updates that failed (``lora_faults``) and (for the adaptive
        controller) the safety rule's standing against its baseline. Definitions:
        :mod:`adaptive_spec.core.metrics`."""
        d = self.metrics.as_dict()
        d["policy"] = self.policy.name
        d["cost_table_source"] = self.cost_table_source
        d["max_k"] = self.max_k
        d["tracked_requests"] = self.driver.num_tracked()
        counts: Any = self.hooks
        if self.workers is not None:
            counts = self.workers.counters() if self._attached else self._worker_counts
        d["plain_sampler_steps"] = counts.plain_sampler_steps
        d["greedy_verify_steps"] = counts.greedy_verify_steps
        d["sampled_verify_steps"] = counts.sampled_verify_steps
        if self.hooks.plan_passes:
            # The passes the engine's drafter was asked to run (adaptive_spec.core.drafter_passes).
            d["drafter_passes"] = self.hooks.drafter_passes
            plan = self.hooks.next_drafts.passes
            if plan is not None:
                d["drafter_plan"] = plan.as_dict()
            if self.hooks.deferred_kv is not None:
                d["drafter_kv"] = self.hooks.deferred_kv.stats()
            elif self.workers is not None and self.workers.defer_drafter_kv:
                d["drafter_kv"] = {"deferred_steps": counts.drafter_kv_deferred_steps}
        if self.lora is not None:
            # Adapter updates that failed inside the drafter (each pass went on without adapters).
            d["lora_faults"] = self.lora.faults
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
