"""Configuration of adaptive speculation under ``vllm serve``: the ``ADAPTIVE_SPEC*`` settings.

:meth:`ServeConfig.from_env` reads the switch (``ADAPTIVE_SPEC``), the optional JSON config file
(``ADAPTIVE_SPEC_CONFIG``) and one variable per field (:data:`ENV_FIELDS`, each overriding the file's
key), converts and validates each value, and remembers where it came from, so that an error names the
variable (or the file and key) the user wrote, the value as given, what is allowed and the fix, in one
line (:class:`~adaptive_spec.core.errors.ConfigError`). :func:`check_vllm_config` refuses, before any
engine process starts, a vLLM configuration adaptive speculation cannot drive.

Importing this module is cheap (no vLLM, no NumPy): it runs in every vLLM process.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from adaptive_spec.core.errors import ConfigError, invalid_value

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

    def invalid(self, allowed: str, *, fix: str, why: str | None = None) -> ConfigError:
        """The one-line error for this value, prefixed with the config file it came from
        (:func:`adaptive_spec.core.errors.invalid_value`)."""
        e = invalid_value(self.name, self.raw, allowed, fix=fix, why=why)
        return ConfigError(self.prefix() + str(e))


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
        Save the state after this many engine steps since the last save. Each save merges with the
        file: it adds this engine's learning since its previous save and takes in what other replicas
        sharing the file added since (:class:`~adaptive_spec.vllm.plugin.runtime.ServeRuntime`).
    save_every_s : float > 0
        ... or when this many seconds have passed since the last save (checked after each step): how
        often, at most, replicas sharing a state file learn from each other while busy.
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
    save_every_s: float = 10.0
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
        return o.invalid(err.allowed or _allowed(name), fix=o.fix(name), why=err.why)

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


def debug_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ADAPTIVE_SPEC_DEBUG`` is 1/true/yes/on (a configuration error then raises, with its
    traceback, instead of stopping the process with one line)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_DEBUG, "").strip().lower() in _TRUE


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
            raise origin.invalid(_allowed(name), fix=origin.fix(name)) from None
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


#: Executors whose model runners adaptive-spec can reach: in the engine-core process (``uni``), or on
#: every rank through ``collective_rpc`` (``mp``, ``ray``; :mod:`adaptive_spec.vllm.workers`).
EXECUTORS = ("uni", "mp", "ray")


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
        No speculative decoding, an unsupported method, an executor outside :data:`EXECUTORS`,
        ``lora:<adapter>`` proposers under a multiprocess executor, async scheduling, ``draft`` without a draft model, or a policy whose k exceeds
        ``num_speculative_tokens``; one line naming the flag or variable and the fix.
    """
    from adaptive_spec.core.policies import make_policy
    from adaptive_spec.vllm.checks import DRAFT_METHODS, ENGINE_METHODS

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
        raise config.origin("proposers").invalid(
            f"proposers without 'draft' with method {spec.method!r}",
            why=f"proposer 'draft' needs a draft-model engine (speculative method in "
            f"{', '.join(DRAFT_METHODS)}); this one uses {spec.method!r}",
            fix="remove 'draft' or serve with a draft model in --speculative-config",
        )
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend not in EXECUTORS:
        raise invalid_value(
            "--distributed-executor-backend",
            backend,
            ", ".join(EXECUTORS),
            why="adaptive-spec installs its runner side on the workers with collective_rpc",
            fix="pass --distributed-executor-backend mp (or uni for one device)",
        )
    lora = [p for p in config.proposers if p.startswith("lora:")]
    if lora and backend != "uni":
        raise config.origin("proposers").invalid(
            "proposers without lora:<adapter> under a multiprocess executor",
            why=f"{lora[0]} needs the drafter in the engine-core process; this engine runs its "
            f"model runner in worker processes ({backend!r})",
            fix="drop the lora proposers, or serve with --distributed-executor-backend uni (CPU: "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 as well)",
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
        raise config.origin("policy").invalid(
            f"a policy whose k are at most num_speculative_tokens={max_k}",
            why=policy_error_reason(e, config.policy),
            fix=f"use k <= {max_k}, or raise num_speculative_tokens in --speculative-config",
        ) from None
