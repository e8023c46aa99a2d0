"""Registration of the ``vllm serve`` plugin: :func:`register`, run by vLLM in each of its processes.

vLLM calls :func:`register` through its ``vllm.general_plugins`` entry point
(``adaptive_spec.vllm.plugin:register``). Without the switch it returns at once and changes nothing;
importing this module stays cheap (no vLLM, no NumPy, no controller). With the switch it validates the
configuration (stopping the process with one line and exit status 2 on an error), forwards
adaptive-spec's log lines to vLLM's handlers, registers the metrics collector in the API server, and
wraps three vLLM functions, each once per process:

* ``EngineArgs.create_engine_config``: :func:`~adaptive_spec.vllm.plugin.config.check_vllm_config` on
  the configuration vLLM built;
* ``EngineCoreProc.run_busy_loop`` (and ``DPEngineCoreProc``'s): a
  :class:`~adaptive_spec.vllm.plugin.runtime.ServeRuntime` around the engine core's busy loop;
* ``get_engine_process_shutdown_timeout``: time for the final state save under vLLM's default
  ``--shutdown-timeout 0`` (:func:`_patch_shutdown_grace`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptive_spec.core.errors import ConfigError
from adaptive_spec.vllm.plugin.config import (
    ENV_METRICS_DIR,
    ServeConfig,
    check_vllm_config,
    debug_enabled,
)
from adaptive_spec.vllm.plugin.runtime import ServeRuntime

logger = logging.getLogger(__name__)

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


def _refuse(err: ConfigError) -> None:
    """Stop the process on a configuration error: one line on stderr and exit status 2 (with the
    traceback too when ``ADAPTIVE_SPEC_DEBUG`` is on)."""
    if debug_enabled():
        raise err
    print(f"adaptive-spec: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(2)


#: Marks a vLLM function wrapped by this plugin (a second registration leaves it alone).
_WRAPPED = "_adaptive_spec_wrapped"


def _wrap_once(owner: Any, name: str, wrap: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace function ``name`` of ``owner`` (a class or a module) by ``wrap(original)``, unless it is
    one of this plugin's wrappers already."""
    orig = getattr(owner, name)
    if getattr(orig, _WRAPPED, False):
        return
    wrapper = functools.wraps(orig)(wrap(orig))
    setattr(wrapper, _WRAPPED, True)
    setattr(owner, name, wrapper)


def _patch_engine_args(config: ServeConfig) -> None:
    """Check each vLLM configuration the API server builds (:func:`check_vllm_config`)."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(orig: Any) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = orig(self, *args, **kwargs)
            _forward_logs_to_vllm()  # vLLM's logging is set up by now (it may not be at register())
            try:
                check_vllm_config(vllm_config, config)
            except ConfigError as e:
                _refuse(e)
            _note_shutdown(vllm_config, config)
            return vllm_config

        return create_engine_config

    _wrap_once(EngineArgs, "create_engine_config", wrap)


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
    if getattr(engine_utils, "get_engine_process_shutdown_timeout", None) is None:
        return False

    def wrap(orig: Any) -> Callable[..., Any]:
        def get_engine_process_shutdown_timeout(
            request_timeout: float | None, process_timeout: float | None
        ) -> float | None:
            timeout = orig(request_timeout, process_timeout)
            if request_timeout == 0 and timeout == 0:
                return SHUTDOWN_GRACE_S
            return timeout

        return get_engine_process_shutdown_timeout

    _wrap_once(engine_utils, "get_engine_process_shutdown_timeout", wrap)
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
    """Run a :class:`ServeRuntime` around each engine core's busy loop."""
    from vllm.v1.engine import core as core_mod

    def wrap(orig: Any) -> Callable[..., Any]:
        def run_busy_loop(self: Any) -> Any:
            runtime = _start_runtime(self, config)
            try:
                return orig(self)
            finally:
                if runtime is not None:
                    runtime.close()

        return run_busy_loop

    for cls_name in ("EngineCoreProc", "DPEngineCoreProc"):
        cls = getattr(core_mod, cls_name, None)
        if cls is not None and "run_busy_loop" in vars(cls):
            _wrap_once(cls, "run_busy_loop", wrap)


_shutdown_grace_installed = False


def _install_utility() -> None:
    """Whatever the switch says: in a process where vLLM's engine core is loaded (the engine-core
    process, where ``EngineCore.__init__`` loads the plugins), add the utility method through which
    ``AdaptiveSpec(llm)`` attaches from the front end (:mod:`adaptive_spec.vllm.core_utility`). Imports
    nothing: a process without the engine core module gets nothing."""
    mod = sys.modules.get("vllm.v1.engine.core")
    cls = getattr(mod, "EngineCore", None)
    if cls is not None:
        from adaptive_spec.vllm.core_utility import install_utility

        install_utility(cls)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point. Cheap and idempotent; a no-op without the switch.

    An invalid configuration (a variable, the config file, or a state or trace path that cannot be
    written) stops the process here, while ``vllm serve`` parses its arguments, before the model
    loads: one line on stderr and exit status 2 (``ADAPTIVE_SPEC_DEBUG=1`` raises the
    :class:`ConfigError` instead, with its traceback).
    """
    global _registered, _shutdown_grace_installed
    _install_utility()
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
        from adaptive_spec.vllm.exit_report import install as quiet_exit

        quiet_exit()  # no Triton leak report under the server's last lines
        _forward_logs_to_vllm()
        directory = ensure_metrics_dir()
        from adaptive_spec.vllm.prom import register_collector

        register_collector(directory)
        _patch_engine_args(config)
        _patch_engine_core(config)
        if any(p.startswith("lora:") for p in config.proposers):
            from adaptive_spec.vllm.lora_sites import enable_lora_sites

            enable_lora_sites()  # the adapters run inside the drafter's compiled pass
        from adaptive_spec.core.arms import drafts_with_drafter

        if any(drafts_with_drafter(p) for p in config.proposers):
            from adaptive_spec.vllm.drafter_bf16 import enable_bf16_drafter, wants_bf16_drafter

            if wants_bf16_drafter("float32"):  # only a float32 drafter's layers are converted
                enable_bf16_drafter()  # half the bytes per draft pass, the same output
        _shutdown_grace_installed = _patch_shutdown_grace()
        logger.debug("adaptive-spec plugin registered (%s)", config.source)
