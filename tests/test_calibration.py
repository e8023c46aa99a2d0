"""Step-cost calibration, cached and shipped tables, acceptance priors and held-out prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaptive_spec.core import cost_tables
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.vllm.calibrate import Calibration, plan_batches, plan_tokens
from tests.conftest import tiny_prompts


def test_calibration_plan():
    assert plan_tokens(1, 8) == [0, 1, 2, 4, 8]
    assert plan_tokens(4, 8) == [0, 1, 2, 4, 8, 16, 32]
    assert plan_tokens(3, 4) == [0, 1, 2, 4, 8, 12]
    assert plan_batches(4) == [1, 2, 4]
    assert plan_batches(6) == [1, 2, 4, 6]
    assert plan_batches(256) == [1, 2, 4, 8, 16, 32, 64]


class _Req:
    def __init__(self, rid, last=7):
        self.request_id, self.all_token_ids, self.num_tokens = rid, [1, last], 2


def test_calibration_drafts_spread_the_planned_tokens():
    cal = Calibration(max_k=4, vocab_size=100, plan=[0, 5, 16, 99])
    live = [_Req("a"), _Req("b"), _Req("c")]
    cal.req_ids = {"a", "b", "c"}
    assert [len(d) for d in cal.drafts(live)[1]] == [0, 0, 0]
    ids, d = cal.drafts(live)
    assert ids == ["a", "b", "c"] and [len(x) for x in d] == [2, 2, 1]
    assert [len(x) for x in cal.drafts(live)[1]] == [4, 4, 4]  # 16 > 3 x 4: capped
    assert all(0 <= t < 100 for x in d for t in x)
    assert cal.drafts([_Req("other")]) == ([], [])


def test_calibration_alternates_even_and_concentrated_placement():
    cal = Calibration(max_k=4, vocab_size=100, plan=[5, 9] * 2, per_repeat=2)
    live = [_Req("a"), _Req("b"), _Req("c")]
    cal.req_ids = {"a", "b", "c"}
    even = [[len(x) for x in cal.drafts(live)[1]] for _ in range(2)]
    conc = [[len(x) for x in cal.drafts(live)[1]] for _ in range(2)]
    assert even == [[2, 2, 1], [3, 3, 3]]
    # Repeat 2 puts the same V on as few requests as possible, from a rotating first request.
    assert sorted(conc[0]) == [0, 1, 4] and sorted(conc[1]) == [1, 4, 4]
    assert [sum(x) for x in even + conc] == [5, 9, 5, 9]


@pytest.mark.parametrize("v", [0, 1, 3, 7, 12, 40])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_placement_keeps_the_planned_tokens_and_the_cap(v, n):
    from adaptive_spec.vllm.calibrate import placement

    for conc in (False, True):
        for start in range(n + 1):
            ks = placement(v, n, 4, concentrated=conc, start=start)
            assert len(ks) == n and sum(ks) == min(v, 4 * n) and max(ks) <= 4
            used = sum(1 for k in ks if k)
            # Concentrated: the fewest requests that hold v; even: the most.
            assert used == (-(-min(v, 4 * n) // 4) if conc else min(v, n))


def test_cached_table_roundtrip_and_key_matching(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    key = {"model": "m", "dtype": "bfloat16", "threads": 2, "device": "cpu x"}
    tab = StepCostTable.from_samples([4, 4], [0, 8], [0.02, 0.023], key=key)
    assert cost_tables.cached_table(key) is None
    path = cost_tables.save_cached_table(tab)
    assert path is not None and path.exists()
    back = cost_tables.cached_table(key)
    assert back is not None and np.allclose(back.seconds, tab.seconds)
    assert cost_tables.cached_table({**key, "threads": 1}) is None
    path.write_text("{ not json")
    assert cost_tables.cached_table(key) is None  # a bad file is skipped, never half-loaded


def test_shipped_tables_and_priors_parse():
    from adaptive_spec.core.priors import shipped_prior

    for t in cost_tables.shipped_tables():
        assert t.key.get("model") and (np.diff(t.seconds, axis=1) >= 0).all()
        prior = shipped_prior(t.key)
        if prior is not None:
            ctrl = AdaptiveController(["ngram", "jacobi"], int(prior["max_k"]))
            ctrl.acceptance.load_state_dict(prior)
            a = ctrl.acceptance.table()
            assert np.isfinite(a).all() and ((a >= 0) & (a <= 1)).all()


def test_prior_prompts_are_held_out_from_the_benchmarks_and_the_main_job():
    from adaptive_spec.commands.workloads import CATEGORIES, PRIOR_SKIP, load_workload

    prior = {p.source_id for p in load_workload("mixed", 48, skip=PRIOR_SKIP)}
    used = {
        p.source_id for p in load_workload("mixed", 64)
    }  # the main job uses 32, bench at most 32
    for cat in CATEGORIES:
        used |= {p.source_id for p in load_workload(cat, 16)}
    assert prior and not prior & used


def test_compare_static_summary_pairs_rounds():
    from adaptive_spec.commands.compare_static import summarize_rounds

    def r(i, g):
        return {"round": i, "goodput_tok_s": g, "mean_accepted_length": 1.0}

    s = summarize_rounds(
        {
            "none": [r(0, 100), r(1, 50)],
            "table:x": [r(0, 110), r(1, 60)],
            "adaptive": [r(0, 120), r(1, 55)],
        },
        "table:x",
    )
    assert s["configs"]["adaptive"]["ratio_to_none"] == pytest.approx((1.2 + 1.1) / 2)
    assert s["configs"]["adaptive"]["ratio_to_baseline"] == pytest.approx((120 / 110 + 55 / 60) / 2)
    assert all("ratio_to_nospec" not in c for c in s["configs"].values())
    # The engine without speculative decoding in the same rounds: ratios to it are paired too. The
    # machine halved its speed in round 1; the quotient of medians would say 87.5 / 77.5 = 1.13.
    s = summarize_rounds(
        {
            "none": [r(0, 100), r(1, 50)],
            "table:x": [r(0, 110), r(1, 60)],
            "adaptive": [r(0, 120), r(1, 55)],
            "nospec": [r(0, 105), r(1, 50)],
        },
        "table:x",
    )
    assert s["configs"]["adaptive"]["ratio_to_nospec"] == pytest.approx((120 / 105 + 55 / 50) / 2)
    assert s["configs"]["none"]["ratio_to_nospec"] == pytest.approx((100 / 105 + 1.0) / 2)
    assert s["configs"]["nospec"]["ratio_to_nospec"] == 1.0


def test_compare_static_counts_outputs_that_differ_from_the_baseline_s():
    from types import SimpleNamespace

    from adaptive_spec.commands.compare_static import diverged_requests, summarize_rounds

    def outs(*texts):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in texts]

    base = outs((1, 2, 3), (4, 5), (6,))
    assert diverged_requests(base, outs([1, 2, 3], (4, 5), (6,))) == 0  # tuple or list alike
    assert diverged_requests(base, outs((1, 2, 9), (4, 5), (6, 7))) == 2
    with pytest.raises(ValueError, match="same prompts"):
        diverged_requests(base, outs((1,)))

    def r(i, g, d):
        run = {"round": i, "goodput_tok_s": g, "mean_accepted_length": 1.0}
        return run | {"diverged_from_baseline": d, "requests": 3}

    s = summarize_rounds(
        {
            "none": [r(0, 1, 0), r(1, 1, 1)],
            "t": [r(0, 1, 0), r(1, 1, 0)],
            "adaptive": [r(0, 1, 2), r(1, 1, 1)],
        },
        "t",
    )
    assert s["configs"]["adaptive"]["diverged_from_baseline"] == {"requests": 3, "total": 6}
    assert s["configs"]["t"]["diverged_from_baseline"] == {"requests": 0, "total": 6}


@pytest.mark.vllm
def test_calibration_on_the_engine_measures_the_planned_cells_and_changes_nothing(
    tiny_llm, tmp_path, monkeypatch
):
    from vllm import SamplingParams

    from adaptive_spec.vllm import AdaptiveSpec

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    prompts = tiny_prompts(3, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def gen():
        outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    with AdaptiveSpec(tiny_llm, ["none"], policy="none", policy_state=None) as plain:
        before = gen()
        assert plain.stats()["cost_table_source"] is None  # a static policy prices no steps
    spec = AdaptiveSpec(
        tiny_llm, ["none", "ngram"], policy="adaptive", policy_state=None, calibrate=True
    )
    try:
        assert spec.cost_table_source == "calibrated now"
        table = spec.policy.cost.table
        assert table.source == "calibrated" and table.key["model"] == spec.engine_key["model"]
        counts = table.counts
        measured = {(int(b), int(v)) for b, v in zip(*np.nonzero(counts), strict=True)}
        assert len(measured) >= 10  # batch sizes 1, 2, 4 x their V plans
        assert (np.diff(table.seconds, axis=1) >= 0).all()
        # the sampled part: the same cells measured at temperature 1, never cheaper than greedy
        assert table.sampled is not None
        assert (table.sampled.counts > 0).sum() == (counts > 0).sum()
        assert (table.sampled.seconds >= table.seconds).all()
        assert spec.driver.num_tracked() == 0 and spec.scheduler.get_num_unfinished_requests() == 0
        assert gen() == before  # greedy identity after calibration, with the controller attached
    finally:
        spec.detach()
    # The table was cached: the next attach finds it without measuring.
    spec2 = AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="adaptive", policy_state=None)
    try:
        assert spec2.cost_table_source == "calibrated earlier on this machine"
        assert spec2.stats()["cost_table_source"] == spec2.cost_table_source
    finally:
        spec2.detach()
    assert (
        json.loads(next((tmp_path / "cost-tables").glob("*.json")).read_text())["source"]
        == "calibrated"
    )


@pytest.mark.vllm
def test_a_cached_table_from_a_smaller_engine_is_measured_again(tiny_llm, tmp_path, monkeypatch):
    """A table cached by a run on a smaller engine (the main job at 4 requests) priced a larger
    engine's batches by extrapolation: at batch 16 it once charged 15 ms to speculate at all where
    the engine paid 1.6 ms. With ``calibrate="auto"`` such a table is measured again up to this
    engine's batch size and replaced in the cache; ``calibrate=False`` still uses it as it is."""
    from adaptive_spec.vllm import AdaptiveSpec

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    top = plan_batches(int(tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_seqs))[-1]
    assert top >= 4
    spec = AdaptiveSpec(
        tiny_llm, ["none", "ngram"], policy="none", policy_state=None, calibrate=False
    )
    try:
        small = spec.calibrate(batch_sizes=[1, 2], repeats=1, sampled=False)
    finally:
        spec.detach()
    assert small.measured_batch_max() == 2
    assert cost_tables.save_cached_table(small) is not None

    def attach(calibrate):
        return AdaptiveSpec(
            tiny_llm, ["none", "ngram"], policy="adaptive", policy_state=None, calibrate=calibrate
        )

    spec = attach(False)
    try:
        assert spec.cost_table_source == "calibrated earlier on this machine"
        assert spec.policy.cost.table.measured_batch_max() == 2
    finally:
        spec.detach()
    spec = attach("auto")
    try:
        assert spec.cost_table_source == "calibrated now"
        assert spec.policy.cost.table.measured_batch_max() == top
    finally:
        spec.detach()
    assert cost_tables.cached_table(spec.engine_key).measured_batch_max() == top
    spec = attach("auto")
    try:
        assert spec.cost_table_source == "calibrated earlier on this machine"
    finally:
        spec.detach()


