"""Attributes set on live vLLM objects (instances, never their classes), each restorable exactly.

AdaptiveSpec's hooks and the LoRA draft manager replace methods of one engine's scheduler, engine core,
rejection sampler and drafter by setting instance attributes that shadow the class's methods; undoing
them restores the instance's own attribute where it had one and deletes the shadow otherwise, so that
the engine is again plain vLLM (its class's methods, not wrappers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


class InstancePatches:
    """A stack of attribute assignments on objects, undone in reverse order by :meth:`restore`."""

    def __init__(self) -> None:
        # (object, attribute, whether the object had its own attribute, that attribute's value)
        self._saved: list[tuple[Any, str, bool, Any]] = []
        self._before: list[Callable[[], None]] = []

    def before_restore(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the next :meth:`restore`, before anything is undone (newest first)."""
        self._before.append(fn)

    def set(self, obj: Any, name: str, value: Any) -> Any:
        """Set ``obj.name = value``, remembering how to undo it; returns what ``obj.name`` was before
        (a bound method for a method of the class, None where there was no such attribute)."""
        own = vars(obj)
        self._saved.append((obj, name, name in own, own.get(name)))
        old = getattr(obj, name, None)
        setattr(obj, name, value)
        return old

    def restore(self) -> None:
        """Undo every assignment, newest first (an attribute deleted meanwhile stays deleted); then
        forget them. Idempotent. The :meth:`before_restore` callbacks run first; one that raises
        stops neither the others nor the undoing, and its exception is re-raised at the end."""
        err: BaseException | None = None
        for fn in reversed(self._before):
            try:
                fn()
            except BaseException as e:
                err = err or e
        self._before.clear()
        for obj, name, had, value in reversed(self._saved):
            if had:
                setattr(obj, name, value)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
        self._saved.clear()
        if err is not None:
            raise err
