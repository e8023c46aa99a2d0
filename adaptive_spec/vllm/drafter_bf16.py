"""The drafter's matrix products in bfloat16 inside a float32 engine.

vLLM builds the drafter (an EAGLE-3 head or a draft model) in the target's dtype. In a float32 engine
on the CPU a draft pass is bound by reading the drafter's weights: the shipped EAGLE-3 head holds 39 MB
of float32 linear weights (fused input projection, one decoder layer, an 8,192-row LM head), and the
target's forward, which runs just before, has flushed them from the cache. Where the CPU has native
bf16 dot products (AVX512-BF16 or AMX) the same products on bf16 copies of the weights read half the
bytes: on the 2-core AVX-512 (BF16) EPYC this project measures on, the head's draft passes went from
4.5 ms to 3.2 ms per step at k = 2 (median of 3 interleaved engine runs each), with acceptance by
position within 0.5 points.

Only the drafter's linear layers change: their weights become bf16 oneDNN operands, the activations
stay float32 (cast to bf16 at each product's input, back to float32 at its output), and attention,
norms, the KV cache and the embedding are untouched. Drafts may differ from the float32 drafter's on
near-ties; the target verifies every draft as before, so the output is unchanged (greedy identity and
the target's distribution at temperature > 0 do not depend on how the drafts were made).

How: vLLM 0.32 prepares every CPU linear layer once, after loading, in
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (which builds a oneDNN handle and sets
``layer.cpu_linear``). While a drafter loads (``SpecDecodeBaseProposer._get_model``, called from its
``load_model`` before the engine's warm-up compiles the drafter), that function is wrapped: for a layer
with float32 weights it builds the handle from a bf16 copy and wraps ``cpu_linear`` with the casts. The
target, loaded earlier, is never touched, and neither is an embedding table (only an LM head, whose
weights may be tied to the embedding: the copy leaves the tied tensor as it was).

Used by :func:`adaptive_spec.vllm.engine.build_llm` (``drafter_bf16``; by default where the engine is
float32 and the CPU has native bf16) and by the serve plugin (:func:`enable_bf16_drafter`).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from adaptive_spec.vllm.drafter_load import DrafterLoadSwitch

logger = logging.getLogger(__name__)

#: Set on each drafter layer whose products run in bf16 (True).
MARK = "_adaptive_spec_bf16"


def wants_bf16_drafter(engine_dtype: str, setting: bool | None = None) -> bool:
    """Whether a drafter of an engine in ``engine_dtype`` runs its products in bf16.

    ``setting``: True or False decides; None (the default) means yes for a float32 engine on a CPU with
    native bf16 dot products (:func:`adaptive_spec.core.machine.native_bf16`), no otherwise (a bf16
    engine's drafter is bf16 already; without native bf16, PyTorch emulates it, slower than float32).

    Raises
    ------
    ValueError
        For a ``setting`` that is not True, False or None.
    """
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(
            f"drafter_bf16={setting!r} is invalid; allowed: True, False or None (auto)"
        )
    if setting is not None:
        return setting
    from adaptive_spec.core.machine import native_bf16

    return engine_dtype == "float32" and native_bf16()


def convert_layer(
    layer: torch.nn.Module, remove_weight: bool, dispatch: Callable[[Any, bool], None]
) -> bool:
    """Give ``layer`` a bf16 product: ``dispatch`` (vLLM's ``dispatch_cpu_unquantized_gemm``) prepares a
    bf16 copy of its [N, K] float32 weight, and ``layer.cpu_linear(x, weight, bias)`` casts ``x``
    ([T, K] float32) to bf16 and the result ([T, N]) back to ``x``'s dtype. With ``remove_weight`` the
    layer's weight becomes an empty float32 tensor (as vLLM frees it), so code that reads the layer's
    dtype still sees the activations' dtype. Returns False, leaving the layer alone, for weights that are
    not 2-D float32 on the CPU and for layers with a bias."""
    w = getattr(layer, "weight", None)
    if getattr(layer, "bias", None) is not None or not (
        isinstance(w, torch.Tensor)
        and w.dtype == torch.float32
        and w.ndim == 2
        and w.device.type == "cpu"
        and not w.is_meta
    ):
        return False
    proxy = types.SimpleNamespace(weight=w.detach().to(torch.bfloat16), bias=None)
    dispatch(proxy, True)
    linear = proxy.cpu_linear

    def cpu_linear(x: torch.Tensor, weight: Any, bias: Any, _linear: Any = linear) -> torch.Tensor:
        return _linear(x.to(torch.bfloat16), weight, bias).to(x.dtype)

    layer.cpu_linear = cpu_linear
    if remove_weight:
        layer.weight = torch.nn.Parameter(
            torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False
        )
    setattr(layer, MARK, True)
    return True


def _wrapped_dispatch(original: Callable[[Any, bool], None]) -> Callable[[Any, bool], None]:
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    def dispatch(layer: Any, remove_weight: bool) -> None:
        # An embedding table is read by index, not multiplied: only an LM head is converted.
        table = isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
        if table or not convert_layer(layer, remove_weight, original):
            original(layer, remove_weight)

    return dispatch


def _load_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SpecDecodeBaseProposer._get_model`` with vLLM's CPU GEMM dispatch wrapped while the switch is on."""
    import vllm.model_executor.layers.utils as layer_utils

    def _get_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _switch.on:
            return original(self, *args, **kwargs)
        plain = layer_utils.dispatch_cpu_unquantized_gemm
        layer_utils.dispatch_cpu_unquantized_gemm = _wrapped_dispatch(plain)
        try:
            model = original(self, *args, **kwargs)
        finally:
            layer_utils.dispatch_cpu_unquantized_gemm = plain
        logger.info(
            "the drafter's %d linear layer(s) run their products in bf16", bf16_layers(model)
        )
        return model

    return _get_model


_switch = DrafterLoadSwitch("_get_model", _load_hook)


@contextlib.contextmanager
def bf16_drafter() -> Iterator[None]:
    """Give bf16 products to every drafter vLLM loads in this process inside the block (build the engine
    in it: the engine core must run in this process)."""
    with _switch.scoped():
        yield


def enable_bf16_drafter() -> None:
    """Give bf16 products to every float32 drafter vLLM loads in this process from now on (the serve
    plugin calls it in the engine-core process). Idempotent."""
    _switch.enable()


def bf16_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s layers run their products in bf16 (0 for a drafter loaded without)."""
    return sum(bool(getattr(m, MARK, False)) for m in model.modules())
