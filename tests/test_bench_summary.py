"""adaptive-spec bench: medians, paired ratios, best static arm, greedy-identity validity and the goals,
on hand-made runs whose figures are known."""

from __future__ import annotations

import pytest

from adaptive_spec.commands.bench.launch import merge
from adaptive_spec.commands.bench.report import cost_table_sources, markdown
from adaptive_spec.commands.bench.summary import (
    best_k_by_concurrency,
    compute_goals,
    median_interval,
    summarize_cell,
)


def runs(goodputs, *, violations=0, emitted=None, steps=None, overhead=None, identity=True):
    out = []
    for i, g in enumerate(goodputs):
        r = {
            "repeat": i,
            "wall_s": 1.0,
            "output_tokens": int(g),
            "goodput_tok_s": float(g),
            "controller_overhead": overhead,
            "totals": {
                "request_steps": steps or 10,
                "emitted": emitted or 10,
                "drafted": 8,
                "accepted": 4,
            },
            "valid": violations == 0,
        }
        if identity:
            r["identity"] = {
                "total": 4,
                "identical": 4 - violations,
                "near_tie": 0,
                "violations": violations,
            }
        out.append(r)
    return out


def cell(label="mixed", c=4, t=0.0, configs=None, baselines=None):
    return {
        "id": f"{label}/c{c}/t{t:g}",
        "label": label,
        "concurrency": c,
        "temperature": t,
        "configs": {n: {"engine": e, "runs": r} for n, (e, r) in (configs or {}).items()},
        "baselines": baselines or {},
    }


def test_paired_ratio_differs_from_ratio_of_medians():
    x = summarize_cell(
        cell(
            configs={
                "none": ("main", runs([100, 50, 80])),
                "static:ngram:2": ("main", runs([150, 75, 80])),
            }
        )
    )
    s = x["summary"]["static:ngram:2"]
    # Per-repeat ratios 1.5, 1.5, 1.0: median 1.5 (the medians' ratio would be 80 / 80 = 1.0).
    assert s["ratio_to_none"] == pytest.approx(1.5)
    assert s["goodput_tok_s"] == pytest.approx(80.0)
    assert s["ratio_method"] == "paired"
    assert x["summary"]["none"]["ratio_to_none"] == 1.0


def test_best_static_skips_invalid_and_adaptive_is_divided_by_it():
    x = summarize_cell(
        cell(
            configs={
                "none": ("main", runs([100, 100, 100])),
                "static:ngram:8": ("main", runs([200, 200, 200], violations=1)),
                "static:ngram:4": ("main", runs([130, 130, 130])),
                "static:jacobi:2": ("main", runs([110, 110, 110])),
                "adaptive": ("main", runs([156, 156, 156], overhead=0.02)),
            }
        )
    )
    assert x["best_static"] == "static:ngram:4"
    s = x["summary"]
    assert not s["static:ngram:8"]["valid"]
    assert s["static:ngram:8"]["identity"]["violations"] == 3
    assert s["adaptive"]["ratio_to_best_static"] == pytest.approx(1.2)
    assert s["adaptive"]["controller_overhead"] == pytest.approx(0.02)
    assert s["adaptive"]["mean_accepted_length"] == pytest.approx(1.0)
    assert s["adaptive"]["acceptance_rate"] == pytest.approx(0.5)


def test_confirmation_rounds_pair_run_by_run_and_do_not_choose_the_best_arm():
    def with_confirm(regular, confirm):
        rs = runs(regular + confirm)
        for r in rs[len(regular) :]:
            r["confirm"] = True
        return rs

    x = summarize_cell(
        cell(
            configs={
                # The machine is twice as fast in repeat 1 and in the second confirmation round.
                "none": ("main", with_confirm([100, 200, 100], [100, 200, 100])),
                "static:ngram:4": ("main", with_confirm([130, 260, 130], [110, 220, 110])),
                "static:ngram:8": ("main", runs([126, 252, 126])),
                "adaptive": ("main", with_confirm([130, 260, 117], [110, 220, 99])),
            }
        )
    )
    # Chosen on the regular repeats (1.30 vs 1.26 x none); over all its runs static:ngram:4 is
    # 1.20 x none, below static:ngram:8: its own confirmation runs may not change the choice.
    assert x["best_static"] == "static:ngram:4"
    s = x["summary"]
    assert s["static:ngram:4"]["ratio_to_none"] == pytest.approx(1.2)  # median of 6 rounds
    # adaptive / best static, round by round: 1, 1, 0.9, 1, 1, 0.9 -> median 1.0 (6 pairs).
    assert s["adaptive"]["ratio_to_best_static"] == pytest.approx(1.0)
    goals = {g["id"]: g for g in compute_goals([x])}
    assert goals["C"]["measured"] == pytest.approx(1.0) and goals["C"]["pairs"] == 6
    # An arm without confirmation runs is paired over the rounds both ran.
    assert s["static:ngram:8"]["ratio_to_best_static"] == pytest.approx(126 / 130)


