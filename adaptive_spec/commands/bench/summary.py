"""From runs to figures: medians, paired ratios, the best static arm, and the controller's goals.

Ratios (the machine drifts between repeats, ``docs/benchmarks.md``, so ratios are paired where they can be):

* ``ratio_to_none`` of a configuration in the main engine is the median over repeats of its goodput
  divided by the same repeat's no-speculation goodput (``paired``);
* vLLM's dynamic table runs in its own engine, which also runs speculation off: its ratio is paired with
  that engine's own no-speculation runs (``paired-own-engine``);
* the draft engine's no-speculation run still drafts every step (AdaptiveSpec only discards the drafts),
  so its configurations are divided by the main engine's median no-speculation goodput (``unpaired``);
  ``ratio_to_own_none`` is kept as well;
* ``nospec`` (an engine built without speculative decoding) runs in the main engine's process, in the
  same rounds (``same_process``): paired like a main-engine configuration. Where it ran in its own
  process it is unpaired, its goodput over the main engine's median no-speculation goodput. Every
  configuration also gets ``ratio_to_nospec``, its ``ratio_to_none`` over nospec's;
* HF greedy is unpaired against vLLM's no speculation; HF prompt lookup is paired with HF greedy and
  multiplied by that (``paired-to-hf-greedy``);
* a ratio between two main-engine configurations (``ratio_to_best_static``, the goals) is paired run
  by run: the median over the rounds both ran of their goodput quotient in that round (rounds include
  the confirmation rounds, in which only ``adaptive``, the best static arm and ``none`` run, back to
  back); between other configurations it is the quotient of their ``ratio_to_none``;
* the best static arm is the static arm with the highest ``ratio_to_none`` over the regular repeats
  (:func:`best_static_arm`), among valid ones.

Each goal measured on paired runs (or, for the controller's overhead, on its runs) also gets a 95 %
confidence interval for that median (:func:`median_interval`: distribution-free, from the order
statistics; it needs at least 6 values) and says whether the interval lies on one side of the target
(``resolved``): a goal that is not met but whose interval contains the target is within the noise of
the runs.

A greedy run is **invalid** when :func:`adaptive_spec.commands.identity.compare_greedy` finds a violation (a
divergence from the no-speculation reference with a clear top-2 margin); a configuration is valid when all
its runs are.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scipy.stats import quantile_test

from adaptive_spec.commands.bench.plan import parse_config

GOAL_THRESHOLDS = {
    "A": 0.98,  # every cell: adaptive / the cell's best static arm
    "B": 0.99,  # mixed c16 T=1.0: adaptive / no speculation (the engine without speculative decoding)
    "C": 1.05,  # mixed c4 greedy: adaptive / the best static arm
    "D": 0.01,  # controller overhead at c16 (share of step time)
    "P": 1.0,  # information: adaptive / a peer (SmartSpec, BanditSpec, vLLM's table)
}
#: Confidence level of the goals' intervals (:func:`median_interval`).
GOAL_CONFIDENCE = 0.95


def median_interval(
    values: list[float], level: float = GOAL_CONFIDENCE
) -> tuple[float, float] | None:
    """A confidence interval for the median of ``values`` that assumes no distribution: the sign-test
    interval between two order statistics (Conover, *Practical Nonparametric Statistics*, 3.2;
    :func:`scipy.stats.quantile_test`), with coverage at least ``level``. ``None`` when there are too
    few values for it (at 95 %: fewer than 6; with 6 it is their minimum and maximum)."""
    xs = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not xs:
        return None
    ci = quantile_test(xs, q=statistics.median(xs), p=0.5).confidence_interval(level)
    low, high = float(ci.low), float(ci.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return low, high


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _by_repeat(runs: list[dict[str, Any]]) -> dict[int, float]:
    return {r["repeat"]: r["goodput_tok_s"] for r in runs}


def _pairs(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[float]:
    """Goodput quotients of ``runs`` over ``base``, round by round (the rounds both ran)."""
    b = _by_repeat(base)
    return [r["goodput_tok_s"] / b[r["repeat"]] for r in runs if b.get(r["repeat"])]


def _paired(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
    return _median(_pairs(runs, base))


def _regular(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of the regular repeats (not of the confirmation rounds)."""
    return [r for r in runs if not r.get("confirm")]


