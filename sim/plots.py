"""Replay plots (PNG, matplotlib Agg): cumulative regret, arm choices over time, goodput per category."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from adaptive_spec.plots import _plt, plot_arm_choices

from .regret import regret_curve
from .replay import ReplayResult


def plot_regret(
    results: dict[str, ReplayResult],
    comparator_run: ReplayResult | float,
    path: str | Path,
    *,
    comparator: str,
) -> Path:
    """Cumulative regret in tokens over simulated steps, one line per policy, against a comparator's
    replay (its trajectory) or goodput (:func:`~adaptive_spec.sim.regret.regret_curve`). Returns the
    path."""
    plt = _plt()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, res in results.items():
        if res.steps:
            ax.plot(np.arange(1, res.steps + 1), regret_curve(res, comparator_run), label=name)
    ax.axhline(0, color="gray", linewidth=0.8)
    ax.set_xlabel("simulated engine step")
    ax.set_ylabel(f"cumulative regret vs {comparator} (tokens)")
    g = comparator_run.goodput if isinstance(comparator_run, ReplayResult) else comparator_run
    ax.set_title(f"Regret against the {comparator} ({g:.1f} tokens/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_arms(result: ReplayResult, path: str | Path) -> Path:
    """Arm choices over simulated steps for one policy (proposer shares and mean k)."""
    return plot_arm_choices(result.step_arms, path, title=f"Arm choices in replay: {result.policy}")


def plot_goodput_by_category(results: dict[str, ReplayResult], path: str | Path) -> Path:
    """Grouped bars: attributed goodput (tokens/s) per workload category, one bar per policy."""
    plt = _plt()
    path = Path(path)
    cats = sorted({c for r in results.values() for c in r.metrics.by_category})
    names = list(results)
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats) * max(len(names), 1) * 0.5 + 3), 4.5))
    x = np.arange(len(cats))
    for i, n in enumerate(names):
        vals = [
            results[n].metrics.by_category[c].goodput
            if c in results[n].metrics.by_category
            else 0.0
            for c in cats
        ]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=n)
    ax.set_xticks(x, cats, rotation=20, ha="right")
    ax.set_ylabel("goodput (tokens/s, attributed)")
    ax.set_title("Goodput per category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
