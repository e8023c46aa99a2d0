"""Data-parallel replicas in replay (adaptive_spec.sim.replicas, ``adaptive-spec replay --replicas``):
one replica is the plain replay; sharing replicas lose no update in the shared state file; sharing
reaches the single server's learned acceptance in fewer requests per replica than not sharing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.replicas import (
    reach,
    replica_study,
    reverse_order,
    run_replicas,
    split_round_robin,
)
from adaptive_spec.sim.synthetic import CODE, make_requests, stationary

from adaptive_spec.commands.cli import main as cli_main
from adaptive_spec.core.controller import AdaptiveController

PROPS = ["ngram", "jacobi"]
PROFILE = PRESETS["cpu-smollm2"]


def _requests(n: int = 16, length: int = 48, seed: int = 3) -> list:
    return make_requests(stationary(CODE, n, length), 4, seed=seed)


def _controller(seed: int, **kw: float) -> AdaptiveController:
    return AdaptiveController(PROPS, 4, seed=seed, **kw)


def test_round_robin_split_by_arrival() -> None:
    reqs = _requests(5, 8)
    for r, t in zip(reqs, (4.0, 0.0, 3.0, 1.0, 2.0), strict=True):
        r.arrival_s = t
    shares = split_round_robin(reqs, 2)
    assert [[r.req_id for r in s] for s in shares] == [["s1", "s4", "s0"], ["s3", "s2"]]
    for bad in (0, 6, 1.5, True):
        with pytest.raises(ValueError, match="n_replicas"):
            split_round_robin(reqs, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("share", [False, True])
def test_one_replica_is_the_plain_replay(share: bool, tmp_path: Path) -> None:
    reqs = _requests(6, 40)
    plain_policy = _controller(0)
    plain = replay(reqs, plain_policy, PROFILE, max_batch=2, proposers=PROPS)
    run = run_replicas(
        reqs,
        _controller,
        PROFILE,
        n_replicas=1,
        max_batch=2,
        share=share,
        sync_every=1,
        proposers=PROPS,
        state_dir=tmp_path,
    )
    (res,) = run.results

    def measured(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "policy_time_s"}  # (wall time)

    assert measured(res.as_dict()) == measured(plain.as_dict())
    np.testing.assert_array_equal(res.step_time_s, plain.step_time_s)
    assert run.policies[0].state_dict() == plain_policy.state_dict()
    assert len(run.tables[0]) == len(reqs) + 1
    np.testing.assert_array_equal(run.tables[0][-1], plain_policy.acceptance.table())
    assert run.pulls == [0]  # alone with its own file: nothing to pull
    if share:  # the file holds what the replica learned (merged into it step by step)
        mine = plain_policy.acceptance.state_dict()
        for part in ("acc", "tri"):
            np.testing.assert_allclose(run.file_state["acceptance"][part], mine[part], atol=1e-3)


def test_sharing_replicas_lose_no_update(tmp_path: Path) -> None:
    """Without forgetting (discount 1), the shared file's acceptance counts are the sum of what every
    replica observed itself, and the replica that merged last holds them too."""
    reqs = _requests(12, 40)
    run = run_replicas(
        reqs,
        lambda i: _controller(i, discount=1.0),
        PROFILE,
        n_replicas=2,
        max_batch=2,
        share=True,
        sync_every=1,
        proposers=PROPS,
        state_dir=tmp_path,
    )
    assert all(p > 0 for p in run.pulls)  # each replica took the other's learning in
    k = 4
    acc = np.array(run.file_state["acceptance"]["acc"]).reshape(-1, k)
    tri = np.array(run.file_state["acceptance"]["tri"]).reshape(-1, k)
    own_t, own_a = sum(run.observed_trials), sum(run.observed_accepts)
    assert own_t.sum() > 100 and all(t.sum() > 0 for t in run.observed_trials)
    np.testing.assert_allclose(tri, own_t, atol=1e-6)
    np.testing.assert_allclose(acc, own_a, atol=1e-6)
    last = max(range(2), key=lambda i: run.results[i].time_s)
    np.testing.assert_allclose(run.policies[last].acceptance.tri.reshape(-1, k), own_t, atol=1e-6)
    # Not sharing, a replica's counts are its own observations only.
    alone = run_replicas(
        reqs,
        lambda i: _controller(i, discount=1.0),
        PROFILE,
        n_replicas=2,
        max_batch=2,
        share=False,
        proposers=PROPS,
    )
    for pol, obs in zip(alone.policies, alone.observed_trials, strict=True):
        np.testing.assert_allclose(pol.acceptance.tri.reshape(-1, k), obs, atol=1e-6)


def test_sharing_reaches_the_single_servers_acceptance_sooner_than_alone() -> None:
    study = replica_study(
        _requests(16, 48, seed=3),
        _controller,
        PROFILE,
        n_replicas=2,
        max_batch=2,
        tolerance=0.02,
        sync_every=1,
        proposers=PROPS,
    )
    single, shared, alone = (study.reach(r) for r in (study.single, study.shared, study.alone))
    assert single is not None and shared is not None
    assert shared < single
    assert alone is None or shared < alone
    assert study.errors(study.single)[0][-1] == 0.0  # the reference is the single server's end
    # Learning curves: sharing replicas trail the single server at the same total of requests by
    # less than lone replicas do.
    assert study.gap(study.single) == 0.0
    assert study.gap(study.shared) < study.gap(study.alone)
    # Sharing replicas end closer to the single server than lone ones.
    assert max(e[-1] for e in study.errors(study.shared)) < max(
        e[-1] for e in study.errors(study.alone)
    )
    d = study.as_dict()
    assert set(d["configurations"]) == {
        "1 server",
        "2 replicas sharing",
        "2 replicas alone",
        "1 server, reverse order",
    }
    assert 0 < study.order_floor < 0.1  # the same requests in another order end elsewhere
    assert d["configurations"]["2 replicas sharing"]["requests_per_replica"] == [8, 8]


def test_reverse_order_mirrors_arrivals() -> None:
    reqs = _requests(3, 8)
    for r, t in zip(reqs, (0.0, 1.0, 5.0), strict=True):
        r.arrival_s = t
    rev = reverse_order(reqs)
    assert [(r.req_id, r.arrival_s) for r in rev] == [("s2", 0.0), ("s1", 4.0), ("s0", 5.0)]
    assert reqs[0].arrival_s == 0.0  # copies


def test_reach_is_the_first_count_from_which_the_error_stays_within() -> None:
    assert reach([0.5, 0.1, 0.3, 0.1, 0.05], 0.2) == 3
    assert reach([0.1, 0.1], 0.2) == 0
    assert reach([0.1, 0.3], 0.2) is None


@pytest.fixture(scope="module")
def syn_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("replicas") / "syn.jsonl"
    assert (
        cli_main(["record", "--synthetic", "code-chat", "--out", str(trace), "--max-k", "4"]) == 0
    )
    return trace


def test_cli_replicas(syn_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = syn_trace
    # --replicas 1 is the usual replay.
    outs = []
    for extra in ([], ["--replicas", "1"]):
        out = tmp_path / f"r{len(extra)}"
        argv = ["replay", str(trace), "--policies", "adaptive,static:ngram:2", "--out", str(out)]
        assert cli_main(argv + extra) == 0
        summary = json.loads((out / "summary.json").read_text())
        for res in summary["policies"].values():
            res.pop("policy_time_s")  # (wall time)
        outs.append(summary)
        assert not (out / "replicas.json").exists()
    assert outs[0] == outs[1]
    capsys.readouterr()
    out = tmp_path / "rep"
    argv = ["replay", str(trace), "--replicas", "2", "--sync-every", "1", "--out", str(out)]
    assert cli_main([*argv, "--tolerance", "0.05"]) == 0
    text = capsys.readouterr().out
    for word in ("2 replicas sharing", "2 replicas alone", "1 server", "verdict", "skipped"):
        assert word in text
    summary = json.loads((out / "replicas.json").read_text())
    conf = summary["policies"]["adaptive"]["configurations"]
    assert conf["2 replicas sharing"]["sharing"] and summary["sync_every_requests"] == 1
    assert (out / "replicas.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--replicas", "0"], ["--replicas='0'", "from 1 to", "fix"]),
        (["--replicas", "two"], ["--replicas='two'", "fix"]),
        (["--replicas", "100000"], ["--replicas='100000'", "number of requests"]),
        (["--sync-every", "2"], ["--replicas", "--sync-every apply only", "add --replicas 2"]),
        (["--replicas", "2", "--sync-every", "0"], ["--sync-every='0'", "integer >= 1"]),
        (["--replicas", "2", "--sync-every-s", "nan"], ["--sync-every-s='nan'", "> 0"]),
        (["--replicas", "2", "--sync-every", "1", "--sync-every-s", "5"], ["not both"]),
        (["--replicas", "2", "--tolerance", "1.5"], ["--tolerance='1.5'", "between 0 and 1"]),
        (["--replicas", "2", "--policies", "static:ngram:2"], ["--policies", "adaptive"]),
        (["--replicas", "2", "--calibration"], ["--calibration", "fix"]),
    ],
)
def test_cli_replicas_errors(
    extra: list[str],
    words: list[str],
    syn_trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    capsys.readouterr()
    assert cli_main(["replay", str(syn_trace), "--out", str(tmp_path / "o"), *extra]) == 2
    text = " ".join(capsys.readouterr().out.split())
    for w in words:
        assert w in text, (w, text)
