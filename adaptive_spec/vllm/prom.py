"""Prometheus metrics of adaptive speculation under ``vllm serve``.

The controller runs in vLLM's engine-core process; ``/metrics`` is served by the API-server process.
vLLM 0.32 carries engine-core statistics to the API server in ``SchedulerStats`` (msgpack, fixed
fields: an extra attribute is dropped on the way), so adaptive-spec uses its own small channel instead:

* engine core: a background thread writes a **snapshot** of the cumulative counters (JSON,
  ``engine-<index>.json``, replaced atomically by a rename) into a directory every
  ``metrics_interval_s`` seconds, and once more at shutdown (:func:`write_snapshot`);
* API server: :class:`SnapshotCollector`, registered in ``prometheus_client``'s default registry (the
  one vLLM's ``/metrics`` serves when there is one API server), reads the snapshots at scrape time and
  exposes them as the ``adaptive_spec_*`` series below, labelled with the engine index.

The directory is ``$ADAPTIVE_SPEC_METRICS_DIR``; the plugin creates a temporary one in the API server
and the engine core inherits it through the environment (see :mod:`adaptive_spec.vllm.plugin`).

Series (``engine`` label on all; counters are cumulative since the engine core started):

=================================================  =========  ================================================
name                                               type       meaning (unit)
=================================================  =========  ================================================
``adaptive_spec_info``                             gauge      1; labels policy, proposers, max_k, engine_method
``adaptive_spec_arm_choices_total``                counter    request-steps verified with arm (proposer, k);
                                                              ``proposer="none",k="0"`` is plain decoding
``adaptive_spec_drafted_tokens_total``             counter    draft tokens verified, by proposer (tokens)
``adaptive_spec_accepted_tokens_total``            counter    draft tokens accepted, by proposer (tokens)
``adaptive_spec_emitted_tokens_total``             counter    tokens committed, by proposer (tokens)
``adaptive_spec_estimated_acceptance``             gauge      controller's first-position acceptance estimate
                                                              for a neutral request, by proposer (0..1)
``adaptive_spec_step_time_seconds``                summary    engine step wall time, controller excluded (s)
``adaptive_spec_controller_time_seconds``          summary    controller time per step (s)
``adaptive_spec_controller_faults_total``          counter    controller exceptions (each falls back to the
                                                              engine's own drafts for that step)
``adaptive_spec_policy_learned_steps``             gauge      steps the policy has learned from, including
                                                              those of a loaded state
``adaptive_spec_state_loaded``                     gauge      1 if the policy state was loaded at start
``adaptive_spec_state_saves_total``                counter    policy-state files written
``adaptive_spec_state_save_failures_total``        counter    policy-state writes that failed
``adaptive_spec_state_last_save_timestamp_seconds``  gauge    Unix time of the last state write (s)
``adaptive_spec_snapshot_timestamp_seconds``       gauge      Unix time the engine wrote this snapshot (s)
=================================================  =========  ================================================

The summaries have ``_count`` (engine steps) and ``_sum`` (seconds); the mean step time over a window is
``rate(..._sum[1m]) / rate(..._count[1m])``. Acceptance rate by proposer:
``rate(adaptive_spec_accepted_tokens_total[1m]) / rate(adaptive_spec_drafted_tokens_total[1m])``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "adaptive-spec-metrics"
SNAPSHOT_VERSION = 1
PREFIX = "adaptive_spec_"


def metrics_snapshot(
    metrics: Any,
    *,
    engine: int,
    info: Mapping[str, Any],
    estimated_acceptance: Mapping[str, float] | None = None,
    policy_learned_steps: int | None = None,
    state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A JSON-serialisable snapshot of the counters, as :class:`SnapshotCollector` reads it.

    Safe to call from a thread other than the engine's: it copies each dictionary in one C-level
    operation (atomic under the GIL) and reads plain numbers; counters may lag the engine by one step.

    Parameters
    ----------
    metrics : adaptive_spec.core.metrics.SpecMetrics
        The controller's counters (``AdaptiveSpec.metrics``).
    engine : int
        vLLM's engine index (data-parallel rank), the ``engine`` label.
    info : mapping
        ``policy`` (str), ``proposers`` (list of str), ``max_k`` (int), ``engine_method`` (str).
    estimated_acceptance : mapping of str to float, optional
        Per proposer, in [0, 1].
    policy_learned_steps : int, optional
        Steps the policy has learned from (``AdaptiveController.n_steps``).
    state : mapping, optional
        ``loaded`` (bool), ``saves`` (int), ``save_failures`` (int), ``last_save_time`` (Unix s or None).

    Returns
    -------
    dict
        ``{"format", "version", "engine", "time", "pid", "info", "steps", "step_time_s",
        "controller_time_s", "faults", "arms": {arm: request-steps}, "proposers": {proposer: {"drafted",
        "accepted", "emitted", "request_steps"}}, "estimated_acceptance", "policy_learned_steps", "state"}``.
    """
    if not isinstance(engine, int) or engine < 0:
        raise ValueError(f"engine={engine!r} is invalid; allowed: an integer >= 0")
    arms = {str(a): int(s.request_steps) for a, s in list(metrics.by_arm.items())}
    proposers = {
        str(p): {
            "drafted": int(s.drafted),
            "accepted": int(s.accepted),
            "emitted": int(s.emitted),
            "request_steps": int(s.request_steps),
        }
        for p, s in list(metrics.by_proposer.items())
    }
    st = state or {}
    return {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "engine": engine,
        "time": time.time(),
        "pid": os.getpid(),
        "info": {
            "policy": str(info.get("policy", "")),
            "proposers": [str(p) for p in info.get("proposers", [])],
            "max_k": int(info.get("max_k", 0)),
            "engine_method": str(info.get("engine_method", "")),
        },
        "steps": int(metrics.steps),
        "step_time_s": float(metrics.step_time_s),
        "controller_time_s": float(metrics.controller_time_s),
        "faults": int(metrics.faults),
        "arms": arms,
        "proposers": proposers,
        "estimated_acceptance": {str(k): float(v) for k, v in (estimated_acceptance or {}).items()},
        "policy_learned_steps": None if policy_learned_steps is None else int(policy_learned_steps),
        "state": {
            "loaded": bool(st.get("loaded", False)),
            "saves": int(st.get("saves", 0)),
            "save_failures": int(st.get("save_failures", 0)),
            "last_save_time": st.get("last_save_time"),
        },
    }


