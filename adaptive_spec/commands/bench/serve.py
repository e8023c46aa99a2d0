"""``adaptive-spec bench serve``: the OpenAI-compatible server under changing load, measured with vLLM's own
serving benchmark client.

For each configuration (``--configs``): start ``python -m vllm.entrypoints.openai.api_server`` with the
adaptive-spec plugin as docs/serving.md describes (or without speculation, or with vLLM's own n-gram
speculation) on 127.0.0.1 on a free port; wait for ``/health`` and ``/v1/models``; send a few warm-up
requests; then for each load pattern (``--patterns``) read ``/metrics``, drive the server with
``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; called as a library), read ``/metrics`` again;
finally stop the server (SIGTERM, wait, SIGKILL fallback). Every server's log is kept.

Every pattern sends the same prompts (the workload's real prompts, written as vLLM ``custom`` dataset
files) to every configuration, so the greedy requests' texts are compared with no speculation's. Outputs
in ``--out``: ``bench_serve.json`` (every figure, the environment, the checks, the goals),
``tpot_vs_rate.png``, ``work/`` (dataset files, server and client logs, raw client results, texts); the
table is printed last. Configurations, patterns and the JSON are described in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.resolve import csv_list
from adaptive_spec.commands.bench.serve_plan import (
    CONFIG_HELP,
    DEFAULT_BURSTINESS,
    DEFAULT_CONFIGS,
    DEFAULT_HOT_SHARE,
    DEFAULT_RATES,
    PATTERN_HELP,
    PATTERN_KINDS,
    QUICK_CONFIGS,
    QUICK_RATES,
    Pattern,
    estimate_minutes,
    expand_patterns,
)
from adaptive_spec.commands.bench.serve_resolve import FULL, QUICK, Plan
from adaptive_spec.commands.bench.serve_runner import Runner
from adaptive_spec.commands.run import _nonneg_int, _positive_int
from adaptive_spec.core.machine import dtype_arg

SCHEMA = "adaptive-spec-bench-serve"
VERSION = 1
JSON_NAME = "bench_serve.json"
PLOT_NAME = "tpot_vs_rate.png"


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{v} is invalid; allowed: a finite number > 0")
    return v


def add_parser(sub: Any) -> None:
    """Register ``serve`` under ``adaptive-spec bench`` (``sub``: the bench parser's subparsers)."""
    p = sub.add_parser(
        "serve",
        help="the OpenAI-compatible server under changing load, measured with vLLM's serving benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI-size smoke run: the tiny float32 test model, --eager, "
        f"{QUICK['requests']} requests x {QUICK['max_tokens']} tokens per pattern, configs "
        f"{','.join(QUICK_CONFIGS)}, rates {','.join(f'{r:g}' for r in QUICK_RATES)}; checks the harness, "
        "not speed",
    )
    p.add_argument(
        "--out", default="runs/bench-serve", help="output directory (default runs/bench-serve)"
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated server configurations, run in the order baseline, static, table, adaptive, "
        f"adaptive-warm (default {','.join(DEFAULT_CONFIGS)}); allowed: {CONFIG_HELP}",
    )
    p.add_argument(
        "--patterns",
        default=",".join(PATTERN_KINDS),
        help=f"comma-separated load patterns (default {','.join(PATTERN_KINDS)}); allowed: {PATTERN_HELP}",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="request rates (requests/s) that bare pattern kinds expand from: steady at each; the ramp from "
        "the lowest (at least 1) to twice the middle one; burst and mixtemp at the middle one (default "
        f"{','.join(f'{r:g}' for r in DEFAULT_RATES)}; quick {','.join(f'{r:g}' for r in QUICK_RATES)})",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="first measure the saturation throughput (all requests at once on the first configuration's "
        "server) and take the rates as 0.25x, 1x and 4x of it (overrides --rates)",
    )
    p.add_argument(
        "--burstiness",
        type=_positive_float,
        default=DEFAULT_BURSTINESS,
        help=f"vLLM's --burstiness of the bare 'burst' pattern (default {DEFAULT_BURSTINESS}; < 1 is "
        "burstier than Poisson)",
    )
    p.add_argument(
        "--hot-share",
        type=_positive_float,
        default=DEFAULT_HOT_SHARE,
        help=f"share of requests at temperature 1.0 in the bare 'mixtemp' pattern (default {DEFAULT_HOT_SHARE})",
    )
    p.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help=f"requests per pattern (default {FULL['requests']}; quick {QUICK['requests']})",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help=f"output tokens per request (default {FULL['max_tokens']}; quick {QUICK['max_tokens']}); "
        "generation also stops at EOS unless --ignore-eos",
    )
    p.add_argument(
        "--warmup",
        type=_nonneg_int,
        default=None,
        help=f"warm-up requests per server before the first pattern, not measured (default "
        f"{FULL['warmup']}; quick {QUICK['warmup']})",
    )
    p.add_argument(
        "--workloads",
        default="mixed",
        help="comma-separated prompt sources, interleaved: built-in workloads (code, math, chat, summarize, "
        "agent, mixed), mtbench, or a JSONL path (MT-Bench format, or vLLM's custom format with a "
        "'prompt' field) (default mixed)",
    )
    p.add_argument(
        "--mt-bench",
        default=None,
        help="MT-Bench question.jsonl for the 'mtbench' workload (default: the shared copy when present)",
    )
    p.add_argument(
        "--model", default=None, help="target model directory (default: embedded; quick: tiny)"
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="drafter directory for the configurations with draft/lora arms (static:draft:<k>, "
        "static:lora:<adapter>:<k>, adaptive+draft, adaptive+lora): an EAGLE-3 head or a draft model "
        "(default: the shipped EAGLE-3 head for the embedded model, and its LoRA adapters)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        type=dtype_arg,
        help="--dtype of the servers: auto (bfloat16 where native, else float32), bfloat16, float32 "
        "(default auto; quick float32)",
    )
    p.add_argument(
        "--max-k",
        type=_positive_int,
        default=8,
        help="num_speculative_tokens of the plugin's engines: the largest k an arm may use (default 8)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        help=f"the servers' --max-num-seqs, the largest batch (default {FULL['max_num_seqs']}; quick "
        f"{QUICK['max_num_seqs']})",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=4096,
        help="the servers' --max-model-len in tokens (default 4096, capped by the model's)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=_positive_float,
        default=None,
        help=f"KV cache per server in GiB (--kv-cache-memory-bytes; default {FULL['kv_cache_gib']:g}; quick "
        f"{QUICK['kv_cache_gib']:g})",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="start the servers with --enforce-eager (fast start, slower decode; always on with --quick)",
    )
    p.add_argument(
        "--multiprocessing",
        action="store_true",
        help="run each server as vLLM does by default, the engine core in its own process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=1); needed for --server-arg=--tensor-parallel-size. Default "
        "off: the engine core stays in the API server's process, which on a machine with few cores "
        "leaves the engine more of them",
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep vLLM's prefix caching on (default off: every pattern sends the same prompts, and "
        "cache hits from earlier patterns would cut their prefill)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate --max-tokens tokens for every request"
    )
    p.add_argument(
        "--warm-state",
        default=None,
        help="policy-state file for adaptive-warm (default: the one 'adaptive' saved in this run)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="vLLM's --seed, the client's and the plugin's"
    )
    p.add_argument(
        "--start-timeout",
        type=_positive_float,
        default=900.0,
        help="seconds a server may take to become ready (default 900)",
    )
    p.add_argument(
        "--pattern-timeout",
        type=_positive_float,
        default=1800.0,
        help="seconds one pattern's client may run before it is cancelled (default 1800)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra argument for every server's command line (repeat the flag for several; use "
        "--server-arg=--flag for values starting with '-')",
    )
    p.add_argument(
        "--overlap-starts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start the next configuration's server while the current one is measured (saves a server "
        "start per configuration, but the two compete for the CPU: for smoke runs only; default on with "
        "--quick, off otherwise)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan and the server commands, then exit"
    )
    p.set_defaults(func=main)


