"""Suffix counterfactuals: replaying a trace in its step order rebuilds the engine's drafts exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from adaptive_spec.sim.counterfactual import check_logged, suffix_counterfactual
from adaptive_spec.sim.requests import matched_length
from adaptive_spec.sim.trace_io import load_replay_trace

from adaptive_spec.core.trace import TraceWriter, read_trace
from adaptive_spec.proposers import ProposalRequest, SuffixProposer


def record_engine_like_trace(
    path: Path, *, k: int = 4, n_req: int = 7, concurrency: int = 3, seed: int = 0, **options
) -> SuffixProposer:
    """A trace as :class:`AdaptiveSpec` writes it for ``static:suffix:k``: up to ``concurrency``
    requests at a time; after each step the running requests are decided together (suffix drafts for
    all, ``cf_drafts``), the next step verifies them (greedy: accepted = common prefix with the true
    output) and logs them; finished requests are released before the next decision."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 60, 40)
    todo = []
    for i in range(n_req):  # repetitive traffic: pieces of a shared text and of the request's own
        prompt = np.concatenate([rng.integers(0, 60, 8), shared[i : i + 12]])
        out = np.concatenate([shared[i + 5 : i + 25], prompt[:6], rng.integers(0, 60, 6)])
        todo.append((f"q{i}", prompt, out))
    options = {"max_k": k, **options}
    prop = SuffixProposer(**options)
    cfg = prop.config()
    header = {"max_k": k, "proposers": ["none", "suffix"], "policy": f"static:suffix:{k}"}
    w = TraceWriter(path, {**header, "meta": {"suffix": cfg}})
    running: dict[str, list] = {}  # rid -> [prompt, out, emitted, pending draft or None]
    step = 0
    while todo or running:
        while todo and len(running) < concurrency:
            rid, prompt, out = todo.pop(0)
            w.request(
                {
                    "req_id": rid,
                    "category": None,
                    "prompt_token_ids": prompt.tolist(),
                    "temperature": 0.0,
                    "max_tokens": len(out),
                }
            )
            running[rid] = [prompt, out, 0, None]
        rows = []
        for rid, st in running.items():
            prompt, out, n, draft = st
            if draft is None:  # prefill step: one token, no decision logged
                emitted = out[:1]
            else:
                acc = matched_length(draft[:k], out[n + 1 :]) if n + 1 < len(out) else 0
                emitted = out[n : n + 1 + acc]
            rows.append(
                {
                    "req_id": rid,
                    "arm": f"suffix:{k}" if draft is not None and len(draft) else "none",
                    "drafted": 0 if draft is None else len(draft),
                    "accepted": 0,
                    "emitted": len(emitted),
                    "emitted_token_ids": emitted.tolist(),
                    "num_output_before": n,
                    "features": None,
                    "propensity": None,
                    "cf_drafts": None if draft is None else {"suffix": draft.tolist()},
                    "target_argmax": None,
                    "finished": n + len(emitted) >= len(out),
                }
            )
            st[2] = n + len(emitted)
        w.step({"step": step, "step_time_s": 0.02, "batch_size": len(rows), "requests": rows})
        step += 1
        for r in rows:
            if r["finished"]:
                prop.release(r["req_id"])
                del running[r["req_id"]]
        # the decision after this step: every running request, one propose call
        rids = list(running)
        reqs = [
            ProposalRequest(
                rid,
                np.concatenate([running[rid][0], running[rid][1][: running[rid][2]]]),
                len(running[rid][1]) - running[rid][2],
                1000,
            )
            for rid in rids
        ]
        for rid, d in zip(rids, prop.propose(reqs, [k] * len(reqs)), strict=True):
            running[rid][3] = d
    w.close({})
    return prop


def test_replayed_suffix_drafts_equal_the_logged_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_engine_like_trace(path, token_budget=120)  # small: requests are evicted mid-trace
    trace = read_trace(path)
    cf = suffix_counterfactual(trace)
    res = check_logged(trace, cf, "suffix")
    assert res["compared"] > 40 and res["equal"] == res["compared"]
    drafted = sum(
        len(r["cf_drafts"]["suffix"]) > 0
        for s in trace.steps
        for r in s["requests"]
        if r["cf_drafts"]
    )
    assert drafted > 10  # the check is not about empty drafts only
    assert cf.sources == {"suffix": "rerun"}


def test_replay_in_another_order_or_configuration_differs(tmp_path: Path) -> None:
    """The global index matters: other options give other drafts on the same trace."""
    path = tmp_path / "t.jsonl"
    record_engine_like_trace(path)
    trace = read_trace(path)
    local_only = suffix_counterfactual(trace, options={"token_budget": 0})
    res = check_logged(trace, local_only, "suffix")
    assert res["compared"] > 0 and res["equal"] < res["compared"]


def test_load_replay_trace_recomputes_and_checks_suffix_drafts(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_engine_like_trace(path, seed=3)
    wl = load_replay_trace(path)
    assert wl.suffix_check["compared"] > 0
    assert wl.suffix_check["equal"] == wl.suffix_check["compared"]
    assert wl.counterfactuals.sources["suffix"] == "rerun"
    assert 0 < wl.coverage["suffix"] <= 1
    r = wl.requests[0]
    known = [n for n in range(len(r)) if r.draft("suffix", n) is not None]
    assert known and all(
        r.match_feature("suffix", n) == int(wl.counterfactuals.features[r.req_id]["suffix"][n])
        for n in known
    )


def test_tenant_scope_needs_the_tenants(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tenants = {f"q{i}": "ab"[i % 2] for i in range(7)}
    record_engine_like_trace(path, scope="tenant", tenant_of=tenants)
    trace = read_trace(path)
    with pytest.raises(ValueError, match="tenant_of"):
        suffix_counterfactual(trace)
    res = check_logged(trace, suffix_counterfactual(trace, tenant_of=tenants), "suffix")
    assert res["compared"] > 0 and res["equal"] == res["compared"]


def test_bench_module_measures_cost_and_coverage(tmp_path: Path, capsys) -> None:
    from adaptive_spec.commands.bench import suffix as bench_suffix

    path = tmp_path / "t.jsonl"
    record_engine_like_trace(path)
    cov = bench_suffix.coverage_on_trace(path)
    assert cov["decisions"] > 0 and cov["positions"] > 0
    for key in ("suffix_at_decisions", "ngram_at_decisions", "suffix_every_position"):
        assert 0 <= cov[key] <= 1
    assert cov["suffix_every_position"] > cov["ngram_every_position"]  # the shared text pays
    assert cov["suffix_accepted_per_position"] > cov["ngram_accepted_per_position"]
    rows = bench_suffix.cost_table(
        bench_suffix.trace_streams(path), concurrencies=(1, 4), repeats=1, arctic=False
    )
    assert {r["config"] for r in rows} >= {"suffix", "ngram (prompt lookup)"}
    assert all(r["steps"] > 0 and r["cpu_min_us"] > 0 for r in rows)
    assert bench_suffix.main(["--trace", str(path), "--repeats", "1", "--no-arctic"]) == 0
    assert "suffix_at_decisions" in capsys.readouterr().out
