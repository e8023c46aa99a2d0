"""A benchmark worker's cell: its prompts and sampling parameters, the ``AdaptiveSpec`` each configuration
attaches, and the untimed passes before its timed runs.

Configurations that attach :class:`~adaptive_spec.vllm.AdaptiveSpec` get only the proposers they use
(:func:`config_proposers`), so a static n-gram arm does not pay for Jacobi drafting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.plan import parse_config
from adaptive_spec.commands.bench.worker_engine import (
    encode,
    generate,
    generate_with,
    prefill_params,
)

ALL_PROPOSERS = ("none", "ngram", "jacobi")


def make_bench_policy(name: str, proposers: list[str], max_k: int, seed: int = 0) -> Any:
    """A policy object for a configuration name: anything :func:`adaptive_spec.core.policies.make_policy`
    knows, plus ``smartspec:<p>`` / ``banditspec:<p>`` from :mod:`adaptive_spec.core.peers` until they are
    registered there.

    Raises
    ------
    ValueError
        For an unknown name, or a peer whose module is not available.
    """
    from adaptive_spec.core.policies import make_policy

    # Every adaptive configuration (-warm, +draft, +lora, +suffix, -ngram) is the same controller;
    # they differ in the proposers enabled (config_proposers) and the state loaded.
    policy_name = "adaptive" if parse_config(name).kind == "adaptive" else name
    try:
        return make_policy(policy_name, proposers, max_k, seed=seed)
    except ValueError as e:
        if "is not known" not in str(e):
            raise
    head, _, prop = name.partition(":")
    if head in ("smartspec", "banditspec"):
        try:
            from adaptive_spec.core.peers import BanditSpecPolicy, SmartSpecPolicy
        except ImportError as e:
            raise ValueError(
                f"config={name!r} needs adaptive_spec.core.peers, which cannot be imported ({e})"
            ) from None
        cls = SmartSpecPolicy if head == "smartspec" else BanditSpecPolicy
        return cls(proposers, max_k, proposer=prop)
    raise ValueError(f"config={name!r} is not a policy this harness can build")


def config_proposers(name: str, engine: str, adapters: Sequence[str] = ()) -> list[str]:
    """The proposers a configuration's ``AdaptiveSpec`` enables: only those it uses (``adapters``: the
    LoRA adapter names the draft engine has, for ``adaptive+lora``)."""
    info = parse_config(name)
    if info.kind == "baseline":
        return ["none"]
    if info.kind == "adaptive":
        if name == "adaptive+lora":
            return [*ALL_PROPOSERS, "draft", *(f"lora:{a}" for a in adapters)]
        if name == "adaptive+suffix":
            return [*ALL_PROPOSERS, "suffix"]
        if name == "adaptive-ngram":
            return ["none", "ngram"]
        return [*ALL_PROPOSERS, "draft"] if name.endswith("+draft") else list(ALL_PROPOSERS)
    if name.startswith("bandit:"):  # a learner over every arm of the main engine's proposers
        return list(ALL_PROPOSERS)
    if info.proposer is None:
        raise ValueError(f"config={name!r} has no proposer to enable")
    return ["none", info.proposer]


class CellState:
    """Per-cell state of a worker: encoded prompts, sampling parameters, the greedy reference outputs
    and the cell's files in the work directory.

    Parameters
    ----------
    llm : vLLM ``LLM``
        Only its tokenizer is used.
    cell : dict
        The cell as the worker's spec lists it (``id``, ``slug``, ``texts``, ``categories``,
        ``train_texts``, ``train_categories``, ``temperature``, ``max_tokens``, ``ignore_eos``,
        ``configs``).
    work_dir : Path
    """

    def __init__(self, llm: Any, cell: dict[str, Any], work_dir: Path) -> None:
        from adaptive_spec.vllm.engine import sampling_params

        self.spec = cell
        self.id = cell["id"]
        self.ids = encode(llm, cell["texts"])
        self.train_ids = encode(llm, cell.get("train_texts") or [])
        cats: dict[tuple[int, ...], str] = {}
        for ids, cat in zip(self.ids, cell["categories"], strict=True):
            cats[tuple(ids)] = cat
        for ids, cat in zip(self.train_ids, cell.get("train_categories") or [], strict=False):
            cats[tuple(ids)] = cat
        self.cats = cats
        self.temperature = float(cell["temperature"])
        self.params = sampling_params(
            temperature=self.temperature,
            max_tokens=int(cell["max_tokens"]),
            ignore_eos=bool(cell.get("ignore_eos", False)),
        )
        self.reference: list[Any] | None = None
        self.state_path = work_dir / f"state_{cell['slug']}.json"
        self.trace_path = work_dir / f"trace_{cell['slug']}.jsonl"
        self.eval_trace_path = work_dir / f"trace_eval_{cell['slug']}.jsonl"

    def category_of(self, ids: Sequence[int]) -> str | None:
        return self.cats.get(tuple(ids))


def attach(
    llm: Any,
    cell: CellState,
    name: str,
    engine: str,
    max_k: int,
    seed: int,
    state: Path | None = None,
    lora_adapters: dict[str, str] | None = None,
    trace: Path | None = None,
) -> Any:
    """``AdaptiveSpec`` attached to ``llm`` as configuration ``name`` runs: only the proposers it
    uses, its policy seeded with ``seed`` (the round), ``state`` loaded if given, ``trace`` if given."""
    from adaptive_spec.vllm import AdaptiveSpec

    adapters = lora_adapters or {}
    proposers = config_proposers(name, engine, list(adapters))
    used = {p.removeprefix("lora:") for p in proposers if p.startswith("lora:")}
    return AdaptiveSpec(
        llm,
        proposers,
        policy=make_bench_policy(name, proposers, max_k, seed=seed),
        policy_state=state,
        category_of=cell.category_of,
        seed=seed,
        lora_adapters={n: a for n, a in adapters.items() if n in used},
        trace=trace,
    )


def prepare_cell(
    llm: Any,
    cell: CellState,
    max_k: int,
    log: Callable[[str], None],
    trace_evaluated: bool = False,
) -> dict[str, Any]:
    """Untimed passes: warm-up/reference, the training pass for ``adaptive-warm`` and, with
    ``trace_evaluated``, a traced pass of ``adaptive`` on the evaluated prompts.

    Returns
    -------
    dict
        ``reference_s`` and, as they ran, ``warm_trained_on``, ``training_s``, ``training_stats``,
        ``trace``, ``policy_state``, ``eval_trace_s`` and ``eval_trace``.
    """
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.engine import sampling_params

    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    spec_config = llm.llm_engine.vllm_config.speculative_config
    plain = contextlib.nullcontext() if spec_config is None else None
    with plain or AdaptiveSpec(llm, ["none"], policy="none", policy_state=None, calibrate=False):
        if cell.temperature == 0:
            params = sampling_params(temperature=0.0, max_tokens=cell.params.max_tokens, logprobs=2)
            cell.reference, _ = generate(llm, cell.ids, params)
        else:
            # Prefill only: warms the engine and caches the prompts' KV as the greedy reference does.
            generate(llm, cell.ids, prefill_params())
    info["reference_s"] = time.perf_counter() - t0
    if "adaptive-warm" in cell.spec["configs"]:
        train = cell.train_ids or cell.ids
        info["warm_trained_on"] = "held-out prompts" if cell.train_ids else "the same prompts"
        cell.state_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        spec = AdaptiveSpec(
            llm,
            list(ALL_PROPOSERS),
            policy="adaptive",
            trace=cell.trace_path,
            policy_state=cell.state_path,
            category_of=cell.category_of,
            seed=10_000,
        )
        generate_with(spec, llm, train, cell.params)
        info["training_s"] = time.perf_counter() - t0
        info["training_stats"] = {
            k: spec.stats()[k] for k in ("steps", "controller_overhead", "by_proposer")
        }
        info["trace"] = str(cell.trace_path)
        info["policy_state"] = str(cell.state_path)
        log(f"{cell.id}: training pass for adaptive-warm done ({info['training_s']:.1f} s)")
    if trace_evaluated and "adaptive" in cell.spec["configs"]:
        # The timed `adaptive` run of round 0 (cold start, seed 0, the same proposers), traced: the
        # trace of the prompts the timed runs decode, for `adaptive-spec replay` to be checked on.
        t0 = time.perf_counter()
        spec = attach(llm, cell, "adaptive", "main", max_k, 0, trace=cell.eval_trace_path)
        generate_with(spec, llm, cell.ids, cell.params)
        info["eval_trace_s"] = time.perf_counter() - t0
        info["eval_trace"] = str(cell.eval_trace_path)
        log(
            f"{cell.id}: traced adaptive pass on the evaluated prompts ({info['eval_trace_s']:.1f} s)"
        )
    return info
