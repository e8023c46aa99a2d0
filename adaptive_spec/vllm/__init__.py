"""vLLM integration: the only part of adaptive-spec that imports vLLM.

``AdaptiveSpec`` and ``AttachError`` are imported lazily: vLLM loads :mod:`adaptive_spec.vllm.plugin`
through its ``vllm.general_plugins`` entry point in every one of its processes, and that import must stay
cheap when adaptive speculation is switched off.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveSpec", "AttachError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from adaptive_spec.vllm import attach

        return getattr(attach, name)
    raise AttributeError(f"module 'adaptive_spec.vllm' has no attribute {name!r}")
