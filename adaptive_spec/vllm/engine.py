"""Building an in-process vLLM engine with speculative decoding enabled, as AdaptiveSpec needs it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

ENGINE_METHODS = ("ngram", "draft_model", "eagle3", None)
#: KV-cache block size (tokens) of an engine with an EAGLE head, unless the caller gives one. On a
#: prefix-cache hit vLLM drops an EAGLE engine's hit back by one block (the head needs the target's
#: hidden states there), so every hit recomputes up to a block of the prompt: 128 tokens at vLLM's CPU
#: default, 32 (the CPU backend's smallest) here. Measured on long prompts, docs/drafts.md.
EAGLE_BLOCK_SIZE = 32


def prepare_engine_env() -> None:
    """Environment for an in-process vLLM engine, set before it is built: the engine core in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, on a machine without CUDA, vLLM's regular
    compile cache instead of its ahead-of-time one. vLLM 0.32's CPU build cannot load its own
    ahead-of-time compiled model ("'function' object has no attribute 'finalize_loading'") and compiles
    it again at every build (about 110 s on 2 cores); the regular cache loads (69 s instead of 169 s per
    build of the embedded default here). A ``VLLM_USE_AOT_COMPILE`` set by the user wins. It also
    installs :func:`adaptive_spec.vllm.cpu_fixes.guard_kernel_override_scan`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    from adaptive_spec.vllm.cpu_fixes import guard_kernel_override_scan

    guard_kernel_override_scan()  # vLLM's CPU start-up scan fails once Numba is loaded

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def request_seed(seed: int | None) -> int | None:
    """The per-request sampling seed to give vLLM's ``SamplingParams``: ``seed``, except on vLLM's CPU
    build, where it returns None. There a seeded request whose prompt is prefilled in chunks (a prompt
    longer than the step's token budget, or several long prompts admitted together) stops the engine:
    vLLM 0.32 rewinds the request's generator with ``Generator.set_offset``, which CPU generators do
    not support ("RuntimeError: CPU Generator does not use offset"). Without per-request seeds, the
    engine's own seed (``build_llm(seed=...)``) still makes a run reproducible for the same schedule."""
    if seed is None:
        return None
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else seed


def sampling_params(**kwargs: Any) -> Any:
    """``vllm.SamplingParams(**kwargs)``: for code outside the integration layer, which never imports
    vLLM itself.

    Raises
    ------
    ValueError
        From vLLM, for a parameter it refuses (say ``temperature=-1``).
    """
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def vllm_version() -> str:
    """The installed vLLM's version string."""
    import vllm

    return str(vllm.__version__)


