"""The engine-core side of ``AdaptiveSpec(llm)`` for an ``LLM`` whose engine core runs in a child process.

vLLM loads its general plugins in the engine-core process (``EngineCore.__init__``); adaptive-spec's
plugin (:func:`adaptive_spec.vllm.plugin.register`) adds :func:`adaptive_spec_call` to vLLM's
``EngineCore`` class as :data:`~adaptive_spec.vllm.remote.UTILITY_METHOD` (:func:`install_utility`),
whatever the ``ADAPTIVE_SPEC`` switch says. The front end's
:class:`~adaptive_spec.vllm.remote.RemoteAdaptiveSpec` calls it through vLLM's utility calls, which the
engine core's busy loop answers between steps. Importing this module is cheap (no vLLM, no NumPy).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
from typing import Any

from adaptive_spec.vllm.remote import UTILITY_METHOD

logger = logging.getLogger(__name__)

_OPS = ("attach", "stats", "faults", "save_state", "detach")


def install_utility(engine_core_cls: Any) -> None:
    """Add :data:`UTILITY_METHOD` to vLLM's ``EngineCore`` class (idempotent)."""
    if getattr(engine_core_cls, UTILITY_METHOD, None) is not adaptive_spec_call:
        setattr(engine_core_cls, UTILITY_METHOD, adaptive_spec_call)


def _jsonable(v: Any) -> Any:
    """``json.dumps``'s fallback for NumPy numbers and arrays, paths and anything else (its text)."""
    import numpy as np

    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def adaptive_spec_call(core: Any, op: str, payload: bytes) -> str:
    """Engine-core process: run operation ``op`` (one of ``attach``, ``stats``, ``faults``,
    ``save_state``, ``detach``) on this engine core's AdaptiveSpec. ``payload``: the cloudpickled
    constructor arguments (``attach``) or a UTF-8 JSON document. Returns ``{"ok": true, "value": ...}``
    or ``{"ok": false, "type": <exception class>, "message": ...}`` as JSON text; never raises."""
    try:
        value = _run(core, op, payload)
        return json.dumps({"ok": True, "value": value}, default=_jsonable)
    except Exception as e:
        if op == "attach":
            logger.debug("adaptive-spec: attach failed in the engine core", exc_info=True)
        return json.dumps({"ok": False, "type": type(e).__name__, "message": str(e)})


def _run(core: Any, op: str, payload: bytes) -> Any:
    from adaptive_spec.vllm.attach import AdaptiveSpec

    if op == "attach":
        import cloudpickle

        args = cloudpickle.loads(payload)
        spec = AdaptiveSpec(core, args.pop("proposers"), args.pop("policy"), **args)
        atexit.register(_detach_at_exit, spec)
        return {
            "proposers": spec.proposer_names,
            "policy": spec.policy.name,
            "max_k": spec.max_k,
            "engine_method": spec.engine_method,
            "cost_table_source": spec.cost_table_source,
            "policy_state_path": str(spec.policy_state_path) if spec.policy_state_path else None,
            "state_loaded": spec.state_loaded,
            "prior_applied": spec.prior_applied,
            "worker_ranks": spec.workers.ranks if spec.workers is not None else 0,
        }
    spec = AdaptiveSpec.attached(core)
    if op not in _OPS:
        raise ValueError(f"op={op!r} is invalid; allowed: {', '.join(_OPS)}")
    if spec is None:
        if op == "detach":
            return None
        from adaptive_spec.vllm.checks import AttachError

        raise AttachError("no AdaptiveSpec is attached to this engine (detached already?)")
    if op == "stats":
        return spec.stats()
    if op == "faults":
        return {"faults": spec.faults, "last_fault": spec.last_fault}
    if op == "save_state":
        path = json.loads(payload.decode("utf-8")) if payload else None
        written = spec.save_state(path)
        return str(written) if written is not None else None
    with contextlib.suppress(Exception):
        atexit.unregister(_detach_at_exit)
    spec.detach()
    return None


def _detach_at_exit(spec: Any) -> None:
    """The engine-core process exits with the controller attached: save and close the trace."""
    try:
        spec.detach()
    except Exception as e:
        logger.warning("adaptive-spec: detach at exit failed: %s: %s", type(e).__name__, e)
