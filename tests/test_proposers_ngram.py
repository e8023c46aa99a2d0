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


def _agrees_by_brute_force(toks: np.ndarray, n: int, window: int) -> bool:
    """Every earlier occurrence of the last ``n`` tokens inside the window, and what followed it."""
    lo = max(0, len(toks) - window)
    suffix = toks[-n:].tolist()
    nxt = [
        int(toks[e + 1])
        for e in range(lo + n - 1, len(toks) - 1)
        if toks[e - n + 1 : e + 1].tolist() == suffix
    ]
    return bool(nxt) and len(set(nxt)) == 1


def test_next_token_agreement_equals_a_brute_force_scan() -> None:
    from adaptive_spec.proposers._fastpath import ngram_next_agrees

    rng = np.random.default_rng(11)
    seen = {True: 0, False: 0}
    for _ in range(400):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int64)
        n = int(rng.integers(1, 5))
        window = int(rng.integers(2, 48))
        want = _agrees_by_brute_force(toks, n, window) if len(toks) > n else False
        assert ngram_next_agrees(toks, n, window) == want, (toks.tolist(), n, window)
        seen[want] += 1
    assert seen[True] > 20 and seen[False] > 20  # both outcomes exercised


def test_match_feature_is_the_match_length_only_when_the_occurrences_agree() -> None:
    p = NgramProposer(min_n=2, max_n=3, max_k=4)
    # "5 6" was followed by 7 both times: the feature is the matched length.
    agree = ProposalRequest("a", np.array([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], dtype=np.int64), 10, 10)
    # "5 6" was followed by 7 once and by 8 once: the feature is 0 (its own acceptance cell).
    split = ProposalRequest("b", np.array([5, 6, 7, 9, 5, 6, 8, 1, 5, 6], dtype=np.int64), 10, 10)
    none = ProposalRequest("c", np.arange(10, dtype=np.int64), 10, 10)
    drafts = p.propose([agree, split, none], [4, 4, 4])
    assert drafts[0].tolist() == [7, 8, 5, 6] and drafts[1].tolist() == [8, 1, 5, 6]
    assert p.match_length(agree) == p.match_length(split) == 2
    assert p.match_feature(agree) == 2
    assert p.match_feature(split) == 0
    assert p.match_feature(none) == 0 and len(drafts[2]) == 0
