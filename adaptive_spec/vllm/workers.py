"""The runner side of :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` under a multiprocess executor.

With vLLM's multiprocess executor (``distributed_executor_backend="mp"``: the CPU build's default, and
tensor parallelism) the model runners live in worker processes beside the engine core, one per rank.
The controller stays with the scheduler in the engine-core process; what has to run on the model
runner runs on every rank, installed there by the engine core through ``collective_rpc`` with the
functions of this module (cloudpickle sends them by reference: each worker imports this module):

* the target's argmax at the verified positions of the requests whose next drafts need it (Jacobi's
  next iterate, the trace's ``trace_argmax``). The engine core names those requests on the
  ``SchedulerOutput`` it sends every worker (attribute :data:`ARGMAX_ATTR`, an :class:`ArgmaxRequest`,
  set by :class:`WorkerLink`); the worker hands the rows back on the ``ModelRunnerOutput`` of that
  step (attribute :data:`REPORT_ATTR`, a :class:`RunnerReport`), which the executor pickles to the
  engine core with the rest of the output;
* the verification shortcuts of :mod:`adaptive_spec.vllm.sampling` (exact, and counted per rank:
  :func:`worker_counters`);
* vLLM 0.32 CPU fixes of the sampler (:mod:`adaptive_spec.vllm.cpu_fixes`,
  :func:`~adaptive_spec.vllm.sampling.fix_recovered_token_sampling`), which must be applied in the
  process that samples;
* an n-gram engine's own drafter is skipped (the controller drafts on the scheduler side; its drafts
  would only serve a failed decision, which then verifies no draft tokens that step: lossless);
* a draft model's pass is timed (seconds, handed back in the report) so that the step-cost table does
  not absorb it, and an EAGLE head's KV-cache pass is deferred on steps without draft passes
  (:mod:`adaptive_spec.vllm.deferred_kv`; its stash is flushed when the hooks are removed).

Not here: the drafter's LoRA adapters (:mod:`adaptive_spec.vllm.lora_draft` replaces the drafter's layers
and reads the controller's per-request choice at every pass, in the same process), so ``lora:<name>``
proposers are refused under a multiprocess executor (:func:`adaptive_spec.vllm.checks.check_proposers`).

Nothing here lets an exception reach vLLM: a failure on the worker is counted, reported to the engine
core in the next report (:attr:`RunnerReport.faults`) and that step falls back to vLLM's own behaviour.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Attribute of vLLM's ``SchedulerOutput`` naming the requests whose argmax rows the engine core wants.
ARGMAX_ATTR = "adaptive_spec_argmax"
#: Attribute of vLLM's ``ModelRunnerOutput`` carrying the worker's :class:`RunnerReport`.
REPORT_ATTR = "adaptive_spec_report"
#: Attribute of a worker holding its :class:`_WorkerHooks` while installed.
_HOOKS_ATTR = "_adaptive_spec_worker_hooks"


@dataclass(frozen=True, slots=True)
class ArgmaxRequest:
    """Which requests' argmax rows the engine core wants from this step's verification."""

    req_ids: frozenset[str] = frozenset()
    every: bool = False  # every request with draft tokens (trace_argmax)

    def wants(self, req_id: str) -> bool:
        return self.every or req_id in self.req_ids


@dataclass(slots=True)
class RunnerReport:
    """What one rank's model runner hands back to the engine core with a step's output.

    Attributes
    ----------
    argmax : dict of str to int64 array
        Request id -> the target's argmax at each verified position and the bonus position
        ([drafted + 1] tokens), for the requests the step's :class:`ArgmaxRequest` named.
    drafter_s : float
        Seconds spent in the engine's draft model since the previous report (draft methods).
    faults : list of (str, str)
        (where, ``"Type: message"``) of the hooks' exceptions on the worker since the previous report.
    """

    argmax: dict[str, np.ndarray] = field(default_factory=dict)
    drafter_s: float = 0.0
    faults: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What the worker hooks need to know: the engine's speculative method, and whether an EAGLE
    head's KV-cache pass is deferred (:mod:`adaptive_spec.vllm.deferred_kv`)."""

    engine_method: str
    defer_drafter_kv: bool = False


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Steps sampled or verified by a shortcut of :mod:`adaptive_spec.vllm.sampling` on one rank, and
    steps whose EAGLE KV-cache pass was deferred (:mod:`adaptive_spec.vllm.deferred_kv`)."""

    plain_sampler_steps: int = 0
    greedy_verify_steps: int = 0
    sampled_verify_steps: int = 0
    drafter_kv_deferred_steps: int = 0


class _WorkerHooks:
    """The hooks installed on one worker (one rank) and the state they hand each other."""

    def __init__(self, worker: Any, setup: WorkerSetup) -> None:
        from adaptive_spec.vllm.patches import InstancePatches

        self.worker = worker
        self.runner = worker.model_runner
        self.setup = setup
        self.patches = InstancePatches()
        self.want = ArgmaxRequest()
        self.argmax: dict[str, np.ndarray] = {}
        self.drafter_s = 0.0
        self.deferred_kv: Any = None
        self.faults: list[tuple[str, str]] = []
        self.counts = {
            "plain_sampler_steps": 0,
            "greedy_verify_steps": 0,
            "sampled_verify_steps": 0,
        }

    def fault(self, where: str, err: BaseException) -> None:
        if len(self.faults) < 64:
            self.faults.append((where, f"{type(err).__name__}: {err}"))

    def install(self) -> None:
        from adaptive_spec.vllm.checks import DRAFT_METHODS
        from adaptive_spec.vllm.sampling import verify_with_shortcuts

        worker, runner, patches = self.worker, self.runner, self.patches
        rs = runner.rejection_sampler
        orig_rs = rs.forward
        orig_execute = worker.execute_model
        orig_sample = worker.sample_tokens

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            want = getattr(scheduler_output, ARGMAX_ATTR, None)
            self.want = want if isinstance(want, ArgmaxRequest) else ArgmaxRequest()
            return self._with_report(orig_execute(scheduler_output, *args, **kwargs))

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            return self._with_report(orig_sample(*args, **kwargs))

        def forward(metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
            try:
                self._record_argmax(metadata, logits)
            except Exception as e:
                self.fault("target argmax", e)
            out, counter = verify_with_shortcuts(
                rs, metadata, draft_probs, logits, sampling_metadata, self.fault
            )
            if counter is not None:
                self.counts[counter] += 1
                return out
            return orig_rs(metadata, draft_probs, logits, sampling_metadata)

        patches.set(worker, "execute_model", execute_model)
        patches.set(worker, "sample_tokens", sample_tokens)
        patches.set(rs, "forward", forward)
        drafter = getattr(runner, "drafter", None)
        if self.setup.engine_method == "ngram" and drafter is not None:

            def propose(num_speculative_tokens: int, sampled_token_ids: Any, *a: Any, **kw: Any):
                return [[] for _ in sampled_token_ids]

            patches.set(drafter, "propose", propose)
        elif self.setup.engine_method in DRAFT_METHODS and drafter is not None:
            if self.setup.defer_drafter_kv:
                from adaptive_spec.vllm.deferred_kv import install_deferred_kv

                self.deferred_kv = install_deferred_kv(drafter, patches, self.fault)
            orig_draft = drafter.propose

            def draft_propose(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig_draft(*a, **kw)
                finally:
                    self.drafter_s += time.perf_counter() - t0

            patches.set(drafter, "propose", draft_propose)

    def _record_argmax(self, metadata: Any, logits: Any) -> None:
        """The argmax rows of the requests the step's :class:`ArgmaxRequest` names (the logits' own
        dtype: argmax is exact in it)."""
        want = self.want
        if not want.every and not want.req_ids:
            return
        req_ids = self.runner.input_batch.req_ids
        num_draft = list(metadata.num_draft_tokens)
        if len(num_draft) != len(req_ids):
            return
        tgt = metadata.target_logits_indices
        bonus = metadata.bonus_logits_indices
        rows: list[Any] = []
        owners: list[tuple[str, int]] = []
        start = 0
        for i, rid in enumerate(req_ids):
            n = num_draft[i]
            if n > 0 and want.wants(rid):
                rows.append(tgt[start : start + n])
                rows.append(bonus[i : i + 1])
                owners.append((rid, n + 1))
            start += n
        if not owners:
            return
        import torch

        am = logits.index_select(0, torch.cat(rows)).max(dim=-1).indices.cpu().numpy()
        am = am.astype(np.int64)
        off = 0
        for rid, n in owners:
            self.argmax[rid] = am[off : off + n]
            off += n

    def _with_report(self, output: Any) -> Any:
        """Attach what the engine core needs to a step's ``ModelRunnerOutput`` (a new object of this
        step, never vLLM's shared empty output)."""
        if not (self.argmax or self.drafter_s or self.faults):
            return output
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        if not isinstance(output, ModelRunnerOutput) or output is EMPTY_MODEL_RUNNER_OUTPUT:
            return output  # kept for the next output (an async output is not supported)
        report = RunnerReport(self.argmax, self.drafter_s, self.faults)
        setattr(output, REPORT_ATTR, report)
        self.argmax, self.drafter_s, self.faults = {}, 0.0, []
        return output


