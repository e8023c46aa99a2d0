"""The head's engine side by side with the engine without speculative decoding, in one process.

    python scripts/head_engine_paired.py --workload mixed --concurrency 4 --repeats 6
    python scripts/head_engine_paired.py --configs adaptive-ngram,adaptive+draft --repeats 3

Builds two in-process engines on the embedded default (float32, compiled): the target with the shipped
EAGLE-3 head (``method: "eagle3"``) and, when ``nospec`` is among ``--configs``, the target alone. Each
repeat runs every configuration on the same prompts, greedy, the order rotating from repeat to repeat,
so that the host's drift falls on all of them alike. Configurations:

* ``nospec``: the engine without speculative decoding;
* ``k0``: the head's engine with every request at k = 0 (``static:draft:0``; the KV-cache pass deferred):
  what having the head costs where it drafts nothing;
* ``adaptive+draft``, ``adaptive``, ``adaptive-ngram``: the controller over none, n-gram, Jacobi and the
  head; none, n-gram and Jacobi; none and n-gram, all in the head's engine;
* ``static:<proposer>:<k>``: a static arm in the head's engine.

Prints goodput per run, each configuration's ratio to the first one per repeat and its median, and the
time per step of vLLM's runner functions in each engine (timers around ``_model_forward``,
``sample_tokens``, ``propose_draft_token_ids``); writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any

CONTROLLERS = {
    "adaptive+draft": ["none", "ngram", "jacobi", "draft"],
    "adaptive": ["none", "ngram", "jacobi"],
    "adaptive-ngram": ["none", "ngram"],
}
TIMED = ("execute_model", "_model_forward", "sample_tokens", "propose_draft_token_ids")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = ap.add_argument
    a("--configs", default="nospec,k0", help="comma-separated configurations (default nospec,k0)")
    a("--workload", default="mtbench", help="mtbench (the bench's 8 prompts), mixed, code, ...")
    a("--concurrency", type=int, default=1, help="requests decoded together (default 1)")
    a(
        "--max-k",
        type=int,
        default=4,
        help="num_speculative_tokens of the head's engine (default 4)",
    )
    a("--prompts", type=int, default=8, help="prompts (default 8)")
    a("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    a("--repeats", type=int, default=4, help="interleaved repeats (default 4)")
    a(
        "--head-block-size",
        type=int,
        default=None,
        help="KV-cache block size of the head's engine (default: vLLM's, 128 on the CPU)",
    )
    a("--out", default="head_engine_paired.json", help="JSON results")
    return ap.parse_args()


def _timers(runner: Any, tag: str, acc: dict[str, float], n: collections.Counter) -> None:
    """Wrap ``runner``'s functions in :data:`TIMED` with timers adding to ``acc[tag.name]``."""
    for name in TIMED:
        f = getattr(runner, name, None)
        if f is None:
            continue

        def timed(*a: Any, _f: Any = f, _k: str = f"{tag}.{name}", **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                acc[_k] += time.perf_counter() - t0
                n[_k] += 1

        setattr(runner, name, timed)


def main() -> None:
    args = _args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in ("nospec", "k0", *CONTROLLERS) and not c.startswith("static:"):
            raise SystemExit(
                f"--configs: {c!r} is invalid; allowed: nospec, k0, {', '.join(CONTROLLERS)}, "
                "static:<proposer>:<k>"
            )
    from adaptive_spec.vllm.engine import prepare_engine_env

    prepare_engine_env()
    from vllm import SamplingParams

    from adaptive_spec import AdaptiveSpec
    from adaptive_spec.commands.bench.plan import MT_BENCH_DEFAULT
    from adaptive_spec.commands.distill.prompts import format_prompt
    from adaptive_spec.commands.workloads import load_workload
    from adaptive_spec.vllm.checks import engine_core
    from adaptive_spec.vllm.eagle3 import assemble_cached_head, shipped_head_dir
    from adaptive_spec.vllm.engine import build_llm
    from adaptive_spec.vllm.models import default_model_path

    model = default_model_path("float32")
    head = str(assemble_cached_head(shipped_head_dir(), "float32"))
    c = args.concurrency
    # The head's engine first: vLLM's rejection sampler is set up once per process with speculation.
    engines = {
        "head": build_llm(
            model,
            dtype="float32",
            max_k=args.max_k,
            concurrency=c,
            method="eagle3",
            draft_model=head,
            **({"block_size": args.head_block_size} if args.head_block_size else {}),
        )
    }
    if "nospec" in configs:
        engines["nospec"] = build_llm(
            model, dtype="float32", max_k=args.max_k, concurrency=c, method=None
        )
    tok = engines["head"].get_tokenizer()
    source = str(MT_BENCH_DEFAULT) if args.workload == "mtbench" else args.workload
    prompts = [
        {"prompt_token_ids": format_prompt(tok, p.text)}
        for p in load_workload(source, args.prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    acc: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for tag, llm in engines.items():
        runner = engine_core(llm).model_executor.driver_worker.worker.model_runner
        _timers(runner, tag, acc, calls)
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up: compiled shapes, prefix cache
    acc.clear()
    calls.clear()

    def run(cfg: str) -> tuple[float, list[list[int]]]:
        if cfg == "nospec":
            llm, spec = engines["nospec"], None
        else:
            llm = engines["head"]
            policy = "adaptive" if cfg in CONTROLLERS else cfg
            if cfg == "k0":
                policy = "static:draft:0"
            proposers = CONTROLLERS.get(cfg) or ["none", policy.split(":")[1]]
            spec = AdaptiveSpec(llm, proposers, policy=policy)
        t0 = time.perf_counter()
        if spec is None:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        else:
            with spec:
                outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return sum(map(len, ids)) / dt, ids

    res: dict[str, list[float]] = {c: [] for c in configs}
    reference: list[list[int]] | None = None
    same = {c: True for c in configs}
    for r in range(args.repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for cfg in order:
            g, ids = run(cfg)
            res[cfg].append(g)
            reference = reference or ids
            same[cfg] = same[cfg] and ids == reference
            print(f"repeat {r}: {cfg:16s} {g:7.1f} tok/s", flush=True)
    base = configs[0]
    summary: dict[str, Any] = {
        "args": vars(args),
        "tokens_per_s": res,
        "greedy_same": same,
        "ratios": {},
    }
    print(f"\n{args.workload} c={c}: goodput (median) and ratio to {base} per repeat")
    for cfg in configs:
        ratios = [a / b for a, b in zip(res[cfg], res[base], strict=True)]
        summary["ratios"][cfg] = ratios
        print(
            f"  {cfg:16s} {statistics.median(res[cfg]):7.1f} tok/s  "
            f"{statistics.median(ratios):.3f}x  ({', '.join(f'{x:.3f}' for x in ratios)})"
            f"  greedy same: {same[cfg]}"
        )
    print("time per step of vLLM's runner functions (ms, over every timed run of the engine):")
    steps = {tag: calls[f"{tag}.execute_model"] for tag in engines}
    summary["ms_per_step"] = {}
    for key in sorted(acc):
        tag = key.split(".")[0]
        ms = 1e3 * acc[key] / max(steps[tag], 1)
        summary["ms_per_step"][key] = ms
        print(f"  {key:40s} {ms:8.3f}")
    Path(args.out).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
