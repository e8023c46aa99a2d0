"""SuffixProposer: the fast trie equals the brute-force reference; memory, eviction, scope, threads."""

from __future__ import annotations

import random
import threading
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_spec.proposers import ProposalRequest, SuffixProposer
from adaptive_spec.proposers.suffix_index import ScanIndex, TrieIndex


def _req(rid: str, toks, budget: int = 100, vocab: int = 1000) -> ProposalRequest:
    return ProposalRequest(rid, np.asarray(toks, dtype=np.int64), budget, vocab)


# -- real token streams ------------------------------------------------------------------------
@cache
def real_streams() -> tuple[tuple[int, ...], ...]:
    """Token ids of real prompts from the data packages: the embedded model's tokenizer when its
    converted copy is in the cache (no conversion, no download), else the prompts' UTF-8 bytes."""
    from adaptive_spec.commands.workloads import load_workload

    prompts = load_workload("mixed", 12) + load_workload("agent", 4)
    encode = None
    try:
        from tokenizers import Tokenizer

        from adaptive_spec.core.paths import cache_dir

        files = sorted(cache_dir().glob("*/tokenizer.json"))
        if files:
            tok = Tokenizer.from_file(str(files[0]))
            encode = lambda text: tok.encode(text).ids  # noqa: E731
    except Exception:
        encode = None
    if encode is None:
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
    return tuple(tuple(encode(p.text)) for p in prompts)


# -- a stream of engine steps, run through both backends ---------------------------------------
def run_both(ops, **kw) -> tuple[SuffixProposer, SuffixProposer]:
    """Apply ``ops`` (("step", [(rid, tokens, budget)], ks) or ("release", rid)) to a trie and a
    reference proposer; assert identical drafts and features after every step."""
    fast = SuffixProposer(backend="trie", **kw)
    ref = SuffixProposer(backend="reference", **kw)
    for op in ops:
        if op[0] == "release":
            fast.release(op[1])
            ref.release(op[1])
            continue
        _, batch, ks = op
        reqs = [_req(rid, toks, budget) for rid, toks, budget in batch]
        a, b = fast.propose(reqs, ks), ref.propose(reqs, ks)
        for r, x, y in zip(reqs, a, b, strict=True):
            assert x.tolist() == y.tolist(), (r.req_id, x, y)
            fa, fb = fast.last_features[r.req_id], ref.last_features[r.req_id]
            assert (fa.match_length, fa.score, fa.source) == (fb.match_length, fb.score, fb.source)
            assert fa.probs.tolist() == fb.probs.tolist()
        for r in reqs:
            assert fast.match_length(r) == ref.match_length(r)
        sf, sr = fast.stats(), ref.stats()
        assert sf["global_tokens"] == sr["global_tokens"] <= kw.get("token_budget", 1 << 18)
        assert sf["sequences"] == sr["sequences"] and sf["evicted"] == sr["evicted"]
    return fast, ref


@st.composite
def streams(draw, source: str = "random"):
    """Several requests growing step by step (1-3 tokens each), some released and restarted."""
    n_req = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 6))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    real = real_streams() if source == "real" else ()
    hist: dict[str, list[int]] = {}
    src: dict[str, tuple[int, ...]] = {}
    ops: list = []
    for _ in range(draw(st.integers(1, 10))):
        batch = []
        for i in range(n_req):
            rid = f"r{i}"
            if rid not in hist or rng.random() < 0.08:
                if rid in hist:
                    ops.append(("release", rid))
                if real:
                    s = real[rng.randrange(len(real))]
                    start = rng.randrange(max(1, len(s) - 60))
                    src[rid] = s[start : start + 60]
                    hist[rid] = list(src[rid][: rng.randrange(1, 30)])
                else:
                    hist[rid] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 14))]
            for _ in range(rng.randrange(0, 4)):
                if real:
                    s = src[rid]
                    hist[rid].append(s[len(hist[rid]) % len(s)])
                else:
                    hist[rid].append(rng.randrange(vocab))
            if rng.random() < 0.8:
                batch.append((rid, list(hist[rid]), rng.randrange(-1, 12)))
        rng.shuffle(batch)
        ops.append(("step", batch, [rng.randrange(0, 7) for _ in batch]))
    return ops


