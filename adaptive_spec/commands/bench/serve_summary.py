"""Figures derived from ``adaptive-spec bench serve``'s runs: acceptance from the ``/metrics`` deltas, greedy
identity across configurations, ratios per pattern, the server's goals, and vLLM's batch-size table
tuned from the static runs.

A **run** is one configuration under one pattern: a dict with the client's merged figures
(:func:`adaptive_spec.commands.bench.serve_client.merge_passes`) and ``server`` (counter deltas).
"""

from __future__ import annotations

import math
from typing import Any

from adaptive_spec.commands.bench.plan import tune_table
from adaptive_spec.commands.bench.serve_plan import ServerConfig

#: Output tokens/s ratio adaptive must reach over every static configuration and the table (ramp, burst).
GOAL_DYNAMIC_RATIO = 1.10
#: ... and over the best static configuration at every steady rate.
GOAL_STEADY_RATIO = 0.98


def acceptance(server: dict[str, Any]) -> dict[str, Any]:
    """Acceptance over one run from the counter deltas.

    Returns
    -------
    dict
        ``vllm``: vLLM's ``vllm:spec_decode_*`` figures (``acceptance_rate`` = accepted / draft tokens;
        ``accepted_length`` = 1 + accepted / drafts, vLLM's definition: tokens per drafting request-step;
        ``per_position``: acceptance rate by draft position), or None without speculation;
        ``plugin``: the plugin's (``acceptance_rate`` = accepted / drafted tokens over all proposers;
        ``accepted_length`` = emitted tokens / request-steps, k = 0 steps included; ``arm_mix``: share
        of request-steps per ``proposer/k``; ``controller_overhead`` = controller time / step time), or
        None without the plugin.
    """
    out: dict[str, Any] = {"vllm": None, "plugin": None}
    spec = server.get("spec")
    if spec and spec.get("drafts", 0) > 0:
        drafts, tokens, acc = spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]
        per_pos = spec.get("accepted_per_position") or {}
        out["vllm"] = {
            "drafts": int(drafts),
            "draft_tokens": int(tokens),
            "accepted_tokens": int(acc),
            "acceptance_rate": acc / tokens if tokens else None,
            "accepted_length": 1.0 + acc / drafts,
            "per_position": [per_pos[k] / drafts for k in sorted(per_pos, key=int)],
        }
    elif spec is not None:
        out["vllm"] = {
            "drafts": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "acceptance_rate": None,
            "accepted_length": None,
            "per_position": [],
        }
    plugin = server.get("plugin")
    if plugin is not None:
        drafted = sum(plugin["drafted"].values())
        accepted = sum(plugin["accepted"].values())
        emitted = sum(plugin["emitted"].values())
        choices = sum(plugin["arm_choices"].values())
        out["plugin"] = {
            "drafted_tokens": int(drafted),
            "accepted_tokens": int(accepted),
            "emitted_tokens": int(emitted),
            "request_steps": int(choices),
            "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_length": emitted / choices if choices else None,
            "by_proposer": {
                p: {
                    "drafted": int(plugin["drafted"].get(p, 0)),
                    "accepted": int(plugin["accepted"].get(p, 0)),
                    "emitted": int(plugin["emitted"].get(p, 0)),
                }
                for p in sorted(plugin["emitted"])
            },
            "arm_mix": {a: c / choices for a, c in sorted(plugin["arm_choices"].items()) if c}
            if choices
            else {},
            "steps": int(plugin["steps"]),
            "controller_overhead": plugin["controller_time_s"] / plugin["step_time_s"]
            if plugin["step_time_s"]
            else None,
            "faults": int(plugin["faults"]),
            "learned_steps": plugin.get("learned_steps"),
        }
    return out


def headline(run: dict[str, Any]) -> tuple[float | None, float | None]:
    """(acceptance rate, accepted length) shown in the table: the plugin's when attached (it sees
    every proposer), else vLLM's."""
    acc = run.get("acceptance") or {}
    src = acc.get("plugin") or acc.get("vllm")
    if not src:
        return None, None
    return src.get("acceptance_rate"), src.get("accepted_length")


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def greedy_identity(
    ref: dict[str, Any], run: dict[str, Any], max_examples: int = 3
) -> dict[str, Any]:
    """Compare the greedy requests' texts of ``run`` with the reference run (same pattern, same prompts).

    Returns
    -------
    dict
        ``compared`` (both answered), ``identical``, ``differing``, ``skipped`` (failed in either),
        ``examples``: up to ``max_examples`` of ``{index, position (first differing character),
        reference, got}`` (40 characters from a little before the difference).
    """
    ref_texts, texts = ref.get("texts") or {}, run.get("texts") or {}
    same = diff = skipped = 0
    examples = []
    for i in run.get("greedy_indices") or []:
        a, b = ref_texts.get(i), texts.get(i)
        if a is None or b is None:
            skipped += 1
        elif a == b:
            same += 1
        else:
            diff += 1
            if len(examples) < max_examples:
                pos = _first_difference(a, b)
                lo = max(0, pos - 10)
                examples.append(
                    {
                        "index": i,
                        "position": pos,
                        "reference": a[lo : pos + 30],
                        "got": b[lo : pos + 30],
                    }
                )
    return {
        "compared": same + diff,
        "identical": same,
        "differing": diff,
        "skipped": skipped,
        "examples": examples,
    }


