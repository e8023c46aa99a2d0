"""Verification by rejection sampling (PyTorch reference): exactness, losslessness, statistics."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from adaptive_spec.kernels import flatten_drafts, philox4x32, sample_noise, verify, verify_reference
from scipy.stats import chisquare


def _random_batch(seed: int, ks: list[int], vocab: int, match: float = 0.6):
    """Random logits and drafts; a fraction of the drafts copy the target argmax."""
    g = torch.Generator().manual_seed(seed)
    drafts = [torch.randint(0, vocab, (k,), generator=g) for k in ks]
    d, cu = flatten_drafts(drafts)
    logits = torch.randn(d.numel() + len(ks), vocab, generator=g) * 2
    am = logits.argmax(-1)
    start = 0
    for i, k in enumerate(ks):
        for j in range(k):
            if torch.rand(1, generator=g).item() < match:
                d[start + j] = am[start + i + j]
        start += k
    return logits, d, cu


# ---------------------------------------------------------------- greedy
@pytest.mark.parametrize("seed", range(4))
def test_greedy_emits_longest_matching_prefix_plus_one_target_token(seed: int) -> None:
    ks = [0, 1, 3, 5, 2, 8]
    logits, d, cu = _random_batch(seed, ks, vocab=7, match=0.7)
    out = verify_reference(logits, d, cu)
    am = logits.argmax(-1)
    start = 0
    for i, k in enumerate(ks):
        rows = am[start + i : start + i + k + 1].tolist()
        draft = d[start : start + k].tolist()
        a = 0
        while a < k and draft[a] == rows[a]:
            a += 1
        expect = [*draft[:a], rows[a]]
        got = out.output_token_ids[i].tolist()
        assert got[: a + 1] == expect and all(t == -1 for t in got[a + 1 :])
        assert out.num_accepted[i].item() == a and out.num_emitted[i].item() == a + 1
        start += k
    assert torch.equal(out.target_argmax, am)


def test_zero_length_drafts_only_emit_the_target_token() -> None:
    logits, d, cu = _random_batch(1, [0, 0, 0], vocab=11)
    out = verify(logits, d, cu)
    assert out.output_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert out.output_token_ids.shape == (3, 1)


def test_draft_ids_outside_vocab_are_rejected() -> None:
    logits = torch.zeros(3, 4)
    logits[:, 2] = 5.0
    d, cu = flatten_drafts([[7, 2]])
    out = verify(logits, d, cu)
    assert out.num_accepted.tolist() == [0]
    assert out.output_token_ids.tolist() == [[2, -1, -1]]


# ---------------------------------------------------------------- exact losslessness
def _weights(rng: np.random.Generator, vocab: int) -> list[Fraction]:
    w = [Fraction(int(x)) for x in rng.integers(1, 9, vocab)]
    return w


def _process(w: list[Fraction], power: int, top_k: int | None, top_p: Fraction | None):
    """Target distribution after temperature 1/power, top-k and top-p (vLLM semantics)."""
    p = [x**power for x in w]
    tot = sum(p)
    p = [x / tot for x in p]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep = set(order)
    if top_k is not None:
        keep = set(order[:top_k])
    if top_p is not None:
        cum, kept = Fraction(0), set()
        for i in order:
            if i not in keep:
                continue
            kept.add(i)
            cum += p[i]
            if cum >= top_p:
                break
        keep = kept
    p = [x if i in keep else Fraction(0) for i, x in enumerate(p)]
    tot = sum(p)
    return [x / tot for x in p]


def _exact_step(p_of, q_of, k: int, vocab: int) -> dict[tuple[int, ...], Fraction]:
    """Distribution of the emitted tokens of one verification step, in exact arithmetic.

    Same algorithm as the reference: accept d_j when u * q < p (probability min(1, p/q) for a
    continuous uniform u); at the first rejection emit from normalize(max(0, p - q)) (falling back
    to p when that is all zero); when all k are accepted emit the bonus token from p_k.
    """
    out: dict[tuple[int, ...], Fraction] = {}

    def emit(seq: tuple[int, ...], dist: list[Fraction], mass: Fraction) -> None:
        for t, pt in enumerate(dist):
            if pt:
                out[(*seq, t)] = out.get((*seq, t), Fraction(0)) + mass * pt

    def walk(prefix: tuple[int, ...], mass: Fraction) -> None:
        j = len(prefix)
        p = p_of(prefix)
        if j == k:
            emit(prefix, p, mass)
            return
        q = q_of(prefix)
        resid = [max(Fraction(0), a - b) for a, b in zip(p, q, strict=True)]
        z = sum(resid)
        resid = [r / z for r in resid] if z else p
        for d in range(vocab):
            if not q[d]:
                continue
            acc = min(Fraction(1), p[d] / q[d])
            if acc:
                walk((*prefix, d), mass * q[d] * acc)
            if acc < 1:
                emit(prefix, resid, mass * q[d] * (1 - acc))

    walk((), Fraction(1))
    return out


def _extend(dist, p_of, length: int) -> dict[tuple[int, ...], Fraction]:
    """Continue every emitted prefix with the target itself up to ``length`` tokens."""
    done: dict[tuple[int, ...], Fraction] = {}
    todo = list(dist.items())
    while todo:
        seq, mass = todo.pop()
        if len(seq) == length:
            done[seq] = done.get(seq, Fraction(0)) + mass
            continue
        for t, pt in enumerate(p_of(seq)):
            if pt:
                todo.append(((*seq, t), mass * pt))
    return done


def _target_joint(p_of, length: int, vocab: int) -> dict[tuple[int, ...], Fraction]:
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        m = Fraction(1)
        for j in range(length):
            m *= p_of(seq[:j])[seq[j]]
            if not m:
                break
        if m:
            out[seq] = m
    return out


CASES = [
    # (vocab, k, temperature power, top_k, top_p, q kind)
    (3, 1, 1, None, None, "random"),
    (3, 3, 1, None, None, "random"),
    (4, 2, 2, None, None, "random"),
    (4, 2, 1, 2, None, "random"),
    (5, 2, 3, None, Fraction(3, 5), "random"),
    (4, 3, 2, 3, Fraction(4, 5), "sparse"),
    (3, 3, 1, None, None, "onehot"),
    (5, 2, 2, 2, None, "onehot"),
]


@pytest.mark.parametrize(("vocab", "k", "power", "top_k", "top_p", "qkind"), CASES)
def test_one_step_is_lossless_in_exact_arithmetic(vocab, k, power, top_k, top_p, qkind) -> None:
    rng = np.random.default_rng(vocab * 100 + k * 10 + power)
    p_table, q_table = {}, {}

    def p_of(prefix):
        if prefix not in p_table:
            p_table[prefix] = _process(_weights(rng, vocab), power, top_k, top_p)
        return p_table[prefix]

    def q_of(prefix):
        if prefix not in q_table:
            if qkind == "onehot":
                q = [Fraction(0)] * vocab
                q[int(rng.integers(vocab))] = Fraction(1)
            else:
                w = _weights(rng, vocab)
                if qkind == "sparse":
                    w[int(rng.integers(vocab))] = Fraction(0)
                tot = sum(w)
                q = [x / tot for x in w]
            q_table[prefix] = q
        return q_table[prefix]

    step = _exact_step(p_of, q_of, k, vocab)
    assert sum(step.values()) == 1
    assert _extend(step, p_of, k + 1) == _target_joint(p_of, k + 1, vocab)
    # the first emitted token alone is distributed as p_0
    first = {}
    for seq, m in step.items():
        first[seq[0]] = first.get(seq[0], Fraction(0)) + m
    assert [first.get(t, Fraction(0)) for t in range(vocab)] == p_of(())


def test_exact_model_detects_a_wrong_residual() -> None:
    """The exact check is not vacuous: resampling from p instead of the residual is lossy."""
    vocab, k = 3, 1
    p0 = [Fraction(1, 2), Fraction(1, 3), Fraction(1, 6)]
    q0 = [Fraction(1, 6), Fraction(1, 6), Fraction(2, 3)]
    # wrong algorithm: on rejection sample p itself
    out = {}
    for d in range(vocab):
        acc = min(Fraction(1), p0[d] / q0[d])
        out[(d,)] = out.get((d,), Fraction(0)) + q0[d] * acc
        for t in range(vocab):
            out[(t,)] = out.get((t,), Fraction(0)) + q0[d] * (1 - acc) * p0[t]
    assert [out[(t,)] for t in range(vocab)] != p0
    right = _exact_step(lambda s: p0, lambda s: q0, k, vocab)
    firsts = [sum(m for s, m in right.items() if s[0] == t) for t in range(vocab)]
    assert firsts == p0


# ---------------------------------------------------------------- statistics
def _sample_batch(n: int, vocab: int, k: int, seed: int, with_q: bool, temperature: float):
    """n requests with the same position-wise target/draft distributions, drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(k + 1, vocab, generator=g) * 1.5
    base[1, 0] = float("-inf")  # a masked token (top-k style) at position 1
    qlog = torch.randn(k, vocab, generator=g)
    q = torch.softmax(qlog, -1)
    if with_q:
        drafts = torch.stack(
            [torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1
        )
    else:
        drafts = torch.stack([torch.full((n,), int(q[j].argmax())) for j in range(k)], 1)
    logits = base.repeat(n, 1)
    cu = torch.arange(1, n + 1, dtype=torch.int64) * k
    dp = q.repeat(n, 1) if with_q else None
    temp = torch.full((n,), temperature)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    out = verify_reference(
        logits, drafts.reshape(-1), cu, draft_probs=dp, temperature=temp, seeds=seeds, max_k=k
    )
    p = torch.softmax(base.double() / temperature, -1)
    return out, p


N_SAMPLES, VOCAB, K = 200_000, 5, 2


@pytest.fixture(scope="module", params=[True, False], ids=["draft_probs", "one_hot"])
def sampled(request):
    """2 x 10^5 seeded verification steps (one thread: int64 Philox is slow with contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _sample_batch(N_SAMPLES, VOCAB, K, seed=11, with_q=request.param, temperature=0.8)
    finally:
        torch.set_num_threads(threads)


def test_emitted_tokens_follow_the_target_chi_square(sampled) -> None:
    n, vocab = N_SAMPLES, VOCAB
    out, p = sampled
    toks = out.output_token_ids
    # first emitted token ~ p_0
    counts = torch.bincount(toks[:, 0], minlength=vocab).double()
    assert chisquare(counts.numpy(), (p[0] / p[0].sum() * n).numpy()).pvalue > 1e-3
    # second token (when the first draft was accepted) ~ p_1, and never the masked token 0
    acc = out.num_accepted >= 1
    second = toks[acc, 1]
    c2 = torch.bincount(second, minlength=vocab).double()
    assert c2[0] == 0
    exp2 = p[1][1:] / p[1][1:].sum() * acc.sum()
    assert chisquare(c2[1:].numpy(), exp2.numpy()).pvalue > 1e-3


def test_chi_square_detects_a_biased_sampler(sampled) -> None:
    """The statistical test has power: a slightly wrong target is rejected at this sample size."""
    n, vocab = N_SAMPLES, VOCAB
    out, p = sampled
    counts = torch.bincount(out.output_token_ids[:, 0], minlength=vocab).double()
    wrong = p[0] / p[0].sum()
    wrong[int(wrong.argmin())] += 0.003  # a 0.3 % shift of mass between two tokens
    wrong[int(wrong.argmax())] -= 0.003
    assert chisquare(counts.numpy(), (wrong * n).numpy()).pvalue < 1e-6


# ---------------------------------------------------------------- determinism, batch-invariance
def test_result_does_not_depend_on_batch_mates() -> None:
    logits, d, cu = _random_batch(5, [3, 0, 4, 2], vocab=9, match=0.5)
    temp = torch.tensor([0.7, 1.3, 0.0, 1.0])
    seeds = torch.tensor([11, 22, 33, 44])
    q = torch.softmax(torch.randn(d.numel(), 9, generator=torch.Generator().manual_seed(1)), -1)
    full = verify(logits, d, cu, draft_probs=q, temperature=temp, seeds=seeds)
    starts = [0, 3, 3, 7]
    ks = [3, 0, 4, 2]
    for i in range(4):
        s, k = starts[i], ks[i]
        one = verify(
            logits[s + i : s + i + k + 1],
            d[s : s + k],
            torch.tensor([k]),
            draft_probs=q[s : s + k],
            temperature=temp[i : i + 1],
            seeds=seeds[i : i + 1],
            max_k=4,
        )
        assert torch.equal(one.output_token_ids[0], full.output_token_ids[i])
    again = verify(logits, d, cu, draft_probs=q, temperature=temp, seeds=seeds)
    assert torch.equal(again.output_token_ids, full.output_token_ids)
    assert not torch.equal(
        sample_noise(seeds, torch.zeros(4, dtype=torch.int64), 9),
        sample_noise(seeds + 1000, torch.zeros(4, dtype=torch.int64), 9),
    )


def test_philox_matches_the_random123_known_answers() -> None:
    zero = torch.tensor([0])
    assert [int(w) for w in philox4x32(zero, zero, 0, 0, 0)] == [
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    ]
    key = torch.tensor([(0x299F31D0 << 32) | 0xA4093822])
    words = philox4x32(key, torch.tensor([0x243F6A88]), 0x85A308D3, 0x13198A2E, 0x03707344)
    assert [int(w) for w in words] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_noise_layout_is_the_same_below_and_above_one_chunk() -> None:
    """Entry v of the noise does not depend on the vocabulary size it was requested with."""
    seeds = torch.tensor([3, 4])
    pos = torch.tensor([0, 2])
    small = sample_noise(seeds, pos, 700)
    big = sample_noise(seeds, pos, 9000)
    assert torch.equal(small, big[:, :700])
    assert bool((big > 0).all()) and bool(torch.isfinite(big).all())


# ---------------------------------------------------------------- argument errors
def test_bad_arguments_raise_clear_errors() -> None:
    logits, d, cu = _random_batch(0, [2, 1], vocab=5)
    with pytest.raises(ValueError, match="target_logits has 4 rows"):
        verify(logits[:4], d, cu)
    with pytest.raises(ValueError, match="seeds is None"):
        verify(logits, d, cu, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="temperature="):
        verify(logits, d, cu, temperature=torch.tensor([1.0, -1.0]), seeds=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        verify(logits, d, torch.tensor([2, 1]), max_k=2)
    with pytest.raises(ValueError, match="draft_probs has shape"):
        verify(logits, d, cu, draft_probs=torch.ones(3, 4))
    with pytest.raises(ValueError, match="backend="):
        verify(logits, d, cu, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        verify(logits.long(), d, cu)
