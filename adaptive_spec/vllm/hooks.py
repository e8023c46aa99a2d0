"""The per-step hooks of :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` inside a vLLM 0.32 engine (V1
model runner).

Hooks (verified on vLLM 0.32.0's CPU build, ``docs/architecture.md``), all installed on instances and
removed by :meth:`AdaptiveSpec.detach <adaptive_spec.vllm.attach.AdaptiveSpec.detach>`, in the order one
engine step runs them:

* ``Scheduler.schedule``: stamps the step's start time (:class:`StepClock`);
* the runner's ``RejectionSampler.forward``: records the target's argmax at every verified position
  (Jacobi's next iterate and the trace's counterfactual data), then calls vLLM's sampler unchanged;
  a step in which no request has a draft token is sampled by vLLM's own sampler on the bonus rows,
  without the rejection sampler's per-vocabulary noise (:mod:`adaptive_spec.vllm.sampling`);
* ``Scheduler.update_from_output``: observes, per request, the draft tokens verified, how many were
  accepted and which tokens were committed (after EOS/stop/length truncation); per step the wall time,
  batch size and tokens verified; feeds the policy and the trace. What it reads before vLLM commits
  the step is handed to what it does after as a :class:`StepObservation`;
* ``Scheduler.update_draft_token_ids``: receives the engine's own drafts (n-gram lookup or draft model)
  and keeps them for this step instead of applying them;
* ``EngineCore.post_step``: after the engine's own post-step, asks the policy for an arm per running
  request (:class:`~adaptive_spec.vllm.next_drafts.NextDrafts`) and hands the chosen drafts, cut to k,
  to the scheduler through vLLM's own ``update_draft_token_ids`` (so vLLM's checks for finished
  requests, prefill chunks and structured output still apply). If the controller raises, that step
  uses the engine's drafts unchanged;
* ``Scheduler.finish_requests``: requests finished from outside the step loop (aborted by a client, or
  ended by the front end on a stop string) release their per-request state in the driver, the policy,
  the proposers and the LoRA manager;
* the drafter's ``propose``: an n-gram engine's drafter only keeps its arguments (it drafts lazily, for
  a failed decision); a draft model's pass is timed.

Verification stays vLLM's rejection sampler, so the output distribution at temperature > 0 is the
target's; drafts only change how many tokens a step can commit, never which. No hook lets an exception
of the controller reach the engine: each is counted as a fault (:meth:`StepDriver.fault
<adaptive_spec.core.driver.StepDriver.fault>`) and that step falls back to the engine's own behaviour.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_spec.core.driver import StepDriver, VerifiedRequest
from adaptive_spec.vllm.checks import DRAFT_METHODS
from adaptive_spec.vllm.next_drafts import NextDrafts
from adaptive_spec.vllm.patches import InstancePatches

#: Drafter methods whose passes follow the decisions (adaptive_spec.core.drafter_passes).
PLANNED_METHODS = ("eagle", "eagle3")


@dataclass(slots=True)
class StepClock:
    """Time stamps and durations that price one engine step, carried from hook to hook.

    All are ``time.perf_counter()`` readings or durations, in seconds.
    """

    t_schedule: float | None = None  # when this step's schedule() began
    tau_prev: float | None = None  # end of the previous step's update_from_output
    busy_prev: bool = False  # whether the engine had requests left after the previous step
    post_prev_s: float = 0.0  # duration of the previous post_step (engine drafter + decision)
    hook_s: float = 0.0  # adapter time inside the current step (argmax, bookkeeping)
    decide_s: float = 0.0  # the decision after the previous step
    drafter_s: float = 0.0  # the draft model's passes inside the current step (draft engines)
    drafter_passes: int | None = (
        None  # draft passes asked of the drafter this step (planned engines)
    )

    def step_time(self, tau: float) -> float:
        """The step's full cost (s), ending at ``tau`` (the end of its ``update_from_output``): from the end
        of the previous step's update, when the engine went straight on (the decision, the engine's own
        drafter, scheduling, the forward pass, verification and the hooks' previous run); after an idle
        wait, from this step's ``schedule()`` plus the previous ``post_step``."""
        if self.tau_prev is not None and self.busy_prev:
            return tau - self.tau_prev
        start = self.t_schedule if self.t_schedule is not None else tau
        return (tau - start) + self.post_prev_s

    def idle(self) -> None:
        """Forget the previous step: the next one is priced as after an idle wait."""
        self.tau_prev = None
        self.busy_prev = False


