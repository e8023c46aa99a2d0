"""A policy-state file shared by several replicas (adaptive_spec.core.state.merge_policy_state): counts
add up across writers under a file lock, so concurrent writers lose no update."""

from __future__ import annotations

import json
import multiprocessing as mp

from adaptive_spec.core.state import FORMAT, VERSION, merge_policy_state


def _doc(counts: list[int], n_steps: int, name: str = "adaptive") -> str:
    state = {"name": name, "max_k": 4, "acceptance": {"counts": counts}, "n_steps": n_steps}
    return json.dumps({"format": FORMAT, "version": VERSION, "policy": name, "state": state})


def _replica(path: str, index: int, rounds: int) -> None:
    """One replica: learns one observation per round in its own cell and merges after each."""
    counts = [0, 0, 0]
    base = json.loads(_doc(counts, 0))["state"]  # the fresh policy's state: where it started
    for n in range(1, rounds + 1):
        counts[index] += 1
        counts[2] += 1
        base = merge_policy_state(_doc(counts, n), path, base)


def test_two_writer_processes_lose_no_update(tmp_path):
    path = str(tmp_path / "policy.json")
    rounds = 150
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_replica, args=(path, i, rounds)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with open(path, encoding="utf-8") as f:
        state = json.load(f)["state"]
    # The merged counts equal the sum of what each replica learned.
    assert state["acceptance"]["counts"] == [rounds, rounds, 2 * rounds]
    assert state["n_steps"] == 2 * rounds
    assert state["max_k"] == 4 and state["name"] == "adaptive"  # unchanged numbers keep their value
    assert not list(tmp_path.glob(".policy.json.*[!k]"))  # no temporary file left (only the lock)


def test_single_writer_is_an_overwrite_and_a_bad_file_is_replaced(tmp_path):
    path = tmp_path / "policy.json"
    base = merge_policy_state(_doc([1, 0, 1], 1), path, None)
    base = merge_policy_state(_doc([3, 0, 3], 3), path, base)
    assert json.loads(path.read_text())["state"]["acceptance"]["counts"] == [3, 0, 3]
    path.write_text("{not json")
    merge_policy_state(_doc([5, 0, 5], 5), path, base)
    assert json.loads(path.read_text())["state"]["n_steps"] == 5
    # Another policy's file is replaced, not added to.
    merge_policy_state(_doc([1, 1, 1], 1, name="other"), path, None)
    assert json.loads(path.read_text())["policy"] == "other"


def test_first_pull_survives_a_changed_provenance_string(tmp_path):
    """A replica's first merge finds a file another replica wrote after learning: the strings that
    learning changes (a cost table's ``source``) do not hide the other's counts from the pull; names
    that index the counts (the proposers) still must match."""
    from adaptive_spec.core.state import sync_policy_state

    def doc(counts: list[int], source: str, proposers: list[str]) -> str:
        state = {
            "name": "adaptive",
            "acceptance": {"proposers": proposers, "counts": counts},
            "cost": {"table": {"source": source}, "scale_on_first": source == "prior"},
        }
        return json.dumps(
            {"format": FORMAT, "version": VERSION, "policy": "adaptive", "state": state}
        )

    path = tmp_path / "policy.json"
    fresh = json.loads(doc([0, 0], "prior", ["ngram", "jacobi"]))["state"]
    # Replica A learned (its cost table's source changed) and wrote the file first.
    sync_policy_state(doc([3, 1], "prior+learned", ["ngram", "jacobi"]), path, fresh, fresh)
    # Replica B's first merge: it has seen only its own fresh state.
    res = sync_policy_state(doc([0, 2], "prior+learned", ["ngram", "jacobi"]), path, fresh, fresh)
    assert res.others is not None and res.others["acceptance"]["counts"] == [3, 1]
    assert json.loads(path.read_text())["state"]["acceptance"]["counts"] == [3, 3]
    # Counts indexed by other names are not a difference of counts.
    other = json.loads(doc([0, 0], "prior", ["jacobi", "ngram"]))["state"]
    res = sync_policy_state(doc([0, 0], "prior", ["jacobi", "ngram"]), path, None, other)
    assert res.others is None
