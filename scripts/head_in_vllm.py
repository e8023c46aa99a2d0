"""The shipped EAGLE-3 head and its LoRA adapters inside vLLM: acceptance by draft position, mean
accepted length, and what a draft pass costs with and without an adapter.

    python scripts/head_in_vllm.py --concurrency 4 --k 4 --prompts 8 --repeats 1

One in-process engine on the embedded default (float32, compiled unless ``--eager``) with the shipped
head (``method: "eagle3"``) and its stored adapters. For each repeat, workload (default ``mtbench``,
``code``, ``math``, ``chat``: prompts distillation never trains on) and arm (``draft``, then
``lora:<adapter>`` for each adapter, the order rotating between repeats), the workload runs once with
the arm as a static policy (``static:<arm>:<k>``) and a step trace. From the traces: acceptance by draft
position (given the drafts before it were accepted), the mean accepted length (tokens committed per
request-step with drafts), the drafter's time per step and per draft pass (``drafter_time_s`` over the
step's ``drafter_passes``, decode steps only) and the step time. Greedy output is checked against the
base head's (adapters change drafts, never the output). Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = ap.add_argument
    a("--concurrency", type=int, default=4, help="requests decoded together (default 4)")
    a("--k", type=int, default=4, help="draft tokens per step of the static arms (default 4)")
    a("--workloads", default="mtbench,code,math,chat", help="comma-separated workloads")
    a("--prompts", type=int, default=8, help="prompts per workload (default 8)")
    a("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    a("--repeats", type=int, default=1, help="repeats (default 1: greedy acceptance is the same)")
    a("--eager", action="store_true", help="build the engine with enforce_eager")
    a(
        "--no-lora-sites",
        action="store_true",
        help="build the drafter without LoRA sites: adapted passes then run eagerly (the fallback)",
    )
    a(
        "--head",
        default=None,
        help="a stored head directory (distill --out) instead of the shipped head; its own adapters, "
        "if it stores any, are the lora arms",
    )
    a("--no-lora", action="store_true", help="the draft arm only (no lora:<name> arms)")
    a(
        "--drafter-float32",
        action="store_true",
        help="keep the head's products in float32 (default: bf16 weights where the CPU has native bf16)",
    )
    a("--out", default="head_in_vllm.json", help="JSON results (default head_in_vllm.json)")
    return ap.parse_args()


def _row(trace_path: Path, k: int) -> dict:
    from adaptive_spec.core.trace import read_trace

    steps = [s for s in read_trace(trace_path).steps if s.get("num_prefill_tokens", 0) == 0]
    per_pass = [
        s["drafter_time_s"] / s["drafter_passes"]
        for s in steps
        if s.get("drafter_passes") and s.get("drafter_time_s")
    ]
    reqs = [q for s in steps for q in s["requests"] if q["drafted"] > 0]
    reach, hit = [0] * k, [0] * k
    for q in reqs:
        for i in range(min(q["drafted"], k)):
            reach[i] += 1
            if q["accepted"] <= i:
                break
            hit[i] += 1
    return {
        "steps": len(steps),
        "step_ms": 1e3 * statistics.median(s["step_time_s"] for s in steps),
        "drafter_ms": 1e3 * statistics.median(s.get("drafter_time_s") or 0.0 for s in steps),
        "pass_ms": 1e3 * statistics.median(per_pass) if per_pass else None,
        "adapted_steps": sum(bool(s.get("drafter_adapters")) for s in steps),
        "acceptance": sum(q["accepted"] for q in reqs) / max(sum(q["drafted"] for q in reqs), 1),
        "by_position": [h / n if n else None for h, n in zip(hit, reach, strict=True)],
        "accepted_length": sum(q["accepted"] + 1 for q in reqs) / max(len(reqs), 1),
    }


def main() -> None:
    args = _args()
    from adaptive_spec.vllm.engine import prepare_engine_env

    prepare_engine_env()
    from vllm import SamplingParams

    from adaptive_spec import AdaptiveSpec
    from adaptive_spec.commands.distill.prompts import format_prompt
    from adaptive_spec.commands.workloads import load_workload
    from adaptive_spec.vllm.eagle3 import assemble_cached_head, head_adapters, shipped_head_dir
    from adaptive_spec.vllm.engine import build_llm
    from adaptive_spec.vllm.models import default_model_path

    stored = Path(args.head) if args.head else shipped_head_dir()
    head = str(assemble_cached_head(stored, "float32"))
    adapters = {} if args.no_lora else head_adapters(stored)
    llm = build_llm(
        default_model_path("float32"),
        dtype="float32",
        max_k=max(args.k, 1),
        concurrency=args.concurrency,
        method="eagle3",
        draft_model=head,
        enforce_eager=args.eager,
        lora_sites=bool(adapters) and not args.no_lora_sites,
        drafter_bf16=False if args.drafter_float32 else None,
    )
    tok = llm.get_tokenizer()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    from adaptive_spec.commands.bench.plan import MT_BENCH, MT_BENCH_DEFAULT

    def texts(w: str) -> list:
        return load_workload(str(MT_BENCH_DEFAULT) if w == MT_BENCH else w, args.prompts)

    prompts = {
        w: [{"prompt_token_ids": format_prompt(tok, p.text)} for p in texts(w)] for w in workloads
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    arms = ["draft", *(f"lora:{n}" for n in adapters)]
    llm.generate(prompts[workloads[0]][: args.concurrency], params, use_tqdm=False)  # warm-up
    rows: list[dict] = []
    ref: dict[str, list] = {}
    work = Path(args.out).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    for r in range(args.repeats):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for w in workloads:
            for arm in order:
                path = work / f"r{r}-{w}-{arm.replace(':', '_')}.jsonl"
                with AdaptiveSpec(
                    llm,
                    ["none", *arms],
                    policy=f"static:{arm}:{args.k}",
                    lora_adapters=adapters,
                    policy_state=None,
                    trace=path,
                ) as spec:
                    outs = llm.generate(prompts[w], params, use_tqdm=False)
                    faults = spec.stats()["faults"]
                toks = [list(o.outputs[0].token_ids) for o in outs]
                if arm == "draft":
                    ref.setdefault(w, toks)
                row = {"repeat": r, "workload": w, "arm": arm, "faults": faults, "toks": toks}
                row.update(_row(path, args.k))
                rows.append(row)
                pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in row["by_position"])
                print(
                    f"repeat {r} {w:<8} {arm:<10} by position {pos}  accepted length "
                    f"{row['accepted_length']:.2f}  pass {row['pass_ms'] or 0:.2f} ms  "
                    f"step {row['step_ms']:.1f} ms",
                    flush=True,
                )
    for row in rows:
        row["identical"] = row.pop("toks") == ref[row["workload"]]
    mode = "eager" if args.eager else "compiled"
    from adaptive_spec.vllm.drafter_bf16 import bf16_layers

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    products = "bf16" if bf16_layers(runner.drafter.model) else "float32"
    print(f"\nengine: c={args.concurrency}, k={args.k}, {mode}, float32, head products {products}")
    print(
        f"{'arm':<12}"
        + "".join(f"{'acc ' + w:>13}" for w in workloads)
        + "   pass ms  x base  step ms"
    )
    med: dict[str, dict] = {}
    for arm in arms:
        mine = [x for x in rows if x["arm"] == arm]
        acc = {
            w: statistics.median(x["acceptance"] for x in mine if x["workload"] == w)
            for w in workloads
        }
        pm = statistics.median(x["pass_ms"] for x in mine if x["pass_ms"] is not None)
        sm = statistics.median(x["step_ms"] for x in mine)
        med[arm] = {"acceptance": acc, "pass_ms": pm, "step_ms": sm}
        ratio = pm / med["draft"]["pass_ms"]
        cells = "".join(f"{acc[w]:>13.3f}" for w in workloads)
        print(f"{arm:<12}{cells}{pm:>10.2f}{ratio:>7.2f}x{sm:>9.1f}")
    print("\nacceptance by draft position and mean accepted length (first repeat)")
    for w in workloads:
        for arm in arms:
            x = next(x for x in rows if x["arm"] == arm and x["workload"] == w)
            pos = " ".join(f"{v:.3f}" if v is not None else "-" for v in x["by_position"])
            print(f"{w:<9}{arm:<12}{pos}   accepted length {x['accepted_length']:.3f}")
    same = sum(x["identical"] for x in rows)
    print(f"greedy output identical to the base head's: {same}/{len(rows)} runs")
    Path(args.out).write_text(
        json.dumps(
            {"args": vars(args), "head_products": products, "rows": rows, "medians": med}, indent=1
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