# -- planning ---------------------------------------------------------------------------------------
def _print_plan(console: Any, plan: Plan, runner: Runner) -> None:
    from adaptive_spec.commands.bench.serve_server import server_command, server_env

    console.print(
        f"[bold]adaptive-spec bench serve[/] ({plan.mode}): {len(plan.configs)} configurations x "
        + (
            f"{len(plan.patterns)} patterns"
            if plan.patterns is not None
            else "patterns from the calibrated rates"
        )
        + f", {plan.requests} requests x {plan.max_tokens} tokens per pattern, dtype {plan.dtype}, "
        f"servers {'eager' if plan.eager else 'compiled'}"
        + (", engine core in its own process" if runner.settings.multiprocessing else "")
    )
    console.print("  configurations (run order): " + ", ".join(c.name for c in plan.configs))
    if plan.patterns is not None:
        for p in plan.patterns:
            passes = p.passes(plan.requests)
            desc = "; ".join(
                f"{cp.label}: {len(cp.indices)} at T={cp.temperature:g}, "
                + (
                    f"ramp {cp.ramp[0]}->{cp.ramp[1]} req/s"
                    if cp.ramp
                    else f"{cp.request_rate:.3g} req/s"
                )
                + (f", burstiness {cp.burstiness:g}" if cp.burstiness != 1 else "")
                for cp in passes
            )
            console.print(f"  pattern {p.name}: {desc}")
    for c in plan.configs:
        if c.kind == "table" and c.table is None:
            console.print(f"  {c.name}: table tuned after the static runs")
            continue
        cmd = server_command(c, runner.settings, 0)
        env = server_env(
            c, runner.settings, state=Path("<state>") if c.kind == "adaptive" else None, base={}
        )
        shown = " ".join(
            f"{k}={v}" for k, v in env.items() if k.startswith(("ADAPTIVE_SPEC", "VLLM_ENABLE"))
        )
        console.print(
            f"  {c.name}: {shown} python " + " ".join(cmd[1:]), markup=False, highlight=False
        )
    est = estimate_minutes(
        plan.configs,
        plan.patterns or expand_patterns(plan.pattern_specs, plan.rates),
        plan.requests,
        start_s=40.0 if plan.eager else 130.0,
        saturation_rps=8.0 if plan.quick else 1.5,
    )
    console.print(
        f"estimated duration on 2 quiet cores: about {est:.0f} min (a loaded machine is slower)"
    )


