"""Kernels of adaptive-spec: each a PyTorch reference plus a Triton kernel, behind a dispatcher.

* :func:`verify`: rejection-sampling verification of draft tokens, greedy and stochastic
  (Leviathan et al. 2023; Chen et al. 2023), batched and flattened like vLLM V1.
* :func:`ngram_match`: batched prompt-lookup n-gram match with bounded work per request.
* :func:`jacobi_step`, :func:`lookahead_ngrams`, :func:`lookahead_pool_update`,
  :func:`lookahead_pool_lookup`: Jacobi decoding (Santilli et al. 2023) and the n-gram pool of
  lookahead decoding (Fu et al. 2024).
* :func:`lora_bgmv`: batched multi-LoRA, Punica's BGMV (Chen et al. 2023).

Dispatch (``backend="auto"``): Triton for CUDA tensors when ``import triton`` works, else the
PyTorch reference. This package imports only torch; Triton is imported lazily, so it imports on
machines without (or with a broken) Triton. ``python -m adaptive_spec.kernels.bench`` times
them.
"""

from ._common import triton_status
from .jacobi import (
    JacobiStep,
    jacobi_step,
    jacobi_step_reference,
    lookahead_ngrams,
    lookahead_ngrams_reference,
    lookahead_pool_lookup,
    lookahead_pool_update,
    lookahead_pool_update_reference,
)
from .lora import lora_bgmv, lora_reference
from .ngram import NgramMatch, check_ngram_config, ngram_match, ngram_match_reference
from .philox import accept_uniforms, philox4x32, sample_noise
from .rejection import VerifyOutput, flatten_drafts, verify, verify_reference

__all__ = [
    "JacobiStep",
    "NgramMatch",
    "VerifyOutput",
    "accept_uniforms",
    "check_ngram_config",
    "flatten_drafts",
    "jacobi_step",
    "jacobi_step_reference",
    "lookahead_ngrams",
    "lookahead_ngrams_reference",
    "lookahead_pool_lookup",
    "lookahead_pool_update",
    "lookahead_pool_update_reference",
    "lora_bgmv",
    "lora_reference",
    "ngram_match",
    "ngram_match_reference",
    "philox4x32",
    "sample_noise",
    "triton_status",
    "verify",
    "verify_reference",
]
