"""One vLLM engine per process: every configuration of its cells, on the same prompts, repeats interleaved.

Run by ``adaptive-spec bench`` as ``python -m adaptive_spec.commands.bench.worker SPEC.json OUT.json``. The
engine is built once (``max_num_seqs`` = the largest concurrency of its cells); a cell's concurrency is
set through vLLM's own admission limit (``max_num_active_seqs``, the scheduler's
``max_num_active_reqs``), which keeps smaller decode batches without rebuilding the engine
(:mod:`~adaptive_spec.commands.bench.worker_engine`). Per cell (steps 1 and 2:
:mod:`~adaptive_spec.commands.bench.worker_cell`):

1. an untimed pass with speculation off warms the engine and the prefix cache; for a greedy cell it is
   the **reference** (``logprobs=2``) that every greedy run is checked against
   (:func:`adaptive_spec.commands.identity.compare_greedy`);
2. for ``adaptive-warm``, an untimed, traced **training** pass of the adaptive controller on held-out
   prompts of the same workload saves the policy state (and gives the arm-mix-over-time plot); with
   ``trace_evaluated`` in the spec, an untimed, traced pass of ``adaptive`` as its timed run of round 0
   runs it, on the evaluated prompts (``trace_eval_<cell>.jsonl``: the trace that
   ``adaptive-spec replay`` can be checked against the timed runs with);
3. ``repeats`` rounds; in each, every configuration generates for all the cell's prompts once, in an
   order rotated by one each round. Each run reports wall time, output tokens, goodput, mean accepted
   length, acceptance rate, controller overhead and greedy identity;
4. ``confirm`` confirmation rounds (main engine): only ``adaptive``, the best static arm of the rounds
   so far and ``none``, back to back in a rotated order, so that the goals' ratios are paired over runs
   seconds apart (this machine's speed drifts by 10-25 % over minutes). Their runs carry
   ``"confirm": true``.

A cell of the main engine that lists ``nospec`` runs it on a second engine built in the same process,
without speculative decoding (after a prefill pass that warms its prefix cache), in the same rounds as
the others and in the confirmation rounds: its ratios are paired run by run like those of the main
engine's configurations, instead of carrying the drift between two processes.

Configurations that attach :class:`~adaptive_spec.vllm.AdaptiveSpec` get only the proposers they use, so a
static n-gram arm does not pay for Jacobi drafting; ``vllm-ngram`` and ``vllm-dynamic`` run the engine with
nothing attached, counted by a passive observer that changes nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from adaptive_spec.commands.bench.jsonio import worker_main, write_json
from adaptive_spec.commands.bench.plan import parse_config, rotated
from adaptive_spec.commands.bench.worker_cell import CellState, attach, prepare_cell
from adaptive_spec.commands.bench.worker_engine import (
    build_engine,
    generate,
    generate_with,
    prefill_params,
    schedulers,
)


class PassiveCounter:
    """Counts, without changing anything, what a bare engine verifies and emits per step: request-steps,
    draft tokens, accepted draft tokens and sampled tokens (before EOS/length truncation). Wraps the
    scheduler's ``update_from_output`` on the instance; :meth:`detach` restores it."""

    def __init__(self, llm: Any) -> None:
        self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        self.request_steps = 0
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.steps = 0
        self._had = "update_from_output" in vars(self.scheduler)
        self._orig = self.scheduler.update_from_output
        orig = self._orig

        def update_from_output(so: Any, mro: Any) -> Any:
            try:
                sampled = mro.sampled_token_ids or []
                index = mro.req_id_to_index
                spec = so.scheduled_spec_decode_tokens
                self.steps += 1
                for rid in so.num_scheduled_tokens:
                    i = index.get(rid)
                    if i is None or i >= len(sampled) or not len(sampled[i]):
                        continue
                    n = len(sampled[i])
                    d = len(spec.get(rid, ()))
                    self.request_steps += 1
                    self.emitted += n
                    self.drafted += d
                    self.accepted += min(n - 1, d) if d else 0
            except Exception:  # an observer never takes the engine down
                pass
            return orig(so, mro)

        self.scheduler.update_from_output = update_from_output

    def detach(self) -> None:
        if self._had:
            self.scheduler.update_from_output = self._orig
        else:
            del self.scheduler.update_from_output

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "request_steps": self.request_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
        }


def _totals(stats: dict[str, Any]) -> dict[str, Any]:
    rows = stats.get("by_proposer", {}).values()
    return {
        "steps": stats.get("steps", 0),
        "request_steps": sum(r["request_steps"] for r in rows),
        "drafted": sum(r["drafted"] for r in rows),
        "accepted": sum(r["accepted"] for r in rows),
        "emitted": sum(r["emitted"] for r in rows),
    }


