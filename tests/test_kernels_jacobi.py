"""Jacobi step and lookahead pool (PyTorch references) against their definitions."""

from __future__ import annotations

import pytest
import torch
from adaptive_spec.kernels import (
    jacobi_step,
    lookahead_ngrams,
    lookahead_pool_lookup,
    lookahead_pool_update,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), max_size=6),
            st.lists(st.integers(0, 2), min_size=7, max_size=7),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_jacobi_step_matches_the_definition(data) -> None:
    k = 6
    y = torch.full((len(data), k), 5, dtype=torch.int64)
    z = torch.tensor([d[1] for d in data], dtype=torch.int64)
    for i, (it, _) in enumerate(data):
        y[i, : len(it)] = torch.tensor(it, dtype=torch.int64)
    ln = torch.tensor([len(d[0]) for d in data])
    r = jacobi_step(y, ln, z)
    for i, (it, pr) in enumerate(data):
        a = 0
        while a < len(it) and it[a] == pr[a]:
            a += 1
        assert int(r.accepted[i]) == a
        assert r.emitted[i].tolist() == pr[: a + 1] + [-1] * (k - a)
        nxt = pr[a + 1 : len(it) + 1]
        assert r.next_iterate[i].tolist() == nxt + [-1] * (k - len(nxt))
        assert int(r.next_len[i]) == len(nxt) and int(r.num_emitted[i]) == a + 1


def test_ngrams_follow_the_trajectory_diagonals() -> None:
    # N = 3: rows are the two previous iterates, then the newest predictions, on one grid.
    traj = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23]]])
    pred = torch.tensor([[30, 31, 32, 33]])
    g = lookahead_ngrams(traj, pred)
    assert g.tolist() == [[[10, 21, 32], [11, 22, 33]]]
    traj[0, 1, 2] = -1  # an unknown token invalidates the n-gram through it
    assert lookahead_ngrams(traj, pred).tolist() == [[[10, 21, 32], [-1, -1, -1]]]
    # N = 2: (draft token, target prediction after it)
    g2 = lookahead_ngrams(torch.tensor([[[1, 2, 3]]]), torch.tensor([[7, 8, 9]]))
    assert g2.tolist() == [[[1, 8], [2, 9]]]


def test_pool_update_is_a_deduplicating_ring() -> None:
    pool = torch.full((1, 3, 2), -1, dtype=torch.int64)
    ptr = torch.zeros(1, dtype=torch.int64)
    lookahead_pool_update(pool, ptr, torch.tensor([[[1, 2], [1, 2], [3, 4], [-1, 5]]]))
    assert ptr.tolist() == [2]
    assert pool[0].tolist() == [[1, 2], [3, 4], [-1, -1]]
    lookahead_pool_update(pool, ptr, torch.tensor([[[5, 6], [7, 8], [3, 4]]]))
    assert ptr.tolist() == [4]
    assert pool[0].tolist() == [[7, 8], [3, 4], [5, 6]]  # [1, 2] evicted first


def test_pool_lookup_returns_the_newest_match() -> None:
    pool = torch.full((2, 4, 3), -1, dtype=torch.int64)
    ptr = torch.zeros(2, dtype=torch.int64)
    lookahead_pool_update(pool, ptr, torch.tensor([[[1, 2, 3], [1, 4, 5], [6, 7, 8]]] * 2))
    cont, found = lookahead_pool_lookup(pool, ptr, torch.tensor([1, 9]))
    assert found.tolist() == [True, False]
    assert cont.tolist() == [[4, 5], [-1, -1]]
    # wrap around: the ring's newest entry sits before the oldest one
    lookahead_pool_update(pool, ptr, torch.tensor([[[9, 9, 9], [1, 0, 0], [2, 2, 2]]] * 2))
    cont, found = lookahead_pool_lookup(pool, ptr, torch.tensor([1, 6]))
    assert cont.tolist() == [[0, 0], [7, 8]] and found.tolist() == [True, True]
    cont, found = lookahead_pool_lookup(pool, ptr, torch.tensor([3, -1]))
    assert cont.tolist() == [[-1, -1], [-1, -1]] and found.tolist() == [False, False]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="predictions has shape"):
        jacobi_step(
            torch.zeros((1, 3), dtype=torch.int64),
            torch.tensor([3]),
            torch.zeros((1, 3), dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="levels"):
        lookahead_ngrams(
            torch.zeros((1, 0, 3), dtype=torch.int64), torch.zeros((1, 3), dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="ngrams has shape"):
        lookahead_pool_update(
            torch.full((1, 2, 3), -1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros((1, 2, 2), dtype=torch.int64),
        )
