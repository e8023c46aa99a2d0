"""Replicas that share one policy-state file while serving (data parallelism, several servers): each
save pushes what a replica learned since its previous save and pulls what the others pushed since, so a
fleet learns as one. Runtimes on stand-in engine cores (tests/test_serve_plugin.py), in one process and
in two processes writing at the same time."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
import types
from pathlib import Path

import pytest

from adaptive_spec.vllm.plugin import ServeConfig, ServeRuntime
from tests.test_serve_plugin import _FakeScheduler, _FakeSpec, _wait_for

#: Two cells of the acceptance counts (proposer ngram, greedy, no history, no match, position 1 / 2).
CELL_B = (0, 0, 0, 0, 0)
CELL_A = (0, 0, 0, 0, 1)


@pytest.fixture
def fake_attach(monkeypatch):
    from adaptive_spec.vllm import attach

    monkeypatch.setattr(
        attach.AdaptiveSpec,
        "attach_engine_core",
        classmethod(lambda cls, core, proposers, **kw: _FakeSpec(core, proposers, **kw)),
    )


def _core() -> types.SimpleNamespace:
    return types.SimpleNamespace(scheduler=_FakeScheduler(), engine_index=0)


def _learn(rt: ServeRuntime, cell: tuple[int, ...], trials: float, accepted: float) -> None:
    """Stands for the controller's learning from verified drafts (the stand-in learns none)."""
    acc = rt.spec.policy.acceptance
    acc.tri[cell] += trials
    acc.acc[cell] += accepted
    acc._mean = None


def _step_and_sync(core: types.SimpleNamespace, rt: ServeRuntime) -> None:
    """One engine step (a save is due after each); waits until the writer merged it."""
    saves = rt.saves
    core.post_step(True)
    _wait_for(lambda: rt.saves > saves)


def _file_counts(path, cell) -> tuple[float, float, int]:
    st = json.loads(path.read_text())["state"]
    a = st["acceptance"]
    pick = lambda x: x[cell[0]][cell[1]][cell[2]][cell[3]][cell[4]]  # noqa: E731
    return pick(a["tri"]), pick(a["acc"]), st["n_steps"]


def test_replica_pulls_what_another_pushed_and_never_echoes_it(fake_attach, tmp_path):
    state = tmp_path / "policy.json"
    cfg = ServeConfig(
        proposers=("none", "ngram"), state=state, save_every_steps=1, metrics_interval_s=3600
    )
    core_a, core_b = _core(), _core()
    a = ServeRuntime(core_a, cfg)
    b = ServeRuntime(core_b, cfg)
    try:
        _learn(b, CELL_B, 10.0, 7.0)
        _step_and_sync(core_b, b)  # B pushes its counts (and 1 step)
        assert _file_counts(state, CELL_B) == (10.0, 7.0, 1)
        tri_a = a.spec.policy.acceptance.tri
        assert tri_a[CELL_B] == 0.0  # A has not merged yet

        _learn(a, CELL_A, 4.0, 1.0)
        _step_and_sync(core_a, a)  # A pushes its own and pulls B's ...
        core_a.post_step(True)  # ... which it takes in after its next step
        pa = a.spec.policy
        assert (pa.acceptance.tri[CELL_B], pa.acceptance.acc[CELL_B]) == (10.0, 7.0)
        assert (pa.acceptance.tri[CELL_A], pa.acceptance.acc[CELL_A]) == (4.0, 1.0)
        assert pa.n_steps == 2 + 1 and a.pulls == 1  # its own 2 steps and B's 1
        assert pa.acceptance.table() is not None  # the posterior cache was dropped, not stale

        _step_and_sync(core_b, b)
        core_b.post_step(True)  # B takes A's counts in
        pb = b.spec.policy
        assert (pb.acceptance.tri[CELL_A], pb.acceptance.acc[CELL_A]) == (4.0, 1.0)

        # More merges with nothing new learned: the file keeps the sum (pulled counts are never
        # pushed back as a replica's own).
        for _ in range(3):
            _step_and_sync(core_a, a)
            _step_and_sync(core_b, b)
        core_a.post_step(True)
        core_b.post_step(True)
    finally:
        a.close()
        b.close()
    assert _file_counts(state, CELL_B)[:2] == (10.0, 7.0)
    assert _file_counts(state, CELL_A)[:2] == (4.0, 1.0)
    assert _file_counts(state, CELL_A)[2] == 6 + 7  # A stepped 6 times, B 7 times
    assert a.spec.policy.acceptance.tri[CELL_B] == 10.0


def _replica(path: str, cell: tuple[int, ...], rounds: int, out) -> None:
    """One replica in its own process: learns one trial (accepted) per step in its own cell, a save
    after every step; at the end reports what its policy holds."""
    from adaptive_spec.vllm import attach

    attach.AdaptiveSpec.attach_engine_core = classmethod(  # type: ignore[method-assign]
        lambda cls, core, proposers, **kw: _FakeSpec(core, proposers, **kw)
    )
    cfg = ServeConfig(proposers=("none", "ngram"), state=Path(path), save_every_steps=1)
    core = _core()
    rt = ServeRuntime(core, cfg)
    for _ in range(rounds):
        _learn(rt, cell, 1.0, 1.0)
        core.post_step(True)
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while rt._writer._pending is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    core.post_step(False)  # takes in the last pull
    tri = rt.spec.policy.acceptance.tri
    out.put((cell, float(tri[CELL_A]), float(tri[CELL_B]), rt.pulls))
    rt.close()


def test_two_replica_processes_lose_no_update_and_learn_from_each_other(tmp_path):
    path = str(tmp_path / "policy.json")
    rounds = 60
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(path, c, rounds, out)) for c in (CELL_A, CELL_B)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    state = tmp_path / "policy.json"
    # The merged counts equal the sum of what each replica learned.
    assert _file_counts(state, CELL_A) == (rounds, rounds, 2 * rounds)
    assert _file_counts(state, CELL_B)[:2] == (rounds, rounds)
    # Each replica pulled the other's counts while both were running.
    for cell, tri_a, tri_b, pulls in results:
        other = tri_b if cell == CELL_A else tri_a
        assert pulls > 0 and other > 0, (cell, tri_a, tri_b, pulls)
    assert not list(tmp_path.glob(".policy.json.*[!k]"))  # no temporary file left (only the lock)