def snapshot_path(directory: str | Path, engine: int) -> Path:
    """Where engine ``engine`` writes its snapshot in ``directory``."""
    return Path(directory) / f"engine-{int(engine)}.json"


def write_snapshot(snapshot: Mapping[str, Any], directory: str | Path) -> Path:
    """Write ``snapshot`` to ``directory/engine-<engine>.json`` atomically (temporary file + rename:
    a reader never sees half a file). No fsync: metrics need not survive a crash.

    Raises
    ------
    OSError
        When the directory cannot be written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = snapshot_path(directory, int(snapshot["engine"]))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(snapshot, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_snapshots(directory: str | Path) -> list[dict[str, Any]]:
    """All valid snapshots in ``directory``, by engine index. Unreadable or foreign files are skipped
    (logged at debug level); a missing directory gives ``[]``."""
    out = []
    try:
        paths = sorted(Path(directory).glob("engine-*.json"))
    except OSError:
        return []
    for p in paths:
        try:
            snap = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            logger.debug("adaptive-spec metrics snapshot %s skipped: %s", p, e)
            continue
        if (
            isinstance(snap, dict)
            and snap.get("format") == SNAPSHOT_FORMAT
            and snap.get("version") == SNAPSHOT_VERSION
        ):
            out.append(snap)
    out.sort(key=lambda s: int(s.get("engine", 0)))
    return out


#: The metric families, in the order they are exposed: short name -> (type, name without the prefix,
#: help text, labels).
_FAMILIES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "info": (
        "gauge",
        "info",
        "Adaptive speculation configuration (value 1).",
        ("engine", "policy", "proposers", "max_k", "engine_method"),
    ),
    "arms": (
        "counter",
        "arm_choices",
        "Request-steps verified with each arm (proposer, k); proposer none, k 0 is plain decoding.",
        ("engine", "proposer", "k"),
    ),
    "drafted": (
        "counter",
        "drafted_tokens",
        "Draft tokens verified, by proposer.",
        ("engine", "proposer"),
    ),
    "accepted": (
        "counter",
        "accepted_tokens",
        "Draft tokens accepted by verification, by proposer.",
        ("engine", "proposer"),
    ),
    "emitted": (
        "counter",
        "emitted_tokens",
        "Tokens committed (after EOS/stop/length truncation), by the proposer of the step.",
        ("engine", "proposer"),
    ),
    "est": (
        "gauge",
        "estimated_acceptance",
        "Controller's estimated first-position acceptance probability for a neutral request (0..1).",
        ("engine", "proposer"),
    ),
    "step": (
        "summary",
        "step_time_seconds",
        "Engine step wall time excluding the controller (seconds).",
        ("engine",),
    ),
    "ctrl": (
        "summary",
        "controller_time_seconds",
        "Controller time per engine step (seconds).",
        ("engine",),
    ),
    "faults": (
        "counter",
        "controller_faults",
        "Controller exceptions; each step affected used the engine's own drafts.",
        ("engine",),
    ),
    "learned": (
        "gauge",
        "policy_learned_steps",
        "Engine steps the policy has learned from, including those of a loaded state.",
        ("engine",),
    ),
    "loaded": (
        "gauge",
        "state_loaded",
        "1 if the policy state was loaded from the state file at start, else 0.",
        ("engine",),
    ),
    "saves": ("counter", "state_saves", "Policy-state files written.", ("engine",)),
    "save_failures": (
        "counter",
        "state_save_failures",
        "Policy-state writes that failed.",
        ("engine",),
    ),
    "last_save": (
        "gauge",
        "state_last_save_timestamp_seconds",
        "Unix time of the last policy-state write (seconds).",
        ("engine",),
    ),
    "snap_time": (
        "gauge",
        "snapshot_timestamp_seconds",
        "Unix time at which the engine core wrote the counters shown (seconds).",
        ("engine",),
    ),
}


def families(snapshots: list[Mapping[str, Any]]) -> Iterator[Any]:
    """Prometheus metric families (``prometheus_client.core`` objects) for ``snapshots``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

    kinds = {
        "counter": CounterMetricFamily,
        "gauge": GaugeMetricFamily,
        "summary": SummaryMetricFamily,
    }
    f = {
        key: kinds[kind](PREFIX + name, doc, labels=list(labels))
        for key, (kind, name, doc, labels) in _FAMILIES.items()
    }
    for s in snapshots:
        e = str(s["engine"])
        i = s.get("info", {})
        f["info"].add_metric(
            [
                e,
                str(i.get("policy", "")),
                ",".join(i.get("proposers", [])),
                str(i.get("max_k", "")),
                str(i.get("engine_method", "")),
            ],
            1.0,
        )
        for arm, n in sorted(s.get("arms", {}).items()):
            proposer, _, k = arm.rpartition(":")
            if not proposer:  # "none"
                proposer, k = arm, "0"
            f["arms"].add_metric([e, proposer, k], float(n))
        for p, c in sorted(s.get("proposers", {}).items()):
            for key in ("drafted", "accepted", "emitted"):
                f[key].add_metric([e, p], float(c.get(key, 0)))
        for p, v in sorted(s.get("estimated_acceptance", {}).items()):
            f["est"].add_metric([e, p], float(v))
        steps = float(s.get("steps", 0))
        for key, field in (("step", "step_time_s"), ("ctrl", "controller_time_s")):
            f[key].add_metric([e], count_value=steps, sum_value=float(s.get(field, 0.0)))
        f["faults"].add_metric([e], float(s.get("faults", 0)))
        if s.get("policy_learned_steps") is not None:
            f["learned"].add_metric([e], float(s["policy_learned_steps"]))
        st = s.get("state", {})
        f["loaded"].add_metric([e], 1.0 if st.get("loaded") else 0.0)
        f["saves"].add_metric([e], float(st.get("saves", 0)))
        f["save_failures"].add_metric([e], float(st.get("save_failures", 0)))
        if st.get("last_save_time") is not None:
            f["last_save"].add_metric([e], float(st["last_save_time"]))
        f["snap_time"].add_metric([e], float(s.get("time", 0.0)))
    yield from f.values()