def _run_config(
    llm: Any,
    cell: CellState,
    name: str,
    engine: str,
    max_k: int,
    repeat: int,
    work_dir: Path,
    lora_adapters: dict[str, str] | None = None,
) -> dict[str, Any]:
    from adaptive_spec.commands.identity import compare_greedy

    info = parse_config(name, max_k)
    stats: dict[str, Any] | None = None
    table_source = None  # where the policy's step-cost table came from (policies that price steps)
    if info.kind in ("vllm", "nospec"):
        counter = PassiveCounter(llm)
        outs, wall = generate_with(counter, llm, cell.ids, cell.params)
        totals = counter.summary()
        overhead = None
    else:
        state = None
        if name == "adaptive-warm":
            if not cell.state_path.exists():
                raise RuntimeError(f"no trained policy state at {cell.state_path}")
            state = work_dir / f"warm_{cell.spec['slug']}_r{repeat}.json"
            shutil.copyfile(cell.state_path, state)
        spec = attach(llm, cell, name, engine, max_k, repeat, state, lora_adapters)
        outs, wall = generate_with(spec, llm, cell.ids, cell.params)
        stats = spec.stats()
        totals = _totals(stats)
        overhead = stats["controller_overhead"]
        table_source = spec.cost_table_source
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    run: dict[str, Any] = {
        "repeat": repeat,
        "wall_s": wall,
        "output_tokens": n,
        "goodput_tok_s": n / wall if wall > 0 else 0.0,
        "mean_accepted_length": totals["emitted"] / totals["request_steps"]
        if totals["request_steps"]
        else None,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "controller_overhead": overhead,
        "totals": totals,
        "valid": True,
    }
    if table_source is not None:
        run["cost_table_source"] = table_source
    if stats is not None:
        run["faults"] = stats["faults"]
        run["by_arm"] = {
            a: {"request_steps": s["request_steps"], "emitted": s["emitted"]}
            for a, s in stats["by_arm"].items()
        }
        if info.kind == "adaptive":
            run["by_category"] = stats["by_category"]
    if cell.reference is not None:
        ident = compare_greedy(cell.reference, outs)
        ident["details"] = ident["details"][:10]
        run["identity"] = ident
        run["valid"] = ident["violations"] == 0
    return run