# -- run on every rank through collective_rpc (the first argument is the worker) -----------------
def _inner(worker: Any) -> Any:
    """The worker itself behind vLLM's ``WorkerWrapperBase`` (what ``collective_rpc`` passes)."""
    return vars(worker).get("worker", worker)


def install_worker_hooks(worker: Any, setup: WorkerSetup) -> bool:
    """Install the runner-side hooks on this rank's worker (idempotent: a second call replaces the
    first). Returns True."""
    from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel
    from adaptive_spec.vllm.sampling import fix_recovered_token_sampling

    fix_cpu_expand_kernel()  # vLLM 0.32 CPU: per-token temperatures at temperature > 0
    fix_recovered_token_sampling()  # vLLM 0.32 CPU: one uniform per recovered token
    remove_worker_hooks(worker)
    worker = _inner(worker)
    hooks = _WorkerHooks(worker, setup)
    hooks.install()
    setattr(worker, _HOOKS_ATTR, hooks)
    return True


def remove_worker_hooks(worker: Any) -> bool:
    """Remove this rank's hooks: its runner is plain vLLM again. Returns whether any were installed."""
    worker = _inner(worker)
    hooks = getattr(worker, _HOOKS_ATTR, None)
    if hooks is None:
        return False
    hooks.patches.restore()
    delattr(worker, _HOOKS_ATTR)
    return True


