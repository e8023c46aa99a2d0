"""The controller's cost under vLLM's default multiprocess engine against the in-process engine.

    python scripts/multiproc_overhead.py --concurrency 4,16 --repeats 2

For each concurrency and repeat, two fresh engines on the embedded default (float32, n-gram
speculative config, k <= 8), one after the other (``inproc``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
``mp``: vLLM's default, the engine core in a child process and on the CPU build the model runner in
a worker process): each runs the ``mixed`` workload (``2 x concurrency`` prompts) once to warm up,
then once as vLLM alone (its n-gram proposer at k = 8), then once more with ``AdaptiveSpec(llm)`` (proposers none, n-gram, Jacobi) attached, and reports
the controller's share of step time (``stats()["controller_overhead"]``, measured where the
controller runs) and the decode throughput. The modes alternate in order from one repeat to the
next. The table gives medians per mode and the median of the paired differences (mp - inproc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(mode: str, concurrency: int, max_tokens: int, eager: bool) -> None:
    from adaptive_spec.vllm.engine import prepare_engine_env

    prepare_engine_env()  # what the product does before an in-process engine (CPU fixes, compile cache)
    if mode == "mp":
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # back to vLLM's default
    from vllm import LLM, SamplingParams

    from adaptive_spec import AdaptiveSpec
    from adaptive_spec.commands.distill.prompts import format_prompt
    from adaptive_spec.commands.workloads import load_workload
    from adaptive_spec.vllm.models import default_model_path

    llm = LLM(
        model=str(default_model_path("float32")),
        dtype="float32",
        max_num_seqs=concurrency,
        max_model_len=2048,
        enforce_eager=eager,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 8,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )
    tok = llm.get_tokenizer()
    prompts = [
        {"prompt_token_ids": format_prompt(tok, p.text)}
        for p in load_workload("mixed", 2 * concurrency)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the prefix cache)
    t0 = time.perf_counter()
    plain = llm.generate(prompts, params, use_tqdm=False)  # vLLM alone: its n-gram proposer, k=8
    plain_tok_s = sum(len(o.outputs[0].token_ids) for o in plain) / (time.perf_counter() - t0)
    with AdaptiveSpec(
        llm, ["none", "ngram", "jacobi"], policy="adaptive", policy_state=None
    ) as spec:
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        st = spec.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    res = {
        "mode": mode,
        "concurrency": concurrency,
        "client": type(llm.llm_engine.engine_core).__name__,
        "spec": type(spec).__name__,
        "tok_s": tokens / wall,
        "plain_tok_s": plain_tok_s,
        "identical": [o.outputs[0].token_ids for o in out]
        == [o.outputs[0].token_ids for o in plain],
        "controller_overhead": st.get("controller_overhead"),
        "steps": st.get("steps"),
        "faults": st.get("faults"),
    }
    print("RESULT " + json.dumps(res), flush=True)


def _run(mode: str, c: int, max_tokens: int, eager: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--concurrency", str(c)]
    cmd += ["--max-tokens", str(max_tokens)] + (["--eager"] if eager else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{mode} c={c} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--concurrency", default="4,16", help="comma-separated max_num_seqs values (default 4,16)"
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="engine pairs per concurrency (default 2)"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=64, help="tokens generated per request (default 64)"
    )
    ap.add_argument(
        "--eager", action="store_true", help="enforce_eager: skip torch.compile (faster start)"
    )
    ap.add_argument(
        "--timeout", type=float, default=900, help="seconds per engine run (default 900)"
    )
    ap.add_argument("--json", help="write every run's result to this JSON file")
    ap.add_argument("--child", choices=["inproc", "mp"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    try:
        cs = [int(x) for x in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency={a.concurrency!r} is invalid; allowed: integers >= 1, e.g. 4,16")
    if not cs or min(cs) < 1 or a.repeats < 1 or a.max_tokens < 1:
        ap.error("--concurrency, --repeats and --max-tokens must be >= 1")
    if a.child:
        _child(a.child, cs[0], a.max_tokens, a.eager)
        return 0
    rows: list[dict] = []
    for r in range(a.repeats):
        for c in cs:
            order = ("inproc", "mp") if r % 2 == 0 else ("mp", "inproc")
            for mode in order:
                res = _run(mode, c, a.max_tokens, a.eager, a.timeout)
                res["repeat"] = r
                rows.append(res)
                print(
                    f"repeat {r + 1}/{a.repeats} c={c} {mode:6s}: {res['tok_s']:.1f} tok/s, "
                    f"controller {100 * res['controller_overhead']:.2f} % of step time "
                    f"(vLLM alone {res['plain_tok_s']:.1f} tok/s; {res['client']}, {res['spec']}; "
                    f"greedy identical: {res['identical']})",
                    flush=True,
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(
        "\n| c | controller, in process | controller, multiprocess | paired difference | "
        "adaptive / vLLM alone, in process | adaptive / vLLM alone, multiprocess |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for c in cs:
        by = {
            m: [x for x in rows if x["concurrency"] == c and x["mode"] == m]
            for m in ("inproc", "mp")
        }
        ov = {m: [100 * x["controller_overhead"] for x in by[m]] for m in by}
        diff = [b - a_ for a_, b in zip(ov["inproc"], ov["mp"], strict=True)]
        ratio = {m: statistics.median(x["tok_s"] / x["plain_tok_s"] for x in by[m]) for m in by}
        tps = {m: statistics.median(x["tok_s"] for x in by[m]) for m in by}
        print(
            f"| {c} | {statistics.median(ov['inproc']):.2f} % | {statistics.median(ov['mp']):.2f} % | "
            f"{statistics.median(diff):+.2f} points | {ratio['inproc']:.3f}x ({tps['inproc']:.1f} tok/s) "
            f"| {ratio['mp']:.3f}x ({tps['mp']:.1f} tok/s) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
