"""Sampled requests whose prompts are prefilled in chunks keep the engine running (vLLM's CPU build
cannot rewind a per-request generator, so ``request_seed`` leaves requests unseeded there)."""

from __future__ import annotations

from tests.conftest import tiny_prompts


def test_sampling_params_of_run_survive_a_chunked_prefill_at_temperature_1(tiny_llm) -> None:
    from vllm import SamplingParams

    from adaptive_spec.vllm.engine import request_seed

    budget = tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = tiny_prompts(3, 1500)
    assert sum(map(len, prompts)) > budget  # the third prompt is prefilled over two steps
    assert request_seed(None) is None
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=request_seed(0))
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