@pytest.mark.vllm
def test_calibration_lifts_the_admission_limit_and_restores_it(tiny_llm, tmp_path, monkeypatch):
    """Under vLLM's admission limit (``max_num_active_seqs``, as the bench sets per cell), a batch of
    B dummy requests would run as a smaller batch and every larger batch would be priced as that
    one. Calibration measures each planned batch size at that size and puts the limit back."""
    from adaptive_spec.vllm import AdaptiveSpec

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    spec = AdaptiveSpec(
        tiny_llm, ["none", "ngram"], policy="none", policy_state=None, calibrate=False
    )
    sched = spec.scheduler
    before = sched.max_num_active_reqs
    sched.max_num_active_reqs = 1
    try:
        table = spec.calibrate(batch_sizes=[1, 2, 4], repeats=1, sampled=False)
        assert sched.max_num_active_reqs == 1
    finally:
        sched.max_num_active_reqs = before
        spec.detach()
    rows = {int(table.batch_sizes[b]) for b in np.nonzero(table.counts.sum(axis=1))[0]}
    assert rows == {1, 2, 4}


def test_a_policy_without_acceptance_counts_gets_no_prior():
    """A SmartSpec-style peer has an ``acceptance(req_id)`` method, not an AcceptanceModel: the shipped
    prior is skipped for it (it once failed the peer's whole benchmark configuration with
    "'function' object has no attribute 'load_state_dict'"), and the controller still gets one."""
    from adaptive_spec.core.peers import SmartSpecPolicy
    from adaptive_spec.core.priors import apply_prior, shipped_prior

    key = next(t.key for t in cost_tables.shipped_tables() if shipped_prior(t.key) is not None)
    peer = SmartSpecPolicy(["ngram"], 8, proposer="ngram")
    assert apply_prior(peer, key) is False
    assert apply_prior(AdaptiveController(["ngram", "jacobi"], 8), key) is True


