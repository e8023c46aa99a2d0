"""JacobiProposer: the Jacobi iterate, the lookahead pool and a simulated decoding loop."""

from __future__ import annotations

import numpy as np

from adaptive_spec.proposers import JacobiProposer, ProposalRequest


def _req(ctx, draft=None, z=None, a=0, budget=100, vocab=50, rid="r"):
    arr = lambda x: None if x is None else np.asarray(x, dtype=np.int64)  # noqa: E731
    return ProposalRequest(rid, arr(ctx), budget, vocab, arr(draft), arr(z), a)


def test_next_draft_is_the_jacobi_iterate() -> None:
    # previous step: context [1], draft [3, 9, 9, 9]; target argmax [3, 4, 5, 6, 7]: one
    # accepted, 4 committed as the correction; the iterate is what the target said after that.
    p = JacobiProposer(max_k=4, ngram=3)
    r = _req([1, 3, 4], draft=[3, 9, 9, 9], z=[3, 4, 5, 6, 7], a=1)
    assert p.match_length(r) == 3
    assert p.propose([r], [4])[0].tolist() == [5, 6, 7]
    assert p.propose([r], [2])[0].tolist() == [5, 6]


def test_pool_replaces_or_completes_the_iterate() -> None:
    p = JacobiProposer(max_k=6, ngram=2, pool_size=16)
    # context [0]; draft [1, 2, 3, 4] all accepted, bonus 5. The bigrams (draft token,
    # prediction after it) (1,2) (2,3) (3,4) (4,5) go into the pool; the iterate is empty.
    r1 = _req([0, 1, 2, 3, 4, 5], draft=[1, 2, 3, 4], z=[1, 2, 3, 4, 5], a=4)
    assert p.match_length(r1) == 0
    # a context ending in 1 with no verification info: the pool chains 1->2->3->4->5
    assert p.propose([_req([7, 7, 1])], [6])[0].tolist() == [2, 3, 4, 5]
    # a pool hit on the last committed token replaces the iterate ([8] here)
    r3 = _req([6, 1], draft=[9, 9], z=[1, 8, 0], a=0)
    assert p.propose([r3], [6])[0].tolist() == [2, 3, 4, 5]
    # no pool entry for the last token 7: the iterate [1, 2, 3], completed from its last token
    r4 = _req([6, 7], draft=[5, 0, 9], z=[7, 1, 2, 3], a=0)
    # (r4's own bigrams include (5, 1): the chain goes on after 5)
    assert p.propose([r4], [6])[0].tolist() == [1, 2, 3, 4, 5, 1]
    assert p.match_length(r4) == 6


def test_initial_guess_and_its_absence() -> None:
    r = _req([4, 5, 6])
    assert JacobiProposer(max_k=3).propose([r], [3])[0].tolist() == [6, 6, 6]
    assert JacobiProposer(max_k=3).match_length(r) == 0  # the guess is not a candidate
    assert JacobiProposer(max_k=3, init="none").propose([r], [3])[0].tolist() == []


def test_state_is_updated_once_per_step() -> None:
    r = _req([1, 3, 4], draft=[3, 9, 9, 9], z=[3, 4, 5, 6, 7], a=1)
    once, many = JacobiProposer(ngram=2), JacobiProposer(ngram=2)
    once.propose([r], [4])
    for _ in range(3):
        many.match_length(r)
    many.propose([r], [4])
    assert once._states["r"].ptr == many._states["r"].ptr > 0
    assert np.array_equal(once._states["r"].pool, many._states["r"].pool)


def _simulate(prop: JacobiProposer, steps: int, k: int, period: int = 7) -> list[int]:
    """Greedy decoding of a target whose next token is (last + 1) mod period."""
    f = lambda ctx: (ctx[-1] + 1) % period  # noqa: E731
    ctx = [3, 0, 5]
    draft, z, a = None, None, 0
    accepted = []
    for _ in range(steps):
        r = _req(ctx, draft, z, a, vocab=period)
        d = prop.propose([r], [k])[0].tolist()
        z = [f(ctx + d[:j]) for j in range(len(d) + 1)]
        a = 0
        while a < len(d) and d[a] == z[a]:
            a += 1
        ctx = ctx + d[:a] + [z[a]]
        draft = d
        accepted.append(a)
    return accepted


def test_jacobi_learns_a_deterministic_target() -> None:
    acc = _simulate(JacobiProposer(max_k=6, ngram=3, pool_size=32), steps=30, k=6)
    assert np.mean(acc[-10:]) >= 5  # nearly every draft token accepted once the pool is warm
    assert sum(acc) > 3 * len(acc)
    # without an initial guess there is never an iterate to start from
    assert sum(_simulate(JacobiProposer(max_k=6, init="none"), steps=30, k=6)) == 0
