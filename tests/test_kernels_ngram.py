"""Batched n-gram match (PyTorch reference): agrees with a naive search, bounded, budget-capped."""

from __future__ import annotations

import time

import pytest
import torch
from adaptive_spec.kernels import ngram_match, ngram_match_reference
from hypothesis import given, settings
from hypothesis import strategies as st


def naive(tokens: list[int], k: int, min_n: int, max_n: int, window: int) -> tuple[list[int], int]:
    """Straight from the definition: longest n first, most recent occurrence, overlapping copy."""
    h = tokens[-window:]
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        suffix = h[len(h) - n :]
        for p in range(len(h) - n - 1, -1, -1):  # occurrence h[p:p+n], followed by >= 1 token
            if h[p : p + n] == suffix:
                ext = list(h)
                while len(ext) < len(h) + k:
                    ext.append(ext[p + n + len(ext) - len(h)])
                return ext[len(h) : len(h) + k], n
    return [], 0


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    window=st.integers(2, 48),
    k=st.integers(0, 9),
)
def test_reference_equals_the_naive_definition(rows, min_n, extra, window, k) -> None:
    max_n = min_n + extra
    lmax = max(1, max(len(r) for r in rows))
    tok = torch.full((len(rows), lmax), 7, dtype=torch.int64)  # padding must be ignored
    for i, r in enumerate(rows):
        tok[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    num = torch.tensor([len(r) for r in rows])
    res = ngram_match_reference(tok, num, k, min_n=min_n, max_n=max_n, max_window=window, max_k=k)
    for i, r in enumerate(rows):
        draft, n = naive(r, k, min_n, max_n, window)
        got = res.draft_token_ids[i, : res.num_draft_tokens[i]].tolist()
        assert (got, int(res.match_len[i])) == (draft, n)
        assert all(t == -1 for t in res.draft_token_ids[i, len(got) :].tolist())


def test_examples() -> None:
    tok = torch.tensor([[5, 6, 7, 8, 5, 6, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    res = ngram_match(tok, torch.tensor([6, 8]), 5, min_n=2, max_n=3)
    assert res.draft_token_ids.tolist() == [[7, 8, 5, 6, 7], [1, 1, 1, 1, 1]]
    assert res.match_len.tolist() == [2, 3]


def test_never_beyond_the_token_budget() -> None:
    tok = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]] * 4)
    num = torch.full((4,), 8)
    res = ngram_match(tok, num, 8, max_new_tokens=torch.tensor([0, 1, 3, 100]))
    assert res.num_draft_tokens.tolist() == [0, 0, 2, 8]
    assert res.match_len.tolist() == [4, 4, 4, 4]  # the match is reported whatever the budget


def test_long_context_without_match_is_cheap_and_empty() -> None:
    """50k distinct tokens: only the window is searched, so it costs what a short context does."""
    long = torch.randperm(50_000, generator=torch.Generator().manual_seed(0))[None, :]
    short = long[:, -2048:].clone()
    kw = dict(min_n=2, max_n=4, max_window=2048)

    def med(tok):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            res = ngram_match(tok, torch.tensor([tok.shape[1]]), 8, **kw)
            times.append(time.perf_counter() - t0)
        return sorted(times)[2], res

    t_long, res = med(long)
    t_short, _ = med(short)
    assert res.num_draft_tokens.tolist() == [0] and res.match_len.tolist() == [0]
    assert t_long < 5 * t_short + 0.01  # not proportional to the 25x longer context


def test_window_limits_the_search() -> None:
    tok = torch.tensor([[9, 4, 5, 6, 0, 0, 0, 0, 0, 0, 4, 5]])
    near = ngram_match(tok, torch.tensor([12]), 2, max_window=12)
    far = ngram_match(tok, torch.tensor([12]), 2, max_window=8)
    assert near.draft_token_ids.tolist() == [[6, 0]]
    assert far.num_draft_tokens.tolist() == [0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(min_n=0), "min_n"),
        (dict(min_n=3, max_n=2), "max_n"),
        (dict(max_window=1), "max_window"),
        (dict(max_k=-1), "max_k"),
    ],
)
def test_bad_configuration_is_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        ngram_match(torch.zeros((1, 4), dtype=torch.int64), torch.tensor([4]), 2, **kw)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_tokens has 2 entries"):
        ngram_match(torch.zeros((1, 4), dtype=torch.int64), torch.tensor([4, 4]), 2)
    with pytest.raises(ValueError, match="ks="):
        ngram_match(torch.zeros((1, 4), dtype=torch.int64), torch.tensor([4]), -1)
