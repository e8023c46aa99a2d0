"""adaptive-spec: online choice of speculative-decoding proposer and k inside a vLLM engine.

``AdaptiveSpec`` is imported lazily so that ``import adaptive_spec`` (and the bandits, kernels and sim
sub-packages) work without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AdaptiveSpec", "AttachError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("AdaptiveSpec", "AttachError"):
        from adaptive_spec import vllm as _vllm

        return getattr(_vllm, name)
    raise AttributeError(f"module 'adaptive_spec' has no attribute {name!r}")
