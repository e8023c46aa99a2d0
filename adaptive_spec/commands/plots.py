"""PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.sim.regret import regret_curve
from adaptive_spec.sim.replay import ReplayResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` as a 110-dpi PNG (creating the directory), close it and
    return ``path``."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_arm_choices(
    steps: list[dict[str, Any]], path: str | Path, title: str = "Arm choices over time"
) -> Path:
    """Stacked share of request-steps per proposer, and mean k, over engine steps (from trace steps).

    Returns the written path.
    """
    plt = _plt()
    path = Path(path)
    rows = [(i, r["arm"]) for i, s in enumerate(steps) for r in s.get("requests", [])]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[3, 1.3])
    if rows:
        n_steps = len(steps)
        bins = max(1, min(80, n_steps // 5 or 1))
        edges = np.linspace(0, n_steps, bins + 1)
        proposers = sorted({"none" if a == "none" else a.rsplit(":", 1)[0] for _, a in rows})
        counts = {p: np.zeros(bins) for p in proposers}
        ksum = np.zeros(bins)
        total = np.zeros(bins)
        for i, arm in rows:
            b = min(int(np.searchsorted(edges, i, side="right")) - 1, bins - 1)
            p = "none" if arm == "none" else arm.rsplit(":", 1)[0]
            counts[p][b] += 1
            ksum[b] += 0 if arm == "none" else int(arm.rsplit(":", 1)[1])
            total[b] += 1
        centers = 0.5 * (edges[:-1] + edges[1:])
        safe = np.maximum(total, 1)
        colors = {"none": "#bbbbbb", "ngram": "#1f77b4", "jacobi": "#ff7f0e", "draft": "#2ca02c"}
        extra = iter(
            ["#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"] * 8
        )
        ax1.stackplot(
            centers,
            *[counts[p] / safe for p in proposers],
            labels=proposers,
            colors=[colors.get(p) or next(extra) for p in proposers],
            alpha=0.9,
        )
        ax1.set_ylim(0, 1)
        ax1.legend(loc="upper right", fontsize=8)
        ax2.plot(centers, ksum / safe, color="black")
    ax1.set_ylabel("share of request-steps")
    ax1.set_title(title)
    ax2.set_ylabel("mean k")
    ax2.set_xlabel("engine step")
    return save_figure(fig, path)


def plot_bars(
    values: dict[str, float],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    baseline: float | None = None,
) -> Path:
    """A simple labelled bar chart (e.g. goodput per configuration)."""
    plt = _plt()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(values) + 2), 4))
    names = list(values)
    ax.bar(range(len(names)), [values[n] for n in names], color="#1f77b4")
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return save_figure(fig, path)


def arm_mix(counter: dict[str, int], top: int = 4) -> str:
    """``"ngram:8 41%, none 30%, ..."`` for a table cell."""
    total = sum(counter.values())
    if not total:
        return "-"
    items = Counter(counter).most_common(top)
    return ", ".join(f"{a} {100 * c / total:.0f}%" for a, c in items)


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
    return save_figure(fig, path)


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
    return save_figure(fig, path)


def plot_head_training(
    curve: list[tuple[int, float, list[float]]],
    path: str | Path,
    title: str = "EAGLE-3 head training",
) -> Path:
    """Loss and agreement per unrolled draft pass over training steps, from ``(step, loss, agreement
    per pass)`` rows (:func:`adaptive_spec.commands.distill.eagle3_train.train_head`'s history).
    Returns the written path."""
    plt = _plt()
    path = Path(path)
    steps = np.array([c[0] for c in curve])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    loss = np.array([c[1] for c in curve])
    a1.plot(steps, loss, color="gray", alpha=0.4, linewidth=0.8)
    w = max(1, len(loss) // 20)
    if len(loss) >= w:
        a1.plot(
            steps[w - 1 :], np.convolve(loss, np.ones(w) / w, mode="valid"), label=f"mean of {w}"
        )
    a1.set_xlabel("training step")
    a1.set_ylabel("TTT loss (weighted cross-entropy)")
    a1.legend(fontsize=8)
    agree = np.array([c[2] for c in curve])
    for j in range(agree.shape[1]):
        y = agree[:, j]
        y = np.convolve(y, np.ones(w) / w, mode="valid") if len(y) >= w else y
        a2.plot(steps[len(steps) - len(y) :], y, label=f"draft pass {j + 1}")
    a2.set_xlabel("training step")
    a2.set_ylabel("agreement with the target (training batch)")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)
