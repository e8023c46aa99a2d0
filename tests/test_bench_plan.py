"""adaptive-spec bench: configuration names, cells, grids and vLLM's tuned batch-size table."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_spec.commands.bench.plan import (
    Cell,
    check_cell,
    custom_plan,
    estimate_minutes,
    full_plan,
    parse_config,
    quick_plan,
    tune_table,
)
from adaptive_spec.commands.workloads import CATEGORIES


@pytest.mark.parametrize(
    ("name", "kind", "engine", "proposer", "k"),
    [
        ("none", "baseline", "main", None, None),
        ("static:ngram:4", "static", "main", "ngram", 4),
        ("static:jacobi:1", "static", "main", "jacobi", 1),
        ("static:draft:8", "static", "draft", "draft", 8),
        ("smartspec:ngram", "peer", "main", "ngram", None),
        ("banditspec:jacobi", "peer", "main", "jacobi", None),
        ("table:ngram:1-2=8,3-16=2", "peer", "main", "ngram", None),
        ("bandit:thompson-beta", "peer", "main", None, None),
        ("bandit:linucb", "peer", "main", None, None),
        ("adaptive", "adaptive", "main", None, None),
        ("adaptive-warm", "adaptive", "main", None, None),
        ("adaptive+draft", "adaptive", "draft", None, None),
        ("adaptive+lora", "adaptive", "draft", None, None),
        ("static:lora:code:4", "static", "draft", "lora:code", 4),
        ("vllm-ngram", "vllm", "main", "ngram", 8),
        ("vllm-dynamic", "vllm", "dynamic", "ngram", None),
        ("hf-greedy", "hf", "hf", None, None),
        ("hf-pld", "hf", "hf", "ngram", None),
    ],
)
def test_parse_config(name, kind, engine, proposer, k):
    info = parse_config(name, 8)
    assert (info.kind, info.engine, info.proposer, info.k) == (kind, engine, proposer, k)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("static:ngram:9", "out of range"),
        ("static:ngram:0", "out of range"),
        ("static:lora:2", "proposer 'lora'"),
        ("static:lora:bad name:2", "proposer 'lora:bad name'"),
        ("static:ngram:x", "k='x'"),
        ("smartspec:foo", "proposer 'foo'"),
        ("table:ngram", "expected e.g."),
        ("bandit:nope", "learner='nope' is not known"),
        ("greedy", "is not known"),
        ("", "invalid"),
    ],
)
def test_parse_config_rejects_with_clear_message(name, fragment):
    with pytest.raises(ValueError, match="config=") as e:
        parse_config(name, 8)
    assert fragment in str(e.value)


def test_cell_validation_and_id():
    c = Cell("mixed", 4, 0.0, 8, 64, ("none", "adaptive"))
    assert c.id == "mixed/c4/t0" and c.greedy
    assert Cell("/x/question.jsonl", 16, 1.0, 2, 8).id == "question/c16/t1"
    for bad in (
        {"concurrency": 0},
        {"temperature": -1.0},
        {"prompts": 0},
        {"max_tokens": 0},
    ):
        kw = {
            "workload": "code",
            "concurrency": 4,
            "temperature": 0.0,
            "prompts": 4,
            "max_tokens": 8,
        }
        kw.update(bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            Cell(**kw)


def test_check_cell_refuses_hf_outside_concurrency_one_greedy_and_duplicates():
    with pytest.raises(ValueError, match="concurrency 1 and temperature 0"):
        check_cell(Cell("code", 4, 0.0, 2, 8, ("none", "hf-pld")))
    with pytest.raises(ValueError, match="concurrency 1 and temperature 0"):
        check_cell(Cell("code", 1, 1.0, 2, 8, ("none", "hf-greedy")))
    with pytest.raises(ValueError, match="duplicates"):
        check_cell(Cell("code", 1, 0.0, 2, 8, ("none", "none")))
    check_cell(Cell("code", 1, 0.0, 2, 8, ("none", "hf-greedy", "hf-pld")))


def test_full_plan_covers_the_goals():
    cells = full_plan(mt_bench=None)
    ids = {c.id: c for c in cells}
    g1 = ids["mixed/c4/t0"]
    statics = {f"static:{p}:{k}" for p in ("ngram", "jacobi") for k in (1, 2, 4, 8)}
    assert statics <= set(g1.configs)
    for peer in (
        "smartspec:ngram",
        "banditspec:ngram",
        "vllm-dynamic",
        "adaptive",
        "adaptive-warm",
    ):
        assert peer in g1.configs
    for cat in CATEGORIES:
        cell = ids[f"{cat}/c4/t0"]
        assert statics <= set(cell.configs) and "adaptive" in cell.configs
    assert {"none", "adaptive"} <= set(ids["mixed/c16/t1"].configs)
    assert {"hf-greedy", "hf-pld"} <= set(ids["mixed/c1/t0"].configs)
    # The vLLM table is tuned from static n-gram runs at each concurrency it is used at or near.
    for c in (1, 4, 16):
        assert "static:ngram:2" in ids[f"mixed/c{c}/t0"].configs
    for c in cells:
        check_cell(c)
        assert c.configs[0] == "none"
    assert "draft" not in " ".join(g1.configs)
    with_draft = full_plan(draft=True)[0]
    assert {"static:draft:4", "adaptive+draft", "adaptive+lora"} <= set(with_draft.configs)
    assert "mtbench/c4/t0" in {c.id for c in full_plan(mt_bench=Path("x"))}


def test_quick_plan_runs_every_kind_and_is_estimated_short():
    cells = quick_plan()
    kinds = {parse_config(n).kind for c in cells for n in c.configs}
    assert kinds == {"baseline", "nospec", "static", "peer", "adaptive", "vllm", "hf"}
    for c in cells:
        check_cell(c)
    assert estimate_minutes(cells, 2) < estimate_minutes(full_plan(), 3) / 4


def test_estimate_grows_with_repeats_and_builds():
    cells = [Cell("code", 4, 0.0, 4, 32, ("none", "static:ngram:2"))]
    one, three = estimate_minutes(cells, 1), estimate_minutes(cells, 3)
    assert three > one > 0
    assert estimate_minutes(cells, 1, eager=True) < one
    # --trace-evaluated adds one pass in a cell that runs adaptive, none elsewhere
    assert estimate_minutes(cells, 1, trace_evaluated=True) == one
    ad = [Cell("code", 4, 0.0, 4, 32, ("none", "adaptive"))]
    base, traced = estimate_minutes(ad, 1), estimate_minutes(ad, 1, trace_evaluated=True)
    # one repeat more is two passes here (none and adaptive): the traced pass is one
    assert traced - base == pytest.approx((estimate_minutes(ad, 2) - base) / 2)


def test_custom_plan_product_and_hf_filter():
    cells = custom_plan(
        ["code", "mixed"], [1, 4], [0.0, 1.0], ["static:ngram:2", "hf-pld", "hf-greedy"], 3, 16
    )
    assert len(cells) == 8
    for c in cells:
        assert c.configs[0] == "none"
        has_hf = any(x.startswith("hf-") for x in c.configs)
        assert has_hf == (c.concurrency == 1 and c.temperature == 0)
    # Without a prompt count each cell gets enough prompts to fill its batch (twice its concurrency).
    auto = custom_plan(["mixed"], [1, 4, 16], [0.0], ["static:ngram:2"], None, 16)
    assert [c.prompts for c in auto] == [8, 8, 32]
    assert all(c.prompts >= c.concurrency for c in auto)
    with pytest.raises(ValueError, match="workloads"):
        custom_plan([], [1], [0.0], ["none"], 1, 1)
    with pytest.raises(ValueError, match="config="):
        custom_plan(["code"], [1], [0.0], ["static:ngram:99"], 1, 1)


def test_tune_table_examples():
    assert tune_table({1: 8, 4: 4, 16: 2}, 16) == [[1, 2, 8], [3, 8, 4], [9, 16, 2]]
    assert tune_table({4: 3}, 4) == [[1, 4, 3]]
    assert tune_table({4: 3}, 16) == [[1, 16, 3]]
    assert tune_table({1: 0, 16: 1}, 16) == [[1, 4, 0], [5, 16, 1]]
    # A concurrency above the engine's limit is ignored.
    assert tune_table({4: 2, 64: 1}, 16) == [[1, 16, 2]]
    with pytest.raises(ValueError, match="best_k"):
        tune_table({}, 4)
    with pytest.raises(ValueError, match="max_batch"):
        tune_table({1: 2}, 0)
    with pytest.raises(ValueError, match="k >= 0"):
        tune_table({1: -1}, 4)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.integers(1, 64), st.integers(0, 8), min_size=1, max_size=5),
    st.integers(1, 64),
)
def test_tune_table_is_contiguous_and_valid_for_vllm(best, max_batch):
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")

    rows = tune_table(best, max_batch)
    assert rows[0][0] == 1 and rows[-1][1] == max_batch
    for a, b in itertools.pairwise(rows):
        assert b[0] == a[1] + 1
    assert all(r[2] in best.values() for r in rows)
    # vLLM's own validation accepts it.
    assert utils.validate_and_normalize_dynamic_sd_schedule(rows) == [tuple(r) for r in rows]
    # Each measured concurrency within range gets its own best k.
    for c, k in best.items():
        if c <= max_batch:
            row = next(r for r in rows if r[0] <= c <= r[1])
            assert row[2] == k
