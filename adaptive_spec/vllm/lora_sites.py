"""LoRA sites: the drafter's adapters inside the pass vLLM compiles.

vLLM 0.32 compiles the drafter's decoder stack once, when the engine warms up (``torch.compile``
through Dynamo, guards dropped). Forward hooks added to its layers after that are not in the graph,
so adapters attached to a running engine can only run in an eager pass (``do_not_compile``), which on
the CPU costs more than the adapters themselves.

A *site* is a forward hook put on each fused linear layer of the drafter (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` of every decoder layer) while vLLM loads it, before the warm-up
compiles it. Dynamo traces the hook, so every compiled drafter pass calls the custom operator
``torch.ops.adaptive_spec.lora_add_(y, x, site)`` after each of those layers. The compiler treats the
operator as opaque; at run time it hands ``y`` (the layer's output, [T, d_out], updated in place) and
``x`` (its input, [T, d_in]) to whatever is bound to the site: a
:class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager` binds its adapters when it attaches and unbinds
them when it detaches. An unbound site returns at once (one operator call per layer and pass).

Sites are added only to drafters loaded inside :func:`lora_sites` (what ``build_llm(lora_sites=True)``
uses) or after :func:`enable_lora_sites` (process-wide: the serve plugin). A site id is
``engine * 256 + layer * 4 + module``, where ``engine`` counts the drafters given sites in this process
(1 for the first), so the id baked into a compiled graph is the same in every process and vLLM's
compile cache stays valid.

vLLM internals it relies on: ``SpecDecodeBaseProposer.load_model`` (vLLM 0.32's V1 drafters load their
model there, before the engine's warm-up) and the Llama-style layers named in
:data:`~adaptive_spec.vllm.lora_draft.FUSED`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from adaptive_spec.vllm.drafter_load import DrafterLoadSwitch

logger = logging.getLogger(__name__)

#: The fused linear layers of a Llama-style decoder layer that carry sites, in site-id order.
SITE_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
#: Attribute of the drafter's decoder stack (``drafter.model.model``): {(layer, module): site id}.
SITES_ATTR = "_adaptive_spec_lora_sites"

# site id -> function(y, x) that adds the bound adapters' updates to y in place.
_bound: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {}
_lock = threading.Lock()
_engines = 0  # drafters given sites in this process


def _lora_add_(y: torch.Tensor, x: torch.Tensor, site: int) -> None:
    """Add the LoRA updates bound to ``site`` to ``y`` in place (nothing if none is bound).

    ``y``: the layer's output [T, d_out]; ``x``: its input [T, d_in]; same dtype and device.
    """
    fn = _bound.get(site)
    if fn is not None:
        fn(y, x)


def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, site: int) -> None:
    return None


# Defined with torch.library.Library rather than the custom_op decorator: a call costs about 2 us
# instead of 15-25 us (measured on 2 CPU cores), and the drafter pays it four times per layer and pass.
_lib = torch.library.Library("adaptive_spec", "DEF")
_lib.define("lora_add_(Tensor(a!) y, Tensor x, int site) -> ()")
_lib.impl("lora_add_", _lora_add_, "CompositeExplicitAutograd")
torch.library.register_fake("adaptive_spec::lora_add_", _lora_add_fake, lib=_lib)


def bind(site: int, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Route ``site``'s operator calls to ``fn(y, x)``.

    Raises
    ------
    ValueError
        If something else is bound to ``site`` (one manager per drafter).
    """
    with _lock:
        if site in _bound:
            raise ValueError(
                f"LoRA site {site} is already bound: detach the drafter's other LoraDraftManager first"
            )
        _bound[site] = fn


def unbind(site: int) -> None:
    """Leave ``site`` unbound (its operator call does nothing); idempotent."""
    with _lock:
        _bound.pop(site, None)


def sites_of(inner: Any) -> dict[tuple[int, str], int] | None:
    """The sites of a drafter's decoder stack (``drafter.model.model``), or None if it has none."""
    return getattr(inner, SITES_ATTR, None)


def submodule(obj: Any, dotted: str) -> Any:
    """``obj.a.b`` for ``dotted="a.b"``, or None where an attribute is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _site_hook(site: int) -> Callable[..., Any]:
    def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        y = output[0] if isinstance(output, tuple) else output
        torch.ops.adaptive_spec.lora_add_(y, inputs[0], site)
        return output

    return hook


def add_sites(model: Any) -> dict[tuple[int, str], int] | None:
    """Put a site on each fused linear layer of a loaded drafter model (``drafter.model``) and return
    them, or None (leaving the model as it is) if its ``model.layers`` are not Llama-style layers with
    :data:`SITE_MODULES`. Idempotent."""
    global _engines
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return None
    if sites_of(inner) is not None:
        return sites_of(inner)
    layers = list(layers)
    if not layers or any(submodule(layers[0], m) is None for m in SITE_MODULES):
        return None
    if len(layers) > 64:  # site ids hold layer * 4 + module below 256
        logger.warning(
            "no LoRA sites on a drafter of %d layers (at most 64): its adapters run in an eager pass",
            len(layers),
        )
        return None
    with _lock:
        _engines += 1
        engine = _engines
    sites: dict[tuple[int, str], int] = {}
    for i, layer in enumerate(layers):
        for j, name in enumerate(SITE_MODULES):
            site = engine * 256 + i * 4 + j
            submodule(layer, name).register_forward_hook(_site_hook(site))
            sites[i, name] = site
    setattr(inner, SITES_ATTR, sites)
    logger.info(
        "LoRA sites on the drafter's %d layer(s): adapters run inside its compiled pass",
        len(layers),
    )
    return sites


def _load_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SpecDecodeBaseProposer.load_model`` that adds sites to the loaded drafter while the switch is on."""

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if _switch.on:
            add_sites(self.model)
        return out

    return load_model


_switch = DrafterLoadSwitch("load_model", _load_hook)


@contextlib.contextmanager
def lora_sites() -> Iterator[None]:
    """Give sites to every drafter vLLM loads in this process inside the block (build the engine in it:
    the engine core must run in this process)."""
    with _switch.scoped():
        yield


def enable_lora_sites() -> None:
    """Give sites to every drafter vLLM loads in this process from now on (the serve plugin calls it
    in the engine-core process when ``lora:<name>`` proposers are configured). Idempotent."""
    _switch.enable()