configs = st.fixed_dictionaries(
    {
        "max_k": st.integers(1, 6),
        "max_depth": st.integers(2, 9),
        "max_spec_factor": st.sampled_from([0.5, 1.0, 2.0, 8.0]),
        "max_spec_offset": st.sampled_from([0.0, 1.0, -1.0]),
        "min_token_prob": st.sampled_from([0.0, 0.1, 0.3, 0.9]),
        "token_budget": st.sampled_from([0, 10, 40, 1000]),
        "window": st.sampled_from([1, 5, 100]),
        "local": st.sampled_from(["fallback", "always", "never"]),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=streams(), kw=configs)
def test_trie_equals_reference_on_random_streams(ops, kw) -> None:
    run_both(ops, **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=streams("real"), kw=configs)
def test_trie_equals_reference_on_real_streams(ops, kw) -> None:
    run_both(ops, **kw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=streams(), kw=configs)
def test_tenant_scope_equals_reference(ops, kw) -> None:
    tenants = {"r0": "a", "r1": "b", "r2": "a"}  # r3, r4: no tenant (the shared "" index)
    run_both(ops, scope="tenant", tenant_of=tenants, **kw)


def test_real_prompts_give_drafts_from_other_requests() -> None:
    """A second request repeating text from a first one's prompt drafts it from the global index."""
    s = list(real_streams()[0])[:200]
    p = SuffixProposer(max_k=8)
    p.propose([_req("a", s, vocab=1 << 20)], [8])
    p.release("a")
    d = p.propose([_req("b", s[:20], vocab=1 << 20)], [8])[0]
    f = p.last_features["b"]
    assert d.tolist() == s[20 : 20 + len(d)] and len(d) >= 4
    assert f.source == "global" and f.match_length >= 4 and f.probability > 0.5


# -- the index itself ----------------------------------------------------------------------------
def _strings(tr: TrieIndex, u: int = 0, pre: tuple = ()):
    """(string, count, node-or-leaf) for every string the trie represents."""
    for x, c in tr._ch[u].items():
        s = (*pre, x)
        if c >= 0:
            yield s, tr._cnt[c], c
            yield from _strings(tr, c, s)
            continue
        packed = ~c
        text, i = tr._text[packed >> 32], packed & 0xFFFFFFFF
        assert text[i] == x
        while True:
            yield s, 1, c
            i += 1
            if i >= len(text) or len(s) == tr.depth:
                break
            s = (*s, text[i])


def _node_of(tr: TrieIndex, s: tuple) -> int | None:
    u = 0
    for x in s:
        c = tr._ch[u].get(x)
        if c is None or c < 0:
            return None
        u = c
    return u


@pytest.mark.parametrize("seed", range(60))
def test_trie_counts_every_substring_exactly(seed) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.randrange(2, 7), rng.choice([2, 3, 5])
    tr = TrieIndex(depth)
    texts: dict[int, list[int]] = {}
    live: list[int] = []
    for op in range(50):
        r = rng.random()
        if r < 0.2 or not live:
            sid = len(texts) + 100 * op
            tr.add(sid)
            texts[sid] = []
            live.append(sid)
        elif r < 0.3:
            sid = rng.choice(list(texts))
            assert tr.remove(sid) == len(texts.pop(sid))
            if sid in live:
                live.remove(sid)
        elif r < 0.35:
            sid = rng.choice(live)
            tr.finish(sid)
            live.remove(sid)
        else:
            sid = rng.choice(live)
            toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            tr.extend(sid, toks)
            texts[sid] += toks
        got = {}
        for s, c, node in _strings(tr):
            assert s not in got and len(s) <= depth
            got[s] = c
            if node >= 0:
                kids = tr._ch[node].values()
                assert tr._cont[node] == sum(tr._cnt[v] if v >= 0 else 1 for v in kids)
                if len(s) > 1:  # nodes are suffix-closed (what the append loop relies on)
                    assert _node_of(tr, s[1:]) is not None
        want: dict[tuple, int] = {}
        for t in texts.values():
            for n in range(1, depth + 1):
                for i in range(len(t) - n + 1):
                    want[tuple(t[i : i + n])] = want.get(tuple(t[i : i + n]), 0) + 1
        assert got == want
        for sid in live:  # each active suffix points at its node, or into a leaf when unique
            act, t = tr._act[sid], texts[sid]
            assert len(act) == min(len(t), depth) + 1
            for m in range(len(act)):
                node = _node_of(tr, tuple(t[len(t) - m :]) if m else ())
                assert act[-1 - m] == node if node is not None else act[-1 - m] < 0
    for sid in list(texts):
        tr.remove(sid)
    assert tr.num_nodes == 1 and not tr._ch[0] and len(tr) == 0  # nothing leaks


def test_reference_counts_by_brute_force() -> None:
    ix = ScanIndex(4)
    ix.add(0)
    ix.extend(0, [1, 2, 3, 1, 2, 4, 1, 2])
    assert ix.next_counts([1, 2]) == {3: 1, 4: 1}
    d = ix.draft(0, 4, 1.0, 0.0, 0.0)
    assert d.tokens == [3, 1] and d.match_length == 2 and d.probs == [0.5, 0.5]


# -- behaviour -----------------------------------------------------------------------------------
def test_frequency_picks_the_most_common_continuation() -> None:
    p = SuffixProposer(max_k=4, local="never")
    for i, nxt in enumerate([7, 7, 8]):
        p.propose([_req(f"h{i}", [1, 2, 3, nxt, 9, 9])], [4])
    d = p.propose([_req("q", [5, 2, 3])], [4])[0]
    f = p.last_features["q"]
    assert d.tolist() == [7, 9] and f.match_length == 2  # the draft budget is the match length
    assert f.probability == pytest.approx(2 / 3) and f.score == pytest.approx(4 / 3)
    p2 = SuffixProposer(max_k=4, local="never", max_spec_factor=4.0)
    for i, nxt in enumerate([7, 7, 8]):
        p2.propose([_req(f"h{i}", [1, 2, 3, nxt, 9, 9])], [4])
    d = p2.propose([_req("q", [5, 2, 3])], [4])[0]
    assert d.tolist() == [7, 9, 9]  # to the end of the text seen
    assert p2.last_features["q"].probs.tolist() == pytest.approx([2 / 3] * 3)


def test_min_token_prob_stops_the_draft() -> None:
    p = SuffixProposer(max_k=4, local="never", min_token_prob=0.7)
    for i, nxt in enumerate([7, 7, 8]):
        p.propose([_req(f"h{i}", [1, 2, 3, nxt])], [4])
    assert p.propose([_req("q", [2, 3])], [4])[0].tolist() == []  # 2/3 < 0.7
    assert p.match_length(_req("q", [2, 3])) == 0


def test_own_text_is_preferred_when_it_scores_higher() -> None:
    p = SuffixProposer(max_k=4, local="always")
    for i in range(5):
        p.propose([_req(f"h{i}", [1, 2, 3, 4, 7, 7])], [4])
    own = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    d = p.propose([_req("q", own)], [4])[0]
    f = p.last_features["q"]
    assert d.tolist() == [5, 6, 0, 1] and f.source == "local" and f.score == 4.0


def test_history_change_under_the_same_id_starts_over() -> None:
    p = SuffixProposer(max_k=4)
    p.propose([_req("a", [1, 2, 3, 1, 2])], [4])
    # [5 6] does not continue [1 2 3 1 2]: a new sequence, with nothing to draft from
    assert p.propose([_req("a", [5, 6])], [4])[0].tolist() == []
    assert p.stats()["sequences"] == 2 and len(p) == 1


def test_only_new_tokens_are_indexed_each_step(monkeypatch) -> None:
    seen: list[int] = []
    orig = TrieIndex.extend

    def spy(self, sid, tokens):
        seen.append(len(tokens))
        return orig(self, sid, tokens)

    monkeypatch.setattr(TrieIndex, "extend", spy)
    for local, per in (("always", 2), ("fallback", 1)):  # local + global, or global only
        p = SuffixProposer(max_k=4, local=local)
        toks = list(np.random.default_rng(0).integers(0, 50, 300))
        seen.clear()
        p.propose([_req("a", toks[:100])], [4])
        assert seen == [100] * per
        for n in range(101, 300, 3):
            seen.clear()
            p.propose([_req("a", toks[:n])], [4])
            p.match_length(_req("a", toks[:n]))
            assert seen in ([1] * per, [3] * per)


def test_memory_bound_holds_under_a_long_stream() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 300, 400)
    budget, depth = 3000, 12
    p = SuffixProposer(max_k=8, max_depth=depth, token_budget=budget)
    nodes = []
    live: dict[str, list[int]] = {}
    for i in range(250):  # ~19k tokens through the engine, 4 requests at a time
        rid = f"r{i}"
        start = int(rng.integers(0, 300))
        live[rid] = [*base[start : start + 40].tolist(), *rng.integers(0, 300, 20).tolist()]
        for _ in range(15):
            for t in live.values():
                t.append(int(rng.integers(0, 300)) if rng.random() < 0.5 else t[-7])
            p.propose([_req(r, t) for r, t in live.items()], [8] * len(live))
            s = p.stats()
            assert s["global_tokens"] <= budget
        if len(live) == 4:
            old = next(iter(live))
            p.release(old)
            del live[old]
        nodes.append(p.stats()["nodes"])
    s = p.stats()
    assert s["evicted"] > 150 and s["requests"] == len(live) <= 4
    local_tokens = sum(len(t) for t in live.values())
    assert s["nodes"] <= depth * (budget + local_tokens) + len(live) + 1
    # steady state: the node count does not creep up as more text streams through
    assert max(nodes[-60:]) <= 1.3 * max(nodes[60:120])


