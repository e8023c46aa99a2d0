"""``AdaptiveSpec(llm)`` when the ``LLM``'s engine core runs in a child process (vLLM's default).

With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default) ``vllm.LLM`` talks to an engine core in a
child process through a ``SyncMPClient``. The controller has to live with the scheduler, in that
process. vLLM loads its general plugins there (``EngineCore.__init__``), and adaptive-spec's plugin
(:func:`adaptive_spec.vllm.plugin.register`) adds one method to vLLM's ``EngineCore`` class,
:data:`UTILITY_METHOD` (:mod:`adaptive_spec.vllm.core_utility`), whatever the ``ADAPTIVE_SPEC`` switch says. The front
end calls it with vLLM's own utility calls (``call_utility``, answered by the engine core's busy loop
between steps):

* ``attach``: builds :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` on the engine core there, with
  the constructor's arguments (cloudpickled: ``category_of`` and policy objects travel too);
* ``stats``, ``faults``, ``save_state``, ``detach``: the same methods, run there.

:class:`RemoteAdaptiveSpec` is what ``AdaptiveSpec(llm)`` returns for such an ``LLM``: the same public
methods (:meth:`~RemoteAdaptiveSpec.stats`, :meth:`~RemoteAdaptiveSpec.detach`,
:meth:`~RemoteAdaptiveSpec.save_state`, the context manager, ``faults``), the same errors (re-raised
here with their type), and the trace and policy-state files written by the engine-core process at the
paths given (made absolute here). Replies are JSON text (vLLM's msgpack channel carries no arbitrary
objects). Importing this module is cheap (the plugin imports it in every vLLM process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The ``EngineCore`` method the plugin adds, called by name through vLLM's utility calls.
UTILITY_METHOD = "adaptive_spec_call"
#: Attribute of the front end's engine-core client holding its :class:`RemoteAdaptiveSpec`.
_CLIENT_ATTR = "_adaptive_spec_remote"


# -- front end ----------------------------------------------------------------------------------
def _error(kind: str, message: str) -> Exception:
    """The exception the engine core raised, rebuilt here with its type where adaptive-spec knows it."""
    from adaptive_spec.core.errors import ConfigError
    from adaptive_spec.core.state import StatePathError, StateSaveError
    from adaptive_spec.vllm.checks import AttachError

    known: dict[str, type[Exception]] = {
        "AttachError": AttachError,
        "StatePathError": StatePathError,
        "StateSaveError": StateSaveError,
        "ConfigError": ConfigError,
        "ValueError": ValueError,
        "TypeError": TypeError,
        "FileNotFoundError": FileNotFoundError,
        "PermissionError": PermissionError,
    }
    cls = known.get(kind)
    if cls is None:
        return RuntimeError(f"{kind} in the engine-core process: {message}")
    return cls(message)


def _absolute(value: Any) -> Any:
    """A path argument made absolute here (the engine core may not share this working directory)."""
    if isinstance(value, (str, os.PathLike)) and str(value) != "auto":
        return str(Path(value).expanduser().absolute())
    return value


class RemoteAdaptiveSpec:
    """An :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` living in the engine-core process of ``llm``,
    driven from the caller's process. Built by ``AdaptiveSpec(llm, ...)`` when ``llm``'s engine core
    runs in a child process; same parameters (see :class:`~adaptive_spec.vllm.attach.AdaptiveSpec`).

    What differs from the in-process object: the policy, driver and hooks stay in the engine core
    (``policy_name`` names the policy; ``stats()["controller"]`` reports its state), ``calibrate()`` is
    not offered (``calibrate=True`` at attach measures there), and ``lora:<name>`` proposers are
    refused when the executor runs the model runner in worker processes (vLLM's CPU default).

    Raises
    ------
    AttachError
        As the in-process constructor, and when the engine core does not answer
        :data:`UTILITY_METHOD` (adaptive-spec's vLLM plugin is not loaded there).
    ValueError, StatePathError
        As the in-process constructor (re-raised here with their message).
    """

    def __init__(
        self,
        llm: Any,
        proposers: Any = ("none", "ngram", "jacobi"),
        policy: Any = "adaptive",
        **kwargs: Any,
    ) -> None:
        from adaptive_spec.vllm.checks import (
            AttachError,
            check_args,
            check_vllm_version,
            remote_engine_client,
        )

        check_vllm_version()
        check_args(
            proposers,
            policy,
            kwargs.get("seed", 0),
            kwargs.get("ngram_min", 2),
            kwargs.get("ngram_max", 4),
            kwargs.get("trace"),
            kwargs.get("policy_state", "auto"),
            kwargs.get("category_of"),
            kwargs.get("lora_adapters"),
        )
        client = remote_engine_client(llm)
        if client is None:
            raise AttachError(
                "RemoteAdaptiveSpec needs a vllm.LLM whose engine core is a child process"
            )
        self.llm = llm
        self.client = client
        self._attached = False
        self._final_stats: dict[str, Any] = {}
        self._final_faults = 0
        for name in ("trace", "policy_state"):
            if kwargs.get(name) is not None:
                kwargs[name] = _absolute(kwargs[name])
        import cloudpickle

        payload = cloudpickle.dumps({"proposers": list(proposers), "policy": policy, **kwargs})
        info = self._call("attach", payload)
        self._attached = True
        self.proposer_names: list[str] = list(info["proposers"])
        self.policy_name: str = info["policy"]
        self.max_k: int = int(info["max_k"])
        self.engine_method: str = info["engine_method"]
        self.cost_table_source: Any = info["cost_table_source"]
        path = info["policy_state_path"]
        self.policy_state_path: Path | None = Path(path) if path else None
        self.state_loaded: bool = bool(info["state_loaded"])
        self.prior_applied: bool = bool(info["prior_applied"])
        self.worker_ranks: int = int(info["worker_ranks"])
        setattr(client, _CLIENT_ATTR, self)

    def _call(self, op: str, payload: bytes = b"") -> Any:
        from adaptive_spec.vllm.checks import AttachError

        try:
            raw = self.client.call_utility(UTILITY_METHOD, op, payload)
        except Exception as e:
            if UTILITY_METHOD in str(e):
                raise AttachError(
                    "the engine-core process does not answer adaptive-spec's utility call: "
                    "adaptive-spec's vLLM plugin is not loaded there; fix: install adaptive-spec "
                    "in the environment vLLM runs in (entry point vllm.general_plugins), do not "
                    "leave it out of VLLM_PLUGINS, or build the LLM with "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=0"
                ) from None
            raise
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise _error(str(reply.get("type")), str(reply.get("message")))
        return reply.get("value")

    # -- the public methods of AdaptiveSpec ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """As :meth:`AdaptiveSpec.stats <adaptive_spec.vllm.attach.AdaptiveSpec.stats>`, computed in the
        engine core (JSON types: tuple keys and NumPy values come back as text and numbers)."""
        if not self._attached:
            return dict(self._final_stats)
        return dict(self._call("stats"))

    @property
    def faults(self) -> int:
        """Controller faults so far (each fell back to the engine's own behaviour for its step)."""
        return int(self._call("faults")["faults"]) if self._attached else self._final_faults

    @property
    def last_fault(self) -> str | None:
        return self._call("faults")["last_fault"] if self._attached else None

    def save_state(self, path: str | Path | None = None) -> Path | None:
        """Write the policy's learned state (in the engine-core process) to ``path``, by default
        ``policy_state``; returns the path written, or None without one.

        Raises
        ------
        StateSaveError
            When it cannot be written; the file already there, if any, is left as it was.
        """
        arg = json.dumps(_absolute(path) if path is not None else None).encode("utf-8")
        written = self._call("save_state", arg)
        return Path(written) if written else None

    def detach(self) -> None:
        """Remove the controller from the engine core (the engine is plain vLLM again), save the policy
        state and close the trace there. Idempotent; raises ``StateSaveError`` as the in-process one."""
        if not self._attached:
            return
        with contextlib.suppress(Exception):
            self._final_stats = self._call("stats")
            self._final_faults = int(self._final_stats.get("faults", 0) or 0)
        self._attached = False
        with contextlib.suppress(AttributeError):
            delattr(self.client, _CLIENT_ATTR)
        self._call("detach")

    def __enter__(self) -> RemoteAdaptiveSpec:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        from adaptive_spec.core.state import StateSaveError

        try:
            self.detach()
        except StateSaveError as e:
            if exc_type is None:
                raise
            logger.error("adaptive-spec: %s", e)

    @staticmethod
    def attached(llm: Any) -> RemoteAdaptiveSpec | None:
        """The RemoteAdaptiveSpec attached to ``llm`` from this process, or None."""
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        return getattr(client, _CLIENT_ATTR, None)
