"""Multi-LoRA drafts: one drafter, a LoRA adapter per domain, chosen per request inside vLLM's drafter.

A LoRA adapter (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models") adds
``scale * (x @ A) @ B`` to the output of a linear layer ``y = x W^T``, with ``A`` [d_in, r],
``B`` [r, d_out] and ``scale = alpha / r``. :class:`LoraDraftManager` installs adapters on the decoder
layers of the drafter inside an in-process vLLM 0.32 engine built with
``speculative_config={"method": "eagle3" | "draft_model", ...}`` (an EAGLE-3 head's one decoder layer,
whose ``qkv_proj`` reads the 2 x hidden concatenation of token embedding and fused state, or a draft
model's layers), after each of the draft's fused linear layers (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``). Requests of one batch may each use a different adapter, or none, in the
same drafter pass; the target model is untouched, so verification, and thus the output, is the same
whatever the adapters (greedy identity).

Where the update runs:

* **inside the compiled pass** when the engine was built with LoRA sites
  (``build_llm(lora_sites=True)``, :mod:`adaptive_spec.vllm.lora_sites`): the manager binds its adapters
  to the sites, custom operators vLLM compiled into the drafter's graph;
* otherwise through forward hooks the manager adds, and a pass in which some request uses an adapter
  runs the draft eagerly (vLLM's ``do_not_compile``), since the compiled graph would skip the hooks.

How it is computed: requests' tokens are contiguous in a drafter pass, so on the CPU each run of tokens
that share an adapter gets two dense products, ``y[s:e] += scale * (x[s:e] @ A) @ B`` (Punica's SGMV
form, Chen et al., MLSys 2024); elsewhere the per-token batched kernel
:func:`adaptive_spec.kernels.lora_bgmv` (Punica's BGMV; Triton on a GPU).

Fused layers are handled exactly: for ``qkv_proj`` the adapter's ``A_q, A_k, A_v`` are concatenated
along the rank and ``B_q, B_k, B_v`` placed block-diagonally, so ``x @ [A_q A_k A_v] @ blockdiag(B)``
is ``[x A_q B_q, x A_k B_k, x A_v B_v]`` (the zero blocks add exact zeros); likewise ``gate_up_proj``.
Adapters of rank below the manager's ``max_rank`` are zero-padded, which changes no value either.

Adapters and their on-disk format: :mod:`adaptive_spec.vllm.lora_adapter` (its names are importable
from here too). ``adaptive-spec distill --lora NAME`` trains them.

vLLM runs the drafter once per engine step, with one adapter per request: the drafts a request gets at
step t were made with the adapter set for it before step t ran (see :meth:`LoraDraftManager.
adapter_of_last_drafts`), and a change made with :meth:`LoraDraftManager.set_request_adapter` applies
from the next drafter pass. The draft's KV cache of a request keeps entries computed under the adapters
it had before; that only affects later drafts, never the output.

vLLM internals it relies on (vLLM 0.32's V1 engine; :class:`LoraDraftManager` checks that the installed
vLLM is :data:`~adaptive_spec.vllm.checks.SUPPORTED_VLLM` and refuses any other version with
:class:`~adaptive_spec.vllm.checks.AttachError`):

* the path to the model runner, ``EngineCore.model_executor.driver_worker.worker.model_runner``
  (single-process executor), and the runner's ``input_batch.req_ids`` (the batch's request order);
* the runner's ``drafter``, a ``DraftModelProposer`` or ``EagleProposer`` whose ``model.model.layers`` are Llama-style
  decoder layers with the fused linear layers ``self_attn.qkv_proj``, ``self_attn.o_proj``,
  ``mlp.gate_up_proj`` and ``mlp.down_proj`` (their ``input_size``, ``output_size``,
  ``output_sizes`` and ``weight``), and the ``do_not_compile`` flag of ``model.model`` (vLLM's switch
  between the compiled graph and eager execution);
* the drafter's ``propose`` (one call per engine step, the first drafter pass of which makes the
  step's drafts) and ``build_per_group_and_layer_attn_metadata``, whose common attention metadata
  gives the pass's ``num_reqs`` and ``query_start_loc_cpu`` (tokens per request, in the order of the
  pass's tokens).

Every change is made on instances (site bindings or forward hooks on the layers, attributes shadowing
the drafter's methods) and undone by :meth:`LoraDraftManager.detach`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from adaptive_spec.vllm import lora_sites
from adaptive_spec.vllm.checks import check_vllm_version
from adaptive_spec.vllm.lora_adapter import (
    ADAPTER_FILE,
    ADAPTER_FORMAT,
    ADAPTER_SPEC,
    LORA_MODULES,
    LoraAdapter,
    adapters_from_dirs,
    check_adapter_name,
    load_lora_adapter,
    lora_delta_reference,
    save_lora_adapter,
)
from adaptive_spec.vllm.patches import InstancePatches

logger = logging.getLogger(__name__)

__all__ = [
    "ADAPTER_FILE",
    "ADAPTER_FORMAT",
    "ADAPTER_SPEC",
    "FUSED",
    "LORA_MODULES",
    "LoraAdapter",
    "LoraDraftManager",
    "adapters_from_dirs",
    "check_adapter_name",
    "load_lora_adapter",
    "lora_delta_reference",
    "save_lora_adapter",
]

# vLLM's drafters whose model is a Llama-style stack of decoder layers: a draft model, an EAGLE-3 head.
DRAFTERS = ("DraftModelProposer", "EagleProposer")

# vLLM's fused Llama linear layers -> the Hugging Face modules they concatenate (output order).
FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


def _runner_of(engine: Any) -> Any:
    """The V1 model runner of an in-process ``vllm.LLM``, an ``EngineCore`` or a runner itself."""
    if hasattr(engine, "drafter") and hasattr(engine, "input_batch"):
        return engine
    core = engine
    if not hasattr(core, "model_executor"):
        try:
            core = engine.llm_engine.engine_core.engine_core
        except AttributeError:
            raise ValueError(
                f"engine={type(engine).__name__} is not an in-process vLLM engine: pass a vllm.LLM built "
                "with VLLM_ENABLE_V1_MULTIPROCESSING=0, its EngineCore, or its model runner"
            ) from None
    try:
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        raise ValueError(
            "cannot reach the model runner (model_executor.driver_worker.worker.model_runner): "
            "LoRA drafts need vLLM's single-process executor"
        ) from None


class LoraDraftManager:
    """Per-request LoRA adapters for the draft model of an in-process vLLM 0.32 engine.

    Parameters
    ----------
    engine : vllm.LLM or EngineCore or model runner
        Built with ``speculative_config={"method": "eagle3" | "draft_model", ...}`` and the engine
        core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    max_rank : int
        Largest adapter rank accepted; stacks are allocated for it (adapters of lower rank are
        zero-padded).
    max_adapters : int
        Adapter slots.
    backend : {"auto", "torch", "triton"}
        ``triton``: every pass through :func:`adaptive_spec.kernels.lora_bgmv`'s Triton kernel. Otherwise
        dense products per run of tokens sharing an adapter on the CPU, and ``lora_bgmv`` (``auto``)
        on other devices.

    Raises
    ------
    AttachError
        If the installed vLLM is not :data:`~adaptive_spec.vllm.checks.SUPPORTED_VLLM`.
    ValueError
        If the engine has no draft model, or its draft model is not a Llama-style stack of decoder
        layers with ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``; for bad parameters.

    Notes
    -----
    On an engine built with LoRA sites (``build_llm(lora_sites=True)``) the adapters run inside the
    drafter's compiled pass, which stays compiled whatever the adapters (:attr:`in_compiled_pass`). On
    any other engine a drafter pass in which some request uses an adapter runs the draft model eagerly
    (vLLM's ``do_not_compile`` flag on the draft's decoder stack), since a graph compiled before the
    hooks existed would skip them; a pass in which no request uses one runs the compiled graph.
    Measured on the shipped head (2 CPU cores, float32, batch 4, k = 4, ``scripts/head_in_vllm.py``):
    an adapted pass took 1.11-1.13x a plain one inside the compiled pass, 1.53-1.61x eagerly.
    :attr:`last_pass_adapters` says whether the last pass applied one. :meth:`detach` restores
    everything.

    Examples
    --------
    >>> mgr = LoraDraftManager(llm)                             # doctest: +SKIP
    >>> mgr.register("code", "adaptive_spec/data/drafts/.../adapters/code")  # doctest: +SKIP
    >>> mgr.set_request_adapter(request_id, "code")            # doctest: +SKIP
    """

    def __init__(
        self, engine: Any, *, max_rank: int = 16, max_adapters: int = 8, backend: str = "auto"
    ) -> None:
        if not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_rank={max_rank!r} is invalid; allowed: an integer >= 1")
        if not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"max_adapters={max_adapters!r} is invalid; allowed: an integer >= 1")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend={backend!r} is invalid; allowed: auto, torch, triton")
        check_vllm_version()
        runner = _runner_of(engine)
        drafter = getattr(runner, "drafter", None)
        if drafter is None or type(drafter).__name__ not in DRAFTERS:
            raise ValueError(
                "the engine has no draft model: build it with speculative_config={'method': "
                "'eagle3' or 'draft_model', 'model': <drafter dir>, ...} (got drafter "
                f"{type(drafter).__name__ if drafter is not None else None})"
            )
        self.runner = runner
        self.drafter = drafter
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self.backend = backend
        model = drafter.model
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise ValueError(
                f"the draft model {type(model).__name__} has no model.layers: not a Llama-style stack"
            )
        self._inner = inner
        # An engine that runs the draft eagerly anyway (enforce_eager) stays eager.
        self._compile_off = bool(getattr(inner, "do_not_compile", False))
        self._layers = list(layers)
        self.num_layers = len(self._layers)
        # Per fused module: (d_in, [d_out of each part]).
        self.shapes: dict[str, tuple[int, tuple[int, ...]]] = {}
        ref = self._layers[0]
        for fused, parts in FUSED.items():
            mod = lora_sites.submodule(ref, fused)
            if mod is None:
                raise ValueError(
                    f"the draft's layers lack {fused!r}: LoRA drafts support Llama-style layers "
                    f"({', '.join(FUSED)})"
                )
            d_in = int(mod.input_size)
            sizes = getattr(mod, "output_sizes", None)
            if sizes is not None and len(sizes) == len(parts):
                outs = tuple(int(s) for s in sizes)
            else:
                outs = (int(mod.output_size),)
            self.shapes[fused] = (d_in, outs)
        w = self._layers[0].self_attn.qkv_proj.weight
        self.device, self.dtype = w.device, w.dtype
        self._slots: dict[str, int] = {}
        self._adapters: dict[str, LoraAdapter] = {}
        self._scale = torch.zeros(max_adapters, dtype=torch.float32, device=self.device)
        self._scale_of: dict[int, float] = {}
        # Per-token BGMV (Triton, or off the CPU); else dense products per run of tokens.
        self._per_token = backend == "triton" or self.device.type != "cpu"
        self._sites = lora_sites.sites_of(inner)
        # Stacks per (layer, fused): A [S, d_in, P*max_rank], B [S, P*max_rank, sum d_out].
        self._a: dict[tuple[int, str], torch.Tensor] = {}
        self._b: dict[tuple[int, str], torch.Tensor] = {}
        for i in range(self.num_layers):
            for fused, (d_in, outs) in self.shapes.items():
                r = len(outs) * max_rank
                self._a[i, fused] = torch.zeros(
                    max_adapters, d_in, r, dtype=self.dtype, device=self.device
                )
                self._b[i, fused] = torch.zeros(
                    max_adapters, r, sum(outs), dtype=self.dtype, device=self.device
                )
        self._req_adapter: dict[str, str] = {}
        self._last_drafts_adapter: dict[str, str | None] = {}
        # The current pass's plan: per-token slots (BGMV) or runs (start, end, slot, scale); None: none.
        self._indices: torch.Tensor | None = None
        self._runs: list[tuple[int, int, int, float]] | None = None
        self._first_pass = False
        #: Whether the drafter's last pass applied an adapter to some request.
        self.last_pass_adapters = False
        #: Adapter updates that raised (each counted and logged; the pass went on without adapters).
        self.faults = 0
        #: Whether adapters run inside the drafter's compiled pass (an engine built with LoRA sites).
        self.in_compiled_pass = self._sites is not None and not self._compile_off
        self._handles: list[Any] = []
        self._patches = InstancePatches()
        self._attached = False
        self._attach()

    # -- registration -------------------------------------------------------------------------
    @property
    def adapters(self) -> tuple[str, ...]:
        """Registered adapter names, in slot order."""
        return tuple(sorted(self._slots, key=self._slots.__getitem__))

    def register(self, name: str, adapter: str | Path | LoraAdapter) -> int:
        """Load an adapter into a free slot and return the slot.

        Parameters
        ----------
        name : str
            Adapter name (arm ``lora:<name>``).
        adapter : path or LoraAdapter
            A directory written by :func:`save_lora_adapter`, or an adapter object.

        Raises
        ------
        ValueError
            If the name is taken or invalid, no slot is free, the rank exceeds ``max_rank``, the adapter
            has more layers than the draft, or a matrix does not fit the draft's layer shapes (the
            message names the tensor, its shape and the expected one).
        """
        check_adapter_name(name)
        if name in self._slots:
            raise ValueError(f"adapter name={name!r} is already registered; unregister it first")
        free = sorted(set(range(self.max_adapters)) - set(self._slots.values()))
        if not free:
            raise ValueError(
                f"all {self.max_adapters} adapter slots are in use ({', '.join(self.adapters)}); "
                "unregister one or build the manager with a larger max_adapters"
            )
        ad = adapter if isinstance(adapter, LoraAdapter) else load_lora_adapter(adapter, name)
        ad.validate()
        if ad.rank > self.max_rank:
            raise ValueError(
                f"adapter {name!r} has rank={ad.rank}; this manager accepts rank <= max_rank={self.max_rank}"
            )
        if ad.num_layers > self.num_layers:
            raise ValueError(
                f"adapter {name!r} has weights for {ad.num_layers} layers; the draft model has "
                f"{self.num_layers}"
            )
        expect = {}
        for fused, (d_in, outs) in self.shapes.items():
            for part, d_out in zip(FUSED[fused], outs, strict=True):
                expect[part] = (d_in, d_out)
        for (layer, module), (a, b) in ad.weights.items():
            d_in, d_out = expect[module]
            if a.shape[0] != d_in or b.shape[1] != d_out:
                raise ValueError(
                    f"adapter {name!r} layers.{layer}.{module}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                    f"do not fit the draft's {module} ({d_in} -> {d_out}): expected A [{d_in}, {ad.rank}] "
                    f"and B [{ad.rank}, {d_out}]"
                )
        slot = free[0]
        self._write_slot(slot, ad)
        self._scale[slot] = ad.scale
        self._scale_of[slot] = float(ad.scale)
        self._slots[name] = slot
        self._adapters[name] = ad
        return slot

    def unregister(self, name: str) -> None:
        """Free ``name``'s slot; requests mapped to it draft with no adapter from then on.

        Raises
        ------
        KeyError
            If ``name`` is not registered.
        """
        if name not in self._slots:
            raise KeyError(
                f"adapter {name!r} is not registered; registered: {', '.join(self.adapters)}"
            )
        slot = self._slots.pop(name)
        self._adapters.pop(name)
        for key in self._a:
            self._a[key][slot].zero_()
            self._b[key][slot].zero_()
        self._scale[slot] = 0.0
        self._scale_of.pop(slot, None)
        for rid in [r for r, a in self._req_adapter.items() if a == name]:
            del self._req_adapter[rid]

    def _write_slot(self, slot: int, ad: LoraAdapter) -> None:
        r, mr = ad.rank, self.max_rank
        for i in range(self.num_layers):
            for fused, (_d_in, outs) in self.shapes.items():
                a_stack, b_stack = self._a[i, fused], self._b[i, fused]
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                col = 0
                for j, (part, d_out) in enumerate(zip(FUSED[fused], outs, strict=True)):
                    pair = ad.weights.get((i, part))
                    if pair is not None:
                        a, b = pair
                        a_stack[slot, :, j * mr : j * mr + r] = a.to(self.device, self.dtype)
                        b_stack[slot, j * mr : j * mr + r, col : col + d_out] = b.to(
                            self.device, self.dtype
                        )
                    col += d_out

    # -- per-request mapping ------------------------------------------------------------------
    def set_request_adapter(self, req_id: str, name: str | None) -> None:
        """Draft request ``req_id`` with adapter ``name`` (``None``: the base draft) from the next
        drafter pass on.

        Raises
        ------
        KeyError
            If ``name`` is not registered.
        """
        if name is None:
            self._req_adapter.pop(req_id, None)
            return
        if name not in self._slots:
            raise KeyError(
                f"adapter {name!r} is not registered; registered: {', '.join(self.adapters) or 'none'}"
            )
        self._req_adapter[req_id] = name

    def request_adapter(self, req_id: str) -> str | None:
        """The adapter the next drafter pass uses for ``req_id`` (``None``: base draft)."""
        return self._req_adapter.get(req_id)

    def adapter_of_last_drafts(self, req_id: str) -> str | None:
        """The adapter that made ``req_id``'s most recent drafts (``None``: base draft or none made)."""
        return self._last_drafts_adapter.get(req_id)

    def release(self, req_id: str) -> None:
        """Forget a finished request."""
        self._req_adapter.pop(req_id, None)
        self._last_drafts_adapter.pop(req_id, None)

    # -- vLLM hooks ---------------------------------------------------------------------------
    def _attach(self) -> None:
        drafter = self.drafter
        orig_build = drafter.build_per_group_and_layer_attn_metadata
        orig_propose = drafter.propose
        mgr = self

        def build_per_group_and_layer_attn_metadata(cad: Any, *args: Any, **kwargs: Any) -> Any:
            mgr._set_indices(cad)
            return orig_build(cad, *args, **kwargs)

        def propose(*args: Any, **kwargs: Any) -> Any:
            mgr._first_pass = True
            try:
                return orig_propose(*args, **kwargs)
            finally:
                mgr._plan(None)
                mgr._first_pass = False

        self._patches.set(
            drafter,
            "build_per_group_and_layer_attn_metadata",
            build_per_group_and_layer_attn_metadata,
        )
        self._patches.set(drafter, "propose", propose)
        if self._sites is not None:
            # The sites are in the compiled graph: bind the adapters to them; the pass stays compiled.
            try:
                for (i, fused), site in self._sites.items():
                    lora_sites.bind(site, self._site_fn(i, fused))
            except BaseException:
                self._unbind()
                self._patches.restore()
                raise
        else:
            # Set per pass by _set_indices (eager only while an adapter applies); restored by detach.
            self._patches.set(self._inner, "do_not_compile", self._compile_off)
            for i, layer in enumerate(self._layers):
                for fused in FUSED:
                    mod = lora_sites.submodule(layer, fused)
                    self._handles.append(mod.register_forward_hook(self._hook(i, fused)))
        self._attached = True
        if self.in_compiled_pass:
            logger.info("LoRA adapters on the drafter run inside its compiled pass (LoRA sites)")
        elif not self._compile_off:
            logger.info(
                "LoRA adapters on the drafter run in an eager pass: the engine was built without LoRA "
                "sites (build_llm(..., lora_sites=True) puts them in the compiled pass)"
            )

    def _unbind(self) -> None:
        for site in (self._sites or {}).values():
            lora_sites.unbind(site)

    def detach(self) -> None:
        """Remove the hooks or site bindings and restore the drafter; idempotent."""
        if not self._attached:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unbind()
        self._patches.restore()
        self._plan(None)
        self._attached = False

    def __enter__(self) -> LoraDraftManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _set_indices(self, cad: Any) -> None:
        bs = int(cad.num_reqs)
        req_ids = list(self.runner.input_batch.req_ids[:bs])
        if len(req_ids) != bs:
            raise RuntimeError(
                f"drafter batch has {bs} requests but the runner's input batch lists {len(req_ids)}"
            )
        names = [self._req_adapter.get(r) for r in req_ids]
        if self._first_pass:
            # First drafter pass of a step: remember which adapter makes each request's drafts.
            self._first_pass = False
            for r, n in zip(req_ids, names, strict=True):
                if n is None:
                    self._last_drafts_adapter.pop(r, None)
                else:
                    self._last_drafts_adapter[r] = n
        used = any(names)
        self.last_pass_adapters = used
        if self._sites is None:
            # The compiled graph skips the hooks: eager only while an adapter applies.
            self._inner.do_not_compile = used or self._compile_off
        if not used:
            self._plan(None)
            return
        qsl = cad.query_start_loc_cpu[: bs + 1].tolist()
        self._plan(
            [
                (self._slots[n] if n is not None else -1, qsl[i + 1] - qsl[i])
                for i, n in enumerate(names)
            ]
        )

    def _plan(self, runs: list[tuple[int, int]] | None) -> None:
        """Set the adapters of the next pass's tokens: ``runs`` lists (slot, number of tokens) in token
        order (slot -1: no adapter); None: no adapter for any token."""
        self._indices = None
        self._runs = None
        if not runs or all(slot < 0 for slot, _ in runs):
            return
        if self._per_token:
            slots = torch.tensor([slot for slot, _ in runs], dtype=torch.int64)
            counts = torch.tensor([n for _, n in runs], dtype=torch.int64)
            self._indices = torch.repeat_interleave(slots, counts).to(self.device)
            return
        merged: list[tuple[int, int, int, float]] = []
        start = 0
        for slot, n in runs:
            end = start + int(n)
            if slot >= 0 and end > start:
                if merged and merged[-1][2] == slot and merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], end, slot, merged[-1][3])
                else:
                    merged.append((start, end, slot, self._scale_of[slot]))
            start = end
        self._runs = merged

    def _apply(self, layer: int, fused: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add the planned adapters' updates of ``fused`` in decoder layer ``layer``: ``y`` [T, d_out]
        in place, from ``x`` [T, d_in] (tokens past the plan get none)."""
        a, b = self._a[layer, fused], self._b[layer, fused]
        t = x.shape[0]
        if self._runs is not None:
            for start, end, slot, scale in self._runs:
                if start >= t:
                    break
                end = min(end, t)
                whole = start == 0 and end == t  # one run: no slicing
                ys, xs = (y, x) if whole else (y[start:end], x[start:end])
                if y.dtype == torch.float32:
                    ys.addmm_(xs @ a[slot], b[slot], alpha=scale)
                else:  # accumulate in float32, round once
                    d = (xs.float() @ a[slot].float()) @ b[slot].float()
                    ys.copy_(ys.float() + scale * d)
            return
        idx = self._indices
        if idx is None:
            return
        from adaptive_spec.kernels import lora_bgmv

        if idx.shape[0] < t:
            idx = torch.cat(
                [idx, torch.full((t - idx.shape[0],), -1, dtype=idx.dtype, device=idx.device)]
            )
        elif idx.shape[0] > t:
            idx = idx[:t]
        lora_bgmv(y, x, a, b, idx, self._scale, backend=self.backend)

    def _guarded(self, layer: int, fused: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """:meth:`_apply`, never raising into vLLM's drafter: a failure is counted and logged, and the
        rest of the pass runs without adapters (drafts only; the output never depends on them)."""
        try:
            self._apply(layer, fused, y, x)
        except Exception as e:
            self.faults += 1
            self._plan(None)
            if self.faults == 1 or self.faults % 1000 == 0:
                logger.error(
                    "LoRA adapter update failed (%s: %s) on layer %d %s; this drafter pass went on "
                    "without adapters (%d failures so far)",
                    type(e).__name__,
                    e,
                    layer,
                    fused,
                    self.faults,
                )

    def _site_fn(self, layer: int, fused: str) -> Any:
        def fn(y: torch.Tensor, x: torch.Tensor) -> None:
            self._guarded(layer, fused, y, x)

        return fn

    def _hook(self, layer: int, fused: str) -> Any:
        def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
            y = output[0] if isinstance(output, tuple) else output
            self._guarded(layer, fused, y, inputs[0])
            return output

        return hook
