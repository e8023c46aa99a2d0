"""A process-wide switch around how vLLM loads a drafter, for changes made while the drafter loads.

Two changes to an engine's drafter must happen while vLLM loads it, before its warm-up compiles the
pass: bf16 products (:mod:`adaptive_spec.vllm.drafter_bf16`) and LoRA sites
(:mod:`adaptive_spec.vllm.lora_sites`). Each wraps one method of vLLM 0.32's
``SpecDecodeBaseProposer`` (the base of its EAGLE and draft-model proposers) once per process, and the
wrapper acts only while its :class:`DrafterLoadSwitch` is on: inside a :meth:`~DrafterLoadSwitch.scoped`
block (a caller building an engine in this process; nesting counted) or after
:meth:`~DrafterLoadSwitch.enable` (the serve plugin, in the engine-core process).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class DrafterLoadSwitch:
    """On inside :meth:`scoped` blocks or after :meth:`enable`; installs its wrapper on first use.

    Parameters
    ----------
    method : str
        The ``SpecDecodeBaseProposer`` method to wrap (``"_get_model"``, ``"load_model"``).
    make_wrapper : callable
        ``make_wrapper(original)`` returns the replacement method; it should call ``original``
        unchanged while :attr:`on` is False. The replacement gets ``__wrapped__ = original``.
    """

    def __init__(self, method: str, make_wrapper: Callable[[Callable[..., Any]], Any]) -> None:
        self.method = method
        self.make_wrapper = make_wrapper
        self._lock = threading.Lock()
        self._depth = 0
        self._always = False
        self._installed = False

    @property
    def on(self) -> bool:
        """Whether a drafter loaded now gets the change."""
        return self._depth > 0 or self._always

    def _install(self) -> None:
        # called with the lock held
        if self._installed:
            return
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        original = getattr(SpecDecodeBaseProposer, self.method)
        wrapper = self.make_wrapper(original)
        wrapper.__wrapped__ = original
        setattr(SpecDecodeBaseProposer, self.method, wrapper)
        self._installed = True

    @contextlib.contextmanager
    def scoped(self) -> Iterator[None]:
        """On for every drafter vLLM loads in this process inside the block."""
        with self._lock:
            self._install()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1

    def enable(self) -> None:
        """On for every drafter vLLM loads in this process from now on. Idempotent."""
        with self._lock:
            self._install()
            self._always = True
