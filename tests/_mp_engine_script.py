"""Run by tests/test_vllm_multiproc.py in a fresh process with vLLM's defaults (the engine core in a child
process, the model runner in a worker process beside it): prints one JSON line of results."""

from __future__ import annotations

import json
import os
import random
import sys


def main() -> None:
    model, workdir = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams

    from adaptive_spec import AdaptiveSpec

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 28,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )
    rng = random.Random(0)
    prompts = []
    for _ in range(4):  # token ids with repetition, so that n-gram lookups find matches
        base = [rng.randrange(3, 49000) for _ in range(8)]
        prompts.append(base + base)
    params = SamplingParams(temperature=0, max_tokens=32)

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res: dict = {"client": type(llm.llm_engine.engine_core).__name__}
    with AdaptiveSpec(llm, ["none"], policy="none", policy_state=None, calibrate=False):
        reference = generate()  # no speculation
    state = os.path.join(workdir, "state.json")
    trace = os.path.join(workdir, "trace.jsonl")
    spec = AdaptiveSpec(
        llm,
        ["none", "ngram", "jacobi"],
        policy="static:jacobi:4",
        policy_state=None,
        calibrate=False,
        trace=trace,
        trace_argmax=True,
    )
    res["type"] = type(spec).__name__
    res["attached_is_spec"] = AdaptiveSpec.attached(llm) is spec
    res["static_identity"] = generate() == reference
    res["static_stats"] = spec.stats()
    spec.detach()
    spec = AdaptiveSpec(llm, ["none", "ngram", "jacobi"], policy_state=state, calibrate=False)
    out = generate()
    res["adaptive_identity"] = out == reference
    res["emitted_total"] = sum(len(o) for o in out)
    res["adaptive_stats"] = spec.stats()
    res["faults"] = spec.faults
    res["saved"] = str(spec.save_state())
    spec.detach()
    res["attached_after_detach"] = AdaptiveSpec.attached(llm) is not None
    res["detached_identity"] = generate() == reference
    with open(trace, encoding="utf-8") as f:
        res["trace"] = [json.loads(line) for line in f]
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