def worker_counters(worker: Any) -> WorkerCounters:
    """This rank's shortcut counters (zeros without hooks)."""
    hooks = getattr(_inner(worker), _HOOKS_ATTR, None)
    if hooks is None:
        return WorkerCounters()
    kv = hooks.deferred_kv
    return WorkerCounters(
        **hooks.counts, drafter_kv_deferred_steps=kv.deferred_steps if kv is not None else 0
    )


def runner_report(model_runner_output: Any) -> RunnerReport | None:
    """The :class:`RunnerReport` a worker attached to ``model_runner_output``, if any."""
    return getattr(model_runner_output, REPORT_ATTR, None)


class WorkerLink:
    """The engine core's side: installs the runner hooks on every rank of a multiprocess (or Ray)
    executor, names each step's argmax requests on the scheduler output, and reads the counters.

    Parameters
    ----------
    core : vllm.v1.engine.core.EngineCore
        Its ``model_executor`` must offer ``collective_rpc`` with callables (vLLM 0.32's multiprocess
        and Ray executors do).
    engine_method : str
        The engine's speculative method.
    argmax_wanted : callable
        ``f(req_id) -> bool``: whether the next decision needs that request's argmax rows.
    any_wanted : callable
        ``f() -> bool``: whether the next decision needs any request's rows.
    every : callable
        ``f() -> bool``: whether every drafted request's rows are wanted (trace diagnostics).
    defer_drafter_kv : bool
        Defer an EAGLE head's KV-cache pass on every rank (:mod:`adaptive_spec.vllm.deferred_kv`).

    Raises
    ------
    RuntimeError
        From vLLM, when a worker cannot install the hooks (the executor failed).
    """

    def __init__(
        self,
        core: Any,
        engine_method: str,
        argmax_wanted: Callable[[str], bool],
        any_wanted: Callable[[], bool],
        every: Callable[[], bool],
        defer_drafter_kv: bool = False,
    ) -> None:
        self.core = core
        self.executor = core.model_executor
        self.engine_method = engine_method
        self.defer_drafter_kv = defer_drafter_kv
        self._wanted = argmax_wanted
        self._any = any_wanted
        self._every = every
        self.ranks = 0

    def install(self, patches: Any) -> None:
        """Install the workers' hooks and wrap the executor's ``execute_model`` (through ``patches``;
        :meth:`remove` takes the workers' hooks away)."""
        done = self.executor.collective_rpc(
            install_worker_hooks, args=(WorkerSetup(self.engine_method, self.defer_drafter_kv),)
        )
        self.ranks = len(done) if isinstance(done, list) else 1
        orig_execute = self.executor.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            # On a failure no rows this step: Jacobi falls back to its own iterate.
            with contextlib.suppress(Exception):
                setattr(scheduler_output, ARGMAX_ATTR, self._argmax_request(scheduler_output))
            return orig_execute(scheduler_output, *args, **kwargs)

        patches.set(self.executor, "execute_model", execute_model)

    def _argmax_request(self, so: Any) -> ArgmaxRequest:
        if self._every():
            return ArgmaxRequest(every=True)
        if not self._any():
            return ArgmaxRequest()
        wanted = self._wanted
        return ArgmaxRequest(frozenset(r for r in so.scheduled_spec_decode_tokens if wanted(r)))

    def counters(self) -> WorkerCounters:
        """The driver rank's shortcut counters (every rank verifies the same rows)."""
        out = self.executor.collective_rpc(worker_counters)
        first = out[0] if isinstance(out, list) else out
        return first if isinstance(first, WorkerCounters) else WorkerCounters()

    def remove(self) -> None:
        """Remove the hooks from every rank. Workers that are gone (shutdown: their hooks went with
        them) are not an error."""
        try:
            self.executor.collective_rpc(remove_worker_hooks, timeout=30.0)
        except Exception as e:
            import logging

            logging.getLogger(__name__).debug("adaptive-spec: workers' hooks not removed: %s", e)