def test_other_engines_ratio_methods():
    x = summarize_cell(
        cell(
            c=1,
            configs={
                "none": ("main", runs([40, 40, 40])),
                "vllm-dynamic": ("dynamic", runs([60, 30, 60])),
                "static:draft:4": ("draft", runs([50, 50, 50])),
                "hf-greedy": ("hf", runs([20, 20, 20], identity=False)),
                "hf-pld": ("hf", runs([30, 30, 30])),
            },
            baselines={
                "dynamic": {"engine": "dynamic", "runs": runs([40, 20, 50])},
                "draft": {"engine": "draft", "runs": runs([25, 25, 25])},
            },
        )
    )
    s = x["summary"]
    # Paired with the dynamic engine's own no-speculation runs: 1.5, 1.5, 1.2.
    assert s["vllm-dynamic"]["ratio_to_none"] == pytest.approx(1.5)
    assert s["vllm-dynamic"]["ratio_method"] == "paired-own-engine"
    # The draft engine: unpaired against the main engine's no speculation, own ratio kept.
    assert s["static:draft:4"]["ratio_to_none"] == pytest.approx(50 / 40)
    assert s["static:draft:4"]["ratio_to_own_none"] == pytest.approx(2.0)
    assert s["hf-greedy"]["ratio_to_none"] == pytest.approx(0.5)
    assert s["hf-pld"]["ratio_to_hf_greedy"] == pytest.approx(1.5)
    assert s["hf-pld"]["ratio_to_none"] == pytest.approx(0.75)
    assert x["best_static"] == "static:draft:4"


def test_a_failed_configuration_is_invalid_without_figures():
    x = cell(configs={"none": ("main", runs([10, 10, 10]))})
    x["configs"]["adaptive"] = {"engine": "main", "runs": [], "error": "RuntimeError: boom"}
    s = summarize_cell(x)["summary"]["adaptive"]
    assert s["valid"] is False and s["error"].startswith("RuntimeError")
    assert s["goodput_tok_s"] is None and s["ratio_to_none"] is None


def _goal_cells(adaptive_mixed=140.0, adaptive_invalid=False):
    g1 = cell(
        configs={
            "none": ("main", runs([100] * 3)),
            "static:ngram:4": ("main", runs([120] * 3)),
            "smartspec:ngram": ("main", runs([125] * 3)),
            "banditspec:ngram": ("main", runs([110] * 3)),
            "vllm-dynamic": ("dynamic", runs([118] * 3)),
            "adaptive": ("main", runs([adaptive_mixed] * 3, violations=int(adaptive_invalid))),
        },
        baselines={"dynamic": {"engine": "dynamic", "runs": runs([100] * 3)}},
    )
    code = cell(
        "code",
        configs={
            "none": ("main", runs([100] * 3)),
            "static:ngram:8": ("main", runs([200] * 3)),
            "adaptive": ("main", runs([192] * 3)),
        },
    )
    hot = cell(
        c=16,
        t=1.0,
        configs={
            "none": ("main", runs([300] * 3, identity=False)),
            "adaptive": ("main", runs([288] * 3, identity=False, overhead=0.04)),
        },
    )
    return [summarize_cell(c) for c in (g1, code, hot)]


def test_goals_measured_and_met():
    goals = {g["id"]: g for g in compute_goals(_goal_cells())}
    g1, code, hot = (c["id"] for c in _goal_cells())
    # A: every cell, adaptive / best static >= 0.98
    assert goals[f"A:{g1}"]["measured"] == pytest.approx(140 / 120) and goals[f"A:{g1}"]["met"]
    assert goals[f"A:{code}"]["measured"] == pytest.approx(0.96) and not goals[f"A:{code}"]["met"]
    assert goals[f"A:{hot}"]["met"] is None  # no static arm in that cell
    # B: c16 T=1.0 against no speculation (the same engine here: no nospec run)
    assert goals["B"]["measured"] == pytest.approx(0.96) and goals["B"]["met"] is False
    assert "same engine" in goals["B"]["description"]
    # C: mixed c4 >= 1.05 x best static
    assert goals["C"]["measured"] == pytest.approx(140 / 120) and goals["C"]["met"] is True
    assert goals["D"]["measured"] == pytest.approx(0.04) and goals["D"]["met"] is False
    assert goals["D"]["comparison"] == "<="
    assert goals["P:vllm-dynamic"]["measured"] == pytest.approx(140 / 118)
    assert goals["P:smartspec:ngram"]["measured"] == pytest.approx(140 / 125)


