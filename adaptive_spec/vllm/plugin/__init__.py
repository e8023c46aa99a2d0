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

Any of vLLM's ``uni``, ``mp`` (the CPU build's default, and tensor parallelism) and ``ray`` executors
works: under ``mp``/``ray`` the runner side runs on every rank (:mod:`adaptive_spec.vllm.workers`);
``lora:<adapter>`` proposers are refused there. Whatever the switch, :func:`register` adds the utility
method through which ``AdaptiveSpec(llm)`` attaches from a front end (:mod:`adaptive_spec.vllm.core_utility`).

Modules: :mod:`~adaptive_spec.vllm.plugin.config` (the ``ADAPTIVE_SPEC*`` settings and the check of
vLLM's configuration), :mod:`~adaptive_spec.vllm.plugin.runtime` (the controller in the engine-core
process: attaching, periodic state saves, metrics snapshots) and
:mod:`~adaptive_spec.vllm.plugin.registration` (:func:`register` and the vLLM functions it wraps).
Importing the package is cheap: none of them imports vLLM, NumPy or the controller at module level.
"""

from __future__ import annotations

from adaptive_spec.vllm.plugin.config import (
    ENV_CONFIG,
    ENV_DEBUG,
    ENV_FIELDS,
    ENV_METRICS_DIR,
    ENV_SWITCH,
    ServeConfig,
    check_vllm_config,
)
from adaptive_spec.vllm.plugin.registration import SHUTDOWN_GRACE_S, ensure_metrics_dir, register
from adaptive_spec.vllm.plugin.runtime import ServeRuntime

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