def run_vllm_group(spec: dict[str, Any], out_path: str | Path | None = None) -> dict[str, Any]:
    """Build the engine and run every cell of the spec.

    Parameters
    ----------
    spec : dict
        ``engine`` (main, dynamic, draft), ``model``, ``dtype``, ``max_k``, ``max_num_seqs``,
        ``enforce_eager``, ``draft_model``, ``lora_adapters`` (name -> directory, draft engine only),
        ``dynamic_table``, ``seed``, ``repeats`` (>= 1), ``work_dir``, ``trace_evaluated`` (bool,
        optional: the traced pass of step 2 of the module docstring), and
        ``cells``: dicts with ``id``, ``slug``, ``texts``, ``categories``, ``train_texts``,
        ``train_categories``, ``concurrency`` (<= ``max_num_seqs``), ``temperature``, ``max_tokens`` and
        ``configs``.
    out_path : path, optional
        Results JSON, rewritten after every cell (a crash keeps the cells already done).

    Returns
    -------
    dict
        ``{"engine", "build_s", "environment", "cells": {id: {"prepare": {...}, "configs": {name:
        {"engine", "runs": [...]}}}}}``; a configuration that failed has ``error`` instead of runs.

    Raises
    ------
    ValueError
        For repeats < 1 or a cell whose concurrency exceeds ``max_num_seqs``.
    """
    repeats = int(spec["repeats"])
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    confirm = int(spec.get("confirm", 0))
    if confirm < 0:
        raise ValueError(f"confirm={confirm!r} is invalid; allowed: an integer >= 0")
    max_seqs = int(spec["max_num_seqs"])
    for c in spec["cells"]:
        if int(c["concurrency"]) > max_seqs:
            raise ValueError(
                f"cell {c['id']}: concurrency {c['concurrency']} exceeds max_num_seqs={max_seqs}"
            )
    engine = spec["engine"]
    max_k = int(spec.get("max_k", 8))
    work_dir = Path(spec["work_dir"])
    work_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{engine}] {msg}", flush=True)

    t0 = time.perf_counter()
    llm = build_engine(spec)
    build_s = time.perf_counter() - t0
    log(f"engine built in {build_s:.1f} s")
    nospec_llm = None
    if engine == "main" and any("nospec" in c["configs"] for c in spec["cells"]):
        # Built second: vLLM 0.32's CPU build fails to build a speculative engine after a plain one.
        t1 = time.perf_counter()
        nospec_llm = build_engine({**spec, "engine": "nospec"})
        log(
            f"engine without speculative decoding built beside it in {time.perf_counter() - t1:.1f} s"
        )
    import torch

    from adaptive_spec.vllm.engine import vllm_version

    result: dict[str, Any] = {
        "engine": engine,
        "build_s": build_s,
        "enforce_eager": bool(spec.get("enforce_eager")),
        "dynamic_table": spec.get("dynamic_table"),
        "nospec_same_process": nospec_llm is not None,
        "environment": {
            "torch_threads": torch.get_num_threads(),
            "vllm": vllm_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "cells": {},
    }
    scheds = schedulers(llm, nospec_llm)
    for cell_spec in spec["cells"]:
        for s in scheds:
            s.max_num_active_reqs = int(cell_spec["concurrency"])
        cell = CellState(llm, cell_spec, work_dir)
        res: dict[str, Any] = {"configs": {}}
        result["cells"][cell.id] = res
        configs = list(cell_spec["configs"])
        beside = nospec_llm if "nospec" in configs else None
        try:
            res["prepare"] = prepare_cell(
                llm, cell, max_k, log, trace_evaluated=bool(spec.get("trace_evaluated"))
            )
            if beside is not None:
                # Prefill pass: the plain engine's prefix cache as warm as the main engine's.
                generate(beside, cell.ids, prefill_params())
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            log(f"{cell.id}: preparation failed: {res['error']}")
            continue
        for name in configs:
            on_beside = name == "nospec" and beside is not None
            res["configs"][name] = (
                {"engine": "nospec", "same_process": True, "runs": []}
                if on_beside
                else {"engine": engine, "runs": []}
            )

        rnd = _Round(
            llm, cell, res, engine, max_k, work_dir, spec.get("lora_adapters"), repeats, log, beside
        )
        for r in range(repeats):
            _run_round(rnd, r, rotated(configs, r), f"repeat {r + 1}/{repeats}")
        trio = confirm_configs(res["configs"]) if confirm else []
        if trio:
            res["confirm"] = {"configs": trio, "rounds": confirm}
            for i in range(confirm):
                _run_round(rnd, repeats + i, rotated(trio, i), f"confirmation {i + 1}/{confirm}")
        if out_path is not None:
            write_json(out_path, result)
    for s in scheds:
        s.max_num_active_reqs = s.max_num_running_reqs
    if out_path is not None:
        write_json(out_path, result)
    return result


class _Round(NamedTuple):
    """What one round of a cell's runs needs."""

    llm: Any
    cell: CellState
    res: dict[str, Any]
    engine: str
    max_k: int
    work_dir: Path
    lora_adapters: dict[str, str] | None
    repeats: int
    log: Callable[[str], None]
    nospec_llm: Any = None  # the engine without speculative decoding, when it runs in this process


def _run_round(rd: _Round, r: int, order: list[str], label: str) -> None:
    """Run the configurations of ``order`` once each (round ``r``; ``r >= repeats``: a confirmation
    round, its runs marked ``confirm``), appending each run or the configuration's error."""
    for name in order:
        entry = rd.res["configs"][name]
        if "error" in entry:
            continue
        try:
            llm = rd.nospec_llm if name == "nospec" and rd.nospec_llm is not None else rd.llm
            run = _run_config(
                llm, rd.cell, name, rd.engine, rd.max_k, r, rd.work_dir, rd.lora_adapters
            )
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            rd.log(f"{rd.cell.id} {name}: failed: {entry['error']}")
            continue
        if r >= rd.repeats:
            run["confirm"] = True
        entry["runs"].append(run)
        ovh = run["controller_overhead"]
        mal = run["mean_accepted_length"]
        rd.log(
            f"{rd.cell.id} {label} {name}: {run['goodput_tok_s']:.1f} tokens/s "
            f"({run['wall_s']:.1f} s)"
            + (f", accepted length {mal:.2f}" if mal is not None else "")
            + (f", overhead {100 * ovh:.1f}%" if ovh is not None else "")
            + ("" if run["valid"] else "  INVALID: greedy identity violated")
        )


def confirm_configs(configs: dict[str, dict[str, Any]]) -> list[str]:
    """The configurations of a cell's confirmation rounds: ``adaptive``, the best static arm of the
    repeats so far (:func:`adaptive_spec.commands.bench.summary.best_static_arm`) and ``none``, the
    three that goals A and C compare; empty when the cell lacks one of them (or it failed)."""
    from adaptive_spec.commands.bench.summary import best_static_arm

    ok = {n: e for n, e in configs.items() if "error" not in e and e.get("runs")}
    best = best_static_arm(ok)
    trio = ["adaptive", best, "none"]
    if best is None or not all(n in ok for n in trio):
        return []
    return [*trio, "nospec"] if ok.get("nospec", {}).get("same_process") else trio


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m adaptive_spec.commands.bench.worker SPEC.json OUT.json``."""
    return worker_main("adaptive_spec.commands.bench.worker", run_vllm_group, argv, quiet_vllm=True)


if __name__ == "__main__":
    sys.exit(main())