def _ok(run: dict[str, Any] | None) -> bool:
    return bool(run) and "error" not in run and run.get("completed", 0) > 0


def summarize_pattern(
    pattern: str, runs: dict[str, dict[str, Any]], configs: dict[str, ServerConfig]
) -> dict[str, Any]:
    """Ratios and identity for one pattern, written into each run; returns the pattern's summary:
    ``best_static`` (highest output tokens/s among static configurations that lost no request) and
    ``best_static_tpot_p99`` (lowest p99 TPOT among them).

    Each run gets ``ratio_to_none`` and ``ratio_to_best_static`` (output tokens/s),
    ``tpot_p99_to_none`` and ``tpot_p99_to_best_static`` (p99 TPOT, lower is better), and
    ``identity`` (greedy texts against ``none``'s) when ``none`` ran.
    """
    ref = runs.get("none")
    statics = {
        n: r
        for n, r in runs.items()
        if configs[n].kind == "static"
        and _ok(r)
        and r.get("failed", 0) == 0
        and r.get("lost", 0) == 0
    }
    best = max(statics, key=lambda n: statics[n]["output_tok_s"], default=None)
    with_tpot = {n: r for n, r in statics.items() if r["tpot_ms"]["p99"] is not None}
    best_tpot = min(with_tpot, key=lambda n: with_tpot[n]["tpot_ms"]["p99"], default=None)

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None or not b or (isinstance(b, float) and math.isnan(b)):
            return None
        return a / b

    for name, run in runs.items():
        if not _ok(run):
            continue
        tp = run["tpot_ms"]["p99"]
        run["ratio_to_none"] = ratio(run["output_tok_s"], ref["output_tok_s"]) if _ok(ref) else None
        run["ratio_to_best_static"] = (
            ratio(run["output_tok_s"], statics[best]["output_tok_s"]) if best else None
        )
        run["tpot_p99_to_none"] = ratio(tp, ref["tpot_ms"]["p99"]) if _ok(ref) else None
        run["tpot_p99_to_best_static"] = (
            ratio(tp, with_tpot[best_tpot]["tpot_ms"]["p99"]) if best_tpot else None
        )
        if _ok(ref) and name != "none":
            run["identity"] = greedy_identity(ref, run)
    return {"pattern": pattern, "best_static": best, "best_static_tpot_p99": best_tpot}


def _is_static_ngram(cfg: ServerConfig) -> bool:
    """A fixed n-gram k: ``static:ngram:<k>`` through the plugin, or vLLM's own ``vllm-ngram``."""
    return cfg.kind == "static" and (cfg.proposers is None or "ngram" in cfg.proposers)