def build_llm(
    model: str | Path | None = None,
    *,
    dtype: str = "auto",
    max_k: int = 8,
    concurrency: int = 4,
    method: str = "ngram",
    draft_model: str | Path | None = None,
    max_model_len: int = 4096,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    kv_cache_gib: float = 1.0,
    speculative_extra: dict[str, Any] | None = None,
    lora_sites: bool = False,
    drafter_bf16: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Build a ``vllm.LLM`` whose engine core runs in this process, with speculative decoding.

    Parameters
    ----------
    model : path, optional
        Model directory; defaults to the embedded SmolLM2-135M-Instruct (:func:`default_model_path`).
    dtype : {"auto", "bfloat16", "float32"}
        ``auto``: bfloat16 where the hardware runs it natively, else float32
        (:func:`adaptive_spec.core.machine.default_dtype`).
    max_k : int in 1..16
        ``num_speculative_tokens``: the largest k any arm may use.
    concurrency : int >= 1
        ``max_num_seqs``: requests decoded together.
    method : {"ngram", "draft_model", "eagle3", None}
        The engine's own proposer (its drafts are the fallback; ``draft_model`` and ``eagle3`` enable the
        ``draft`` arm). With ``draft_model`` or ``eagle3`` the kind of ``draft_model``'s directory decides:
        an EAGLE-3 head (:mod:`adaptive_spec.vllm.eagle3`) runs as ``eagle3``, any other model as
        ``draft_model``.
        ``None`` builds an engine without speculative decoding (what an operator runs without
        adaptive-spec; AdaptiveSpec cannot attach to it).
    draft_model : path, optional
        Required with ``method="draft_model"``.
    kv_cache_gib : float
        KV-cache size in GiB (SmolLM2-135M needs about 23 KB per token in bf16).
    speculative_extra : dict, optional
        More keys of vLLM's ``speculative_config`` (say ``num_speculative_tokens_per_batch_size``, vLLM's
        batch-size table); refused with ``method=None``.
    lora_sites : bool
        Build the drafter with LoRA sites (:mod:`adaptive_spec.vllm.lora_sites`), so that the adapters
        of ``lora:<name>`` arms run inside its compiled pass; without them an adapted pass runs eagerly.
        Needs ``draft_model``.
    drafter_bf16 : bool, optional
        Run the drafter's matrix products on bf16 copies of its weights
        (:mod:`adaptive_spec.vllm.drafter_bf16`): half the bytes a draft pass reads, the same output.
        None (the default): yes in a float32 engine on a CPU with native bf16, no otherwise.
    **kwargs
        More ``vllm.LLM`` arguments. An engine with an EAGLE-3 head gets ``block_size``
        :data:`EAGLE_BLOCK_SIZE` unless given.

    Raises
    ------
    ValueError
        For a parameter outside its allowed values.
    """
    if not isinstance(max_k, int) or not 1 <= max_k <= 16:
        raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer in 1..16")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} is invalid; allowed: an integer >= 1")
    if method not in ENGINE_METHODS:
        raise ValueError(f"method={method!r} is invalid; allowed: ngram, draft_model, eagle3, None")
    if lora_sites and method not in ("draft_model", "eagle3"):
        raise ValueError(
            f"lora_sites=True needs a drafter (method='eagle3' or 'draft_model'); got method={method!r}"
        )
    if speculative_extra and method is None:
        raise ValueError("speculative_extra needs a method; allowed with ngram or draft_model")
    if method in ("draft_model", "eagle3"):
        if draft_model is None:
            raise ValueError(
                f"method={method!r} needs draft_model=<path of a draft model directory>"
            )
        from adaptive_spec.vllm.eagle3 import draft_method

        method = draft_method(draft_model)
    from adaptive_spec.core.machine import resolve_dtype

    dtype = resolve_dtype(dtype)
    prepare_engine_env()
    from vllm import LLM

    if model is None:
        from adaptive_spec.vllm.models import default_model_path

        model = default_model_path(dtype)
    spec: dict[str, Any] | None = {"method": method, "num_speculative_tokens": max_k}
    if method == "ngram":
        spec.update({"prompt_lookup_min": 2, "prompt_lookup_max": 4})
    elif method is None:
        spec = None
    else:
        spec["model"] = str(draft_model)
    if spec is not None and speculative_extra:
        spec.update(speculative_extra)
    if method == "eagle3":
        kwargs.setdefault("block_size", EAGLE_BLOCK_SIZE)
    from adaptive_spec.vllm.drafter_bf16 import bf16_drafter, wants_bf16_drafter
    from adaptive_spec.vllm.lora_sites import lora_sites as sites

    bf16 = wants_bf16_drafter(dtype, drafter_bf16) and method in ("draft_model", "eagle3")
    with (
        sites() if lora_sites else contextlib.nullcontext(),
        bf16_drafter() if bf16 else contextlib.nullcontext(),
    ):
        llm = LLM(
            model=str(model),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=concurrency,
            seed=seed,
            speculative_config=spec,
            enable_prefix_caching=enable_prefix_caching,
            # A fixed KV-cache size: vLLM's CPU backend otherwise reserves a fraction of the NUMA node's
            # memory and refuses to start when other processes hold some of it.
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
            **kwargs,
        )
    from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel
    from adaptive_spec.vllm.sampling import fix_recovered_token_sampling

    fix_cpu_expand_kernel()  # vLLM 0.32 CPU: speculation at temperature > 0 needs it
    fix_recovered_token_sampling()  # vLLM 0.32 CPU: one uniform per recovered token
    return llm