class SnapshotCollector:
    """A ``prometheus_client`` custom collector exposing the engine cores' snapshots in ``directory``.

    Parameters
    ----------
    directory : path
        Where the engine cores write ``engine-<index>.json`` (:func:`write_snapshot`).

    Notes
    -----
    ``collect`` reads a few small files per scrape and never raises: a scrape while no snapshot exists
    yet gives the families with no samples.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def describe(self) -> list[Any]:
        # Registering must not read the directory (prometheus_client calls collect() otherwise).
        return []

    def collect(self) -> Iterator[Any]:
        try:
            snaps = read_snapshots(self.directory)
            fams = list(families(snaps))
        except Exception as e:  # a scrape never fails because of adaptive-spec
            logger.warning("adaptive-spec metrics collection failed: %s: %s", type(e).__name__, e)
            return
        yield from fams


_registered: dict[tuple[int, str], SnapshotCollector] = {}
_lock = threading.Lock()


def register_collector(directory: str | Path, registry: Any = None) -> SnapshotCollector:
    """Register a :class:`SnapshotCollector` for ``directory`` in ``registry`` (default: the
    ``prometheus_client`` default registry, which vLLM's ``/metrics`` serves). Idempotent: a second call
    for the same directory and registry returns the first collector."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    key = (id(registry), str(Path(directory).resolve()))
    with _lock:
        col = _registered.get(key)
        if col is None:
            col = SnapshotCollector(directory)
            registry.register(col)
            _registered[key] = col
    return col