@dataclass(slots=True)
class StepObservation:
    """What one engine step verified, read before vLLM's scheduler commits it (``update_from_output``),
    for the hook's work after it."""

    # request id -> (vLLM Request, its num_output_tokens before the update): every request scheduled
    requests: dict[str, tuple[Any, int]]
    # rows verified as draft tokens this step, all requests together (placeholder drafts included)
    num_verified_tokens: int
    # request id -> draft tokens verified (placeholder drafts -1 excluded): requests with drafts
    drafted: dict[str, int]
    # prompt tokens computed this step (scheduled tokens beyond one decode token plus the drafts)
    num_prefill_tokens: int
    # request id -> draft tokens vLLM accepted (its sampled tokens - 1, before EOS/stop/length cuts)
    accepted: dict[str, int]
    # request id -> int64 array [drafted + 1]: the target's argmax at each verified position and the
    # bonus position; only the requests whose next drafts need it (or all, with trace_argmax)
    target_argmax: dict[str, np.ndarray]


class StepHooks:
    """The hooks of one AdaptiveSpec in one engine, and the per-step state they hand each other.

    Parameters
    ----------
    core : vllm.v1.engine.core.EngineCore
        The in-process engine core (its ``scheduler`` and ``post_step`` are hooked).
    runner : vllm.v1.worker model runner
        The V1 model runner (its ``rejection_sampler``, ``input_batch`` and ``drafter``).
    engine_method : str
        The engine's speculative method (``ngram`` or one of the draft-model methods).
    driver : StepDriver
        Observes each step and owns the faults' count.
    next_drafts : NextDrafts
        The decision after each step.
    lora : LoraDraftManager, optional
        Released per finished request.
    category_of : callable, optional
        ``f(prompt_token_ids) -> str | None``: a new request's workload category.

    Attributes
    ----------
    clock : StepClock
    calibration : Calibration or None
        A step-cost calibration in progress (:meth:`calibrating`): while set, the steps feed it and
        the drafts come from it, and the driver sees nothing.
    plain_sampler_steps, greedy_verify_steps, sampled_verify_steps : int
        Steps sampled or verified by a shortcut of :mod:`adaptive_spec.vllm.sampling`.
    """

    def __init__(
        self,
        core: Any,
        runner: Any,
        engine_method: str,
        driver: StepDriver,
        next_drafts: NextDrafts,
        lora: Any = None,
        category_of: Callable[[Any], str | None] | None = None,
        defer_drafter_kv: bool = True,
    ) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.runner = runner
        self.engine_method = engine_method
        self.driver = driver
        self.next_drafts = next_drafts
        self.lora = lora
        self.category_of = category_of
        self.defer_drafter_kv = defer_drafter_kv
        # adaptive_spec.vllm.deferred_kv.DeferredDrafterKV, if installed
        self.deferred_kv: Any = None
        self.clock = StepClock()
        self.calibration: Any = None
        self.plain_sampler_steps = 0
        self.drafter_passes = 0  # draft passes the drafter was asked to run, over the run
        self.plan_passes = False  # whether the drafter's passes follow the decisions (install())
        self.greedy_verify_steps = 0
        self.sampled_verify_steps = 0
        self._engine_drafts: dict[str, list[int]] = {}
        self._argmax: dict[str, np.ndarray] = {}
        self._orig_update_drafts: Callable[[Any], None] | None = None  # vLLM's, to apply drafts
        self._orig_ngram_propose: Callable[..., Any] | None = None  # vLLM's n-gram drafter
        self._ngram_args: tuple[Any, ...] | None = None  # its arguments at the last step

    @contextlib.contextmanager
    def calibrating(self, calibration: Any) -> Iterator[None]:
        """Route the engine's steps to ``calibration`` (:class:`adaptive_spec.vllm.calibrate.Calibration`)
        for the block; after it, the next step is priced as after an idle wait."""
        self.calibration = calibration
        try:
            yield
        finally:
            self.calibration = None
            self.clock.idle()

    # -- installation -------------------------------------------------------------------------
    def install(self, patches: InstancePatches) -> None:
        """Install every hook through ``patches`` (whose ``restore()`` removes them)."""
        sched, core, clock, driver = self.scheduler, self.core, self.clock, self.driver
        rs = getattr(self.runner, "rejection_sampler", None)  # None: runner on the workers
        orig_schedule = sched.schedule
        orig_update = sched.update_from_output
        orig_finish = sched.finish_requests
        orig_post = core.post_step
        orig_rs = getattr(rs, "forward", None)
        self._orig_update_drafts = orig_update_drafts = sched.update_draft_token_ids
        from adaptive_spec.vllm.sampling import verify_with_shortcuts

        # EAGLE heads only: a draft model's proposals were seen to change after steps with fewer passes
        # (tests/test_correctness_draft.py), so a draft model keeps vLLM's full passes.
        plan_passes = self.plan_passes = self.engine_method in PLANNED_METHODS

        def schedule(*args: Any, **kwargs: Any) -> Any:
            clock.t_schedule = time.perf_counter()
            out = orig_schedule(*args, **kwargs)
            # The drafter runs only the passes the decisions use (adaptive_spec.core.drafter_passes);
            # a calibration drafts in full.
            if plan_passes and self.calibration is None:
                try:
                    n = out.num_spec_tokens_to_schedule
                    out.num_spec_tokens_to_schedule = min(n, self.next_drafts.next_passes())
                    self.drafter_passes += out.num_spec_tokens_to_schedule
                    clock.drafter_passes = out.num_spec_tokens_to_schedule
                except Exception as e:
                    driver.fault("drafter passes", e)
            return out

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            try:
                obs = self._pre_update(scheduler_output, model_runner_output)
            except Exception as e:  # the controller never takes the engine down
                driver.fault("observe", e)
                obs = None
            result = orig_update(scheduler_output, model_runner_output)
            tau = time.perf_counter()
            if obs is not None:
                try:
                    self._post_update(obs, tau)
                except Exception as e:
                    driver.fault("observe", e)
            clock.tau_prev = tau
            try:
                clock.busy_prev = bool(sched.has_requests())
            except Exception:
                clock.busy_prev = False
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
                driver.fault("engine drafts", e)
                orig_update_drafts(draft_token_ids)

        def finish_requests(request_ids: Any, finished_status: Any) -> Any:
            finished = orig_finish(request_ids, finished_status)
            try:
                for r in finished or ():
                    self._forget(r.request_id)
            except Exception as e:
                driver.fault("finish", e)
            return finished

        def post_step(model_executed: bool) -> None:
            t0 = time.perf_counter()
            self._engine_drafts = {}
            orig_post(model_executed)
            if model_executed:
                self._assign_drafts()
            clock.post_prev_s = time.perf_counter() - t0

        def forward(metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
            t0 = time.perf_counter()
            try:
                self._record_argmax(metadata, logits)
            except Exception as e:
                driver.fault("target argmax", e)
            clock.hook_s += time.perf_counter() - t0
            # A step without draft tokens: its bonus rows alone (vLLM's sampler when greedy, one
            # uniform per row when sampled), without the rejection sampler's per-vocabulary noise; a
            # greedy step with drafts and untouched logits: one argmax over every row in the logits'
            # own dtype, no float32 copies; a sampled step with deterministic drafts: one
            # exponential per entry of the target rows, a sample only of the rows that emit
            # (adaptive_spec.vllm.sampling). Each returns None where it does not apply.
            out, counter = verify_with_shortcuts(
                rs, metadata, draft_probs, logits, sampling_metadata, driver.fault
            )
            if counter is not None:
                setattr(self, counter, getattr(self, counter) + 1)
                return out
            return orig_rs(metadata, draft_probs, logits, sampling_metadata)

        if self.runner is None:
            # A multiprocess executor: the runner side runs on the workers (adaptive_spec.vllm.workers).
            self._install_scheduler_side(patches, schedule, update_from_output, post_step)
            patches.set(sched, "update_draft_token_ids", update_draft_token_ids)
            patches.set(sched, "finish_requests", finish_requests)
            return
        if self.engine_method == "ngram":
            # vLLM's own n-gram drafter runs for every request at every step, but with the controller
            # attached its drafts are used only when a decision fails. It now only keeps its
            # arguments (views of the input batch, current until the next step) and drafts lazily in
            # that case (_engine_ngram_drafts): 0.1-0.3 ms per step at batch 16 on 2 CPU cores.
            def propose(num_speculative_tokens: int, sampled_token_ids: Any, *args: Any, **kw: Any):
                self._ngram_args = (num_speculative_tokens, sampled_token_ids, *args)
                return [[] for _ in sampled_token_ids]

            self._orig_ngram_propose = patches.set(self.runner.drafter, "propose", propose)
        if self.engine_method in DRAFT_METHODS:
            # The draft model's pass is timed: it is part of the step's time that the controller's
            # decisions do not change, except through LoRA adapters (see the controller's drafter
            # cost), and the step-cost table must not absorb it.
            drafter = self.runner.drafter
            if plan_passes and self.defer_drafter_kv and self.lora is None:
                # Steps without draft passes stash the head's KV-cache pass and the next step that
                # drafts writes it in one batch (adaptive_spec.vllm.deferred_kv). LoRA adapters
                # change the head's keys per request, so with them the pass runs at every step.
                from adaptive_spec.vllm.deferred_kv import install_deferred_kv

                self.deferred_kv = install_deferred_kv(drafter, patches, driver.fault)
            orig_draft_propose = drafter.propose

            def draft_propose(*args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig_draft_propose(*args, **kw)
                finally:
                    clock.drafter_s += time.perf_counter() - t0

            patches.set(drafter, "propose", draft_propose)
        patches.set(sched, "schedule", schedule)
        patches.set(sched, "update_from_output", update_from_output)
        patches.set(sched, "update_draft_token_ids", update_draft_token_ids)
        patches.set(sched, "finish_requests", finish_requests)
        patches.set(core, "post_step", post_step)
        patches.set(rs, "forward", forward)

    def _install_scheduler_side(
        self, patches: InstancePatches, schedule: Any, update_from_output: Any, post_step: Any
    ) -> None:
        """The scheduler's and the engine core's hooks alone (the runner's are on the workers)."""
        patches.set(self.scheduler, "schedule", schedule)
        patches.set(self.scheduler, "update_from_output", update_from_output)
        patches.set(self.core, "post_step", post_step)

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
    def _pre_update(self, so: Any, mro: Any) -> StepObservation:
        """Read the step from vLLM's scheduler output ``so`` and model-runner output ``mro`` before the
        scheduler commits it."""
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
        argmax = self._argmax
        if self.runner is None:
            argmax = self._worker_report(mro)
        obs = StepObservation(reqs, verified, drafted, prefill, accepted, argmax)
        self._argmax = {}
        self.clock.hook_s += time.perf_counter() - t0
        return obs

    def _worker_report(self, mro: Any) -> dict[str, np.ndarray]:
        """A multiprocess executor: what the workers handed back with the step's output (argmax
        rows, the draft model's time, their faults; :mod:`adaptive_spec.vllm.workers`)."""
        from adaptive_spec.vllm.workers import runner_report

        report = runner_report(mro)
        if report is None:
            return {}
        self.clock.drafter_s += report.drafter_s
        for where, msg in report.faults:
            self.driver.fault(f"worker: {where}", RuntimeError(msg))
        return report.argmax

    def _post_update(self, obs: StepObservation, tau: float) -> None:
        """After the scheduler committed the step (at ``tau``): what each request emitted, to the driver
        (or to a calibration in progress)."""
        t0 = time.perf_counter()
        clock = self.clock
        step_time = clock.step_time(tau)
        drafter_s, clock.drafter_s = clock.drafter_s, 0.0
        if self.calibration is not None:
            # The table prices the target's step; a draft model's pass is measured apart.
            self.calibration.record(
                len(obs.requests),
                obs.num_verified_tokens,
                obs.num_prefill_tokens,
                step_time - drafter_s,
            )
            clock.hook_s = 0.0
            return
        driver = self.driver
        verified: list[VerifiedRequest] = []
        drafted_of, accepted_of, argmax_of = obs.drafted, obs.accepted, obs.target_argmax
        for rid, (r, n_before) in obs.requests.items():
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
            for rid in [rid for rid, (r, _) in obs.requests.items() if r.is_finished()]:
                self.lora.release(rid)
        hook_s = clock.hook_s + (time.perf_counter() - t0)
        clock.hook_s = 0.0
        driver.observe(
            verified,
            step_time_s=step_time,
            batch_size=len(obs.requests),
            num_verified_tokens=obs.num_verified_tokens,
            num_prefill_tokens=obs.num_prefill_tokens,
            queue_len=len(self.scheduler.waiting),
            start_time=clock.t_schedule or tau,
            controller_time_s=hook_s + clock.decide_s,
            drafter_time_s=drafter_s,
            drafter_adapters=self.lora is not None and self.lora.last_pass_adapters,
            drafter_passes=clock.drafter_passes,
        )
        clock.decide_s = 0.0

    def _forget(self, rid: str) -> None:
        """A request finished outside the step loop (abort, stop string): drop its state everywhere."""
        if self.driver.has_request(rid):
            if self.lora is not None:
                self.lora.release(rid)
            self.driver.release(rid)

    # -- after the step: the next drafts ------------------------------------------------------
    def _assign_drafts(self) -> None:
        """Hand the next step's drafts to vLLM: the decision's, a calibration's, or after a failed
        decision the engine's own."""
        t0 = time.perf_counter()
        engine = self._engine_drafts
        from vllm.v1.outputs import DraftTokenIds

        apply = self._orig_update_drafts
        assert apply is not None  # install() ran
        if self.calibration is not None:
            ids, drafts = self.calibration.drafts(
                [r for r in self.scheduler.running if not r.is_prefill_chunk]
            )
            if ids:
                apply(DraftTokenIds(ids, drafts))
            return

        try:
            dec = self.next_drafts.decide(engine)
        except Exception as e:
            self.driver.fault("decide", e)
            self.driver.clear_decision()
            engine = self._engine_ngram_drafts(engine)
            if engine:
                ids = list(engine)
                apply(DraftTokenIds(ids, [engine[r] for r in ids]))
            self.clock.decide_s = time.perf_counter() - t0
            return
        self.clock.decide_s = time.perf_counter() - t0
        if dec.req_ids:
            apply(DraftTokenIds(dec.req_ids, dec.drafts))

    def _engine_ngram_drafts(self, engine: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts vLLM's n-gram drafter would have made this step (it was skipped while the
        controller decides; see :meth:`install`), for the fallback after a failed decision."""
        args, self._ngram_args = self._ngram_args, None
        if args is None or self._orig_ngram_propose is None or not engine:
            return engine
        try:
            drafts = self._orig_ngram_propose(*args)
        except Exception as e:
            self.driver.fault("engine drafts", e)
            return engine
        return {rid: list(d) for rid, d in zip(engine, drafts, strict=False)}
