"""``adaptive-spec run --compare-static``: the main job against what an operator would otherwise run.

On the same prompts, after one untimed pass of all of them with speculation off (the warm-up that fills
vLLM's prefix cache and, for greedy decoding, the reference every run is checked against), each round
runs, in an order rotated by one per round:

* ``none``: speculation off in the same engine (every request k = 0);
* the controller's **baseline** (its safety rule's comparator; default the shipped n-gram batch-size
  table) as a static policy;
* the **adaptive** controller (each round starts from the same learned state, so rounds do not train
  each other; the last round's state is saved).

``none`` and the baseline enable only the proposer they play (:func:`static_proposers`), as an operator
would run them; the adaptive controller pays for every proposer it may choose.

No timed run is traced. After the rounds, one more adaptive run from the same state writes the trace
that the per-category table, the plot and ``adaptive-spec replay`` use; it is not part of the ratios
(tracing costs time inside the step loop that the other configurations would not pay).

Ratios are paired per round (the machine drifts between rounds) and the medians reported. With
``nospec`` (the default), an engine built **without speculative decoding**, what an operator runs
without adaptive-spec, runs the same prompts in the same rounds, in the same process: vLLM 0.32's CPU
build holds it beside the speculative engine when it is built second
(:func:`adaptive_spec.commands.run.build_engine` with ``speculative=False``),
so its ratios are paired like the others (they had spanned two processes, minutes apart, and carried
the machine's drift between them). Where that build fails, it runs in a worker process afterwards
(:func:`run_nospec_engine`), and that ratio is unpaired and says so.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from adaptive_spec.commands.generation import GenerationJob, RunResult, generate
from adaptive_spec.core.baselines import default_baseline_spec


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def compare_in_engine(
    console: Any,
    job: GenerationJob,
    args: Any,
    reference: list[Any],
    state: Any,
    prompts: list[Any],
    nospec_llm: Any = None,
) -> tuple[list[Any], float, dict[str, Any], dict[str, Any]]:
    """Run the rounds (module docstring) of ``job``'s prompts. Returns the traced adaptive run after
    them (outputs, wall time, stats) and the results: per configuration the goodput per round,
    medians, paired ratios to ``none``, to the baseline and (with ``nospec_llm``, the engine without
    speculative decoding built in this process) to ``nospec``, greedy identity, and how the engine
    without speculative decoding was measured.

    ``reference`` holds the warm-up pass's outputs (the greedy reference), ``state`` the adaptive
    controller's starting state (a file, ``"auto"`` or None) and ``prompts`` the workload's prompts
    (for the engine without speculative decoding in a worker process)."""
    from adaptive_spec.commands.identity import compare_greedy

    llm, proposers = job.llm, job.proposers
    greedy = args.temperature == 0
    baseline = args.baseline or default_baseline_spec(proposers, args.max_k)
    names = ["none", baseline, "adaptive"] + (["nospec"] if nospec_llm is not None else [])
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    texts: dict[tuple[str, int], list[Any]] = {}  # (configuration, round) -> its outputs
    snapshot = _state_snapshot(llm, args, proposers, state)
    last: RunResult | None = None
    last_state: Path | None = None
    work = Path(tempfile.mkdtemp(prefix="adaptive-spec-compare-"))

    def state_copy(name: str) -> Path | None:
        # A fresh copy of the starting state for one adaptive run (None: no state kept).
        if snapshot is None:
            return None
        tmp = work / name
        if snapshot.exists():
            shutil.copyfile(snapshot, tmp)
        return tmp

    try:
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                console.print(f"[bold]round {r + 1}/{args.repeats}[/]: {name}")
                if name == "adaptive":
                    tmp = state_copy(f"state_r{r}.json")
                    outs, wall, stats = job.run_adaptive(False, tmp)
                    last_state = tmp
                elif name == "nospec":
                    outs, wall, stats = _run_plain(nospec_llm, job.token_ids, job.params)
                else:
                    outs, wall, stats = job.run_static(name, static_proposers(name, proposers))
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                run = {"round": r, "wall_s": wall, "output_tokens": n, "goodput_tok_s": n / wall}
                texts[(name, r)] = outs
                if greedy:
                    ident = compare_greedy(reference, outs)
                    ident.pop("details", None)
                    run["identity"] = ident
                # Where a difference comes from: more engine steps, or slower ones (the step time
                # includes the hooks and the controller), and how many draft tokens were verified.
                run["steps"] = stats["steps"]
                # (the engine without speculative decoding has no hooks: its wall time per step)
                run["mean_step_ms"] = 1e3 * stats["step_time_s"] / max(stats["steps"], 1)
                run["controller_overhead"] = stats["controller_overhead"]
                run["faults"] = stats["faults"]
                cats = list(stats["by_category"].values())
                run["drafted"] = sum(c["drafted"] for c in cats)
                run["accepted"] = sum(c["accepted"] for c in cats)
                run["mean_accepted_length"] = sum(c["emitted"] for c in cats) / max(
                    sum(c["request_steps"] for c in cats), 1
                )
                runs[name].append(run)
        # Whose outputs differ from the baseline's in the same round: in reduced precision a
        # different batch shape can flip a near-tie, and the rest of that request's text differs.
        for name, rs in runs.items():
            for run in rs:
                other = texts.get((baseline, run["round"]))
                if other is not None:
                    run["diverged_from_baseline"] = diverged_requests(
                        texts[(name, run["round"])], other
                    )
                    run["requests"] = len(other)
        texts.clear()
        # The traced run (per-category table, trace, plot): untimed for the comparison, because a
        # trace costs the run time the untraced configurations do not pay (its JSON lines are
        # written inside the step loop: about 0.2 ms per step at concurrency 16 on 2 CPU cores).
        console.print("traced run: adaptive (for the per-category table, trace and plot; untimed)")
        last = job.run_adaptive(True, state_copy("state_traced.json"))
        if snapshot is not None and last_state is not None and last_state.exists():
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(last_state, snapshot)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert last is not None
    results = summarize_rounds(runs, baseline)
    if nospec_llm is not None:
        ns = results["configs"]["nospec"]
        results["nospec"] = {
            "goodput_tok_s": ns["goodput_tok_s"],
            "goodput_runs": [r["goodput_tok_s"] for r in ns["runs"]],
            "paired": True,
        }
    elif getattr(args, "nospec", True):
        results["nospec"] = run_nospec_engine(console, args, prompts)
        ns = results["nospec"].get("goodput_tok_s")
        none = results["configs"]["none"]["goodput_tok_s"]
        if ns and none:
            for c in results["configs"].values():
                c["ratio_to_nospec"] = c["goodput_tok_s"] / ns
    return last[0], last[1], last[2], results


def _run_plain(llm: Any, token_ids: list[list[int]], params: Any) -> RunResult:
    """One timed pass on the engine without speculative decoding, counted without changing it
    (:class:`~adaptive_spec.commands.bench.worker.PassiveCounter`); the stats a comparison run needs."""
    from adaptive_spec.commands.bench.worker import PassiveCounter

    counter = PassiveCounter(llm)
    try:
        outs, wall = generate(llm, token_ids, params)
    finally:
        counter.detach()
    t = counter.summary()
    cat = {k: t[k] for k in ("request_steps", "drafted", "accepted", "emitted")}
    stats = {
        "steps": t["steps"],
        "step_time_s": wall,
        "controller_overhead": None,
        "faults": 0,
        "by_category": {"all": cat},
    }
    return outs, wall, stats


def static_proposers(policy: str, proposers: list[str]) -> list[str]:
    """The proposers a non-adaptive configuration enables: only the one it plays (``none`` alone for
    ``none``), so that it does not pay for drafting, or the target's argmax rows, of proposers it never
    uses (as an operator would configure it). Other policies get ``proposers`` unchanged."""
    head, _, rest = policy.partition(":")
    if policy == "none":
        return ["none"]
    if head in ("static", "table"):
        p = rest.partition(":")[0]
        return ["none", p] if p in proposers and p != "none" else ["none"]
    return list(proposers)


def diverged_requests(a: list[Any], b: list[Any]) -> int:
    """How many requests' output token ids differ between two runs of the same prompts (vLLM
    ``RequestOutput`` lists in prompt order)."""
    if len(a) != len(b):
        raise ValueError(f"runs of {len(a)} and {len(b)} requests; expected the same prompts")
    return sum(
        list(x.outputs[0].token_ids) != list(y.outputs[0].token_ids)
        for x, y in zip(a, b, strict=True)
    )


def summarize_rounds(runs: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, Any]:
    """Medians and paired ratios (per round) of each configuration's goodput: to ``none``, to the
    baseline and, when the engine without speculative decoding ran in the same rounds (``nospec`` in
    ``runs``), to it."""
    by_round = {n: {r["round"]: r["goodput_tok_s"] for r in rs} for n, rs in runs.items()}
    out: dict[str, Any] = {"baseline": baseline, "configs": {}}
    for name, rs in runs.items():
        med = _median([r["goodput_tok_s"] for r in rs])
        to_none = _median(
            [g / by_round["none"][k] for k, g in by_round[name].items() if by_round["none"].get(k)]
        )
        to_base = _median(
            [
                g / by_round[baseline][k]
                for k, g in by_round[name].items()
                if by_round[baseline].get(k)
            ]
        )
        idents = [r["identity"] for r in rs if "identity" in r]
        div = [r for r in rs if "diverged_from_baseline" in r]
        to_nospec = (
            _median(
                [
                    g / by_round["nospec"][k]
                    for k, g in by_round[name].items()
                    if by_round["nospec"].get(k)
                ]
            )
            if "nospec" in by_round
            else None
        )
        out["configs"][name] = {
            "runs": rs,
            "goodput_tok_s": med,
            "ratio_to_none": to_none,
            "ratio_to_baseline": to_base,
            **({"ratio_to_nospec": to_nospec} if to_nospec is not None else {}),
            "mean_accepted_length": _median([r["mean_accepted_length"] for r in rs]),
            "identity": {
                k: sum(i[k] for i in idents)
                for k in ("total", "identical", "near_tie", "violations")
            }
            if idents
            else None,
            "diverged_from_baseline": {
                "requests": sum(r["diverged_from_baseline"] for r in div),
                "total": sum(r["requests"] for r in div),
            }
            if div
            else None,
        }
    return out


def _state_snapshot(llm: Any, args: Any, proposers: list[str], state: Any) -> Path | None:
    """The state file the adaptive rounds start from (and the last round's state is saved to)."""
    if state is None:
        return None
    if state != "auto":
        return Path(state)
    from adaptive_spec.core.machine import engine_key
    from adaptive_spec.core.policies import make_policy
    from adaptive_spec.core.state import auto_state_path

    mc = llm.llm_engine.vllm_config.model_config
    pol = make_policy(args.policy, proposers, args.max_k)
    return auto_state_path(pol, engine_key(mc.model, str(mc.dtype)), proposers)


def run_nospec_engine(console: Any, args: Any, prompts: list[Any]) -> dict[str, Any]:
    """The same prompts on an engine built without speculative decoding, in a worker process
    (:mod:`adaptive_spec.commands.bench.worker`, engine ``nospec``): warm-up pass, then ``args.repeats``
    timed passes. Returns the median goodput (tokens/s) and the runs, or an ``error``."""
    console.print(
        "[bold]engine without speculative decoding[/] (its own process: one more engine build)"
    )
    work = Path(tempfile.mkdtemp(prefix="adaptive-spec-nospec-"))
    spec = {
        "engine": "nospec",
        "model": args.model,
        "dtype": args.dtype,
        "max_k": args.max_k,
        "max_num_seqs": args.concurrency,
        "seed": args.seed,
        "repeats": args.repeats,
        "work_dir": str(work),
        "cells": [
            {
                "id": "main-job",
                "slug": "main-job",
                "workload": args.workload,
                "concurrency": args.concurrency,
                "temperature": args.temperature,
                "max_tokens": args.max_tokens,
                "texts": [p.text for p in prompts],
                "categories": [p.category for p in prompts],
                "configs": ["nospec"],
            }
        ],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "adaptive_spec.commands.bench.worker",
        str(work / "spec.json"),
        str(out),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"worker exited with {proc.returncode}: {' | '.join(tail)}"}
        res = json.loads(out.read_text())
        entry = res["cells"]["main-job"]["configs"]["nospec"]
        if "error" in entry:
            return {"error": entry["error"]}
        goodputs = [r["goodput_tok_s"] for r in entry["runs"]]
        return {
            "goodput_tok_s": _median(goodputs),
            "goodput_runs": goodputs,
            "build_s": res.get("build_s"),
            "paired": False,
        }
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_comparison(console: Any, results: dict[str, Any], greedy: bool) -> None:
    """The comparison table: per configuration, median goodput, paired ratios, identity."""
    from rich.table import Table

    cmp = results.get("comparison")
    if not cmp:
        return
    t = Table(title="goodput on the same prompts (medians over interleaved rounds)")
    for col in (
        "configuration",
        "tokens/s",
        "x k=0 (same engine)",
        "x baseline",
        "x no-spec engine",
        "accepted length",
        "greedy identity",
    ):
        t.add_column(
            col, justify="left" if col in ("configuration", "greedy identity") else "right"
        )
    ns = cmp.get("nospec", {})
    for name, c in cmp["configs"].items():
        label = {
            "none": "speculation off (k = 0)",
            "adaptive": "adaptive",
            "nospec": "engine without speculative decoding",
        }.get(name, f"baseline {name}")
        ident = c.get("identity")
        t.add_row(
            label,
            f"{c['goodput_tok_s']:.1f}",
            f"{c['ratio_to_none']:.3f}" if c["ratio_to_none"] else "-",
            f"{c['ratio_to_baseline']:.3f}" if c["ratio_to_baseline"] else "-",
            f"{c['ratio_to_nospec']:.3f}" if c.get("ratio_to_nospec") else "-",
            f"{c['mean_accepted_length']:.2f}" if c["mean_accepted_length"] else "-",
            (
                f"{ident['identical']}/{ident['total']} identical, {ident['near_tie']} near-ties, "
                f"{ident['violations']} violations"
            )
            if greedy and ident
            else "-",
        )
    if ns.get("goodput_tok_s") and "nospec" not in cmp["configs"]:
        t.add_row(
            "engine without speculative decoding",
            f"{ns['goodput_tok_s']:.1f}",
            "",
            "",
            "1.000",
            "",
            "",
        )
    notes = ["ratios to k=0 and to the baseline are paired per round"]
    if ns.get("error"):
        notes.append(f"engine without speculative decoding: not measured ({ns['error']})")
    elif ns.get("paired"):
        notes[0] = (
            "ratios are paired per round (the engine without speculative decoding ran in the same "
            "rounds, in the same process)"
        )
    elif ns:
        notes.append(
            "the engine without speculative decoding ran in its own process after the others (unpaired)"
        )
    if greedy:
        div = (cmp["configs"].get("adaptive") or {}).get("diverged_from_baseline")
        if div and div["requests"]:
            notes.append(
                f"adaptive's output differed from the baseline's on {div['requests']} of "
                f"{div['total']} request-runs (numeric near-ties of reduced precision, where the "
                "batch shape decides the rounding): those ratios also compare different texts, "
                "which on a few dozen prompts moves them by several per cent either way; "
                "--dtype float32 compares the same texts"
            )
    t.caption = "; ".join(notes)
    console.print(t)