def main(args: argparse.Namespace) -> int:
    """Run ``adaptive-spec bench serve``; 0 when every request was accounted for, every server started
    and (float32) every greedy text matched no speculation's; 1 otherwise; 2 for invalid arguments."""
    from rich.console import Console

    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 220)
    t_start = time.perf_counter()
    try:
        plan = Plan(args)
        runner = Runner(plan, args, console)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    _print_plan(console, plan, runner)
    if args.dry_run:
        return 0
    from adaptive_spec.commands.bench.report import environment

    try:
        runner.prepare_prompts()
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    runner.import_client()
    env_start = environment()
    try:
        for i, cfg in enumerate(plan.configs, 1):
            runner.run_config(i, cfg)
    finally:
        runner.stop_prestarted()
    data = finish(runner, env_start, time.perf_counter() - t_start)
    for n in data["notes"]:
        console.print(f"note: {n}")
    console.print(
        f"results: {data['json']}; plot: {data.get('plot') or 'none (no steady pattern ran)'}; "
        f"total {data['total_s'] / 60:.1f} min"
    )
    from adaptive_spec.commands.bench.serve_report import print_tables

    print_tables(console, data)
    ok = data["checks"]["ok"]
    if not ok:
        console.print(f"[red]checks failed:[/] {', '.join(data['checks']['problems'])}")
    return 0 if ok else 1