def best_static_arm(
    configs: dict[str, dict[str, Any]], other_ratios: dict[str, float] | None = None
) -> str | None:
    """The static arm with the highest ratio to no speculation over the **regular** repeats (the
    confirmation rounds then re-measure it, so its selection does not bias its own ratio).

    ``configs``: name -> ``{"engine", "runs"}`` (a configuration with ``error`` or an invalid run is
    skipped); main-engine arms are scored by their paired ratio to ``none``, and ``other_ratios`` gives
    the ratios of static arms in other engines (the draft engine's, unpaired). None without any."""
    none = _regular(configs.get("none", {}).get("runs", []))
    scores = dict(other_ratios or {})
    for name, entry in configs.items():
        runs = entry.get("runs", [])
        if (
            parse_config(name).kind == "static"
            and entry.get("engine", "main") == "main"
            and "error" not in entry
            and runs
            and all(r.get("valid", True) for r in runs)
        ):
            scores[name] = _paired(_regular(runs), none)
    scores = {n: v for n, v in scores.items() if v is not None}
    return max(scores, key=lambda n: scores[n]) if scores else None


def summarize_config(
    name: str, entry: dict[str, Any], cell: dict[str, Any], none_median: float | None
) -> dict[str, Any]:
    """Medians, ratio to no speculation, pooled mean accepted length, controller overhead and greedy
    identity of one configuration in one cell (``entry`` holds its ``runs`` and ``engine``)."""
    runs = entry.get("runs", [])
    info = parse_config(name)
    out: dict[str, Any] = {
        "kind": info.kind,
        "engine": entry.get("engine", info.engine),
        "greedy": cell["temperature"] == 0,
        "repeats": len(runs),
        "goodput_tok_s": _median([r["goodput_tok_s"] for r in runs]),
        "goodput_runs": [round(r["goodput_tok_s"], 3) for r in runs],
        "ratio_to_none": None,
        "ratio_method": None,
        # Ran in the main engine's rounds: ratios to other such configurations are paired run by run.
        "same_rounds": entry.get("engine", info.engine) == "main"
        or bool(entry.get("same_process")),
    }
    if "error" in entry:
        out["error"] = entry["error"]
    if not runs:
        out["valid"] = False
        return out
    main_none = cell["configs"].get("none", {}).get("runs", [])
    engine = out["engine"]
    if name == "none":
        out["ratio_to_none"], out["ratio_method"] = 1.0, "paired"
    elif out["same_rounds"]:
        out["ratio_to_none"], out["ratio_method"] = _paired(runs, main_none), "paired"
    elif engine == "nospec":
        if none_median:
            out["ratio_to_none"] = out["goodput_tok_s"] / none_median
        out["ratio_method"] = "unpaired"
    elif engine == "dynamic":
        own = cell.get("baselines", {}).get("dynamic", {}).get("runs", [])
        out["ratio_to_none"], out["ratio_method"] = _paired(runs, own), "paired-own-engine"
    elif engine == "draft":
        own = cell.get("baselines", {}).get("draft", {}).get("runs", [])
        out["ratio_to_own_none"] = _paired(runs, own)
        if none_median:
            out["ratio_to_none"] = out["goodput_tok_s"] / none_median
        out["ratio_method"] = "unpaired"
    elif engine == "hf":
        greedy = cell["configs"].get("hf-greedy", {}).get("runs", [])
        g_med = _median([r["goodput_tok_s"] for r in greedy])
        g_ratio = g_med / none_median if none_median and g_med else None
        if name == "hf-greedy":
            out["ratio_to_none"], out["ratio_method"] = g_ratio, "unpaired"
        else:
            to_greedy = _paired(runs, greedy)
            out["ratio_to_hf_greedy"] = to_greedy
            out["ratio_to_none"] = to_greedy * g_ratio if to_greedy and g_ratio else None
            out["ratio_method"] = "paired-to-hf-greedy"
    steps = sum(r.get("totals", {}).get("request_steps", 0) for r in runs)
    emitted = sum(r.get("totals", {}).get("emitted", 0) for r in runs)
    drafted = sum(r.get("totals", {}).get("drafted", 0) for r in runs)
    accepted = sum(r.get("totals", {}).get("accepted", 0) for r in runs)
    out["mean_accepted_length"] = emitted / steps if steps else None
    out["acceptance_rate"] = accepted / drafted if drafted else None
    out["controller_overhead"] = _median([r.get("controller_overhead") for r in runs])
    idents = [r["identity"] for r in runs if "identity" in r]
    if idents:
        out["identity"] = {
            k: sum(i[k] for i in idents) for k in ("total", "identical", "near_tie", "violations")
        }
    out["valid"] = all(r.get("valid", True) for r in runs) and "error" not in entry
    return out


