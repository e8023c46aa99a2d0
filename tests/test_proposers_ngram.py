"""NgramProposer: prompt lookup on the request's tokens, cut to budget and vocabulary."""

from __future__ import annotations

import numpy as np

from adaptive_spec.proposers import NgramProposer, ProposalRequest


def test_drafts_the_continuation_of_the_longest_match() -> None:
    toks = np.array([1, 2, 3, 4, 9, 2, 3, 4, 8, 7, 2, 3, 4], dtype=np.int64)
    p = NgramProposer(min_n=2, max_n=3, max_k=3)
    r = ProposalRequest("a", toks, 100, 10)
    # "2 3 4" occurs twice before the suffix: the most recent occurrence (followed by 8) wins
    assert p.propose([r], [3])[0].tolist() == [8, 7, 2]
    assert p.match_length(r) == 3
    assert p.propose([r], [1])[0].tolist() == [8]


def test_no_match_gives_an_empty_draft() -> None:
    r = ProposalRequest("a", np.arange(100, dtype=np.int64), 100, 200)
    p = NgramProposer()
    assert p.propose([r], [8])[0].tolist() == [] and p.match_length(r) == 0


def test_out_of_vocabulary_ids_cut_the_draft() -> None:
    toks = np.array([5, 6, 7, 99, 3, 5, 6], dtype=np.int64)
    r = ProposalRequest("a", toks, 100, 50)
    assert NgramProposer(max_k=4).propose([r], [4])[0].tolist() == [7]


def test_k_above_max_k_is_cut() -> None:
    toks = np.tile(np.array([1, 2, 3], dtype=np.int64), 10)
    r = ProposalRequest("a", toks, 100, 10)
    assert len(NgramProposer(max_k=4).propose([r], [20])[0]) == 4


def test_window_bounds_the_search() -> None:
    toks = np.concatenate([[4, 5, 6], np.arange(10, 60), [4, 5]]).astype(np.int64)
    r = ProposalRequest("a", toks, 100, 100)
    assert NgramProposer(window=64).propose([r], [1])[0].tolist() == [6]
    assert NgramProposer(window=32).propose([r], [1])[0].tolist() == []


def test_match_length_after_propose_equals_a_fresh_lookup() -> None:
    """The matched length found while drafting is returned for the same request object, and a new
    lookup runs for any other request (another object, or one whose history grew in place)."""
    rng = np.random.default_rng(3)
    p = NgramProposer(min_n=2, max_n=4, max_k=8)
    fresh = NgramProposer(min_n=2, max_n=4, max_k=8)
    reqs = []
    for i in range(40):
        toks = rng.integers(0, 6, size=int(rng.integers(2, 60))).astype(np.int64)
        reqs.append(
            ProposalRequest(f"r{i}", toks, max_new_tokens=int(rng.integers(1, 12)), vocab_size=6)
        )
    drafts = p.propose(reqs, [8] * len(reqs))
    matched = 0
    for r, d in zip(reqs, drafts, strict=True):
        assert p.match_length(r) == fresh.match_length(r)
        matched += p.match_length(r) > 0 and len(d) > 0
    assert matched > 5  # the cache was exercised
    # Same history under a new object, and a history that changed since the lookup.
    r0 = next(r for r, d in zip(reqs, drafts, strict=True) if len(d))
    copy = ProposalRequest(r0.req_id, r0.token_ids.copy(), r0.max_new_tokens, r0.vocab_size)
    assert p.match_length(copy) == fresh.match_length(copy)
    grown = ProposalRequest("g", np.array([1, 2, 3, 1, 2], dtype=np.int64), 8, 6)
    p.propose([grown], [4])
    assert p.match_length(grown) == 2
    grown.token_ids = np.array([1, 2, 3, 1, 2, 5], dtype=np.int64)
    assert p.match_length(grown) == fresh.match_length(grown) == 0