def test_calibration_prompts_default_to_a_realistic_context_within_max_model_len(
    tiny_llm, tmp_path, monkeypatch
):
    """A draft token's verification attends over the context, so the dummy prompts default to
    ``DEFAULT_PROMPT_LEN`` tokens (not a few), spread over a batch (a quarter to 4.5 times it):
    shortened only where ``max_model_len`` leaves no room for them and the planned steps; an explicit
    length is spread the same way."""
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm import calibrate as cal_mod

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    seen: list[int] = []
    real = cal_mod._measure_batch

    def spy(core, sched, cal, rng, spec, B, repeats, lengths, temperature):
        seen.append(lengths)
        return real(core, sched, cal, rng, spec, B, repeats, lengths, temperature)

    monkeypatch.setattr(cal_mod, "_measure_batch", spy)
    spec = AdaptiveSpec(
        tiny_llm, ["none", "ngram"], policy="none", policy_state=None, calibrate=False
    )
    try:
        spec.calibrate(batch_sizes=[2], repeats=1, sampled=False)
        spec.calibrate(batch_sizes=[2], repeats=1, sampled=False, prompt_len=7)
        full = spec.max_model_len
        spec.max_model_len = 150  # as an engine with a short max_model_len would have it
        spec.calibrate(batch_sizes=[2], repeats=1, sampled=False)
        spec.max_model_len = full
        with pytest.raises(ValueError, match="prompt_len=0 is invalid"):
            spec.calibrate(batch_sizes=[2], repeats=1, prompt_len=0)
    finally:
        spec.detach()
    steps = cal_mod.plan_steps(2, spec.max_k, 1)
    room = 150 - steps - spec.max_k - 1
    n = cal_mod.DEFAULT_PROMPT_LEN
    assert seen == [
        [n // 4, min(n * 9 // 2, full - steps - spec.max_k - 1)],
        [2, 32],
        [round(room / 4), room],
    ]


def test_prompt_lengths_spread_log_uniformly_within_the_room():
    from adaptive_spec.vllm.calibrate import PROMPT_SPREAD, prompt_lengths

    assert prompt_lengths(1, 192, 10_000) == [192]
    got = prompt_lengths(16, 192, 10_000)
    assert got[0] == 48 and got[-1] == 864 and got == sorted(got)
    ratios = np.array(got[1:], dtype=float) / np.array(got[:-1], dtype=float)
    step = (PROMPT_SPREAD[1] / PROMPT_SPREAD[0]) ** (1 / 15)
    assert np.allclose(ratios, step, rtol=0.03)  # equal ratios: log-uniform
    assert max(prompt_lengths(16, 192, 300)) == 300 and min(prompt_lengths(4, 1, 5)) >= 1


def test_a_prior_for_more_draft_positions_serves_a_smaller_max_k():
    """The shipped prior (max_k 8) once fitted only controllers of max_k 8: a benchmark at
    ``--max-k 4`` started from nothing. Positions 1..4 of it are the same conditional acceptances."""
    from adaptive_spec.core.priors import apply_prior, fit_max_k, shipped_prior

    key = next(t.key for t in cost_tables.shipped_tables() if shipped_prior(t.key) is not None)
    prior = shipped_prior(key)
    assert int(prior["max_k"]) > 4
    small = AdaptiveController(["ngram", "jacobi"], 4)
    assert apply_prior(small, key) is True
    full = AdaptiveController(["ngram", "jacobi"], int(prior["max_k"]))
    assert apply_prior(full, key) is True
    np.testing.assert_allclose(small.acceptance.prior_a, full.acceptance.prior_a[..., :4])
    np.testing.assert_allclose(small.acceptance.prior_b, full.acceptance.prior_b[..., :4])
    assert small.acceptance.prior_a.sum() > 0
    assert fit_max_k(prior, 64) is prior  # more positions than the prior has: unchanged, refused
    big = AdaptiveController(["ngram", "jacobi"], int(prior["max_k"]) + 4)
    assert apply_prior(big, key) is False
    with pytest.raises(ValueError, match="shape"):
        fit_max_k({"acc": []}, 4)


@pytest.mark.parametrize(
    "argv",
    [["--proposers", "none,ngram,draft"], ["--draft-model", "/x"], ["--lora-adapter", "a=/x"]],
)
def test_calibrate_refuses_the_engine_flags_it_does_not_use(argv, capsys):
    """``calibrate`` shares the engine flags of ``run`` but measures the engine without a drafter and
    learns the prior for none, n-gram and Jacobi: a drafter asked for is refused, not ignored."""
    from adaptive_spec.commands.cli import main

    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "not supported" in err and "leave these flags out" in err


EMBEDDED = {"model": "SmolLM2-135M-Instruct-float32", "dtype": "float32"}


def _head_key(dtype: str = "float32") -> dict:
    from adaptive_spec.core.priors import prior_key
    from adaptive_spec.vllm.eagle3 import default_head_path

    key = {"model": f"SmolLM2-135M-Instruct-{dtype}", "dtype": dtype}
    return prior_key(key, default_head_path(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shipped_head_has_a_drafter_prior(dtype, default_model_dir):
    """The drafter prior is keyed on the head's directory name, which holds the start of its weights'
    SHA-256: a retrained head needs ``calibrate --head-prior --dtype D --ship`` again."""
    from adaptive_spec.core.priors import DRAFTER_ROW, shipped_prior

    state = shipped_prior(_head_key(dtype), drafter=True)
    assert state is not None, f"no drafter prior for {_head_key(dtype)['drafter']}"
    assert state["proposers"] == [DRAFTER_ROW]
    a, b = np.asarray(state["prior_a"]), np.asarray(state["prior_b"])
    mean = a / (a + b)
    # greedy, no history yet, position 1: the head is right about a third to a half of the time
    assert 0.2 < mean[0, 0, 0, 0, 0] < 0.8 and (a + b)[0, 0, 0, 0, 0] > 10


def test_a_drafter_prior_serves_the_draft_and_lora_arms_of_its_drafter_only(default_model_dir):
    from adaptive_spec.core.priors import apply_prior, prior_key, shipped_prior

    props = ["ngram", "jacobi", "draft", "lora:code"]
    key = _head_key()
    head = AdaptiveController(props, 4)
    assert apply_prior(head, key) is True
    lookup = AdaptiveController(props, 4)
    assert apply_prior(lookup, EMBEDDED) is True  # no drafter: the lookup prior alone
    other = AdaptiveController(props, 4)
    assert apply_prior(other, prior_key(EMBEDDED, "/cache/head-other-0123456789ab-float32")) is True
    fresh = AdaptiveController(props, 4)
    d, lo = props.index("draft"), props.index("lora:code")
    h, lk, ot, fr = (c.acceptance for c in (head, lookup, other, fresh))
    # the drafter's rows come from its prior, the same for its adapter's arm
    np.testing.assert_allclose(h.prior_a[d], h.prior_a[lo])
    np.testing.assert_allclose(h.prior_b[d], h.prior_b[lo])
    assert not np.allclose(h.prior_a[d], fr.prior_a[d])
    drafter = shipped_prior(key, drafter=True)
    np.testing.assert_allclose(h.prior_a[d], np.asarray(drafter["prior_a"])[0, ..., :4])
    # the lookup proposers' rows are the lookup prior's, with or without a drafter
    np.testing.assert_allclose(h.prior_a[:2], lk.prior_a[:2])
    assert not np.allclose(lk.prior_a[:2], fr.prior_a[:2])
    # another drafter, or none: its arms keep the generic prior
    for c in (lk, ot):
        np.testing.assert_allclose(c.prior_a[d:], fr.prior_a[d:])
        np.testing.assert_allclose(c.prior_b[d:], fr.prior_b[d:])
    assert shipped_prior(EMBEDDED, drafter=True) is None


def test_select_rows_renames_and_refuses_a_missing_row():
    from adaptive_spec.core.priors import select_rows

    m = AdaptiveController(["ngram", "draft"], 3).acceptance
    m.prior_a[1] = 7.0
    out = select_rows(m.state_dict(), {"draft": "lora:x"})
    assert out["proposers"] == ["lora:x"] and out["shape"][0] == 1
    assert np.asarray(out["prior_a"]).shape == (1, *m.shape[1:])
    assert (np.asarray(out["prior_a"]) == 7.0).all()
    with pytest.raises(ValueError, match="no row 'suffix'"):
        select_rows(m.state_dict(), {"suffix": "suffix"})
    with pytest.raises(ValueError, match="malformed"):
        select_rows({"proposers": ["draft"]}, {"draft": "draft"})


def test_calibrate_learns_the_head_prior_apart(capsys):
    """The drafter prior needs an engine with the drafter, the table and lookup prior one without:
    asking for both at once is refused with the two commands to run instead."""
    from adaptive_spec.commands.cli import main

    assert main(["calibrate", "--prior", "--head-prior"]) == 2
    err = capsys.readouterr().err
    assert "--head-prior" in err and "run calibrate --prior, then calibrate --head-prior" in err