def test_eviction_never_breaks_a_running_request() -> None:
    p = SuffixProposer(max_k=4, token_budget=50)
    runner = [1, 2, 3, 4] * 5
    p.propose([_req("run", runner)], [4])
    before = p.last_features["run"]
    assert p.propose([_req("run", runner)], [4])[0].tolist() == [1, 2, 3, 4]
    for i in range(10):  # other traffic pushes the running request out of the global index
        p.propose([_req(f"o{i}", list(range(100 + 10 * i, 110 + 10 * i)))], [4])
        p.release(f"o{i}")
    assert p._states["run"].gsid is None and p.stats()["global_tokens"] <= 50
    for extra in range(1, 30):  # it keeps growing and drafting from its own text
        toks = runner + [1, 2, 3, 4] * (extra // 4) + [1, 2, 3, 4][: extra % 4]
        d = p.propose([_req("run", toks)], [4])[0]
        nxt = [1, 2, 3, 4, 1, 2, 3, 4]
        off = len(toks) % 4
        assert d.tolist() == nxt[off : off + 4]
        assert p.last_features["run"].source == "local"
    assert before.source in ("local", "global")
    # and a local-only proposer sees the same thing
    solo = SuffixProposer(max_k=4, token_budget=0)
    assert solo.propose([_req("run", toks)], [4])[0].tolist() == d.tolist()


def test_tenant_scope_isolates_tenants() -> None:
    tenants = {"a1": "A", "a2": "A", "b1": "B"}
    p = SuffixProposer(max_k=4, local="never", scope="tenant", tenant_of=tenants)
    secret = [11, 12, 13, 14, 15, 16, 17, 18]
    p.propose([_req("a1", secret)], [4])
    p.release("a1")
    assert p.propose([_req("b1", secret[:4])], [4])[0].tolist() == []  # B never sees A's text
    assert p.propose([_req("a2", secret[:4])], [4])[0].tolist() == [15, 16, 17, 18]
    assert p.stats()["tenants"] == 2
    shared = SuffixProposer(max_k=4, local="never")  # the default: one index for the engine
    shared.propose([_req("a1", secret)], [4])
    assert shared.propose([_req("b1", secret[:4])], [4])[0].tolist() == [15, 16, 17, 18]


def test_tenant_of_callable_and_failures_fall_back_to_the_shared_tenant() -> None:
    def tenant(rid: str) -> str | None:
        if rid.startswith("x"):
            raise KeyError(rid)
        return None if rid.startswith("n") else rid[0]

    p = SuffixProposer(max_k=4, local="never", scope="tenant", tenant_of=tenant)
    p.propose([_req("x1", [1, 2, 3, 4, 5])], [4])
    assert p.propose([_req("n1", [2, 3])], [4])[0].tolist() == [4, 5]  # both in ""
    assert p.propose([_req("a1", [2, 3])], [4])[0].tolist() == []


def test_concurrent_calls_are_safe() -> None:
    p = SuffixProposer(max_k=4, token_budget=2000)
    errors: list[BaseException] = []
    rng = np.random.default_rng(0)
    data = rng.integers(0, 40, (8, 400))

    def worker(w: int) -> None:
        try:
            for step in range(40, 400, 2):
                reqs = [_req(f"w{w}-{j}", data[(w + j) % 8, :step]) for j in range(2)]
                for d in p.propose(reqs, [4, 4]):
                    assert len(d) <= 4
                p.match_length(reqs[0])
            for j in range(2):
                p.release(f"w{w}-{j}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    def reader() -> None:
        try:
            for _ in range(200):
                assert p.stats()["global_tokens"] <= 2000
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(p) == 0 and p.stats()["global_tokens"] <= 2000


def test_features_document_the_draft() -> None:
    p = SuffixProposer(max_k=8)
    r = _req("a", [3, 4, 5, 6, 1, 3, 4, 5])
    d = p.propose([r], [8])[0]
    f = p.features(r)
    assert f is p.last_features["a"]  # cached: nothing changed since propose
    assert d.tolist() == [6, 1, 3] and f.match_length == 3 and f.source == "global"
    assert f.probs.dtype == np.float64 and f.probs.shape == (3,)
    assert f.probability == f.probs[0] == 1.0 and f.score == 3.0
    assert f.as_tuple() == (3, 1.0) and p.match_length(r) == 3
    empty = _req("b", [90, 91])
    assert p.propose([empty], [8])[0].size == 0 and p.features(empty).as_tuple() == (0, 0.0)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(max_depth=1), "max_depth"),
        (dict(max_spec_factor=-1.0), "max_spec_factor"),
        (dict(max_spec_offset=float("nan")), "max_spec_offset"),
        (dict(min_token_prob=1.5), "min_token_prob"),
        (dict(token_budget=-1), "token_budget"),
        (dict(window=0), "window"),
        (dict(local="yes"), "local"),
        (dict(scope="user"), "scope"),
        (dict(scope="tenant"), "tenant_of"),
        (dict(tenant_of=3), "tenant_of"),
        (dict(backend="cuda"), "backend"),
        (dict(max_states=0), "max_states"),
    ],
)
def test_bad_configuration_names_the_parameter(kw, param) -> None:
    with pytest.raises(ValueError, match=rf"{param}=.* is invalid; allowed"):
        SuffixProposer(**kw)