def summarize_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """Add ``summary`` (per configuration), ``best_static`` and ``ratio_to_best_static`` to a merged
    cell and return it."""
    none_runs = cell["configs"].get("none", {}).get("runs", [])
    none_median = _median([r["goodput_tok_s"] for r in none_runs])
    summary = {
        name: summarize_config(name, entry, cell, none_median)
        for name, entry in cell["configs"].items()
    }
    other = {
        n: s["ratio_to_none"]
        for n, s in summary.items()
        if s["kind"] == "static"
        and s["engine"] != "main"
        and s["valid"]
        and s["ratio_to_none"] is not None
    }
    best = best_static_arm(cell["configs"], other)
    cell["best_static"] = best
    cell["summary"] = summary
    nospec = summary.get("nospec", {}).get("ratio_to_none")
    for name, s in summary.items():
        s["ratio_to_best_static"] = (
            _ratio(cell, name, best)[0]
            if best is not None and s["ratio_to_none"] is not None
            else None
        )
        # Against the engine built without speculative decoding: paired run by run where it ran in
        # the same rounds, else the quotient of the two ratios to no speculation.
        if nospec and s["ratio_to_none"] is not None:
            s["ratio_to_nospec"] = _ratio(cell, name, "nospec")[0]
        else:
            s["ratio_to_nospec"] = None
    return cell


def best_k_by_concurrency(
    cells: list[dict[str, Any]], label: str, proposer: str = "ngram"
) -> dict[int, int]:
    """Per concurrency, the static k of ``proposer`` with the highest ratio to no speculation in the
    summarized cells of workload ``label`` (greedy cells first; k = 0 when none beats no speculation):
    the points vLLM's batch-size table is tuned from (:func:`adaptive_spec.commands.bench.plan.tune_table`)."""
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


def _find(cells: list[dict[str, Any]], label: str, c: int, t: float) -> dict[str, Any] | None:
    for cell in cells:
        if cell["label"] == label and cell["concurrency"] == c and cell["temperature"] == t:
            return cell
    return None


def _ratio(cell: dict[str, Any], a: str, b: str) -> tuple[float | None, int]:
    """Goodput of configuration a over b and the number of paired runs behind it: two configurations
    that ran in the same rounds (the main engine's, and nospec beside them) are paired run by run (the
    median over the repeats and confirmation rounds both ran of a's goodput over b's in the same
    round); otherwise the quotient of their ratios to no speculation (0 pairs)."""
    s = cell["summary"]
    if a == b:
        return 1.0, 0
    if s[a].get("same_rounds") and s[b].get("same_rounds"):
        pairs = _pairs(cell["configs"][a].get("runs", []), cell["configs"][b].get("runs", []))
        if pairs:
            return float(statistics.median(pairs)), len(pairs)
    if s[a]["ratio_to_none"] is None or not s[b]["ratio_to_none"]:
        return None, 0
    return s[a]["ratio_to_none"] / s[b]["ratio_to_none"], 0


def _vs(cell: dict[str, Any] | None, a: str, b: str) -> tuple[float | None, str | None]:
    """Ratio of configuration a to b in a cell (:func:`_ratio`), and why it is missing (None when
    present)."""
    if cell is None:
        return None, "cell not run"
    s = cell["summary"]
    for n in (a, b):
        if n not in s or s[n]["ratio_to_none"] is None:
            return None, f"{n} not run"
        if not s[n]["valid"]:
            return None, f"{n} invalid"
    return _ratio(cell, a, b)[0], None


def _pairs_of(cell: dict[str, Any] | None, a: str, b: str) -> list[float]:
    """The per-round goodput quotients behind :func:`_ratio` (empty when a and b did not both run
    in the same rounds)."""
    if cell is None or a == b:
        return []
    s = cell.get("summary", {})
    if a not in s or b not in s or not (s[a].get("same_rounds") and s[b].get("same_rounds")):
        return []
    return _pairs(cell["configs"][a].get("runs", []), cell["configs"][b].get("runs", []))


def _goal(
    gid: str,
    description: str,
    cell_id: str | None,
    measured,
    missing,
    *,
    at_most=False,
    samples: list[float] | None = None,
):
    """One goal; ``samples``: the values whose median is ``measured`` (paired ratios or per-run
    overheads), for its confidence interval."""
    thr = GOAL_THRESHOLDS[gid.split(":")[0]]
    met = None if measured is None else (measured <= thr if at_most else measured >= thr)
    g = {
        "id": gid,
        "description": description,
        "cell": cell_id,
        "measured": measured,
        "threshold": thr,
        "comparison": "<=" if at_most else ">=",
        "met": met,
    }
    ci = median_interval(samples) if samples and measured is not None else None
    if ci is not None:
        g["interval"] = [round(ci[0], 4), round(ci[1], 4)]
        g["confidence"] = GOAL_CONFIDENCE
        # Resolved: the interval lies on one side of the target (else the runs cannot tell).
        g["resolved"] = (
            bool(ci[1] < thr or ci[0] >= thr) if not at_most else bool(ci[1] <= thr or ci[0] > thr)
        )
    if missing:
        g["note"] = missing
    return g


