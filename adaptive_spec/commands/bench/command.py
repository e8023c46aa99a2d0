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
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.plan import (
    MT_BENCH,
    MT_BENCH_DEFAULT,
    Cell,
    check_cell,
    custom_plan,
    estimate_minutes,
    full_plan,
    parse_config,
    quick_plan,
    tune_table,
)
from adaptive_spec.commands.run import _nonneg_int, _positive_int
from adaptive_spec.core.machine import dtype_arg

SCHEMA = "adaptive-spec-bench"
VERSION = 1
WORKER_MODULES = {
    "main": "adaptive_spec.commands.bench.worker",
    "nospec": "adaptive_spec.commands.bench.worker",
    "dynamic": "adaptive_spec.commands.bench.worker",
    "draft": "adaptive_spec.commands.bench.worker",
    "hf": "adaptive_spec.commands.bench.hf_peer",
}


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


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
        default=str(MT_BENCH_DEFAULT) if MT_BENCH_DEFAULT.is_file() else None,
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


# -- planning ---------------------------------------------------------------------------------------
def _draft_path(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The draft model directory to use, or None and why."""
    if args.draft == "off" or (args.draft == "auto" and args.quick and not args.draft_model):
        return None, "draft arms off"
    if args.draft_model:
        if not Path(args.draft_model).is_dir():
            raise ValueError(f"--draft-model={args.draft_model!r} is not a directory")
        return args.draft_model, None
    try:
        from adaptive_spec.vllm.drafts import (
            default_draft_path,  # written by another engineer; optional
        )

        path = default_draft_path()
    except Exception as e:  # a missing module or draft is not an error: the draft arms are optional
        if args.draft == "on":
            raise ValueError(f"--draft on, but no draft model is available ({e})") from None
        return None, f"no draft model ({type(e).__name__}: {e})"
    if path is None or not Path(path).is_dir():
        if args.draft == "on":
            raise ValueError(
                "--draft on, but adaptive_spec.vllm.drafts.default_draft_path() found none"
            )
        return None, "no draft model found"
    return str(path), None


def _lora_adapters(args: argparse.Namespace, draft_path: str | None) -> dict[str, str]:
    """LoRA adapters of the draft (name -> directory): the shipped ones when the shipped draft is used."""
    if draft_path is None or args.draft_model:
        return {}
    from adaptive_spec.vllm.drafts import shipped_adapters

    try:
        return {n: str(p) for n, p in shipped_adapters().items()}
    except FileNotFoundError:
        return {}


def build_plan(args: argparse.Namespace, draft: bool) -> tuple[list[Cell], str]:
    """Cells to run and the mode (``quick``, ``full`` or ``custom``), with the overrides applied.

    Raises
    ------
    ValueError
        For a bad override or configuration.
    """
    custom = any(
        getattr(args, a) is not None
        for a in ("workloads", "concurrency", "temperatures", "configs")
    )
    if custom:
        mode = "custom"
        try:
            conc = [int(x) for x in _csv(args.concurrency or "4")]
            temps = [float(x) for x in _csv(args.temperatures or "0")]
        except ValueError:
            raise ValueError(
                f"--concurrency={args.concurrency!r} / --temperatures={args.temperatures!r} are invalid; "
                "allowed: comma-separated numbers"
            ) from None
        cells = custom_plan(
            _csv(args.workloads or "mixed"),
            conc,
            temps,
            _csv(args.configs or "none,static:ngram:4,adaptive"),
            args.prompts,
            args.max_tokens or 64,
            args.max_k,
        )
    elif args.quick:
        mode = "quick"
        cells = quick_plan(max_tokens=args.max_tokens or 48)
    else:
        mode = "full"
        cells = full_plan(
            mt_bench=Path(args.mt_bench) if args.mt_bench else None,
            draft=draft,
            max_tokens=args.max_tokens or 128,
        )
    out = []
    for c in cells:
        if args.prompts is not None or args.max_tokens is not None:
            c = Cell(
                c.workload,
                c.concurrency,
                c.temperature,
                args.prompts or c.prompts,
                args.max_tokens or c.max_tokens,
                c.configs,
            )
        if not draft:
            kept = tuple(x for x in c.configs if parse_config(x, args.max_k).engine != "draft")
            c = Cell(c.workload, c.concurrency, c.temperature, c.prompts, c.max_tokens, kept)
        check_cell(c, args.max_k)
        out.append(c)
    return out, mode


def _slug(cell_id: str) -> str:
    return cell_id.replace("/", "_").replace(".", "p")


def _load_texts(
    cell: Cell, mt_bench: str | None, seed: int
) -> tuple[list[Any], list[Any], str | None]:
    """(eval prompts, held-out training prompts, note). Training prompts are loaded only for
    ``adaptive-warm``: the workload's next ``prompts`` items after the evaluated ones."""
    from adaptive_spec.commands.workloads import load_workload

    name = cell.workload
    if name == MT_BENCH:
        if not mt_bench or not Path(mt_bench).is_file():
            raise FileNotFoundError(
                f"the mtbench workload needs --mt-bench (not found: {mt_bench})"
            )
        name = mt_bench
    warm = "adaptive-warm" in cell.configs
    items = load_workload(name, cell.prompts * (2 if warm else 1), seed=seed)
    if len(items) < cell.prompts:
        note = f"the workload has only {len(items)} prompts (asked {cell.prompts})"
        return items, [], note
    return items[: cell.prompts], items[cell.prompts :], None


# -- workers ----------------------------------------------------------------------------------------
def _run_worker(
    group: str,
    spec: dict[str, Any],
    work_dir: Path,
    timeout: float | None,
    verbose: bool,
    console: Any,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    spec_path = work_dir / f"spec_{group}.json"
    out_path = work_dir / f"result_{group}.json"
    log_path = work_dir / f"worker_{group}.log"
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    env = os.environ.copy()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    if not verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [sys.executable, "-m", WORKER_MODULES[group], str(spec_path), str(out_path)]
    console.print(f"[bold]{group}[/]: starting worker ({len(spec['cells'])} cells); log {log_path}")
    t0 = time.perf_counter()
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if verbose or line.startswith(f"[{group}]"):
                    console.print(line.rstrip("\n"), markup=False, highlight=False)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            console.print(
                f"[red]{group}: worker killed after {timeout:.0f} s (--worker-timeout)[/]"
            )
        reader.join(timeout=10)
    info: dict[str, Any] = {
        "returncode": rc,
        "wall_s": time.perf_counter() - t0,
        "log": str(log_path),
    }
    result = json.loads(out_path.read_text()) if out_path.exists() else None
    if rc != 0:
        console.print(f"[red]{group}: worker exited with {rc}[/] (see {log_path})")
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        info["log_tail"] = tail
    return result, info


def _engine_spec(
    args: argparse.Namespace, engine: str, cells: list[dict], repeats: int, confirm: int = 0
) -> dict:
    return {
        "engine": engine,
        "model": args.model,
        "dtype": args.dtype,
        "max_k": args.max_k,
        "max_num_seqs": max(c["concurrency"] for c in cells),
        "enforce_eager": bool(args.eager),
        "seed": args.seed,
        "repeats": repeats,
        "confirm": confirm if engine == "main" else 0,
        "trace_evaluated": bool(getattr(args, "trace_evaluated", False)) and engine == "main",
        "cells": cells,
    }


def ignores_eos(cell: Cell, mode: str) -> bool:
    """Whether ``cell``'s requests decode to ``max_tokens`` past EOS under ``--ignore-eos mode``:
    ``sampled`` for cells at temperature > 0, ``off`` never."""
    return mode == "sampled" and not cell.greedy


def _cell_payload(
    cell: Cell, texts: dict[str, Any], configs: list[str], *, ignore_eos: bool
) -> dict[str, Any]:
    ev, tr = texts[cell.id]["eval"], texts[cell.id]["train"]
    return {
        "id": cell.id,
        "slug": _slug(cell.id),
        "workload": cell.workload,
        "concurrency": cell.concurrency,
        "temperature": cell.temperature,
        "max_tokens": cell.max_tokens,
        "ignore_eos": ignore_eos,
        "texts": [p.text for p in ev],
        "categories": [p.category for p in ev],
        "train_texts": [p.text for p in tr],
        "train_categories": [p.category for p in tr],
        "configs": configs,
    }


def best_k_by_concurrency(
    cells: list[dict[str, Any]], label: str, proposer: str = "ngram"
) -> dict[int, int]:
    """Per concurrency, the static k of ``proposer`` with the highest ratio to no speculation in the
    summarized cells of workload ``label`` (greedy cells first; k = 0 when none beats no speculation)."""
    out: dict[int, int] = {}
    for greedy in (True, False):
        for cell in cells:
            if cell["label"] != label or (cell["temperature"] == 0) != greedy:
                continue
            if cell["concurrency"] in out or "summary" not in cell:
                continue
            best_k, best_r = 0, 1.0
            for name, s in cell["summary"].items():
                info = parse_config(name)
                if info.kind != "static" or info.proposer != proposer or not s["valid"]:
                    continue
                if s["ratio_to_none"] is not None and s["ratio_to_none"] > best_r:
                    best_k, best_r = int(info.k or 0), s["ratio_to_none"]
            if any(
                parse_config(n).kind == "static" and parse_config(n).proposer == proposer
                for n in cell["summary"]
            ):
                out[cell["concurrency"]] = best_k
    return out


def _merge(merged: dict[str, dict], group: str, result: dict[str, Any] | None) -> None:
    if result is None:
        return
    for cid, res in result.get("cells", {}).items():
        cell = merged[cid]
        cell.setdefault("prepare", {})[group] = res.get("prepare")
        if "error" in res:
            cell.setdefault("errors", {})[group] = res["error"]
        for name, entry in res.get("configs", {}).items():
            if name == "none" and group in ("dynamic", "draft"):
                cell.setdefault("baselines", {})[group] = entry
            else:
                cell["configs"][name] = entry


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from adaptive_spec.commands.bench.report import (
        environment,
        make_plots,
        print_tables,
        write_json,
    )
    from adaptive_spec.commands.bench.summary import compute_goals, summarize_cell

    console = Console(width=None if sys.stdout.isatty() else 200)
    t_start = time.perf_counter()
    notes: list[str] = []
    try:
        draft_path, why = _draft_path(args)
        if why:
            notes.append(why)
        lora_adapters = _lora_adapters(args, draft_path)
        cells, mode = build_plan(args, draft_path is not None)
        wanted = {
            info.proposer.removeprefix("lora:")
            for c in cells
            for info in (parse_config(p, args.max_k) for p in c.configs)
            if info.proposer and info.proposer.startswith("lora:")
        }
        missing = sorted(wanted - set(lora_adapters))
        if missing:
            raise ValueError(
                f"--configs uses LoRA adapters {', '.join(missing)}, which the draft does not have "
                f"(available: {', '.join(sorted(lora_adapters)) or 'none'})"
            )
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    repeats = args.repeats or (2 if mode == "quick" else 3)
    confirm = args.confirm if args.confirm is not None else (0 if mode == "quick" else 3)
    kept = []
    for c in cells:
        if c.workload == MT_BENCH and not (args.mt_bench and Path(args.mt_bench).is_file()):
            notes.append(f"{c.id} skipped: MT-Bench file not found ({args.mt_bench})")
            continue
        kept.append(c)
    cells = kept
    past_eos = {c.id: ignores_eos(c, args.ignore_eos) for c in cells}
    console.print(
        f"[bold]adaptive-spec bench[/] ({mode}): {len(cells)} cells, {repeats} interleaved repeats "
        f"+ {confirm} confirmation rounds, "
        f"engines compiled={'no (enforce_eager)' if args.eager else 'yes (torch.compile)'}"
    )
    for c in cells:
        console.print(
            f"  {c.id}: {c.prompts} prompts x {c.max_tokens} tokens"
            + (" (EOS ignored)" if past_eos[c.id] else "")
            + f": {', '.join(c.configs)}"
        )
    est = estimate_minutes(
        cells, repeats, eager=args.eager, confirm=confirm, trace_evaluated=args.trace_evaluated
    )
    console.print(
        f"estimated duration on 2 quiet cores: about {est:.0f} min (nominal rates; a loaded machine is slower)"
    )
    if args.dry_run:
        return 0
    out_dir = Path(args.out)
    work_dir = out_dir / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    env_start = environment()

    texts: dict[str, Any] = {}
    merged: dict[str, dict[str, Any]] = {}
    for c in cells:
        ev, tr, note = _load_texts(c, args.mt_bench, args.seed)
        if note:
            notes.append(f"{c.id}: {note}")
        texts[c.id] = {"eval": ev, "train": tr}
        merged[c.id] = {
            "id": c.id,
            "slug": _slug(c.id),
            "label": c.label,
            "workload": c.workload,
            "concurrency": c.concurrency,
            "temperature": c.temperature,
            "prompts": len(ev),
            "max_tokens": c.max_tokens,
            "ignore_eos": past_eos[c.id],
            "prompt_ids": [p.source_id for p in ev],
            "configs": {},
        }
    eos_cells = [cid for cid, past in past_eos.items() if past]
    if eos_cells:
        notes.append(
            f"{', '.join(eos_cells)}: every request decodes to max_tokens past EOS (--ignore-eos "
            "sampled), so every configuration does the same work"
        )
    workers: dict[str, Any] = {}
    failed = False

    def engine_cells(engine: str, with_none: bool) -> list[dict[str, Any]]:
        out = []
        for c in cells:
            kinds = {x: parse_config(x, args.max_k).engine for x in c.configs}
            # nospec runs beside the main engine, in its process, when the cell has main configurations.
            host = "main" if "main" in kinds.values() else "nospec"
            cfg = [x for x, e in kinds.items() if (host if e == "nospec" else e) == engine]
            if not cfg:
                continue
            if with_none and "none" not in cfg:
                cfg = ["none", *cfg]
            out.append(_cell_payload(c, texts, cfg, ignore_eos=past_eos[c.id]))
        return out

    def run_group(group: str, payload: list[dict[str, Any]], **extra: Any) -> None:
        nonlocal failed
        if group == "hf":
            spec = {
                "model": args.model or _default_model(args.dtype),
                "dtype": args.dtype,
                "repeats": repeats,
                "pld_tokens": args.pld_tokens or args.max_k,
                "max_matching_ngram_size": None,
                "cells": payload,
            }
        else:
            spec = _engine_spec(args, group.split(":")[0], payload, repeats, confirm)
            spec["work_dir"] = str(work_dir)
            spec.update(extra)
        result, info = _run_worker(
            group.split(":")[0] if group != "hf" else "hf",
            spec,
            work_dir,
            args.worker_timeout,
            args.verbose,
            console,
        )
        if result is not None:
            info.update(
                {k: result.get(k) for k in ("build_s", "load_s", "environment") if k in result}
            )
        workers[group] = info
        failed = failed or info["returncode"] != 0
        _merge(merged, group.split(":")[0], result)

    main_cells = engine_cells("main", with_none=False)
    if main_cells:
        run_group("main", main_cells)
    # No speculation as an operator runs it: an engine built without speculative decoding (in its own
    # process only for cells without main-engine configurations).
    nospec_cells = engine_cells("nospec", with_none=False)
    if nospec_cells:
        run_group("nospec", nospec_cells)
    for cid in merged:
        if merged[cid]["configs"]:
            summarize_cell(merged[cid])
    # vLLM's own dynamic speculation: one engine per workload, its table tuned from the static runs.
    tables: dict[str, Any] = {}
    dyn = [c for c in cells if "vllm-dynamic" in c.configs]
    for label in dict.fromkeys(c.label for c in dyn):
        these = [c for c in dyn if c.label == label]
        best = best_k_by_concurrency(list(merged.values()), label)
        if not best:
            notes.append(
                f"vllm-dynamic skipped for {label}: no static n-gram runs to tune its table"
            )
            continue
        max_batch = max(c.concurrency for c in these)
        table = tune_table(best, max_batch)
        tables[label] = {"best_k_by_concurrency": best, "table": table}
        console.print(
            f"[bold]vLLM table[/] for {label} (best static n-gram k per concurrency {best}): {table}"
        )
        payload = [
            _cell_payload(c, texts, ["none", "vllm-dynamic"], ignore_eos=past_eos[c.id])
            for c in these
        ]
        run_group(f"dynamic:{label}", payload, dynamic_table=table)
        for c in these:
            merged[c.id]["dynamic_table"] = table
    draft_cells = engine_cells("draft", with_none=True)
    if draft_cells and draft_path:
        run_group("draft", draft_cells, draft_model=draft_path, lora_adapters=lora_adapters)
    hf_cells = engine_cells("hf", with_none=False)
    if hf_cells:
        run_group("hf", hf_cells)

    final = []
    for c in cells:
        cell = merged[c.id]
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
        "mode": mode,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_s": time.perf_counter() - t_start,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "repeats": repeats,
        "confirm": confirm,
        "environment": env_start,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "draft_model": draft_path,
        "workers": workers,
        "dynamic_tables": tables,
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
    return 1 if failed else 0


def _default_model(dtype: str) -> str:
    from adaptive_spec.vllm.models import default_model_path

    return str(default_model_path(dtype))
