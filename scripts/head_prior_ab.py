"""What the head's acceptance prior is worth: ``adaptive+draft`` from the shipped priors against the same
controller from the lookup prior only, side by side in one engine.

    python scripts/head_prior_ab.py --concurrency 1 --repeats 3

One in-process engine on the embedded default (float32, compiled) with the shipped EAGLE-3 head. For
each repeat and workload (default ``mtbench``, the bench's 8 MT-Bench prompts, and ``mixed``), both
controllers run the same prompts greedy, in alternating order, each a fresh ``adaptive`` controller over
none, n-gram, Jacobi and the head: ``head prior`` starts from the lookup prior and the head's drafter prior
(what ``AdaptiveSpec`` does by default), ``lookup prior`` from the lookup prior alone (the head's arm
from the generic prior, as before the drafter prior existed). Prints goodput, the paired ratio per
repeat and its median, the share of request-steps that drafted with the head, the drafter passes per
step and whether the greedy output is the same; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = ap.add_argument
    a("--concurrency", type=int, default=1, help="requests decoded together (default 1)")
    a("--max-k", type=int, default=4, help="num_speculative_tokens (default 4)")
    a("--workloads", default="mtbench,mixed", help="comma-separated workloads")
    a("--prompts", type=int, default=8, help="prompts per workload (default 8)")
    a("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    a("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    a("--out", default="head_prior_ab.json", help="JSON results (default head_prior_ab.json)")
    return ap.parse_args()


def main() -> None:
    args = _args()
    from adaptive_spec.vllm.engine import prepare_engine_env

    prepare_engine_env()
    from vllm import SamplingParams

    from adaptive_spec import AdaptiveSpec
    from adaptive_spec.commands.bench.plan import MT_BENCH, MT_BENCH_DEFAULT
    from adaptive_spec.commands.distill.prompts import format_prompt
    from adaptive_spec.commands.workloads import load_workload
    from adaptive_spec.core.priors import apply_prior
    from adaptive_spec.vllm.eagle3 import default_head_path
    from adaptive_spec.vllm.engine import build_llm
    from adaptive_spec.vllm.models import default_model_path

    llm = build_llm(
        default_model_path("float32"),
        dtype="float32",
        max_k=args.max_k,
        concurrency=args.concurrency,
        method="eagle3",
        draft_model=str(default_head_path("float32")),
    )
    tok = llm.get_tokenizer()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    prompts = {
        w: [
            {"prompt_token_ids": format_prompt(tok, p.text)}
            for p in load_workload(str(MT_BENCH_DEFAULT) if w == MT_BENCH else w, args.prompts)
        ]
        for w in workloads
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(prompts[workloads[0]][: args.concurrency], params, use_tqdm=False)  # warm-up
    proposers = ["none", "ngram", "jacobi", "draft"]
    arms = ("head prior", "lookup prior")
    rows: list[dict] = []
    for r in range(args.repeats):
        for w in workloads:
            for arm in arms if r % 2 == 0 else arms[::-1]:
                spec = AdaptiveSpec(
                    llm, proposers, policy="adaptive", policy_state=None, prior=arm == "head prior"
                )
                if arm == "lookup prior":
                    apply_prior(spec.policy, spec.engine_key)  # the key without the drafter
                with spec:
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts[w], params, use_tqdm=False)
                    wall = time.perf_counter() - t0
                    st = spec.stats()
                toks = [list(o.outputs[0].token_ids) for o in outs]
                n = sum(len(t) for t in toks)
                by = st["by_proposer"]
                head = by.get("draft", {}).get("request_steps", 0)
                total = sum(v["request_steps"] for v in by.values())
                steps = max(st.get("steps", 0), 1)
                row = {
                    "repeat": r,
                    "workload": w,
                    "arm": arm,
                    "tokens_per_s": n / wall,
                    "head_share": head / max(total, 1),
                    "passes_per_step": st.get("drafter_passes", 0) / steps,
                    "faults": st["faults"],
                    "toks": toks,
                }
                rows.append(row)
                print(
                    f"repeat {r} {w:<8} {arm:<13} {row['tokens_per_s']:6.1f} tokens/s  head "
                    f"{100 * row['head_share']:4.1f} % of request-steps  "
                    f"{row['passes_per_step']:.2f} passes/step",
                    flush=True,
                )
    print(f"\nc={args.concurrency}, max_k={args.max_k}, float32, greedy")
    out: dict[str, dict] = {}
    for w in workloads:
        mine = [x for x in rows if x["workload"] == w]
        by = {a: [x for x in mine if x["arm"] == a] for a in arms}
        ratios = [
            h["tokens_per_s"] / g["tokens_per_s"]
            for h, g in zip(by[arms[0]], by[arms[1]], strict=True)
        ]
        same = all(x["toks"] == by[arms[0]][0]["toks"] for x in mine)
        out[w] = {
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
            **{
                a: {
                    "tokens_per_s": statistics.median(x["tokens_per_s"] for x in by[a]),
                    "head_share": statistics.median(x["head_share"] for x in by[a]),
                    "passes_per_step": statistics.median(x["passes_per_step"] for x in by[a]),
                }
                for a in arms
            },
            "identical": same,
        }
        print(
            f"{w:<8} head prior / lookup prior: {out[w]['ratio_median']:.3f}x (per repeat "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + "); "
            + "; ".join(
                f"{a}: {out[w][a]['tokens_per_s']:.1f} tokens/s, head "
                f"{100 * out[w][a]['head_share']:.0f} %, {out[w][a]['passes_per_step']:.2f} passes/step"
                for a in arms
            )
            + f"; greedy output identical: {same}"
        )
    for x in rows:
        x.pop("toks")
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "rows": rows, "summary": out}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