def _best_static_goal(
    gid: str, where: str, cell: dict[str, Any] | None, adaptive: str, no_best: str
) -> dict[str, Any]:
    """Goal ``gid``: ``adaptive`` over the cell's best static arm (``where`` prefixes the description;
    ``no_best`` is the note when the cell or its best static arm is missing), with the number of
    paired runs behind a measured ratio."""
    best = cell.get("best_static") if cell else None
    m, why = _vs(cell, adaptive, best) if best else (None, no_best)
    g = _goal(
        gid,
        f"{where}adaptive / best static arm ({best})",
        cell["id"] if cell else None,
        m,
        why,
        samples=_pairs_of(cell, adaptive, best) if best else None,
    )
    if m is not None:
        g["pairs"] = _ratio(cell, adaptive, best)[1]
    return g


def compute_goals(cells: list[dict[str, Any]], adaptive: str = "adaptive") -> list[dict[str, Any]]:
    """The goals of the controller, each with its measured ratio, threshold and met/unmet
    (``met`` is None when a cell or configuration it needs was not run or is invalid).

    * ``A:<cell>``: in every cell, adaptive from cold start >= 0.98x the cell's best static arm;
    * ``B``: mixed, concurrency 16, temperature 1.0: adaptive >= 0.99x no speculation (the engine built
      without speculative decoding when the cell ran ``nospec``, else the same engine at k = 0);
    * ``C``: mixed, concurrency 4, greedy: adaptive >= 1.05x the best static arm;
    * ``D``: controller overhead <= 1 % of step time at concurrency 16 (the largest median over the
      concurrency-16 cells);
    * ``P:<peer>`` (information, threshold 1.0): mixed c4 greedy, adaptive over SmartSpec, BanditSpec
      and vLLM's tuned table.

    ``adaptive`` names the configuration judged (the cold-start controller by default).
    """
    goals = []
    for cell in cells:
        if "summary" not in cell or adaptive not in cell["summary"]:
            continue
        goals.append(
            _best_static_goal(f"A:{cell['id']}", "", cell, adaptive, "no valid static arm")
        )
    g3 = _find(cells, "mixed", 16, 1.0)
    ref = "nospec" if g3 is not None and "nospec" in g3.get("summary", {}) else "none"
    m, why = _vs(g3, adaptive, ref)
    goals.append(
        _goal(
            "B",
            f"c=16, T=1.0: adaptive / no speculation ({'engine without speculative decoding' if ref == 'nospec' else 'same engine, k = 0'})",
            g3["id"] if g3 else None,
            m,
            why,
            samples=_pairs_of(g3, adaptive, ref),
        )
    )
    g1 = _find(cells, "mixed", 4, 0.0)
    goals.append(
        _best_static_goal(
            "C", "mixed c=4 greedy: ", g1, adaptive, "cell not run or no valid static arm"
        )
    )
    overheads = [
        (c["id"], c["summary"][adaptive]["controller_overhead"])
        for c in cells
        if c["concurrency"] == 16
        and adaptive in c.get("summary", {})
        and c["summary"][adaptive]["controller_overhead"] is not None
    ]
    if overheads:
        cid, worst = max(overheads, key=lambda x: x[1])
        worst_cell = next(c for c in cells if c["id"] == cid)
        goals.append(
            _goal(
                "D",
                "controller overhead at c=16 (share of step time)",
                cid,
                worst,
                None,
                at_most=True,
                samples=[
                    r.get("controller_overhead")
                    for r in worst_cell["configs"][adaptive].get("runs", [])
                ],
            )
        )
    else:
        goals.append(
            _goal(
                "D",
                "controller overhead at c=16",
                None,
                None,
                "no adaptive run at c=16",
                at_most=True,
            )
        )
    for peer, label in (
        ("smartspec:ngram", "SmartSpec-style"),
        ("banditspec:ngram", "BanditSpec-style"),
        ("vllm-dynamic", "vLLM's tuned batch-size table"),
    ):
        if g1 is not None and peer in g1.get("summary", {}):
            m, why = _vs(g1, adaptive, peer)
            goals.append(
                _goal(
                    f"P:{peer}",
                    f"mixed c=4 greedy: adaptive / {label}",
                    g1["id"],
                    m,
                    why,
                    samples=_pairs_of(g1, adaptive, peer),
                )
            )
    return goals