def finish(runner: Runner, env_start: dict[str, Any], total_s: float) -> dict[str, Any]:
    """Summaries, checks, goals, the plot and the JSON."""
    from adaptive_spec.commands.bench.serve_report import plot_tpot, write_json
    from adaptive_spec.commands.bench.serve_summary import goals, summarize_pattern

    plan = runner.plan
    configs = {c.name: c for c in plan.configs}
    patterns = plan.patterns or []
    summaries = {}
    for p in patterns:
        per = {n: r[p.name] for n, r in runner.runs.items() if p.name in r}
        summaries[p.name] = summarize_pattern(p.name, per, configs)
    for by_pattern in runner.runs.values():
        for run in by_pattern.values():
            run.pop("texts", None)
    texts_path = runner.work / "texts.json"
    texts_path.write_text(json.dumps(runner.texts, indent=0), encoding="utf-8")
    checks = overall_checks(runner, patterns)
    if "none" not in configs:
        runner.notes.append(
            "no 'none' configuration: no ratios to no speculation and no greedy comparison"
        )
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "version": VERSION,
        "mode": plan.mode,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_s": total_s,
        "args": {k: v for k, v in vars(runner.args).items() if k != "func"},
        "settings": {
            "model": str(runner.settings.model),
            "served_name": runner.settings.served_name,
            "dtype": plan.dtype,
            "eager": plan.eager,
            "max_k": plan.max_k,
            "max_num_seqs": plan.max_num_seqs,
            "max_model_len": runner.settings.max_model_len,
            "kv_cache_gib": plan.kv_cache_gib,
            "prefix_caching": runner.settings.prefix_caching,
            "multiprocessing": runner.settings.multiprocessing,
            "requests": plan.requests,
            "max_tokens": plan.max_tokens,
            "warmup": plan.warmup,
            "workloads": csv_list(runner.args.workloads),
            "rates": list(plan.rates),
            "client": "vllm.benchmarks.serve.main_async (vLLM's `vllm bench serve`), one call per pass",
        },
        "environment": env_start,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpu_s": _cpu_seconds(),
        "calibration": runner.calibration,
        "configs": [
            {
                "name": c.name,
                "kind": c.kind,
                "plugin": c.plugin,
                "policy": c.policy,
                "proposers": list(c.proposers) if c.proposers else None,
                "k": c.k,
                "warm": c.warm,
            }
            for c in plan.configs
        ],
        "patterns": [
            {
                "name": p.name,
                "kind": p.kind,
                "rate": p.rate,
                "burstiness": p.burstiness,
                "ramp_start": p.ramp_start,
                "hot_share": p.hot_share,
            }
            for p in patterns
        ],
        "servers": runner.servers,
        "dynamic_tables": runner.tables,
        "runs": runner.runs,
        "pattern_summaries": summaries,
        "goals": goals(runner.runs, configs, {p.name: p.kind for p in patterns}),
        "checks": checks,
        "notes": runner.notes,
        "texts": str(texts_path),
    }
    plot = plot_tpot(data, runner.out / PLOT_NAME)
    data["plot"] = str(plot) if plot else None
    data["json"] = str(runner.out / JSON_NAME)
    write_json(runner.out / JSON_NAME, data)
    return data


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process (the harness and vLLM's client, which compete with
    the server for the cores) and of its finished children (the servers, engine cores included)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"harness": me.ru_utime + me.ru_stime, "servers": kids.ru_utime + kids.ru_stime}


def overall_checks(runner: Runner, patterns: list[Pattern]) -> dict[str, Any]:
    """Whether the run is sound: every request accounted for, every configuration's server started and
    ran every pattern, and, in float32, every greedy text identical to no speculation's (bf16 differences
    are reported, not failed: numeric near-ties). ``problems`` lists what failed."""
    problems = []
    sent = completed = failed = lost = 0
    identical = compared = 0
    mismatch_counts = []
    for name, by_pattern in runner.runs.items():
        info = runner.servers.get(name, {})
        if "error" in info:
            problems.append(f"{name}: {info['error']}")
        for p in patterns:
            run = by_pattern.get(p.name)
            if run is None:
                if "error" not in info:
                    problems.append(f"{name}/{p.name} did not run")
                continue
            if "error" in run:
                problems.append(f"{name}/{p.name}: {run['error']}")
                continue
            sent += run["sent"]
            completed += run["completed"]
            failed += run["failed"]
            lost += run["lost"]
            if not run["checks"]["all_accounted"]:
                problems.append(f"{name}/{p.name}: {run['lost']} requests unaccounted for")
            for key in (
                "server_completed_matches",
                "generation_tokens_match",
                "plugin_emitted_matches",
            ):
                if run["checks"].get(key) is False:
                    mismatch_counts.append(f"{name}/{p.name}: {key}")
            ident = run.get("identity")
            if ident:
                identical += ident["identical"]
                compared += ident["compared"]
    exact = runner.plan.dtype == "float32"
    if exact and identical != compared:
        problems.append(
            f"float32 greedy texts differ from no speculation's: {compared - identical}/{compared}"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "requests_sent": sent,
        "requests_completed": completed,
        "requests_failed": failed,
        "requests_lost": lost,
        "greedy_identical": identical,
        "greedy_compared": compared,
        "greedy_must_be_exact": exact,
        "server_counter_mismatches": mismatch_counts,
    }
