"""Generation on a built engine, shared by ``adaptive-spec run`` and its ``--compare-static`` rounds.

:func:`encode_prompts` turns prompts into token ids with the model's chat template, :func:`generate`
runs one timed pass, and a :class:`GenerationJob` holds what every configuration of the main job runs
on (engine, prompts, sampling parameters, proposers, adapters) and runs the adaptive controller or a
static policy over it with :class:`~adaptive_spec.vllm.AdaptiveSpec` attached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RunResult = tuple[list[Any], float, dict[str, Any]]
"""One timed pass: vLLM ``RequestOutput`` list (prompt order), wall time in seconds, and the
:meth:`~adaptive_spec.vllm.AdaptiveSpec.stats` of the run."""


def encode_prompts(llm: Any, prompts: list[Any]) -> list[list[int]]:
    """Apply the model's chat template to each prompt and return token ids."""
    from adaptive_spec.commands.workloads import chat_token_ids

    return chat_token_ids(llm.get_tokenizer(), [p.text for p in prompts])


def generate(llm: Any, token_ids: list[list[int]], params: Any) -> tuple[list[Any], float]:
    """Generate for all prompts (with vLLM's progress bar); returns outputs and wall time (s)."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params, use_tqdm=True)
    return outs, time.perf_counter() - t0


@dataclass
class GenerationJob:
    """The prompts of the main job on one engine, and the controller's settings for them.

    Attributes
    ----------
    llm : vllm.LLM
        The speculative engine.
    proposers : list of str
        The proposers the adaptive controller may choose.
    adapters : dict
        LoRA adapter name -> directory.
    token_ids : list of list of int
        The chat-formatted prompts.
    params : vllm.SamplingParams
        Sampling parameters of every timed pass.
    categories : dict
        Prompt token ids (a tuple) -> workload category.
    policy : str
        The adaptive policy (``--policy``).
    seed : int
        Seed of the policy.
    trace_path : Path
        Where a traced run writes its trace.
    baseline : str, optional
        The controller's safe baseline (``--baseline``); None for the default.
    """

    llm: Any
    proposers: list[str]
    adapters: dict[str, Any]
    token_ids: list[list[int]]
    params: Any
    categories: dict[tuple[int, ...], str]
    policy: str
    seed: int
    trace_path: Path
    baseline: str | None = None

    def category_of(self, ids: Any) -> str | None:
        """The workload category of a prompt given as token ids (None when it is not one of ours)."""
        return self.categories.get(tuple(ids))

    def run_adaptive(self, traced: bool, policy_state: Any) -> RunResult:
        """One timed pass with the adaptive controller, starting from ``policy_state`` (a state file,
        ``"auto"`` or None), writing the trace when ``traced``."""
        from adaptive_spec.vllm import AdaptiveSpec

        spec = AdaptiveSpec(
            self.llm,
            self.proposers,
            policy=self.policy,
            trace=self.trace_path if traced else None,
            policy_state=policy_state,
            category_of=self.category_of,
            seed=self.seed,
            lora_adapters=self.adapters,
            **({"baseline": self.baseline} if self.baseline else {}),
        )
        return self._timed(spec)

    def run_static(self, policy: str, proposers: list[str]) -> RunResult:
        """One timed pass with a non-learning ``policy`` over ``proposers`` (no state, no trace)."""
        from adaptive_spec.vllm import AdaptiveSpec

        spec = AdaptiveSpec(
            self.llm,
            proposers,
            policy=policy,
            policy_state=None,
            category_of=self.category_of,
            lora_adapters=self.adapters,
        )
        return self._timed(spec)

    def _timed(self, spec: Any) -> RunResult:
        try:
            outs, wall = generate(self.llm, self.token_ids, self.params)
        finally:
            spec.detach()
        return outs, wall, spec.stats()
