"""vLLM integration: the only part of adaptive-spec that imports vLLM."""

from adaptive_spec.vllm.attach import AdaptiveSpec, AttachError

__all__ = ["AdaptiveSpec", "AttachError"]
