"""A benchmark worker's vLLM engine: building it from the worker's spec, and timed generation on it.

The engine is built once per process with ``max_num_seqs`` = the largest concurrency of its cells; a
cell's concurrency is set through vLLM's own admission limit (the scheduler's ``max_num_active_reqs``),
which keeps smaller decode batches without rebuilding the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from adaptive_spec.commands.bench.resolve import model_max_len


def build_engine(spec: dict[str, Any]) -> Any:
    """Build the process's engine from its spec.

    ``engine`` is ``main`` (vLLM's n-gram method, k up to ``max_k``: the engine every in-framework
    configuration shares), ``nospec`` (no speculative decoding at all: what an operator runs without
    adaptive-spec), ``dynamic`` (the same with ``num_speculative_tokens_per_batch_size`` =
    ``dynamic_table``) or ``draft`` (method ``draft_model`` with ``draft_model``). The settings are those of
    :func:`adaptive_spec.vllm.engine.build_llm`; the context is 4096 tokens or the model's, if shorter.

    Raises
    ------
    ValueError
        For an unknown engine kind or a missing table / draft model.
    """
    from adaptive_spec.vllm.engine import build_llm

    kind = spec["engine"]
    common = {
        "dtype": spec.get("dtype", "auto"),
        "max_k": int(spec.get("max_k", 8)),
        "concurrency": int(spec["max_num_seqs"]),
        "seed": int(spec.get("seed", 0)),
        "max_model_len": model_max_len(spec.get("model")),
    }
    extra = {"enforce_eager": True} if spec.get("enforce_eager") else {}
    if kind == "main":
        return build_llm(spec.get("model"), method="ngram", **common, **extra)
    if kind == "nospec":
        return build_llm(spec.get("model"), method=None, **common, **extra)
    if kind == "draft":
        if not spec.get("draft_model"):
            raise ValueError("engine='draft' needs draft_model=<directory>")
        return build_llm(
            spec.get("model"),
            method="draft_model",
            draft_model=spec["draft_model"],
            lora_sites=bool(spec.get("lora_adapters")),
            **common,
            **extra,
        )
    if kind == "dynamic":
        table = spec.get("dynamic_table")
        if not table:
            raise ValueError("engine='dynamic' needs dynamic_table=[[start, end, k], ...]")
        return build_llm(
            spec.get("model"),
            method="ngram",
            speculative_extra={"num_speculative_tokens_per_batch_size": [list(r) for r in table]},
            **common,
            **extra,
        )
    raise ValueError(f"engine={kind!r} is invalid; allowed: main, nospec, dynamic, draft")


def schedulers(*llms: Any) -> list[Any]:
    """The schedulers of in-process vLLM engines (``None`` entries skipped)."""
    return [llm.llm_engine.engine_core.engine_core.scheduler for llm in llms if llm is not None]


def encode(llm: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as one user turn in the engine's chat template."""
    from adaptive_spec.commands.workloads import chat_token_ids

    return chat_token_ids(llm.get_tokenizer(), texts)


def generate(llm: Any, ids: list[list[int]], params: Any) -> tuple[list[Any], float]:
    """Generate for every prompt (token ids) at once; returns vLLM's outputs and the wall time (s)."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": t} for t in ids], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def generate_with(
    attached: Any, llm: Any, ids: list[list[int]], params: Any
) -> tuple[list[Any], float]:
    """:func:`generate`, then ``attached.detach()`` whatever happens (``attached``: an
    ``AdaptiveSpec`` or an observer on ``llm``)."""
    try:
        return generate(llm, ids, params)
    finally:
        attached.detach()


def prefill_params() -> Any:
    """Sampling parameters of a prefill-only pass (one greedy token per prompt)."""
    from adaptive_spec.vllm.engine import sampling_params

    return sampling_params(temperature=0.0, max_tokens=1)
