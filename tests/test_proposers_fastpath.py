"""The proposers' NumPy fast paths equal the kernels' PyTorch references exactly."""

from __future__ import annotations

import numpy as np
import torch
from adaptive_spec.kernels import (
    jacobi_step_reference,
    lookahead_ngrams_reference,
    lookahead_pool_lookup,
    lookahead_pool_update_reference,
    ngram_match_reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_spec.proposers import NgramProposer, ProposalRequest
from adaptive_spec.proposers._fastpath import (
    jacobi_next_np,
    lookahead_ngrams_np,
    ngram_match_np,
    pool_lookup_np,
    pool_update_np,
)

tokens = st.lists(st.integers(0, 3), max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    toks=tokens,
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    window=st.integers(2, 70),
    k=st.integers(0, 10),
)
def test_ngram_fast_path_equals_reference(toks, min_n, extra, window, k) -> None:
    max_n = min_n + extra
    arr = np.asarray(toks, dtype=np.int64)
    draft, n = ngram_match_np(arr, k, min_n, max_n, window)
    t = torch.tensor(toks if toks else [0], dtype=torch.int64)[None, :]
    ref = ngram_match_reference(
        t, torch.tensor([len(toks)]), k, min_n=min_n, max_n=max_n, max_window=window, max_k=k
    )
    assert n == int(ref.match_len[0])
    assert draft.tolist() == ref.draft_token_ids[0, : int(ref.num_draft_tokens[0])].tolist()


@settings(max_examples=200, deadline=None)
@given(
    y=st.lists(st.integers(0, 2), max_size=8),
    z=st.lists(st.integers(0, 2), min_size=9, max_size=9),
)
def test_jacobi_fast_path_equals_reference(y, z) -> None:
    k = len(y)
    zz = np.asarray(z[: k + 1], dtype=np.int64)
    a, nxt = jacobi_next_np(np.asarray(y, dtype=np.int64), zz, accepted=10**6)
    ref = jacobi_step_reference(
        torch.tensor([y + [0] * (8 - k)], dtype=torch.int64),
        torch.tensor([k]),
        torch.tensor([z[: k + 1] + [0] * (8 - k)], dtype=torch.int64),
    )
    assert a == int(ref.accepted[0])
    assert nxt.tolist() == ref.next_iterate[0, : int(ref.next_len[0])].tolist()


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 5), w=st.integers(0, 12), data=st.data())
def test_lookahead_ngrams_fast_path_equals_reference(n, w, data) -> None:
    traj = np.asarray(
        data.draw(st.lists(st.integers(-1, 4), min_size=(n - 1) * w, max_size=(n - 1) * w)),
        dtype=np.int64,
    ).reshape(n - 1, w)
    pred = np.asarray(
        data.draw(st.lists(st.integers(-1, 4), min_size=w, max_size=w)), dtype=np.int64
    )
    ref = lookahead_ngrams_reference(torch.from_numpy(traj)[None], torch.from_numpy(pred)[None])[0]
    assert lookahead_ngrams_np(traj, pred).tolist() == ref.tolist()


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 4),
    cap=st.integers(1, 6),
    steps=st.lists(
        st.lists(st.lists(st.integers(-1, 2), min_size=4, max_size=4), max_size=6), max_size=5
    ),
    keys=st.lists(st.integers(-1, 3), min_size=1, max_size=4),
)
def test_pool_fast_paths_equal_reference(n, cap, steps, keys) -> None:
    pool = np.full((cap, n), -1, dtype=np.int64)
    ptr = 0
    tpool = torch.full((1, cap, n), -1, dtype=torch.int64)
    tptr = torch.zeros(1, dtype=torch.int64)
    for grams in steps:
        g = np.asarray([row[:n] for row in grams], dtype=np.int64).reshape(-1, n)
        ptr = pool_update_np(pool, ptr, g)
        lookahead_pool_update_reference(tpool, tptr, torch.from_numpy(g)[None])
        assert pool.tolist() == tpool[0].tolist() and ptr == int(tptr[0])
        for key in keys:
            cont, found = lookahead_pool_lookup(tpool, tptr, torch.tensor([key]))
            mine = pool_lookup_np(pool, ptr, key)
            if mine is None:
                assert not bool(found[0])
            else:
                assert bool(found[0]) and mine.tolist() == cont[0].tolist()


@settings(max_examples=60, deadline=None)
@given(
    ctxs=st.lists(st.lists(st.integers(0, 3), max_size=50), min_size=1, max_size=6),
    ks=st.data(),
)
def test_ngram_proposer_numpy_equals_batched_kernel(ctxs, ks) -> None:
    reqs = [
        ProposalRequest(str(i), np.asarray(c, dtype=np.int64), 7, 4) for i, c in enumerate(ctxs)
    ]
    kk = [ks.draw(st.integers(0, 8)) for _ in ctxs]
    fast = NgramProposer(min_n=1, max_n=3, max_k=6, window=32)
    batched = NgramProposer(min_n=1, max_n=3, max_k=6, window=32, backend="torch")
    a = fast.propose(reqs, kk)
    b = batched.propose(reqs, kk)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
