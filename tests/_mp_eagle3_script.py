"""Run by tests/test_vllm_multiproc.py in a fresh process with vLLM's defaults (engine core in a child
process, model runner in a worker process) and a tiny EAGLE-3 head: prints one JSON line of results."""

from __future__ import annotations

import json
import sys


def main() -> None:
    target, head, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    from vllm import LLM, SamplingParams

    from adaptive_spec import AdaptiveSpec
    from adaptive_spec.vllm.eagle3 import assemble_cached_head

    loadable = assemble_cached_head(head, "float32", target_dir=target, root=workdir)
    llm = LLM(
        model=target,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 28,
        speculative_config={
            "method": "eagle3",
            "model": str(loadable),
            "num_speculative_tokens": 4,
        },
    )
    prompts = [[5 + i, 17, 301 + 7 * i, 42, 9, 1000 + i, 77, 5 + i, 17] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24)

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res: dict = {"client": type(llm.llm_engine.engine_core).__name__}
    with AdaptiveSpec(llm, ["none"], policy="none", policy_state=None, calibrate=False):
        reference = generate()
    runs = {}
    for policy in ("static:none", "static:draft:2"):
        for defer in (True, False):
            with AdaptiveSpec(
                llm,
                ["none", "draft"],
                policy=policy,
                policy_state=None,
                calibrate=False,
                defer_drafter_kv=defer,
            ) as spec:
                out = generate()
                st = spec.stats()
            runs[f"{policy} defer={defer}"] = {
                "identity": out == reference,
                "faults": st["faults"],
                "drafter_kv": st.get("drafter_kv"),
                "drafted": st["by_category"]["all"]["drafted"],
                "accepted": st["by_category"]["all"]["accepted"],
            }
    res["runs"] = runs
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
