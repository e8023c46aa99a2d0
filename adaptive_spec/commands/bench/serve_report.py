"""The PNG, the rich tables and the Markdown of ``adaptive-spec bench serve`` (``bench_serve.json``).

``python -m adaptive_spec.commands.bench.serve_report runs/bench-serve/bench_serve.json`` prints the tables as
Markdown (for ``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench import jsonio
from adaptive_spec.commands.bench.report import fmt, machine_text, met_text, provenance
from adaptive_spec.commands.bench.serve_summary import headline


def _identity(run: dict[str, Any]) -> str:
    ident = run.get("identity")
    if ident is None:
        return "reference" if run.get("config") == "none" else "-"
    text = f"{ident['identical']}/{ident['compared']}"
    if ident["skipped"]:
        text += f" ({ident['skipped']} n/a)"
    return text


def _ms3(stats: dict[str, Any]) -> str:
    return " / ".join(fmt(stats.get(k), ".0f") for k in ("mean", "p50", "p99"))


def rows(data: dict[str, Any]) -> list[dict[str, str]]:
    """One row per pattern x configuration (patterns in run order, configurations in run order)."""
    out = []
    for pat in data["patterns"]:
        name = pat["name"]
        best = (data["pattern_summaries"].get(name) or {}).get("best_static")
        for cfg in data["configs"]:
            run = data["runs"].get(cfg["name"], {}).get(name)
            if run is None:
                continue
            label = cfg["name"] + (" *" if cfg["name"] == best else "")
            if "error" in run:
                out.append({"pattern": name, "configuration": label, "error": run["error"]})
                continue
            acc, length = headline(run)
            out.append(
                {
                    "pattern": name,
                    "configuration": label,
                    "done/sent": f"{run['completed']}/{run['sent']}",
                    "failed": str(run["failed"] + run["lost"]),
                    "out tok/s": fmt(run["output_tok_s"], ".1f"),
                    "x none": fmt(run.get("ratio_to_none"), ".2f", "x"),
                    "x best static": fmt(run.get("ratio_to_best_static"), ".2f", "x"),
                    "req/s": fmt(run["request_throughput"], ".2f"),
                    "TTFT ms mean/p50/p99": _ms3(run["ttft_ms"]),
                    "TPOT ms mean/p50/p99": _ms3(run["tpot_ms"]),
                    "ITL ms mean/p50/p99": _ms3(run["itl_ms"]),
                    "accept": fmt(acc, ".0%"),
                    "acc. len": fmt(length, ".2f"),
                    "greedy same": _identity(run),
                }
            )
    return out


COLUMNS = (
    "pattern",
    "configuration",
    "done/sent",
    "failed",
    "out tok/s",
    "x none",
    "x best static",
    "req/s",
    "TTFT ms mean/p50/p99",
    "TPOT ms mean/p50/p99",
    "ITL ms mean/p50/p99",
    "accept",
    "acc. len",
    "greedy same",
)
CAPTION = (
    "* best static configuration of the pattern (highest output tokens/s). x none / x best static: output "
    "tokens/s ratios within the pattern. failed: refused or broken requests (counted, never dropped). "
    "accept: accepted / drafted tokens; acc. len: tokens per request-step (plugin: all steps; vLLM's own "
    "speculation: 1 + accepted / drafts). greedy same: greedy requests whose text equals no "
    "speculation's."
)


def print_tables(console: Any, data: dict[str, Any]) -> None:
    """The goals, then the main table (printed last)."""
    from rich.table import Table

    if data.get("goals"):
        gt = Table(title="Goals (server under load)")
        for col in ("goal", "configuration", "pattern", "measured", "target", "met", "note"):
            gt.add_column(col)
        for g in data["goals"]:
            met = met_text(g)
            target = f">= {g['threshold']:.2f}x"
            gt.add_row(
                g["goal"],
                g["config"],
                g["pattern"],
                fmt(g["measured"], ".3f", "x"),
                target,
                met,
                g["note"],
            )
        console.print(gt)
    t = Table(
        title=f"adaptive-spec bench serve ({data['mode']}): vLLM's serving benchmark per pattern"
    )
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("pattern", "configuration") else "right")
    last = None
    for r in rows(data):
        if last is not None and r["pattern"] != last:
            t.add_section()
        first = r["pattern"] != last
        last = r["pattern"]
        if "error" in r:
            t.add_row(
                r["pattern"] if first else "", r["configuration"], f"error: {r['error'][:80]}"
            )
            continue
        t.add_row(*[(r[c] if c != "pattern" or first else "") for c in COLUMNS])
    t.caption = CAPTION
    console.print(t)


def markdown(data: dict[str, Any]) -> str:
    """The environment line, the goals and the main table as Markdown."""
    s = data.get("settings", {})
    lines = [
        provenance(data)
        + f", {data.get('total_s', 0) / 60:.1f} min; model {Path(str(s.get('model', '?'))).name} "
        f"({s.get('dtype')}), {s.get('requests')} requests x {s.get('max_tokens')} tokens per pattern, "
        f"max_num_seqs {s.get('max_num_seqs')}; {machine_text(data.get('environment', {}))}.",
        "",
    ]
    if data.get("goals"):
        lines += [
            "| goal | configuration | pattern | measured | target | met | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for g in data["goals"]:
            met = met_text(g, {True: "met", False: "**unmet**", None: "n/a"})
            lines.append(
                f"| {g['goal']} | `{g['config']}` | `{g['pattern']}` | {fmt(g['measured'], '.3f', 'x')} | "
                f">= {g['threshold']:.2f}x | {met} | {g['note']} |"
            )
        lines.append("")
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append(
        "|"
        + "|".join("---" if c in ("pattern", "configuration") else "---:" for c in COLUMNS)
        + "|"
    )
    for r in rows(data):
        if "error" in r:
            lines.append(
                f"| `{r['pattern']}` | `{r['configuration']}` | error: {r['error'][:80]} |"
            )
            continue
        cells = [f"`{r[c]}`" if c in ("pattern",) else r[c] for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", CAPTION]
    return "\n".join(lines)


def plot_tpot(data: dict[str, Any], path: Path) -> Path | None:
    """TPOT (p50 and p99) and output tokens/s against the request rate of the steady patterns, one line
    per configuration. Returns the path, or None when no steady pattern ran."""
    from adaptive_spec.commands.plots import _plt, save_figure

    steady = [p for p in data["patterns"] if p["kind"] == "steady" and not math.isinf(p["rate"])]
    if not steady:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for cfg in data["configs"]:
        name = cfg["name"]
        pts = []
        for p in steady:
            run = data["runs"].get(name, {}).get(p["name"])
            if run and "error" not in run and run.get("completed"):
                pts.append(
                    (p["rate"], run["tpot_ms"]["p50"], run["tpot_ms"]["p99"], run["output_tok_s"])
                )
        if not pts:
            continue
        pts.sort()
        x = [q[0] for q in pts]
        style = "--" if cfg["kind"] == "baseline" else "-"
        for ax, j in zip(axes, (1, 2, 3), strict=True):
            ax.plot(x, [q[j] for q in pts], style, marker="o", label=name)
    from matplotlib.ticker import NullFormatter, NullLocator

    rates = sorted({p["rate"] for p in steady})
    for ax, title in zip(axes, ("TPOT p50 (ms)", "TPOT p99 (ms)", "output tokens/s"), strict=True):
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    s = data.get("settings", {})
    fig.suptitle(
        f"bench serve: {Path(str(s.get('model', ''))).name} ({s.get('dtype')}), {s.get('requests')} requests "
        f"x {s.get('max_tokens')} tokens per rate"
    )
    return save_figure(fig, path)


def finite(x: Any) -> Any:
    """``x`` with every non-finite float (in nested dicts, lists and tuples) as its string, e.g.
    ``"inf"``; dict keys as strings, tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write the results JSON atomically (non-finite numbers as strings, e.g. ``"inf"``)."""
    return jsonio.write_json(path, finite(data))


def load_json(path: Path) -> dict[str, Any]:
    """Read a ``bench_serve.json`` back (``"inf"`` rates become floats again)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for p in data.get("patterns", []):
        p["rate"] = float(p["rate"])
    return data


if __name__ == "__main__":
    print(
        markdown(
            load_json(
                Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench-serve/bench_serve.json")
            )
        )
    )
