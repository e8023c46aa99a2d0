"""Every proposer is total: any request content gives 0..k in-vocabulary ids, never an error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_spec.proposers import (
    PROPOSERS,
    JacobiProposer,
    NgramProposer,
    ProposalRequest,
    SuffixProposer,
    make_proposer,
)

FACTORIES = {
    "ngram": lambda: NgramProposer(min_n=2, max_n=4, max_k=8, window=64),
    "ngram_min1": lambda: NgramProposer(min_n=1, max_n=2, max_k=5, window=16),
    "ngram_torch": lambda: NgramProposer(max_k=8, window=64, backend="torch"),
    "jacobi": lambda: JacobiProposer(max_k=8, pool_size=8, ngram=3),
    "jacobi_n2": lambda: JacobiProposer(max_k=4, pool_size=2, ngram=2),
    "jacobi_noinit": lambda: JacobiProposer(max_k=8, init="none"),
    "suffix": lambda: SuffixProposer(max_k=8, window=512),
    "suffix_small": lambda: SuffixProposer(
        max_k=5, max_depth=3, token_budget=30, window=64, max_spec_factor=4.0, min_token_prob=0.0
    ),
    "suffix_tenant": lambda: SuffixProposer(
        max_k=8, window=256, local="never", scope="tenant", tenant_of={"a": "t1", "b": "t2"}
    ),
}

ids = st.integers(-5, 40)
arrays = st.one_of(
    st.none(),
    st.lists(ids, max_size=12).map(lambda x: np.asarray(x, dtype=np.int64)),
    st.just(np.zeros((2, 2), dtype=np.int64)),
    st.just(np.array([1.5, np.nan])),
    st.just("garbage"),
)
contexts = st.one_of(
    st.lists(ids, max_size=40).map(lambda x: np.asarray(x, dtype=np.int64)),
    st.integers(0, 30).map(lambda t: np.full(10_000, t, dtype=np.int64)),
    st.just(np.zeros(0, dtype=np.int64)),
    st.just(np.arange(3000, dtype=np.int64)),
    arrays,
)
requests = st.builds(
    ProposalRequest,
    req_id=st.sampled_from(["a", "b", "c"]),
    token_ids=contexts,
    max_new_tokens=st.one_of(st.integers(-3, 20), st.just(None)),
    vocab_size=st.one_of(st.integers(0, 45), st.just(None)),
    last_draft=arrays,
    last_target_argmax=arrays,
    last_accepted=st.one_of(st.integers(-3, 15), st.just(None)),
)


def _bound(r: ProposalRequest, k: int, max_k: int) -> int:
    try:
        budget = int(r.max_new_tokens) - 1
    except TypeError:
        budget = -1
    return max(0, min(k, max_k, budget))


def _vocab(r: ProposalRequest) -> int:
    try:
        return int(r.vocab_size)
    except TypeError:
        return 0


@pytest.mark.parametrize("name", list(FACTORIES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(st.tuples(requests, st.integers(0, 12)), max_size=5), steps=st.integers(1, 3))
def test_propose_is_total_and_bounded(name, batch, steps) -> None:
    prop = FACTORIES[name]()
    reqs = [b[0] for b in batch]
    ks = [b[1] for b in batch]
    for _ in range(steps):
        out = prop.propose(reqs, ks)
        assert len(out) == len(reqs)
        for r, k, d in zip(reqs, ks, out, strict=True):
            assert isinstance(d, np.ndarray) and d.dtype == np.int64 and d.ndim == 1
            assert len(d) <= _bound(r, k, prop.max_k)
            assert ((d >= 0) & (d < _vocab(r))).all()
        for r in reqs:
            m = prop.match_length(r)
            assert isinstance(m, int) and m >= 0
    for r in reqs:
        prop.release(r.req_id)


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_repeated_token_context_gets_a_full_draft(name) -> None:
    r = ProposalRequest("x", np.full(10_000, 7, dtype=np.int64), 100, 50)
    assert make_proposer(name).propose([r], [8])[0].tolist() == [7] * 8


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_budget_caps_the_draft(name) -> None:
    toks = np.tile(np.arange(5, dtype=np.int64), 20)
    for budget, expect in [(0, 0), (1, 0), (2, 1), (4, 3), (50, 8)]:
        r = ProposalRequest("x", toks, budget, 10)
        assert len(make_proposer(name).propose([r], [8])[0]) == expect


@pytest.mark.parametrize(
    ("name", "kw", "param"),
    [
        ("ngram", dict(min_n=3, max_n=2), "max_n"),
        ("ngram", dict(min_n=0), "min_n"),
        ("ngram", dict(max_k=-1), "max_k"),
        ("ngram", dict(window=1), "max_window"),
        ("ngram", dict(backend="gpu"), "backend"),
        ("jacobi", dict(max_k=-2), "max_k"),
        ("jacobi", dict(pool_size=0), "pool_size"),
        ("jacobi", dict(ngram=1), "ngram"),
        ("jacobi", dict(init="random"), "init"),
        ("jacobi", dict(max_states=0), "max_states"),
        ("suffix", dict(max_k=200), "max_k"),
        ("suffix", dict(max_depth=0), "max_depth"),
        ("suffix", dict(token_budget=-5), "token_budget"),
        ("suffix", dict(scope="global"), "scope"),
        ("suffix", dict(local=True), "local"),
    ],
)
def test_bad_configuration_is_refused_naming_the_parameter(name, kw, param) -> None:
    with pytest.raises(ValueError, match=param):
        make_proposer(name, **kw)


def test_unknown_proposer_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"allowed: \['jacobi', 'ngram', 'suffix'\]"):
        make_proposer("eagle")


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_bad_ks_are_refused(name) -> None:
    p = make_proposer(name)
    r = ProposalRequest("x", np.arange(5), 10, 10)
    with pytest.raises(ValueError, match="ks has 2 entries"):
        p.propose([r], [1, 2])
    with pytest.raises(ValueError, match=r"ks\[0\]=-1"):
        p.propose([r], [-1])


def test_no_state_leaks_over_10000_requests() -> None:
    p = JacobiProposer(max_k=4)
    rng = np.random.default_rng(0)
    for i in range(10_000):
        r = ProposalRequest(
            f"r{i}",
            rng.integers(0, 50, 20),
            10,
            50,
            last_draft=rng.integers(0, 50, 3),
            last_target_argmax=rng.integers(0, 50, 4),
            last_accepted=1,
        )
        p.propose([r], [4])
        p.release(r.req_id)
    assert len(p) == 0
    capped = JacobiProposer(max_k=4, max_states=100)
    for i in range(1000):
        capped.propose([ProposalRequest(f"r{i}", np.arange(5), 10, 10)], [2])
    assert len(capped) == 100  # least recently used states dropped when never released


def test_suffix_keeps_no_state_after_release_and_bounds_unreleased_ones() -> None:
    p = SuffixProposer(max_k=4, token_budget=500)
    rng = np.random.default_rng(0)
    for i in range(3000):
        r = ProposalRequest(f"r{i}", rng.integers(0, 50, 20), 10, 50)
        p.propose([r], [4])
        p.release(r.req_id)
    s = p.stats()
    assert len(p) == 0 and s["global_tokens"] <= 500 and s["sequences"] <= 500 // 20 + 1
    capped = SuffixProposer(max_k=4, max_states=100)
    for i in range(1000):
        capped.propose([ProposalRequest(f"r{i}", np.arange(5), 10, 10)], [2])
    assert len(capped) == 100


def test_suffix_cached_draft_respects_each_requests_vocabulary():
    """Regression (found by the property test above): a request id given twice in one batch, first with
    ``vocab_size=1`` then without a usable vocabulary, must not get the draft cached for the first."""
    from adaptive_spec.proposers.base import ProposalRequest

    prop = FACTORIES["suffix_small"]()
    toks = np.zeros((2, 2), dtype=np.int64)
    batch = [
        ProposalRequest("c", toks, max_new_tokens=2, vocab_size=1),
        ProposalRequest("c", toks, max_new_tokens=2, vocab_size=None),
    ]
    out = prop.propose(batch, [1, 1])
    assert len(out[1]) == 0, out