def test_goal_b_uses_the_engine_without_speculation_when_it_ran():
    cells = _goal_cells()
    hot = cells[2]
    hot["configs"]["nospec"] = {"engine": "nospec", "runs": runs([310] * 3, identity=False)}
    summarize_cell(hot)
    assert hot["summary"]["nospec"]["ratio_method"] == "unpaired"
    assert hot["summary"]["adaptive"]["ratio_to_nospec"] == pytest.approx(288 / 310)
    goals = {g["id"]: g for g in compute_goals(cells)}
    assert goals["B"]["measured"] == pytest.approx(288 / 310)
    assert "without speculative decoding" in goals["B"]["description"]


def test_nospec_beside_the_main_engine_is_paired_round_by_round():
    """nospec run in the main engine's process and rounds: its ratios, and goal B, are medians of
    per-round quotients, not quotients of medians across engines."""
    cells = _goal_cells()
    hot = cells[2]
    # The machine's speed changes from round to round; nospec is 10, 3 and 3 % faster than none.
    hot["configs"]["none"]["runs"] = runs([100, 200, 300], identity=False)
    hot["configs"]["adaptive"]["runs"] = runs([100, 199, 291], identity=False)
    hot["configs"]["nospec"] = {
        "engine": "nospec",
        "same_process": True,
        "runs": runs([110, 206, 309], identity=False),
    }
    summarize_cell(hot)
    s = hot["summary"]
    assert s["nospec"]["ratio_method"] == "paired"
    assert s["nospec"]["ratio_to_none"] == pytest.approx(1.03)
    # adaptive / nospec per round: 100/110, 199/206, 291/309 -> median 291/309 (three pairs).
    assert s["adaptive"]["ratio_to_nospec"] == pytest.approx(291 / 309)
    goals = {g["id"]: g for g in compute_goals(cells)}
    assert goals["B"]["measured"] == pytest.approx(291 / 309)
    # Unpaired (its own process), the same runs give the quotient of the two ratios to none.
    del hot["configs"]["nospec"]["same_process"]
    summarize_cell(hot)
    assert hot["summary"]["nospec"]["ratio_method"] == "unpaired"
    unpaired = hot["summary"]["adaptive"]["ratio_to_none"] / (206 / 200)
    assert hot["summary"]["adaptive"]["ratio_to_nospec"] == pytest.approx(unpaired)
    assert unpaired == pytest.approx(0.995 / 1.03)  # not 291 / 309


def test_confirmation_rounds_include_nospec_only_beside_the_main_engine():
    from adaptive_spec.commands.bench.worker import confirm_configs

    configs = {
        "none": {"engine": "main", "runs": runs([100] * 3)},
        "static:ngram:2": {"engine": "main", "runs": runs([120] * 3)},
        "adaptive": {"engine": "main", "runs": runs([125] * 3)},
        "nospec": {"engine": "nospec", "same_process": True, "runs": runs([104] * 3)},
    }
    assert confirm_configs(configs) == ["adaptive", "static:ngram:2", "none", "nospec"]
    del configs["nospec"]["same_process"]
    assert confirm_configs(configs) == ["adaptive", "static:ngram:2", "none"]


def test_goals_unmet_and_not_available():
    goals = {g["id"]: g for g in compute_goals(_goal_cells(adaptive_mixed=116))}
    assert goals["C"]["met"] is False  # 116 / 120 < 1.05
    goals = {g["id"]: g for g in compute_goals(_goal_cells(adaptive_invalid=True))}
    assert goals["C"]["met"] is None and "invalid" in goals["C"]["note"]
    goals = {g["id"]: g for g in compute_goals([])}
    assert all(g["met"] is None for g in goals.values())
    assert goals["B"]["note"] == "cell not run"


def test_best_k_by_concurrency_prefers_greedy_and_zero_when_nothing_helps():
    def static_cell(c, t, ratios):
        cfg = {"none": ("main", runs([100] * 3))}
        for k, r in ratios.items():
            cfg[f"static:ngram:{k}"] = ("main", runs([100 * r] * 3))
        cfg["static:jacobi:8"] = ("main", runs([500] * 3))  # another proposer: ignored
        return summarize_cell(cell(c=c, t=t, configs=cfg))

    cells = [
        static_cell(1, 0.0, {2: 1.1, 8: 1.4}),
        static_cell(4, 1.0, {2: 1.3}),
        static_cell(4, 0.0, {2: 1.05, 4: 1.2}),
        static_cell(16, 0.0, {1: 0.9, 2: 0.95}),
    ]
    assert best_k_by_concurrency(cells, "mixed") == {1: 8, 4: 4, 16: 0}
    assert best_k_by_concurrency(cells, "code") == {}


