"""The worker processes of ``adaptive-spec bench``: the spec each engine's process gets, starting it and
following its log, and merging its results into the cells.

One engine per process, one after the other: the main n-gram engine (with ``nospec`` beside it when the
cell has main-engine configurations), an engine without speculative decoding for cells that have none,
vLLM's dynamic speculation per workload with its batch-size table tuned from the main engine's static
runs, the draft-model engine, and the Hugging Face peer.
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

from adaptive_spec.commands.bench.plan import Cell, parse_config, tune_table
from adaptive_spec.commands.bench.resolve import BenchPlan, CellPrompts
from adaptive_spec.commands.bench.summary import best_k_by_concurrency, summarize_cell

WORKER_MODULES = {
    "main": "adaptive_spec.commands.bench.worker",
    "nospec": "adaptive_spec.commands.bench.worker",
    "dynamic": "adaptive_spec.commands.bench.worker",
    "draft": "adaptive_spec.commands.bench.worker",
    "hf": "adaptive_spec.commands.bench.hf_peer",
}


def slug(cell_id: str) -> str:
    """A cell id as a file-name part (``mixed/c4/t0.5`` -> ``mixed_c4_t0p5``)."""
    return cell_id.replace("/", "_").replace(".", "p")


def run_worker(
    group: str,
    spec: dict[str, Any],
    work_dir: Path,
    timeout: float | None,
    verbose: bool,
    console: Any,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run worker ``group`` (a key of :data:`WORKER_MODULES`) on ``spec`` and wait for it (at most
    ``timeout`` seconds, then it is killed). Its output goes to ``work_dir/worker_<group>.log``; lines
    it tags ``[<group>]`` (all of them with ``verbose``) are echoed to ``console``.

    Returns
    -------
    (result or None, info)
        The worker's results JSON (None when it wrote none) and ``returncode``, ``wall_s``, ``log``
        and, when it failed, ``log_tail``.
    """
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
    args: argparse.Namespace,
    engine: str,
    cells: list[dict[str, Any]],
    repeats: int,
    confirm: int = 0,
) -> dict[str, Any]:
    """The spec of a vLLM worker (:func:`adaptive_spec.commands.bench.worker.run_vllm_group`)."""
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


