"""``adaptive-spec bench``: the adaptive controller against every peer, side by side.

Runs the same prompts, per cell (workload x concurrency x temperature), under every configuration: no
speculation; every static arm (n-gram, Jacobi, and the draft model when one exists, k in 1, 2, 4, 8);
vLLM's own dynamic speculation with its batch-size table tuned on the workload from the static runs;
SmartSpec- and BanditSpec-style policies; Hugging Face prompt-lookup assisted generation and HF greedy at
concurrency 1; and the adaptive controller from no prior knowledge and warm-started from a saved state.
Repeats are interleaved; the report gives medians and paired ratios, checks greedy identity against the
no-speculation run, and computes the controller's goals.

One engine per process (``adaptive_spec.commands.bench.worker``; HF: ``adaptive_spec.commands.bench.hf_peer``): the main
n-gram engine runs every in-framework configuration; vLLM's tuned table, the draft model and HF each get
their own. The exception is ``nospec``, the engine built without speculative decoding: it is built in
the main engine's process and runs in the same rounds, so that its ratios are paired run by run.
Outputs in ``--out``: ``bench.json`` (every figure, the environment, the goals), PNG plots, worker logs;
the table is printed last. ``--quick`` is a small grid for checking the harness (under 15 minutes on 2
cores); the full grid and its design are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.resolve import (
    default_mt_bench,
    load_texts,
    print_plan,
    resolve_plan,
)
from adaptive_spec.commands.run import _nonneg_int, _positive_int
from adaptive_spec.core.machine import dtype_arg

SCHEMA = "adaptive-spec-bench"
VERSION = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the adaptive controller against static arms, vLLM's table, peers and HF",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="the small grid (under 15 minutes here)")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument(
        "--repeats", type=_positive_int, default=None, help="interleaved repeats (3; quick 2)"
    )
    p.add_argument(
        "--confirm",
        type=_nonneg_int,
        default=None,
        help="confirmation rounds per cell after the repeats (3; quick 0): only adaptive, the best "
        "static arm so far and no speculation, back to back, so the goals' paired ratios rest on "
        "runs seconds apart; 0 turns them off",
    )
    p.add_argument(
        "--prompts",
        type=_positive_int,
        default=None,
        help="prompts per cell (override; default: the grid's own per cell, and max(8, 2 x "
        "concurrency) in a custom grid, so that each cell's batch fills)",
    )
    p.add_argument(
        "--max-tokens", type=_positive_int, default=None, help="output tokens per prompt (override)"
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="custom grid: comma-separated workloads (code, math, chat, summarize, agent, mixed, mtbench "
        "or a JSONL path in MT-Bench format)",
    )
    p.add_argument("--concurrency", default=None, help="custom grid: e.g. 1,4,16")
    p.add_argument("--temperatures", default=None, help="custom grid: e.g. 0,1.0")
    p.add_argument(
        "--configs",
        default=None,
        help="custom grid: comma-separated configurations (see adaptive_spec.commands.bench.plan)",
    )
    p.add_argument(
        "--mt-bench",
        default=default_mt_bench(),
        help="MT-Bench question.jsonl for the 'mtbench' workload (default: the shared copy when present)",
    )
    p.add_argument("--model", default=None, help="target model directory (default: embedded)")
    p.add_argument(
        "--dtype",
        default="auto",
        type=dtype_arg,
        help="auto (default: bfloat16 where native, else float32), bfloat16, float32",
    )
    p.add_argument("--max-k", type=_positive_int, default=8, help="num_speculative_tokens (8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft",
        choices=["auto", "on", "off"],
        default="auto",
        help="draft-model arms: auto (full run: when a draft exists; quick: off), on, off",
    )
    p.add_argument("--draft-model", default=None, help="draft model directory")
    p.add_argument(
        "--eager",
        action="store_true",
        help="build engines with enforce_eager=True (faster builds, slower decode)",
    )
    p.add_argument(
        "--pld-tokens",
        type=_positive_int,
        default=None,
        help="HF prompt_lookup_num_tokens (default: --max-k)",
    )
    p.add_argument(
        "--worker-timeout", type=float, default=None, help="seconds per worker process (no limit)"
    )
    p.add_argument(
        "--trace-evaluated",
        action="store_true",
        help="per cell with `adaptive`, one more untimed pass: the cold-start controller as its "
        "first timed run has it, traced, on the evaluated prompts (work/trace_eval_<cell>.jsonl; "
        "`adaptive-spec replay` that trace to check offline what the timed runs measured; the "
        "adaptive-warm training trace is of held-out prompts). Costs one adaptive run per cell",
    )
    p.add_argument(
        "--ignore-eos",
        choices=["sampled", "off"],
        default="sampled",
        help="sampled (default): cells at temperature > 0 decode every request to --max-tokens, "
        "ignoring the end-of-sequence token (SamplingParams.ignore_eos, as vLLM's throughput "
        "benchmark does), so that every configuration does the same work and a run's goodput does "
        "not move with where its requests happen to sample EOS (about 2.5 %% per run at c=16, "
        "T=1.0 on the embedded model); greedy cells stop at EOS, where every configuration emits "
        "the same tokens. off: every cell stops at EOS",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--verbose", action="store_true", help="echo the workers' full logs")
    p.set_defaults(func=main)
    # `adaptive-spec bench serve`: the OpenAI-compatible server under load.
    from adaptive_spec.commands.bench import serve as bench_serve

    bench_serve.add_parser(p.add_subparsers(dest="bench_command", metavar="{serve}"))


def main(args: argparse.Namespace) -> int:
    """Run ``adaptive-spec bench``: 0 when every worker succeeded, 1 when one failed, 2 for invalid
    arguments (and 0 after printing the plan with ``--dry-run``)."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    t_start = time.perf_counter()
    try:
        plan = resolve_plan(args)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    print_plan(console, plan, args)
    if args.dry_run:
        return 0
    from adaptive_spec.commands.bench.jsonio import write_json
    from adaptive_spec.commands.bench.launch import Launcher
    from adaptive_spec.commands.bench.report import environment, make_plots, print_tables
    from adaptive_spec.commands.bench.summary import compute_goals, summarize_cell

    out_dir = Path(args.out)
    work_dir = out_dir / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    env_start = environment()
    notes = plan.notes
    prompts = {}
    for c in plan.cells:
        prompts[c.id] = load_texts(c, args.mt_bench, args.seed)
        if prompts[c.id].note:
            notes.append(f"{c.id}: {prompts[c.id].note}")
    eos_cells = [cid for cid, past in plan.ignore_eos.items() if past]
    if eos_cells:
        notes.append(
            f"{', '.join(eos_cells)}: every request decodes to max_tokens past EOS (--ignore-eos "
            "sampled), so every configuration does the same work"
        )
    launcher = Launcher(args, plan, prompts, work_dir, console)
    launcher.run_all()

    final = []
    for c in plan.cells:
        cell = launcher.cells[c.id]
        if cell["configs"]:
            summarize_cell(cell)
        else:
            cell["error"] = "no configuration ran"
        final.append(cell)
    goals = compute_goals(final)
    plots = make_plots(out_dir, final)
    data = {
        "schema": SCHEMA,
        "version": VERSION,
        "mode": plan.mode,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_s": time.perf_counter() - t_start,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "repeats": plan.repeats,
        "confirm": plan.confirm,
        "environment": env_start,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "draft_model": plan.draft_path,
        "workers": launcher.workers,
        "dynamic_tables": launcher.tables,
        "notes": notes,
        "goals": goals,
        "plots": plots,
        "cells": final,
    }
    json_path = write_json(out_dir / "bench.json", data)
    for n in notes:
        console.print(f"note: {n}")
    console.print(
        f"results: {json_path}; plots: {', '.join(Path(p).name for p in plots)} in {out_dir}; "
        f"total {data['total_s'] / 60:.1f} min"
    )
    print_tables(console, final, goals)
    return 1 if launcher.failed else 0