def tuned_table(
    runs: dict[str, dict[str, dict[str, Any]]],
    configs: dict[str, ServerConfig],
    steady: list[str],
    max_num_seqs: int,
) -> tuple[list[list[int]] | None, dict[int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` tuned as in ``adaptive-spec bench``: per steady
    pattern, the concurrency the server saw (``none``'s mean concurrency, Little's law, capped at
    ``max_num_seqs``) gets the k of the best static n-gram configuration there (0 when none beat no
    speculation); :func:`adaptive_spec.commands.bench.plan.tune_table` turns that into rows.

    Parameters
    ----------
    runs : dict
        ``{config: {pattern: run}}``.
    steady : list of str
        The steady patterns' names.

    Returns
    -------
    (table or None, {concurrency: k})
        None when no steady pattern had both ``none`` and a static n-gram run.
    """
    best_k: dict[int, int] = {}
    for pat in steady:
        ref = runs.get("none", {}).get(pat)
        if not _ok(ref):
            continue
        conc = max(1, min(max_num_seqs, round(ref["mean_concurrency"])))
        cands = {
            n: r[pat] for n, r in runs.items() if _is_static_ngram(configs[n]) and _ok(r.get(pat))
        }
        if not cands or conc in best_k:
            continue
        name = max(cands, key=lambda n: cands[n]["output_tok_s"])
        k = int(configs[name].k or 0) if cands[name]["output_tok_s"] > ref["output_tok_s"] else 0
        best_k[conc] = k
    if not best_k:
        return None, {}
    table = tune_table(best_k, max_num_seqs)
    if all(row[2] == 0 for row in table):
        # vLLM needs num_speculative_tokens >= 1 somewhere to build a speculative engine; k = 1 is the
        # cheapest arm where no static arm beat no speculation.
        table = [[a, b, 1] for a, b, _ in table]
    return table, best_k


def _goal(
    goal: str,
    config: str,
    pattern: str,
    threshold: float,
    measured: float | None = None,
    met: bool | None = None,
    note: str = "missing runs",
) -> dict[str, Any]:
    """One goal's row (``measured`` and ``met`` None, noted ``missing runs``, when a run it needs is
    missing)."""
    return {
        "goal": goal,
        "config": config,
        "pattern": pattern,
        "measured": measured,
        "threshold": threshold,
        "met": met,
        "note": note,
    }


def _dynamic_goal(name: str, pat: str, mine: Any, others: dict[str, Any]) -> dict[str, Any]:
    """Goal ``dynamic`` of configuration ``name`` on pattern ``pat`` against the runs ``others`` (every
    static configuration and the table)."""
    others = {p: r for p, r in others.items() if _ok(r)}
    if not _ok(mine) or not others:
        return _goal("dynamic", name, pat, GOAL_DYNAMIC_RATIO)
    worst = min(others, key=lambda p: mine["output_tok_s"] / others[p]["output_tok_s"])
    r = mine["output_tok_s"] / others[worst]["output_tok_s"]
    tps = [o["tpot_ms"]["p99"] for o in others.values() if o["tpot_ms"]["p99"] is not None]
    tp_ok = mine["tpot_ms"]["p99"] is not None and bool(tps) and mine["tpot_ms"]["p99"] <= min(tps)
    return _goal(
        "dynamic",
        name,
        pat,
        GOAL_DYNAMIC_RATIO,
        r,
        bool(r >= GOAL_DYNAMIC_RATIO and tp_ok),
        f"worst against {worst}; p99 TPOT "
        + ("<=" if tp_ok else ">")
        + " the lowest of the static configurations and the table",
    )


def _steady_goal(
    name: str,
    pat: str,
    mine: Any,
    statics: dict[str, Any],
    ref: Any,
) -> dict[str, Any]:
    """Goal ``steady`` of configuration ``name`` on pattern ``pat`` against the static runs
    ``statics`` and no speculation's run ``ref``."""
    statics = {p: r for p, r in statics.items() if _ok(r)}
    best = max(statics, key=lambda p: statics[p]["output_tok_s"]) if statics else None
    if not _ok(mine) or best is None:
        return _goal("steady", name, pat, GOAL_STEADY_RATIO)
    r = mine["output_tok_s"] / statics[best]["output_tok_s"]
    above_none = ref is None or not _ok(ref) or mine["output_tok_s"] >= ref["output_tok_s"]
    return _goal(
        "steady",
        name,
        pat,
        GOAL_STEADY_RATIO,
        r,
        bool(r >= GOAL_STEADY_RATIO and above_none),
        f"against {best}; " + ("not below" if above_none else "BELOW") + " no speculation",
    )


def goals(
    runs: dict[str, dict[str, dict[str, Any]]],
    configs: dict[str, ServerConfig],
    patterns: dict[str, str],
) -> list[dict[str, Any]]:
    """The server goals for each adaptive configuration that ran.

    * ``dynamic``: over each ramp and burst pattern, output tokens/s >= 1.10x every static
      configuration and the table, and p99 TPOT <= the lowest of theirs;
    * ``steady``: at every steady rate, output tokens/s >= 0.98x that rate's best static configuration
      and >= no speculation.

    Parameters
    ----------
    patterns : dict
        ``{pattern name: kind}``.

    Returns
    -------
    list of dict
        ``goal``, ``config``, ``pattern``, ``measured`` (the worst ratio), ``threshold``, ``met``
        (None when a comparison is missing), ``note``.
    """
    out: list[dict[str, Any]] = []
    peers = [n for n, c in configs.items() if c.kind in ("static", "table")]
    statics = [p for p in peers if configs[p].kind == "static"]
    for name, cfg in configs.items():
        if cfg.kind != "adaptive" or name not in runs:
            continue
        for pat, kind in patterns.items():
            mine = runs[name].get(pat)
            if kind in ("ramp", "burst"):
                others = {p: runs.get(p, {}).get(pat) for p in peers}
                out.append(_dynamic_goal(name, pat, mine, others))
            elif kind == "steady":
                static_runs = {p: runs.get(p, {}).get(pat) for p in statics}
                ref = runs.get("none", {}).get(pat)
                out.append(_steady_goal(name, pat, mine, static_runs, ref))
    return out