def cell_payload(
    cell: Cell, prompts: CellPrompts, configs: list[str], *, ignore_eos: bool
) -> dict[str, Any]:
    """A cell as a worker's spec lists it: its prompts' texts and categories, and ``configs``."""
    ev, tr = prompts.evaluated, prompts.training
    return {
        "id": cell.id,
        "slug": slug(cell.id),
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


def cell_record(cell: Cell, prompts: CellPrompts, *, ignore_eos: bool) -> dict[str, Any]:
    """A cell of ``bench.json`` before any run: what it is and which prompts it evaluates; the
    workers' runs are merged into ``configs`` (:func:`merge`)."""
    ev = prompts.evaluated
    return {
        "id": cell.id,
        "slug": slug(cell.id),
        "label": cell.label,
        "workload": cell.workload,
        "concurrency": cell.concurrency,
        "temperature": cell.temperature,
        "prompts": len(ev),
        "max_tokens": cell.max_tokens,
        "ignore_eos": ignore_eos,
        "prompt_ids": [p.source_id for p in ev],
        "configs": {},
    }


def merge(merged: dict[str, dict], group: str, result: dict[str, Any] | None) -> None:
    """Merge worker ``group``'s results into the cells (id -> cell record): each configuration's
    entry, the preparation and any error; the dynamic and draft engines' own no-speculation runs go
    to the cell's ``baselines``."""
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


def _default_model(dtype: str) -> str:
    from adaptive_spec.vllm.models import default_model_path

    return str(default_model_path(dtype))


class Launcher:
    """Runs a plan's worker processes in turn and merges their results.

    Attributes
    ----------
    cells : dict
        Cell id -> cell record (:func:`cell_record`), runs merged in.
    workers : dict
        Worker group -> its info (:func:`run_worker`, plus ``build_s``, ``load_s`` and ``environment``
        from its results).
    tables : dict
        Workload label -> ``{"best_k_by_concurrency", "table"}`` of vLLM's tuned dynamic table.
    failed : bool
        Whether a worker exited with an error.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        plan: BenchPlan,
        prompts: dict[str, CellPrompts],
        work_dir: Path,
        console: Any,
    ) -> None:
        self.args = args
        self.plan = plan
        self.prompts = prompts
        self.work_dir = work_dir
        self.console = console
        self.cells: dict[str, dict[str, Any]] = {
            c.id: cell_record(c, prompts[c.id], ignore_eos=plan.ignore_eos[c.id])
            for c in plan.cells
        }
        self.workers: dict[str, Any] = {}
        self.tables: dict[str, Any] = {}
        self.failed = False

    def _payload(self, cell: Cell, configs: list[str]) -> dict[str, Any]:
        return cell_payload(
            cell, self.prompts[cell.id], configs, ignore_eos=self.plan.ignore_eos[cell.id]
        )

    def engine_cells(self, engine: str, with_none: bool) -> list[dict[str, Any]]:
        """The cells (as a worker's spec lists them) with configurations on ``engine``, each with
        only those (and ``none`` first when ``with_none``)."""
        out = []
        for c in self.plan.cells:
            kinds = {x: parse_config(x, self.args.max_k).engine for x in c.configs}
            # nospec runs beside the main engine, in its process, when the cell has main configurations.
            host = "main" if "main" in kinds.values() else "nospec"
            cfg = [x for x, e in kinds.items() if (host if e == "nospec" else e) == engine]
            if not cfg:
                continue
            if with_none and "none" not in cfg:
                cfg = ["none", *cfg]
            out.append(self._payload(c, cfg))
        return out

    def run_group(self, group: str, payload: list[dict[str, Any]], **extra: Any) -> None:
        """Run one worker (``group``: its kind, or ``dynamic:<label>``) on ``payload`` and merge its
        results; ``extra``: more keys of its spec."""
        args = self.args
        kind = group.split(":")[0]
        if group == "hf":
            spec = {
                "model": args.model or _default_model(args.dtype),
                "dtype": args.dtype,
                "repeats": self.plan.repeats,
                "pld_tokens": args.pld_tokens or args.max_k,
                "max_matching_ngram_size": None,
                "cells": payload,
            }
        else:
            spec = _engine_spec(args, kind, payload, self.plan.repeats, self.plan.confirm)
            spec["work_dir"] = str(self.work_dir)
            spec.update(extra)
        result, info = run_worker(
            kind, spec, self.work_dir, args.worker_timeout, args.verbose, self.console
        )
        if result is not None:
            info.update(
                {k: result.get(k) for k in ("build_s", "load_s", "environment") if k in result}
            )
        self.workers[group] = info
        self.failed = self.failed or info["returncode"] != 0
        merge(self.cells, kind, result)

    def run_dynamic(self) -> None:
        """vLLM's own dynamic speculation: one engine per workload, its table tuned from the static
        n-gram runs already summarized."""
        dyn = [c for c in self.plan.cells if "vllm-dynamic" in c.configs]
        for label in dict.fromkeys(c.label for c in dyn):
            these = [c for c in dyn if c.label == label]
            best = best_k_by_concurrency(list(self.cells.values()), label)
            if not best:
                self.plan.notes.append(
                    f"vllm-dynamic skipped for {label}: no static n-gram runs to tune its table"
                )
                continue
            max_batch = max(c.concurrency for c in these)
            table = tune_table(best, max_batch)
            self.tables[label] = {"best_k_by_concurrency": best, "table": table}
            self.console.print(
                f"[bold]vLLM table[/] for {label} (best static n-gram k per concurrency {best}): {table}"
            )
            payload = [self._payload(c, ["none", "vllm-dynamic"]) for c in these]
            self.run_group(f"dynamic:{label}", payload, dynamic_table=table)
            for c in these:
                self.cells[c.id]["dynamic_table"] = table

    def run_all(self) -> None:
        """Every worker of the plan, in order: main, nospec, the dynamic tables (after summarizing
        the static runs they are tuned from), the draft engine, HF."""
        main_cells = self.engine_cells("main", with_none=False)
        if main_cells:
            self.run_group("main", main_cells)
        # No speculation as an operator runs it: an engine built without speculative decoding (in its
        # own process only for cells without main-engine configurations).
        nospec_cells = self.engine_cells("nospec", with_none=False)
        if nospec_cells:
            self.run_group("nospec", nospec_cells)
        for cell in self.cells.values():
            if cell["configs"]:
                summarize_cell(cell)
        self.run_dynamic()
        draft_cells = self.engine_cells("draft", with_none=True)
        if draft_cells and self.plan.draft_path:
            self.run_group(
                "draft",
                draft_cells,
                draft_model=self.plan.draft_path,
                lora_adapters=self.plan.lora_adapters,
            )
        hf_cells = self.engine_cells("hf", with_none=False)
        if hf_cells:
            self.run_group("hf", hf_cells)