def test_merge_puts_other_engines_no_speculation_in_baselines():
    merged = {"a/c1/t0": {"configs": {}}}
    merge(
        merged,
        "dynamic",
        {
            "cells": {
                "a/c1/t0": {
                    "prepare": {"reference_s": 1.0},
                    "configs": {
                        "none": {"engine": "dynamic", "runs": [1]},
                        "vllm-dynamic": {"engine": "dynamic", "runs": [2]},
                    },
                }
            }
        },
    )
    m = merged["a/c1/t0"]
    assert m["baselines"]["dynamic"]["runs"] == [1]
    assert list(m["configs"]) == ["vllm-dynamic"]
    assert m["prepare"]["dynamic"] == {"reference_s": 1.0}


def test_median_interval_is_the_sign_test_interval_between_order_statistics():
    # 6 values: their extremes (coverage 1 - 2 / 2**6 = 0.969 >= 0.95); 5 are too few at 95 %.
    assert median_interval([1.0, 0.9, 1.2, 1.1, 0.95, 1.05]) == (0.9, 1.2)
    assert median_interval([1.0, 0.9, 1.2, 1.1, 0.95]) is None
    # 9 values: the 2nd and 8th smallest (P(Binomial(9, 1/2) <= 1) = 0.0195 <= 0.025 per side).
    xs = [0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 2.0]
    assert median_interval(xs[::-1]) == (0.8, 1.2)
    assert median_interval([]) is None


def _six_round_cell(adaptive, *, overhead=None):
    return summarize_cell(
        cell(
            configs={
                "none": ("main", runs([100] * 6)),
                "static:ngram:2": ("main", runs([100] * 6)),
                "adaptive": ("main", runs(adaptive, overhead=overhead)),
            }
        )
    )


def test_goal_intervals_say_whether_the_runs_resolve_the_target():
    # Paired ratios 0.90-1.04 (median 0.97): not met, but the interval contains 0.98.
    noisy = _six_round_cell([90, 95, 97, 97, 100, 104])
    g = {x["id"]: x for x in compute_goals([noisy])}["A:mixed/c4/t0"]
    assert g["measured"] == pytest.approx(0.97) and g["met"] is False
    assert g["interval"] == [0.9, 1.04] and g["resolved"] is False
    # All six rounds below 0.98: not met and resolved.
    low = _six_round_cell([90, 91, 92, 93, 94, 97])
    g = {x["id"]: x for x in compute_goals([low])}["A:mixed/c4/t0"]
    assert g["met"] is False and g["resolved"] is True and g["interval"] == [0.9, 0.97]
    # Three rounds give no 95 % interval: no verdict on the noise either way.
    three = {x["id"]: x for x in compute_goals(_goal_cells())}
    assert "interval" not in three["C"] and "resolved" not in three["C"]
    # The overhead goal (<=): per-run overheads all above 1 % resolve it as not met.
    hot = summarize_cell(
        cell(
            c=16,
            t=1.0,
            configs={
                "none": ("main", runs([300] * 6, identity=False)),
                "adaptive": ("main", runs([288] * 6, identity=False, overhead=0.012)),
            },
        )
    )
    d = {x["id"]: x for x in compute_goals([hot])}["D"]
    assert d["met"] is False and d["interval"] == [0.012, 0.012] and d["resolved"] is True


def test_report_prints_the_interval_and_within_noise():
    noisy = _six_round_cell([90, 95, 97, 97, 100, 104])
    text = markdown({"cells": [noisy], "goals": []})
    row = next(line for line in text.splitlines() if line.startswith("| A:mixed/c4/t0"))
    assert "0.970x (6 pairs), 95% CI 0.900x-1.040x" in row
    assert row.endswith("**not met** (within noise) |")


def test_report_names_the_step_cost_tables_used():
    # Two adaptive runs priced with the shipped table, one with a table calibrated on the machine;
    # static arms price nothing and are not counted.
    c = _six_round_cell([100] * 6)
    ad = c["configs"]["adaptive"]["runs"]
    for r in ad[:2]:
        r["cost_table_source"] = "shipped"
    ad[2]["cost_table_source"] = "calibrated earlier on this machine"
    assert cost_table_sources([c]) == {"shipped": 2, "calibrated earlier on this machine": 1}
    first = markdown({"cells": [c], "goals": []}).splitlines()[0]
    assert first.endswith(
        "Step-cost table of the runs that price steps: calibrated earlier on this machine (1 run), "
        "shipped (2 runs)."
    )
    # A file written before the source was recorded: no such sentence.
    for r in ad:
        r.pop("cost_table_source", None)
    assert cost_table_sources([c]) == {}
    assert "Step-cost table" not in markdown({"cells": [c], "goals": []})
