"""The controller inside vLLM's engine-core process: :class:`ServeRuntime`.

When the engine core enters its busy loop (fully built, before it takes its first request) the plugin
(:mod:`adaptive_spec.vllm.plugin.registration`) builds a :class:`ServeRuntime`, which attaches
:class:`~adaptive_spec.vllm.attach.AdaptiveSpec` to the core, loads the policy state, and on the way
out (shutdown, ``SIGTERM``) saves the state and detaches.

Persistence: every ``save_every_steps`` engine steps or ``save_every_s`` seconds (whichever first; checked
after each step) the engine thread serialises the policy state to a JSON string (tens of microseconds for
the default controller) and hands it to a background thread (:class:`_Writer`), which merges it into the
file under a file lock and writes it atomically (:func:`adaptive_spec.core.state.sync_policy_state`):
the file gets what this engine learned since its previous save (the push), and the engine gets what
other replicas sharing the file added since (the pull), which the engine thread adds to its policy
after its next step (``policy.add_learning``: the adaptive controllers' acceptance counts and steps;
the step-cost model stays each machine's own). A final save happens at shutdown, after the background
thread has finished; under vLLM's default ``--shutdown-timeout 0`` the API server is made to wait for it
(:func:`adaptive_spec.vllm.plugin.registration._patch_shutdown_grace`). Stale temporary files of a
killed save are removed at start. A state file that is corrupt or does not fit (other proposers, ``max_k``, policy) is refused with a log line,
moved aside to ``<file>.refused-<unix time>``, and the controller starts fresh.

Metrics: the same background thread writes a snapshot of the counters every ``metrics_interval_s``
seconds into ``$ADAPTIVE_SPEC_METRICS_DIR`` (:mod:`adaptive_spec.vllm.prom`), which the API server
serves at ``/metrics``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from adaptive_spec.vllm.plugin.config import ENV_METRICS_DIR, ServeConfig

logger = logging.getLogger(__name__)


class ServeRuntime:
    """Adaptive speculation attached to one vLLM ``EngineCore``, with periodic state saves and metrics
    snapshots. Built by the plugin inside the engine-core process; usable on an in-process core too.

    Parameters
    ----------
    core : vllm.v1.engine.core.EngineCore
        A fully built engine core with speculative decoding and a single-process executor.
    config : ServeConfig
    engine_index : int
        vLLM's engine index (the ``engine`` label of the metrics).
    metrics_dir : path, optional
        Where to write the metrics snapshot (default ``$ADAPTIVE_SPEC_METRICS_DIR``; none if unset).

    Raises
    ------
    AttachError, ValueError
        As :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` (unsupported engine, bad proposer/policy).
    """

    def __init__(
        self,
        core: Any,
        config: ServeConfig,
        *,
        engine_index: int = 0,
        metrics_dir: str | Path | None = None,
    ) -> None:
        from adaptive_spec.vllm.attach import AdaptiveSpec

        self.config = config
        self.engine_index = int(engine_index)
        if metrics_dir is None and os.environ.get(ENV_METRICS_DIR):
            metrics_dir = os.environ[ENV_METRICS_DIR]
        self.metrics_dir = Path(metrics_dir) if metrics_dir else None
        lora_adapters = {}
        if any(p.startswith("lora:") for p in config.proposers):
            from adaptive_spec.vllm.eagle3 import drafter_adapters

            spec_cfg = getattr(core.vllm_config, "speculative_config", None)
            drafter = getattr(spec_cfg, "model", None)
            lora_adapters = drafter_adapters(drafter) if drafter else {}
        self.spec = AdaptiveSpec.attach_engine_core(
            core,
            list(config.proposers),
            lora_adapters=lora_adapters,
            policy=config.policy,
            trace=config.trace,
            seed=config.seed,
            ngram_min=config.ngram_min,
            ngram_max=config.ngram_max,
            policy_state=None,  # the runtime saves and loads the state itself (periodically)
        )
        from adaptive_spec.core.controller import AdaptiveController

        if isinstance(self.spec.policy, AdaptiveController):
            # A server's queue empties between arrivals and every request's latency counts: per-step
            # goodput, never the draining-batch objective of an offline batch.
            self.spec.policy.drain_margin = None
        self.core = core
        self.state_path = config.state
        if self.state_path is None:
            # No ADAPTIVE_SPEC_STATE: the automatic state in the cache directory, as in process
            # (ADAPTIVE_SPEC_STATE_DIR moves it; "off" disables it).
            from adaptive_spec.core.state import auto_state_path

            self.state_path = auto_state_path(
                self.spec.policy, self.spec.engine_key, self.spec.proposer_names
            )
        self.state_loaded = False
        self.saves = 0
        self.save_failures = 0
        self.last_save_time: float | None = None
        self.max_serialise_s = 0.0
        self._closed = False
        self._steps = 0
        self._saved_steps = 0
        self._saved_t = time.monotonic()
        self._est_t = -float("inf")
        self._estimates: dict[str, float] = {}
        self._seq = 0
        self._written_seq = 0
        self._state_lock = threading.Lock()
        self._metrics_key: tuple[Any, ...] | None = None
        self._metrics_warned = False
        # The shared state file (adaptive_spec.core.state.sync_policy_state). Each save (writer
        # thread) adds what this engine learned since its previous save to the file (the push) and
        # hands back what the other replicas added since this engine last saw the file (the pull),
        # which the engine thread adds to its policy after its next step. What this engine learned
        # itself is its policy's state minus the pulls it took in (``_pulled``, engine thread);
        # ``_own_base`` is that at the previous save and ``_file_seen`` the file then (writer side).
        self._own_base: dict[str, Any] | None = None
        self._file_seen: dict[str, Any] | None = None
        self._pulled: dict[str, Any] | None = None
        self._pull_pending: dict[str, Any] | None = None
        self._pull_lock = threading.Lock()  # guards _pull_pending only (never held during I/O)
        self.pulls = 0
        self.pull_failures = 0
        try:
            self.state_loaded = self._load_state()
            self._refresh_estimates()
            self._write_metrics()
            self._writer = _Writer(self, config.metrics_interval_s)
            self._writer.start()
            inner = core.post_step  # AdaptiveSpec's hook; its detach() removes this wrapper too

            def post_step(model_executed: bool) -> None:
                inner(model_executed)
                self._after_step(model_executed)

            core.post_step = post_step
        except BaseException:
            self.spec.detach()
            raise
        atexit.register(self.close)
        logger.info(
            "adaptive-spec attached to engine %d: policy=%s proposers=%s max_k=%d engine_method=%s "
            "state=%s (%s) metrics_dir=%s",
            self.engine_index,
            self.spec.policy.name,
            ",".join(self.spec.proposer_names),
            self.spec.max_k,
            self.spec.engine_method,
            self.state_path,
            "loaded" if self.state_loaded else "fresh",
            self.metrics_dir,
        )

    # -- state --------------------------------------------------------------------------------
    def _load_state(self) -> bool:
        """Check the state path (writable; stale temporary files removed), then load the state file if
        there is one; a refused file is moved aside (:func:`adaptive_spec.core.state.load_or_set_aside`)."""
        from adaptive_spec.core.state import (
            load_or_set_aside,
            prepare_state_path,
            read_state_part,
            state_file_lock,
        )

        path = self.state_path
        if path is None:
            return False
        name = self.config.label("state")
        prepare_state_path(path, name)
        existed = path.exists()
        # Where this engine's learning starts, and the file as it saw it (its fresh state when there
        # was no file: then everything in the file at the first merge is the others').
        with state_file_lock(path) if existed else contextlib.nullcontext():
            # (no replica's merge between loading the file and reading it again)
            loaded = existed and load_or_set_aside(self.spec.policy, path, name)
            self._own_base = self._state_snapshot()
            self._file_seen = (read_state_part(path) if loaded else None) or self._own_base
        if not existed:
            logger.info(
                "adaptive-spec: no policy state at %s yet; the controller starts fresh and saves there",
                path,
            )
            return False
        if loaded:
            logger.info(
                "adaptive-spec: policy state loaded from %s (%s learned steps)",
                path,
                getattr(self.spec.policy, "n_steps", "?"),
            )
            return True
        return False

    def _state_snapshot(self) -> dict[str, Any] | None:
        """The policy's state as JSON types (the base of the next merge), or None without a file."""
        if self.state_path is None:
            return None
        import json

        from adaptive_spec.core.state import policy_state_json

        return json.loads(policy_state_json(self.spec.policy))["state"]

    def _after_step(self, model_executed: bool) -> None:
        """Engine thread, after each step: cheap checks; serialise the state when due (every
        ``save_every_steps`` steps or ``save_every_s`` seconds while busy, and as soon as the engine has
        no unfinished request, so that an idle server's state on disk is current)."""
        try:
            if self._pull_pending is not None:
                self._take_pull()
            if model_executed:
                self._steps += 1
            unsaved = self._steps - self._saved_steps
            if unsaved <= 0:
                return
            now = time.monotonic()
            cfg = self.config
            idle = self.core.scheduler.get_num_unfinished_requests() == 0
            if self.state_path is not None and (
                idle or unsaved >= cfg.save_every_steps or now - self._saved_t >= cfg.save_every_s
            ):
                self._queue_save(now)
            elif idle:
                self._saved_steps = self._steps  # no state file: only marks the idle point
            if idle or now - self._est_t >= cfg.metrics_interval_s:
                self._refresh_estimates()
                self._est_t = now
                self._writer.nudge()
        except Exception as e:  # never takes the engine down
            self.spec._fault("serve runtime", e)

    def _queue_save(self, now: float) -> None:
        from adaptive_spec.core.state import policy_state_json

        t0 = time.perf_counter()
        data = policy_state_json(self.spec.policy)
        self.max_serialise_s = max(self.max_serialise_s, time.perf_counter() - t0)
        self._seq += 1
        self._writer.put_state(data, self._seq, self._pulled)
        self._saved_steps = self._steps
        self._saved_t = now

    def _write_state(self, data: str, seq: int, pulled: dict[str, Any] | None) -> None:
        """Writer thread (and :meth:`close`): merge into the file if newer than what is on disk; keep
        what the other replicas added for the engine thread (:meth:`_take_pull`). ``pulled``: the pulls
        the policy had taken in when ``data`` was serialised."""
        from adaptive_spec.core.state import combine_states, has_nonzero, sync_policy_state

        assert self.state_path is not None
        with self._state_lock:
            if seq <= self._written_seq:
                return
            try:
                # Under a file lock, this engine's own learning since its previous save added to the
                # file's counts (data-parallel replicas and other servers share it), written
                # atomically; ``data`` minus ``base`` is that learning.
                base = self._own_base
                if base is not None and pulled is not None:
                    base = combine_states(base, pulled, +1)
                result = sync_policy_state(data, self.state_path, base, self._file_seen)
            except OSError as e:
                self.save_failures += 1
                if self.save_failures <= 3 or self.save_failures % 100 == 0:
                    logger.warning(
                        "adaptive-spec: cannot write the policy state to %s (%s: %s); failure #%d, "
                        "serving continues",
                        self.state_path,
                        type(e).__name__,
                        e,
                        self.save_failures,
                    )
                return
            mine = result.mine
            self._own_base = mine if pulled is None else combine_states(mine, pulled, -1)
            self._file_seen = result.merged
            if result.others is not None and has_nonzero(result.others):
                with self._pull_lock:
                    pending = self._pull_pending
                    self._pull_pending = (
                        result.others
                        if pending is None
                        else combine_states(pending, result.others, +1)
                    )
            self._written_seq = seq
            self.saves += 1
            self.last_save_time = time.time()

    def _take_pull(self) -> None:
        """Engine thread, between steps: add what the other replicas pushed to the policy
        (``policy.add_learning``; policies that learn nothing, or another layout, skip it)."""
        import json

        from adaptive_spec.core.state import combine_states, policy_state_json

        with self._pull_lock:
            others, self._pull_pending = self._pull_pending, None
        if others is None:
            return
        policy = self.spec.policy
        before = json.loads(policy_state_json(policy))["state"]
        try:
            if not policy.add_learning(others):
                return
        except (TypeError, ValueError) as e:
            self.pull_failures += 1
            if self.pull_failures <= 3:
                logger.warning(
                    "adaptive-spec: the other replicas' learning in %s does not fit this policy "
                    "(%s: %s); this engine keeps its own",
                    self.state_path,
                    type(e).__name__,
                    e,
                )
            return
        # What the policy actually took in (counts are kept >= 0): never pushed back as its own.
        applied = combine_states(json.loads(policy_state_json(policy))["state"], before, -1)
        self._pulled = (
            applied if self._pulled is None else combine_states(self._pulled, applied, +1)
        )
        self.pulls += 1

    def save_now(self) -> None:
        """Serialise and write the state synchronously on the calling thread (the engine's thread)."""
        if self.state_path is None:
            return
        from adaptive_spec.core.state import policy_state_json

        self._seq += 1
        self._write_state(policy_state_json(self.spec.policy), self._seq, self._pulled)
        self._saved_steps = self._steps
        self._saved_t = time.monotonic()

    # -- metrics ------------------------------------------------------------------------------
    def _refresh_estimates(self) -> None:
        est = getattr(self.spec.policy, "estimated_acceptance", None)
        if callable(est):
            self._estimates = {str(k): float(v) for k, v in est().items()}

    def snapshot(self) -> dict[str, Any]:
        """The current metrics snapshot (:func:`adaptive_spec.vllm.prom.metrics_snapshot`)."""
        from adaptive_spec.vllm.prom import metrics_snapshot

        spec = self.spec
        n = getattr(spec.policy, "n_steps", None)
        return metrics_snapshot(
            spec.metrics,
            engine=self.engine_index,
            info={
                "policy": spec.policy.name,
                "proposers": spec.proposer_names,
                "max_k": spec.max_k,
                "engine_method": spec.engine_method,
            },
            estimated_acceptance=self._estimates,
            policy_learned_steps=n if isinstance(n, int) else None,
            state={
                "loaded": self.state_loaded,
                "saves": self.saves,
                "save_failures": self.save_failures,
                "last_save_time": self.last_save_time,
            },
        )

    def _write_metrics(self, force: bool = False) -> None:
        """Writer thread (and start/close): write the snapshot if anything changed."""
        if self.metrics_dir is None:
            return
        from adaptive_spec.vllm.prom import write_snapshot

        m = self.spec.metrics
        key = (m.steps, m.faults, self.saves, self.save_failures, tuple(self._estimates.values()))
        if not force and key == self._metrics_key:
            return
        try:
            write_snapshot(self.snapshot(), self.metrics_dir)
            self._metrics_key = key
        except Exception as e:
            if not self._metrics_warned:
                self._metrics_warned = True
                logger.warning(
                    "adaptive-spec: cannot write metrics to %s (%s: %s); /metrics will lag",
                    self.metrics_dir,
                    type(e).__name__,
                    e,
                )

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the writer, save the state a last time, write the last metrics, detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        try:
            self._writer.stop(timeout=10.0)
            if self.state_path is not None:
                try:
                    self.save_now()
                    logger.info(
                        "adaptive-spec: policy state saved to %s at shutdown (%s learned steps, "
                        "%d saves, slowest serialisation on the engine thread %.2f ms)",
                        self.state_path,
                        getattr(self.spec.policy, "n_steps", "?"),
                        self.saves,
                        1e3 * self.max_serialise_s,
                    )
                except Exception as e:
                    logger.warning(
                        "adaptive-spec: final state save failed: %s: %s", type(e).__name__, e
                    )
            with contextlib.suppress(Exception):
                self._refresh_estimates()
            self._write_metrics(force=True)
        finally:
            self.spec.detach()


class _Writer(threading.Thread):
    """Background thread: writes queued policy states (newest only) and metrics snapshots."""

    def __init__(self, runtime: ServeRuntime, interval_s: float) -> None:
        super().__init__(name="adaptive-spec-writer", daemon=True)
        self.runtime = runtime
        self.interval_s = interval_s
        self._cv = threading.Condition()
        self._pending: tuple[str, int, dict[str, Any] | None] | None = None
        self._nudged = False
        self._stopping = False

    def put_state(self, data: str, seq: int, pulled: dict[str, Any] | None) -> None:
        with self._cv:
            self._pending = (
                data,
                seq,
                pulled,
            )  # an older pending state is superseded, never queued
            self._cv.notify()

    def nudge(self) -> None:
        """Write the metrics snapshot now rather than at the next interval."""
        with self._cv:
            self._nudged = True
            self._cv.notify()

    def run(self) -> None:
        while True:
            with self._cv:
                if not self._stopping and self._pending is None and not self._nudged:
                    self._cv.wait(timeout=self.interval_s)
                pending, self._pending = self._pending, None
                self._nudged = False
                stopping = self._stopping
            try:
                if pending is not None:
                    self.runtime._write_state(*pending)
                self.runtime._write_metrics()
            except Exception as e:  # pragma: no cover (both methods catch their own errors)
                logger.warning("adaptive-spec writer: %s: %s", type(e).__name__, e)
            if stopping:
                return

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self.is_alive():
            self.join(timeout)
