"""vLLM plugin: adaptive speculation inside ``vllm serve`` (the engine core in its own process).

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` -> ``adaptive_spec``) in each of its
processes. Without the switch it returns at once and changes nothing. With ``ADAPTIVE_SPEC=1`` (or
``ADAPTIVE_SPEC_CONFIG=/path/config.json``) it:

* validates the configuration (:class:`ServeConfig`; a bad value, or a state or trace path that cannot
  be written, stops ``vllm serve`` before the model loads, with one line naming the variable and exit
  status 2);
* in the API server: creates the metrics directory (``$ADAPTIVE_SPEC_METRICS_DIR``, inherited by the
  engine core) and registers :class:`~adaptive_spec.vllm.prom.SnapshotCollector` so that ``/metrics``
  shows the ``adaptive_spec_*`` series;
* wraps ``EngineCoreProc.run_busy_loop``: when the engine core enters its busy loop (fully built, before
  it takes its first request), a :class:`ServeRuntime` attaches
  :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` to it, loads the policy state, and on the way out
  (shutdown, ``SIGTERM``) saves the state and detaches.

vLLM's CPU build runs one worker in the engine-core process (``distributed_executor_backend="uni"``, the
default for one device), which AdaptiveSpec needs for its runner-side hook; a multiprocess executor is
refused at attach time with a clear error.

Persistence: every ``save_every_steps`` engine steps or ``save_every_s`` seconds (whichever first; checked
after each step) the engine thread serialises the policy state to a JSON string (tens of microseconds for
the default controller) and hands it to a background thread, which writes it atomically
(:func:`adaptive_spec.core.state.write_policy_state`). A final save happens at shutdown, after the background
thread has finished; under vLLM's default ``--shutdown-timeout 0`` the API server is made to wait for it
(:func:`_patch_shutdown_grace`). Stale temporary files of a killed save are removed at start. A state
file that is corrupt or does not fit (other proposers, ``max_k``, policy) is refused with a log line,
moved aside to ``<file>.refused-<unix time>``, and the controller starts fresh.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from adaptive_spec.core.errors import ConfigError, invalid_value

logger = logging.getLogger(__name__)

ENV_SWITCH = "ADAPTIVE_SPEC"
ENV_CONFIG = "ADAPTIVE_SPEC_CONFIG"
ENV_METRICS_DIR = "ADAPTIVE_SPEC_METRICS_DIR"
#: With 1/true/yes/on, a configuration error also shows its traceback (otherwise: one line, exit 2).
ENV_DEBUG = "ADAPTIVE_SPEC_DEBUG"
#: Environment variable -> ServeConfig field. Each overrides the same key of the config file.
ENV_FIELDS = {
    "ADAPTIVE_SPEC_PROPOSERS": "proposers",
    "ADAPTIVE_SPEC_POLICY": "policy",
    "ADAPTIVE_SPEC_STATE": "state",
    "ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "save_every_steps",
    "ADAPTIVE_SPEC_SAVE_EVERY_S": "save_every_s",
    "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "metrics_interval_s",
    "ADAPTIVE_SPEC_TRACE": "trace",
    "ADAPTIVE_SPEC_SEED": "seed",
    "ADAPTIVE_SPEC_NGRAM_MIN": "ngram_min",
    "ADAPTIVE_SPEC_NGRAM_MAX": "ngram_max",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
#: What each field allows, in words (the policy's list comes from adaptive_spec.core.policies).
_ALLOWED = {
    "proposers": "a non-empty comma-separated list of none, ngram, jacobi, suffix, draft, lora:<adapter>",
    "state": "a file path (empty: no state file)",
    "save_every_steps": "an integer >= 1",
    "save_every_s": "a finite number of seconds > 0",
    "metrics_interval_s": "a finite number of seconds > 0",
    "trace": "a file path (empty: no trace)",
    "seed": "an integer",
    "ngram_min": "an integer >= 1",
    "ngram_max": "an integer >= 1",
}
#: A valid value of each field, for the fix in error messages.
_EXAMPLE = {
    "proposers": "none,ngram,jacobi",
    "policy": "adaptive",
    "state": "/var/lib/adaptive-spec/policy.json",
    "save_every_steps": "1000",
    "save_every_s": "60",
    "metrics_interval_s": "1",
    "trace": "/tmp/adaptive-spec-trace.jsonl",
    "seed": "0",
    "ngram_min": "2",
    "ngram_max": "4",
}


@dataclass(frozen=True)
class _Origin:
    """Where a configuration value came from, to name it in an error message."""

    name: str  # the variable, key or parameter, as the user wrote it
    raw: Any  # the value as given (the text of a variable)
    kind: str  # "env", "file" or "arg"
    file: str | None = None

    def fix(self, field_name: str) -> str:
        example = _EXAMPLE.get(field_name, "")
        if self.kind == "env":
            return f"set {self.name} to a valid value (e.g. {example}) or unset it for the default"
        if self.kind == "file":
            return (
                f"set {self.name!r} in {self.file} to a valid value (e.g. {example}) or remove the "
                "key for the default"
            )
        return f"pass a valid {self.name} (e.g. {example})"

    def prefix(self) -> str:
        return f"{self.file}: " if self.kind == "file" else ""


class _Invalid(Exception):
    """A field's value is invalid (internal: turned into a :class:`ConfigError` naming its origin)."""

    def __init__(self, why: str | None = None, allowed: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.allowed = allowed


@dataclass(frozen=True)
class ServeConfig:
    """Configuration of adaptive speculation under ``vllm serve``.

    Parameters
    ----------
    proposers : tuple of str
        Arms' proposers (``none``, ``ngram``, ``jacobi``, ``suffix``, ``draft``), as for ``AdaptiveSpec``.
    policy : str
        A policy name for :func:`adaptive_spec.core.policies.make_policy` (its k are checked against the
        engine's ``num_speculative_tokens`` by :func:`check_vllm_config`).
    state : Path, optional
        Policy-state file: loaded at start if present, saved periodically and at shutdown.
    save_every_steps : int >= 1
        Save the state after this many engine steps since the last save.
    save_every_s : float > 0
        ... or when this many seconds have passed since the last save (checked after each step).
    metrics_interval_s : float > 0
        Seconds between metrics snapshots (the freshness of ``/metrics``).
    trace : Path, optional
        JSONL step trace (:mod:`adaptive_spec.core.trace`).
    seed : int
        Seeds the policy.
    ngram_min, ngram_max : int >= 1
        n-gram sizes of the prompt-lookup proposer (``ngram_min <= ngram_max``).

    Raises
    ------
    ConfigError
        A ``ValueError`` for a value outside the ranges above, in one line naming where it came from
        (the environment variable, the config file and key, or the parameter), the value as given,
        what is allowed and the fix.
    """

    proposers: tuple[str, ...] = ("none", "ngram", "jacobi")
    policy: str = "adaptive"
    state: Path | None = None
    save_every_steps: int = 1000
    save_every_s: float = 60.0
    metrics_interval_s: float = 1.0
    trace: Path | None = None
    seed: int = 0
    ngram_min: int = 2
    ngram_max: int = 4
    source: str = field(default="defaults", compare=False)
    origins: Mapping[str, _Origin] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("source", "origins"):
                continue
            try:
                _check_field(f.name, getattr(self, f.name), self.proposers)
            except _Invalid as e:
                raise self._error(f.name, e) from None
        if self.ngram_min > self.ngram_max:
            lo, hi = self.origin("ngram_min"), self.origin("ngram_max")
            raise ConfigError(
                f"{lo.prefix()}{lo.name}={lo.raw!r} and {hi.prefix()}{hi.name}={hi.raw!r} are invalid "
                f"together; allowed: ngram_min <= ngram_max; fix: {lo.fix('ngram_min')}, or raise "
                f"{hi.name}"
            )

    def origin(self, name: str) -> _Origin:
        """Where field ``name`` came from (the parameter itself when not from the environment or a file)."""
        return self.origins.get(name) or _Origin(name, getattr(self, name), "arg")

    def label(self, name: str) -> str:
        """How the user wrote field ``name``: ``ADAPTIVE_SPEC_STATE``, ``/etc/a.json: state``, ``state``."""
        o = self.origin(name)
        return o.prefix() + o.name

    def _error(self, name: str, err: _Invalid) -> ConfigError:
        o = self.origin(name)
        allowed = err.allowed or _allowed(name)
        e = invalid_value(o.name, o.raw, allowed, fix=o.fix(name), why=err.why)
        return ConfigError(o.prefix() + str(e))

    def check_paths(self) -> None:
        """Check, before anything starts, that the state and trace files can be written there (their
        directory exists or is created, and a temporary file can be created in it); removes stale
        temporary files of an interrupted state save.

        Raises
        ------
        StatePathError
            A :class:`ConfigError` naming the variable (or key) and the path.
        """
        from adaptive_spec.core.state import StatePathError, check_writable_path, prepare_state_path

        for name, check in (("state", prepare_state_path), ("trace", check_writable_path)):
            path = getattr(self, name)
            if path is None:
                continue
            try:
                check(path, self.origin(name).name)
            except StatePathError as e:
                raise StatePathError(self.origin(name).prefix() + str(e)) from None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> ServeConfig:
        """Build from a mapping of field names to values (strings are converted: ``proposers`` from a
        comma-separated list, numbers from their text, paths from text). Errors name ``source`` (the
        config file) and the key.

        Raises
        ------
        ConfigError
            For an unknown key or a value that does not convert or is out of range.
        """
        kwargs, origins = _from_values(
            {key: (_Origin(key, raw, "file", source), raw) for key, raw in values.items()}
        )
        return cls(**kwargs, source=source, origins=origins)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServeConfig | None:
        """The configuration from the environment, or None when adaptive speculation is off.

        On when ``ADAPTIVE_SPEC`` is 1/true/yes/on, or when ``ADAPTIVE_SPEC_CONFIG`` is set and
        ``ADAPTIVE_SPEC`` is unset. The config file (JSON object with :class:`ServeConfig`'s field names)
        is read first; each ``ADAPTIVE_SPEC_<FIELD>`` variable (:data:`ENV_FIELDS`) overrides its key.

        Raises
        ------
        ConfigError
            For an invalid switch value, an unreadable or invalid config file, or an invalid value; the
            message names the variable (or the file and key).
        """
        env = os.environ if environ is None else environ
        switch = env.get(ENV_SWITCH)
        config_path = env.get(ENV_CONFIG)
        if switch is not None:
            s = switch.strip().lower()
            if s not in _TRUE + _FALSE:
                raise invalid_value(
                    ENV_SWITCH,
                    switch,
                    "1/true/yes/on or 0/false/no/off",
                    fix=f"set {ENV_SWITCH}=1 to switch adaptive speculation on",
                )
            if s in _FALSE:
                return None
        elif not config_path:
            return None
        given: dict[str, tuple[_Origin, Any]] = {}
        source = "environment"
        if config_path:
            for key, raw in _read_config_file(config_path).items():
                given[key] = (_Origin(key, raw, "file", config_path), raw)
            source = f"{ENV_CONFIG}={config_path} and environment"
        for var, name in ENV_FIELDS.items():
            if var in env:
                given[name] = (_Origin(var, env[var], "env"), env[var])
        kwargs, origins = _from_values(given)
        return cls(**kwargs, source=source, origins=origins)


def _allowed(name: str) -> str:
    if name == "policy":
        from adaptive_spec.core.policies import POLICY_NAMES

        return ", ".join(POLICY_NAMES)
    return _ALLOWED[name]


def _read_config_file(config_path: str) -> dict[str, Any]:
    allowed = "a readable JSON object with the keys of ServeConfig"
    try:
        loaded = json.loads(Path(config_path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        why = f"cannot be read as JSON: {type(e).__name__}: {e}"
        raise invalid_value(
            ENV_CONFIG, config_path, allowed, why=why, fix="fix the file or point to another one"
        ) from None
    if not isinstance(loaded, dict):
        raise invalid_value(
            ENV_CONFIG,
            config_path,
            allowed,
            why=f"it must hold a JSON object, got {type(loaded).__name__}",
            fix='write an object such as {"policy": "adaptive"}',
        )
    return loaded


def _from_values(
    given: Mapping[str, tuple[_Origin, Any]],
) -> tuple[dict[str, Any], dict[str, _Origin]]:
    """Field values converted from what the user gave, and where each came from."""
    known = [f.name for f in fields(ServeConfig) if f.name not in ("source", "origins")]
    kwargs: dict[str, Any] = {}
    origins: dict[str, _Origin] = {}
    for name, (origin, raw) in given.items():
        if name not in known:
            raise ConfigError(
                f"{origin.prefix()}unknown key {name!r}; allowed: {', '.join(sorted(known))}; "
                f"fix: remove it or correct its spelling"
            )
        try:
            kwargs[name] = _convert(name, raw)
        except (TypeError, ValueError):
            e = invalid_value(origin.name, raw, _allowed(name), fix=origin.fix(name))
            raise ConfigError(origin.prefix() + str(e)) from None
        origins[name] = origin
    return kwargs, origins


def _convert(name: str, raw: Any) -> Any:
    """Convert ``raw`` (text from the environment, or a JSON value) to field ``name``'s type.
    Raises ``TypeError`` or ``ValueError`` when it does not convert."""
    if name == "proposers":
        if isinstance(raw, str):
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if isinstance(raw, (list, tuple)):
            return tuple(raw)
        raise TypeError(name)
    if name in ("state", "trace"):
        if raw is None or raw == "":
            return None
        if not isinstance(raw, (str, os.PathLike)):
            raise TypeError(name)
        return Path(raw).expanduser()
    if name in ("save_every_steps", "seed", "ngram_min", "ngram_max"):
        return int(raw.strip()) if isinstance(raw, str) else raw
    if name in ("save_every_s", "metrics_interval_s"):
        return float(raw.strip()) if isinstance(raw, str) else raw
    return raw


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


#: Checks of the fields with a simple range (the others are checked in :func:`_check_field`).
_VALID = {
    "save_every_steps": lambda v: _is_int(v) and v >= 1,
    "ngram_min": lambda v: _is_int(v) and v >= 1,
    "ngram_max": lambda v: _is_int(v) and v >= 1,
    "seed": _is_int,
    "save_every_s": _is_seconds,
    "metrics_interval_s": _is_seconds,
    "state": lambda v: v is None or isinstance(v, Path),
    "trace": lambda v: v is None or isinstance(v, Path),
}


def _check_field(name: str, v: Any, proposers: Any) -> None:
    """Raise :class:`_Invalid` when ``v`` is not a valid value of field ``name``."""
    if name in _VALID:
        if not _VALID[name](v):
            raise _Invalid()
    elif name == "proposers":
        from adaptive_spec.core.arms import check_proposer_name

        if isinstance(v, str) or not isinstance(v, (tuple, list)) or not v:
            raise _Invalid("an empty list" if not v else None)
        for p in v:
            try:
                check_proposer_name(p)
            except ValueError:
                raise _Invalid(f"proposer {p!r} is not known") from None
    elif name == "policy":
        from adaptive_spec.core.policies import check_policy_name, policy_error_reason

        if not isinstance(v, str) or not v:
            raise _Invalid()
        try:
            check_policy_name(v, list(proposers))
        except ValueError as e:
            raise _Invalid(policy_error_reason(e, v)) from None


# -- the engine-core side -----------------------------------------------------------------------------
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
        self.spec = AdaptiveSpec.attach_engine_core(
            core,
            list(config.proposers),
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
        from adaptive_spec.core.state import load_or_set_aside, prepare_state_path

        path = self.state_path
        if path is None:
            return False
        name = self.config.label("state")
        prepare_state_path(path, name)
        if not path.exists():
            logger.info(
                "adaptive-spec: no policy state at %s yet; the controller starts fresh and saves there",
                path,
            )
            return False
        if load_or_set_aside(self.spec.policy, path, name):
            logger.info(
                "adaptive-spec: policy state loaded from %s (%s learned steps)",
                path,
                getattr(self.spec.policy, "n_steps", "?"),
            )
            return True
        return False

    def _after_step(self, model_executed: bool) -> None:
        """Engine thread, after each step: cheap checks; serialise the state when due (every
        ``save_every_steps`` steps or ``save_every_s`` seconds while busy, and as soon as the engine has
        no unfinished request, so that an idle server's state on disk is current)."""
        try:
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
        self._writer.put_state(data, self._seq)
        self._saved_steps = self._steps
        self._saved_t = now

    def _write_state(self, data: str, seq: int) -> None:
        """Writer thread (and :meth:`close`): write if newer than what is on disk."""
        from adaptive_spec.core.state import write_policy_state

        assert self.state_path is not None
        with self._state_lock:
            if seq <= self._written_seq:
                return
            try:
                write_policy_state(data, self.state_path)
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
            self._written_seq = seq
            self.saves += 1
            self.last_save_time = time.time()

    def save_now(self) -> None:
        """Serialise and write the state synchronously on the calling thread (the engine's thread)."""
        if self.state_path is None:
            return
        from adaptive_spec.core.state import policy_state_json

        self._seq += 1
        self._write_state(policy_state_json(self.spec.policy), self._seq)
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
        self._pending: tuple[str, int] | None = None
        self._nudged = False
        self._stopping = False

    def put_state(self, data: str, seq: int) -> None:
        with self._cv:
            self._pending = (data, seq)  # an older pending state is superseded, never queued up
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


# -- registration (every vLLM process) ------------------------------------------------------------
_registered = False
_register_lock = threading.Lock()


def ensure_metrics_dir(environ: dict[str, str] | os._Environ[str] | None = None) -> Path:
    """``$ADAPTIVE_SPEC_METRICS_DIR``, creating a temporary directory (removed at exit by the process
    that created it) and exporting it for child processes when unset."""
    env = os.environ if environ is None else environ
    d = env.get(ENV_METRICS_DIR)
    if d:
        return Path(d)
    d = tempfile.mkdtemp(prefix="adaptive-spec-metrics-")
    env[ENV_METRICS_DIR] = d
    pid = os.getpid()

    def _cleanup() -> None:
        if os.getpid() == pid:
            shutil.rmtree(d, ignore_errors=True)

    atexit.register(_cleanup)
    return Path(d)


def _forward_logs_to_vllm() -> None:
    """Show adaptive-spec's log lines like vLLM's (same handlers and level), unless the application
    configured the ``adaptive_spec`` logger itself."""
    ours = logging.getLogger("adaptive_spec")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def _start_runtime(core: Any, config: ServeConfig) -> ServeRuntime | None:
    if getattr(core, "_adaptive_spec_runtime", None) is not None:
        return None  # already attached (a subclass's busy loop calling its parent's)
    runtime = ServeRuntime(core, config, engine_index=int(getattr(core, "engine_index", 0) or 0))
    core._adaptive_spec_runtime = runtime
    return runtime


def check_vllm_config(vllm_config: Any, config: ServeConfig) -> None:
    """Refuse, before any engine process starts, a vLLM configuration adaptive speculation cannot drive.

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig
        As built by ``EngineArgs.create_engine_config`` (after the platform adjusted it).
    config : ServeConfig

    Raises
    ------
    ConfigError
        No speculative decoding, an unsupported method, a multiprocess executor (the model runner in
        another process), async scheduling, ``draft`` without a draft model, or a policy whose k exceeds
        ``num_speculative_tokens``; one line naming the flag or variable and the fix.
    """
    from adaptive_spec.core.policies import make_policy
    from adaptive_spec.vllm.attach import DRAFT_METHODS, ENGINE_METHODS

    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not getattr(spec, "num_speculative_tokens", 0):
        raise ConfigError(
            f"{ENV_SWITCH} is on but the engine has no speculative decoding; fix: add e.g. "
            """--speculative-config '{"method": "ngram", "num_speculative_tokens": 8, """
            """"prompt_lookup_min": 2, "prompt_lookup_max": 4}' (its num_speculative_tokens is the """
            "largest k)"
        )
    if spec.method not in ENGINE_METHODS:
        raise invalid_value(
            "--speculative-config method",
            spec.method,
            ", ".join(ENGINE_METHODS),
            why="not supported by adaptive-spec",
            fix='use e.g. "method": "ngram"',
        )
    if "draft" in config.proposers and spec.method not in DRAFT_METHODS:
        o = config.origin("proposers")
        raise ConfigError(
            o.prefix()
            + str(
                invalid_value(
                    o.name,
                    o.raw,
                    f"proposers without 'draft' with method {spec.method!r}",
                    why=f"proposer 'draft' needs a draft-model engine (speculative method in "
                    f"{', '.join(DRAFT_METHODS)}); this one uses {spec.method!r}",
                    fix="remove 'draft' or serve with a draft model in --speculative-config",
                )
            )
        )
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend != "uni":
        hint = (
            "on vLLM's CPU backend set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the server's environment "
            "(vLLM's CPU platform otherwise moves the worker into a process of its own; the engine core "
            "still runs in its own process under vllm serve)"
            if str(getattr(vllm_config.device_config, "device_type", "")) == "cpu"
            else "pass --distributed-executor-backend uni (one device per engine)"
        )
        raise ConfigError(
            f"adaptive-spec needs the model runner in the engine-core process "
            f"(distributed_executor_backend='uni'); this configuration uses {backend!r}; fix: {hint}"
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise ConfigError(
            "adaptive-spec does not support async scheduling; fix: pass --no-async-scheduling"
        )
    from adaptive_spec.core.policies import policy_error_reason

    max_k = int(spec.num_speculative_tokens)
    try:
        make_policy(config.policy, list(config.proposers), max_k)
    except ValueError as e:
        o = config.origin("policy")
        raise ConfigError(
            o.prefix()
            + str(
                invalid_value(
                    o.name,
                    o.raw,
                    f"a policy whose k are at most num_speculative_tokens={max_k}",
                    why=policy_error_reason(e, config.policy),
                    fix=f"use k <= {max_k}, or raise num_speculative_tokens in --speculative-config",
                )
            )
        ) from None


def _debug() -> bool:
    return os.environ.get(ENV_DEBUG, "").strip().lower() in _TRUE


def _refuse(err: ConfigError) -> None:
    """Stop the process on a configuration error: one line on stderr and exit status 2 (with the
    traceback too when ``ADAPTIVE_SPEC_DEBUG`` is on)."""
    if _debug():
        raise err
    print(f"adaptive-spec: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _patch_engine_args(config: ServeConfig) -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_adaptive_spec_wrapped", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = orig(self, *args, **kwargs)
        _forward_logs_to_vllm()  # vLLM's logging is set up by now (it may not be at register())
        try:
            check_vllm_config(vllm_config, config)
        except ConfigError as e:
            _refuse(e)
        _note_shutdown(vllm_config, config)
        return vllm_config

    create_engine_config._adaptive_spec_wrapped = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


#: Seconds the API server gives the engine core to save and exit after ``SIGTERM`` when vLLM's
#: ``--shutdown-timeout`` is 0 (requests are still aborted at once; the wait ends when the process does).
SHUTDOWN_GRACE_S = 10.0


def _patch_shutdown_grace() -> bool:
    """Give the engine core time for the final state save under vLLM's default ``--shutdown-timeout 0``.

    vLLM 0.32's process manager sends ``SIGTERM`` to the engine core, then waits the shutdown timeout
    before ``SIGKILL``: with 0 it kills at once, while the engine core (which handles ``SIGTERM`` by
    aborting its requests and leaving its busy loop) is saving. vLLM already makes an exception for
    ROCm through ``get_engine_process_shutdown_timeout``; this wraps that function so that, when both
    timeouts are 0, the wait is :data:`SHUTDOWN_GRACE_S`. Returns False when vLLM has no such function
    (the final save then depends on ``--shutdown-timeout``)."""
    try:
        from vllm.v1.engine import utils as engine_utils
    except ImportError:
        return False
    orig = getattr(engine_utils, "get_engine_process_shutdown_timeout", None)
    if orig is None:
        return False
    if getattr(orig, "_adaptive_spec_wrapped", False):
        return True

    @functools.wraps(orig)
    def get_engine_process_shutdown_timeout(
        request_timeout: float | None, process_timeout: float | None
    ) -> float | None:
        timeout = orig(request_timeout, process_timeout)
        if request_timeout == 0 and timeout == 0:
            return SHUTDOWN_GRACE_S
        return timeout

    get_engine_process_shutdown_timeout._adaptive_spec_wrapped = True  # type: ignore[attr-defined]
    engine_utils.get_engine_process_shutdown_timeout = get_engine_process_shutdown_timeout
    return True


def _note_shutdown(vllm_config: Any, config: ServeConfig) -> None:
    """Say at start whether the final state save can happen at shutdown (API server)."""
    if config.state is None:
        return
    timeout = int(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    if timeout == 0 and not _shutdown_grace_installed:
        logger.warning(
            "adaptive-spec: this vLLM kills the engine core right after SIGTERM with "
            "--shutdown-timeout 0: the final policy-state save at shutdown will be lost (the last "
            "periodic or idle save is kept); pass --shutdown-timeout 10 to keep it"
        )
    elif timeout == 0:
        logger.info(
            "adaptive-spec: the policy state is saved at shutdown: after SIGTERM the engine core aborts "
            "its requests and gets up to %.0f s to save and exit",
            SHUTDOWN_GRACE_S,
        )
    else:
        logger.info(
            "adaptive-spec: with --shutdown-timeout %d the final policy-state save happens after "
            "in-flight requests drain; if they are still running after %d s, vLLM kills the engine "
            "core and the last periodic or idle save is kept",
            timeout,
            timeout,
        )


def _patch_engine_core(config: ServeConfig) -> None:
    from vllm.v1.engine import core as core_mod

    for cls_name in ("EngineCoreProc", "DPEngineCoreProc"):
        cls = getattr(core_mod, cls_name, None)
        if cls is None or "run_busy_loop" not in vars(cls):
            continue
        orig = vars(cls)["run_busy_loop"]
        if getattr(orig, "_adaptive_spec_wrapped", False):
            continue

        @functools.wraps(orig)
        def run_busy_loop(self: Any, _orig: Any = orig) -> Any:
            runtime = _start_runtime(self, config)
            try:
                return _orig(self)
            finally:
                if runtime is not None:
                    runtime.close()

        run_busy_loop._adaptive_spec_wrapped = True  # type: ignore[attr-defined]
        cls.run_busy_loop = run_busy_loop


_shutdown_grace_installed = False


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point. Cheap and idempotent; a no-op without the switch.

    An invalid configuration (a variable, the config file, or a state or trace path that cannot be
    written) stops the process here, while ``vllm serve`` parses its arguments, before the model
    loads: one line on stderr and exit status 2 (``ADAPTIVE_SPEC_DEBUG=1`` raises the
    :class:`ConfigError` instead, with its traceback).
    """
    global _registered, _shutdown_grace_installed
    with _register_lock:
        if _registered:
            return
        try:
            config = ServeConfig.from_env()
            if config is not None:
                config.check_paths()
        except ConfigError as e:
            _refuse(e)
        _registered = True
        if config is None:
            return
        from adaptive_spec.vllm.cpu_fixes import guard_kernel_override_scan

        guard_kernel_override_scan()  # the controller loads Numba; vLLM's worker start-up scan trips on it
        _forward_logs_to_vllm()
        directory = ensure_metrics_dir()
        from adaptive_spec.vllm.prom import register_collector

        register_collector(directory)
        _patch_engine_args(config)
        _patch_engine_core(config)
        _shutdown_grace_installed = _patch_shutdown_grace()
        logger.debug("adaptive-spec plugin registered (%s)", config.source)


__all__ = [
    "ENV_CONFIG",
    "ENV_DEBUG",
    "ENV_FIELDS",
    "ENV_METRICS_DIR",
    "ENV_SWITCH",
    "SHUTDOWN_GRACE_S",
    "ServeConfig",
    "ServeRuntime",
    "check_vllm_config",
    "ensure_metrics_dir",
    "register",
]
