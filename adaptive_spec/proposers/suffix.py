"""Suffix proposer: frequency-scored continuations from the request itself and from every request served.

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", NeurIPS 2025; Snowflake ArcticInference's ``suffix_decoding``, vLLM's
``method="suffix"``) keeps suffix trees over token sequences and drafts the most frequent
continuation of the context's suffix. This module is an independent implementation of that
algorithm over two kinds of index:

* a **global** index over the prompts and outputs of every request served so far (running ones
  included, from the step their tokens are seen), one per *scope*: the whole engine by default, or
  one per tenant;
* a **local** index over one request's own prompt and output (ArcticInference's per-request
  "prompt tree"; it also sees the output, like prompt lookup). With ``local="fallback"`` (default)
  a request gets one only when its text is not in a global index (evicted from it, or
  ``token_budget=0``): while it is, the global index holds the same text, and a separate local index
  measured 0-2 % more accepted tokens for about 1.6x the cost. ``local="always"`` keeps one for every
  request (ArcticInference's design), ``local="never"`` none.

The index is a *depth-bounded suffix trie*: for every position of every stored sequence it holds
the substring starting there, cut to ``max_depth`` tokens, with ``count(s)`` = number of
occurrences of the string ``s``. Unique strings (count 1) are not materialised: an edge that leads
to a unique string points into the stored text instead ("leaf"), so novel text costs O(1) nodes per
token and repeated text O(max_depth).

Drafting (per index) follows ArcticInference's path speculation:

1. for every match length ``m = 1, 2, ...`` (the context's last ``m`` tokens; stops at the first
   ``m`` whose string has no continuation, and before ``max_depth``):
2. the draft budget is ``min(k, floor(m * max_spec_factor + max_spec_offset))``;
3. from the node of that suffix, repeatedly append the most frequent next token (ties: the
   smallest id), multiplying ``prob`` by its conditional frequency ``count(s t) / sum_u count(s u)``
   and stopping when ``prob < min_token_prob``, at depth ``max_depth`` or at the budget;
4. the score of a draft is the sum of its per-position ``prob`` (an estimate of the expected number
   of accepted tokens); the best-scoring ``m`` wins (ties: the longer match).

With both indexes, the request's draft is the global one when its score is strictly higher than the
local one's, else the local one.

Conditional frequencies here count only occurrences that have a next token (ArcticInference divides
by all occurrences, including the one at the end of the context, which halves the first probability
of a continuation seen once).

Scope and privacy
-----------------
Drafts never change outputs (verification keeps the target's tokens), but a shared global index holds
the text of every request that went through it, and its speed-up is observable: a client that times
its own requests can tell whether a continuation was seen before, i.e. learn something about what
other clients sent. ``scope="tenant"`` keeps one global index per tenant key (a LoRA adapter name, a
``user`` field, an API key's owner: whatever ``tenant_of`` returns for a request id), so a tenant's
drafts only ever come from its own traffic; requests with no tenant (``tenant_of`` returns None or
fails) share the ``""`` index. Memory stays bounded by one ``token_budget`` over all tenants.

Memory, cost, lifetime
----------------------
* The global indexes hold at most ``token_budget`` tokens (checked after each ``propose``): when over
  it, the oldest sequences (first-seen order) are removed, O(tokens x max_depth) each. A running
  request whose global text is evicted keeps drafting from its own text: its local index (built then
  from the evicted text with ``local="fallback"``); its later tokens are not added to the global index
  any more.
* Each step adds only the tokens not seen before (per request: how many were ingested and the last
  one, so a changed history restarts the request's sequences): O(max_depth) per new token.
* A request seen for the first time is indexed from its last ``window`` tokens.
* The tokens a request commits in its very last step are never seen (no ``propose`` follows) and are
  not indexed.
* All mutation happens under one lock: ``propose``, ``features``, ``release`` and ``stats`` may be
  called from different threads.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .base import (
    EMPTY,
    ProposalRequest,
    Proposer,
    as_int,
    as_tokens,
    check_ks,
    check_max_k,
    clean_draft,
    draft_cap,
)

SCOPES = ("engine", "tenant")
LOCAL_MODES = ("fallback", "always", "never")
BACKENDS = ("trie", "reference")
_MASK = 0xFFFFFFFF
_EMPTY_PROBS = np.zeros(0, dtype=np.float64)


class SuffixFeatures(NamedTuple):
    """Per-request features of the suffix draft available now (cheap: computed with the draft).

    Attributes
    ----------
    match_length : int
        Tokens of the context's suffix that the chosen draft continues (0 when there is no draft).
    probability : float
        Estimated probability of the first draft token (its conditional frequency), in (0, 1];
        0.0 when there is no draft.
    score : float
        ``probs.sum()``: estimated expected number of accepted draft tokens, in [0, len(draft)].
    probs : np.ndarray
        float64 [d], non-increasing: estimated probability that ``draft[:j + 1]`` is accepted, for
        the d tokens of the (cleaned) draft.
    source : str
        ``"local"`` (the request's own text), ``"global"`` (the shared index) or ``""`` (no draft).
    """

    match_length: int = 0
    probability: float = 0.0
    score: float = 0.0
    probs: np.ndarray = _EMPTY_PROBS
    source: str = ""

    def as_tuple(self) -> tuple[int, float]:
        """``(match_length, probability)``: the two numbers a controller conditions on."""
        return self.match_length, self.probability


NO_FEATURES = SuffixFeatures()


@dataclass(slots=True)
class _Draft:
    tokens: list[int]
    probs: list[float]
    score: float
    match_length: int


_NO_DRAFT = _Draft([], [], 0.0, 0)


def _spec_budget(m: int, k: int, factor: float, offset: float) -> int:
    """Draft tokens allowed after a match of ``m`` tokens (ArcticInference's ``max_spec_factor``)."""
    return max(0, min(k, int(m * factor + offset + 1e-6)))


class _TrieIndex:
    """Depth-bounded suffix trie over several token sequences, with unique strings kept as leaves.

    Nodes are explicit strings ``s`` (1 <= len(s) <= depth) with ``count(s) >= 2`` at the time they were
    created (and >= 1 while they exist). For node ``u``: ``_ch[u]`` maps a token ``x`` to the node of
    ``s + x`` (an int >= 0) or, when ``s + x`` occurs exactly once, to a *leaf* ``~(sid << 32 | i)``:
    ``x`` is token ``i`` of sequence ``sid`` and the unique string continues along that sequence;
    ``_cnt[u]`` is ``count(s)``; ``_cont[u]`` is the sum of its children's counts (occurrences of
    ``s`` followed by a token, depth permitting); ``_btok[u]``/``_bcnt[u]`` cache its most frequent
    child (``_bcnt[u] == -1``: stale, recomputed when read).

    Each *active* sequence (one that can still grow) keeps ``_act[sid]``: entry ``-1 - m`` is where its
    last ``m`` tokens sit (a node, or the leaf whose edge contains them), ``m = 0..min(len, depth)``.
    Appending token ``x`` extends each of these suffixes by ``x`` (suffixes inside leaves extend for
    free), so an append costs O(number of suffixes that sit on nodes) <= O(depth).
    """

    __slots__ = ("_act", "_bcnt", "_btok", "_ch", "_cnt", "_cont", "_free", "_text", "depth")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._ch: list[dict[int, int] | None] = [{}]
        self._cnt = [0]
        self._cont = [0]
        self._btok = [0]
        self._bcnt = [0]
        self._free: list[int] = []
        self._text: dict[int, array] = {}
        self._act: dict[int, list[int]] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._text)

    @property
    def num_nodes(self) -> int:
        return len(self._ch) - len(self._free)

    def add(self, sid: int) -> None:
        self._text[sid] = array("q")
        self._act[sid] = [0]

    def finish(self, sid: int) -> None:
        """The sequence will not grow any more: drop its active suffixes (its text stays indexed)."""
        self._act.pop(sid, None)

    def text(self, sid: int) -> list[int]:
        """The tokens of sequence ``sid``."""
        return self._text[sid].tolist()

    def _node(self, count: int, ch: dict[int, int], cont: int, btok: int, bcnt: int) -> int:
        if self._free:
            u = self._free.pop()
            self._ch[u] = ch
            self._cnt[u] = count
            self._cont[u] = cont
            self._btok[u] = btok
            self._bcnt[u] = bcnt
            return u
        self._ch.append(ch)
        self._cnt.append(count)
        self._cont.append(cont)
        self._btok.append(btok)
        self._bcnt.append(bcnt)
        return len(self._ch) - 1

    def _best(self, u: int) -> None:
        bt, bc = 0, 0
        cnt = self._cnt
        for t, c in self._ch[u].items():  # type: ignore[union-attr]
            k = cnt[c] if c >= 0 else 1
            if k > bc or (k == bc and t < bt):
                bt, bc = t, k
        self._btok[u] = bt
        self._bcnt[u] = bc

    # -- updates -------------------------------------------------------------------------------
    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to active sequence ``sid``.

        The active suffixes are stored newest-last: ``act[-1 - m]`` is where the last ``m`` tokens sit.
        Nodes come first in ``m`` (a string with a node has its suffixes on nodes too: a node is only
        made when its string's shorter suffix already is one), so the loop stops at the first leaf;
        suffixes in leaves stay where they are. Each suffix is moved in place to its extension, then
        the root (the empty suffix) is appended and a suffix longer than ``depth`` dropped.
        """
        text = self._text[sid]
        act = self._act[sid]
        depth = self.depth
        chs, cnt, cont, btok, bcnt = self._ch, self._cnt, self._cont, self._btok, self._bcnt
        hi = sid << 32
        for x in tokens:
            n = len(text)
            leaf = ~(hi | n)  # the edge to a new unique string: it continues at this token
            j = len(act) - 1
            stop = j - min(n, depth - 1)  # entries j >= stop: the suffixes of length 0..depth - 1
            while j >= stop:
                u = act[j]
                if u < 0:
                    break  # this suffix and all longer ones are unique: nothing to update
                ch = chs[u]
                c = ch.get(x)  # type: ignore[union-attr]
                if c is None:
                    c = ch[x] = leaf  # type: ignore[index]
                    k = 1
                elif c >= 0:
                    k = cnt[c] + 1
                    cnt[c] = k
                else:
                    c = self._materialize(u, len(act) - 1 - j, x, c)
                    k = 2
                cont[u] += 1
                b = bcnt[u]
                if b >= 0 and (k > b or (k == b and x < btok[u])):
                    btok[u] = x
                    bcnt[u] = k
                act[j] = c
                j -= 1
            act.append(0)
            if len(act) > depth + 1:
                del act[0]
            text.append(x)

    def _materialize(self, u: int, m: int, x: int, leaf: int) -> int:
        """A second occurrence of the unique string ``s(u) + x`` (edge ``leaf``, ``len(s(u)) = m``):
        make it a node, and move the old occurrence's continuation to a leaf below it."""
        packed = ~leaf
        s2, i2 = packed >> 32, packed & _MASK
        d = m + 1
        t2 = self._text[s2]
        acc = len(t2)
        if d < self.depth and i2 + 1 < acc:  # the old occurrence goes on: its own leaf below
            y = t2[i2 + 1]
            c = self._node(2, {y: ~((s2 << 32) | (i2 + 1))}, 1, y, 1)
        else:
            c = self._node(2, {}, 0, 0, 0)
        self._ch[u][x] = c  # type: ignore[index]
        act2 = self._act.get(s2)
        if act2 is not None:  # the old occurrence's sequence has an active suffix inside this edge
            j = acc - 1 - i2  # ... of length d + j (it ends at that sequence's last token)
            if d + j <= self.depth:
                act2[len(act2) - 1 - d - j] = c if j == 0 else ~((s2 << 32) | (i2 + 1))
        return c

    def remove(self, sid: int) -> int:
        """Remove sequence ``sid`` (every occurrence it contributed); returns its length."""
        text = self._text.pop(sid)
        self._act.pop(sid, None)
        depth = self.depth
        chs, cnt, cont, btok, bcnt = self._ch, self._cnt, self._cont, self._btok, self._bcnt
        n = len(text)
        for i in range(n):
            u = 0
            for j in range(min(depth, n - i)):
                x = text[i + j]
                ch = chs[u]
                c = ch[x]  # type: ignore[index]
                cont[u] -= 1
                if btok[u] == x:
                    bcnt[u] = -1
                if c < 0:
                    del ch[x]  # type: ignore[attr-defined]
                    break
                k = cnt[c] - 1
                if k == 0:
                    del ch[x]  # type: ignore[attr-defined]
                    self._drop_subtree(c)
                    break
                cnt[c] = k
                u = c
        return n

    def _drop_subtree(self, u: int) -> None:
        stack = [u]
        while stack:
            v = stack.pop()
            stack.extend(c for c in self._ch[v].values() if c >= 0)  # type: ignore[union-attr]
            self._ch[v] = None
            self._free.append(v)

    # -- drafting ------------------------------------------------------------------------------
    def draft(
        self, sid: int, k: int, factor: float, offset: float, min_prob: float, beat: float = 0.0
    ) -> _Draft:
        """Best draft for the active sequence ``sid`` whose score is above ``beat`` (else none).

        Same result as trying every match length in increasing order and keeping the best score
        (ties: the longer match); here the longest match is tried first, and a shorter one is skipped
        when ``budget x its first probability`` (an upper bound of its score: probabilities never
        increase along a draft) cannot beat the best so far, and the search stops when no shorter
        match's budget can.
        """
        act = self._act.get(sid)
        if act is None or k <= 0:
            return _NO_DRAFT
        depth = self.depth
        cont, bcnt = self._cont, self._bcnt
        h = 0  # longest match with a continuation
        for m in range(1, min(len(act) - 1, depth - 1) + 1):
            u = act[-1 - m]
            if u < 0 or cont[u] == 0:
                break  # only this occurrence: no longer suffix has a continuation either
            h = m
        best = _NO_DRAFT
        top = beat
        for m in range(h, 0, -1):
            budget = min(k, int(m * factor + offset + 1e-6))
            if budget <= top:
                break  # shorter matches have no larger budget: none can score higher
            room = min(budget, depth - m)
            if room <= top:
                continue
            u = act[-1 - m]
            if bcnt[u] < 0:
                self._best(u)
            if room * (bcnt[u] / cont[u]) * (1.0 + 1e-9) <= top:
                continue
            d = self._expand(u, m, room, min_prob)
            if d.score > top:
                best, top = d, d.score
        return best

    def _expand(self, u: int, m: int, budget: int, min_prob: float) -> _Draft:
        depth = self.depth
        chs, cont, btok, bcnt = self._ch, self._cont, self._btok, self._bcnt
        toks: list[int] = []
        probs: list[float] = []
        score, prob, d = 0.0, 1.0, m
        while len(toks) < budget and cont[u]:
            if bcnt[u] < 0:
                self._best(u)
            bt = btok[u]
            p = prob * (bcnt[u] / cont[u])
            if p < min_prob or p <= 0.0:
                break
            prob = p
            toks.append(bt)
            probs.append(p)
            score += p
            d += 1
            c = chs[u][bt]  # type: ignore[index]
            if c < 0:  # a unique continuation: read it from the text
                packed = ~c
                t2 = self._text[packed >> 32]
                i = (packed & _MASK) + 1
                stop = min(len(t2), i + depth - d, i + budget - len(toks))
                for t in t2[i:stop]:
                    toks.append(t)
                    probs.append(p)
                    score += p
                break
            u = c
        return _Draft(toks, probs, score, m)


class _ScanIndex:
    """The reference: the same drafts as :class:`_TrieIndex` by brute force over the stored text.

    ``count`` of a pattern is found by comparing it with every window of every stored sequence;
    O(stored tokens x depth) per count. For tests only.
    """

    __slots__ = ("_text", "active", "depth")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._text: dict[int, list[int]] = {}
        self.active: set[int] = set()

    def __len__(self) -> int:
        return len(self._text)

    @property
    def num_nodes(self) -> int:
        return 0

    def add(self, sid: int) -> None:
        self._text[sid] = []
        self.active.add(sid)

    def finish(self, sid: int) -> None:
        self.active.discard(sid)

    def text(self, sid: int) -> list[int]:
        return list(self._text[sid])

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        self._text[sid].extend(tokens)

    def remove(self, sid: int) -> int:
        self.active.discard(sid)
        return len(self._text.pop(sid))

    def next_counts(self, pattern: list[int]) -> dict[int, int]:
        """How often each token follows an occurrence of ``pattern`` in the stored sequences."""
        out: dict[int, int] = {}
        n = len(pattern)
        for seq in self._text.values():
            for i in range(len(seq) - n):
                if seq[i : i + n] == pattern:
                    out[seq[i + n]] = out.get(seq[i + n], 0) + 1
        return out

    def draft(
        self, sid: int, k: int, factor: float, offset: float, min_prob: float, beat: float = 0.0
    ) -> _Draft:
        """Every match length in increasing order, each drafted greedily; the best score wins (ties:
        the longer match) if it is above ``beat``."""
        if sid not in self.active or k <= 0:
            return _NO_DRAFT
        ctx = self._text[sid]
        best = _NO_DRAFT
        for m in range(1, min(len(ctx), self.depth - 1) + 1):
            pattern = ctx[len(ctx) - m :]
            if not self.next_counts(pattern):
                break
            toks: list[int] = []
            probs: list[float] = []
            score, prob = 0.0, 1.0
            while len(toks) < _spec_budget(m, k, factor, offset) and len(pattern) < self.depth:
                counts = self.next_counts(pattern)
                if not counts:
                    break
                tok = min(counts, key=lambda t: (-counts[t], t))
                p = prob * (counts[tok] / sum(counts.values()))
                if p < min_prob or p <= 0.0:
                    break
                prob = p
                toks.append(tok)
                probs.append(p)
                score += p
                pattern = [*pattern, tok]
            if toks and score >= best.score:
                best = _Draft(toks, probs, score, m)
        return best if best.score > beat else _NO_DRAFT


@dataclass(slots=True)
class _Request:
    tenant: str
    local: Any  # _TrieIndex | _ScanIndex | None
    gsid: int | None  # sequence id in the tenant's global index; None when not (or no longer) there
    gentry: list[Any] | None  # its first-seen-order entry: [tokens, request id]
    base: int  # history position of the first indexed token
    n: int = 0  # tokens indexed
    last: int = 0  # last token indexed
    cached: tuple[int, int, np.ndarray, SuffixFeatures] | None = (
        None  # (version, cap, draft, feats)
    )


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or value < lo
        or (hi is not None and value > hi)
    ):
        allowed = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
    return int(value)


def _check_float(name: str, value: object, lo: float, hi: float | None = None) -> float:
    ok = isinstance(value, int | float | np.floating) and not isinstance(value, bool)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = np.isfinite(v) and v >= lo and (hi is None or v <= hi)
    if not ok:
        allowed = (
            f"a finite number in [{lo}, {hi}]" if hi is not None else f"a finite number >= {lo}"
        )
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
    return float(value)  # type: ignore[arg-type]


class SuffixProposer(Proposer):
    """SuffixDecoding proposer (Oliaro et al. 2025; ArcticInference): local + global suffix indexes.

    See the module docstring for the algorithm, the scope/privacy note and the memory model.

    Parameters
    ----------
    max_k : int
        Longest draft, 0..128.
    max_depth : int
        Longest string indexed (match length + draft length), 2..256 (ArcticInference/vLLM default 24).
    max_spec_factor : float
        Draft budget per matched token: a match of m tokens allows ``floor(m * max_spec_factor +
        max_spec_offset)`` draft tokens, >= 0 (default 1.0, as vLLM).
    max_spec_offset : float
        See ``max_spec_factor``; finite, >= -128 (default 0).
    min_token_prob : float
        Stop the draft when the estimated probability of the whole prefix drops below this, in [0, 1]
        (default 0.1, as vLLM).
    token_budget : int
        Tokens the global indexes hold at most (all tenants together), >= 0; 0 disables the global
        index (local drafts only). Default 262,144.
    window : int
        A request seen for the first time is indexed from its last ``window`` tokens, >= 1.
    local : {"fallback", "always", "never"}
        When a request has its own index (its prompt and output): only while its text is not in a
        global index (default), always (both are searched), or never (a request evicted from the
        global index then gets no drafts).
    scope : {"engine", "tenant"}
        One global index for the whole engine, or one per tenant (``tenant_of``).
    tenant_of : mapping or callable, optional
        Request id -> tenant key (``str``), as a mapping or a function; needed for ``scope="tenant"``.
        A missing key, None, or an exception puts the request in the shared ``""`` tenant.
    backend : {"trie", "reference"}
        ``"trie"``: the fast index. ``"reference"``: brute-force counting over the stored text (equal
        drafts, proven by the tests; for tests only: O(stored tokens) per count).
    max_states : int
        Per-request states kept at most (least recently used released first), >= 1: a guard for callers
        that never call :meth:`release`.

    Attributes
    ----------
    last_features : dict of str to SuffixFeatures
        Features of the drafts returned by the last :meth:`propose`, by request id.

    Raises
    ------
    ValueError
        Invalid configuration: the message names the parameter, its value and what is allowed.

    Examples
    --------
    >>> import numpy as np
    >>> p = SuffixProposer(max_k=4)
    >>> a = ProposalRequest("a", np.array([1, 2, 3, 4, 5, 9]), max_new_tokens=10, vocab_size=10)
    >>> p.propose([a], [4])[0].tolist()  # nothing repeats yet
    []
    >>> b = ProposalRequest("b", np.array([7, 2, 3]), max_new_tokens=10, vocab_size=10)
    >>> p.propose([b], [4])[0].tolist()  # request a's text continues "2 3" with "4 5"
    [4, 5]
    >>> f = p.last_features["b"]
    >>> f.match_length, f.probability, f.source
    (2, 1.0, 'global')
    """

    name = "suffix"

    def __init__(
        self,
        max_k: int = 8,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        token_budget: int = 1 << 18,
        window: int = 8192,
        local: str = "fallback",
        scope: str = "engine",
        tenant_of: Mapping[str, str] | Callable[[str], str | None] | None = None,
        backend: str = "trie",
        max_states: int = 4096,
    ) -> None:
        self.max_k = check_max_k(max_k)
        self.max_depth = _check_int("max_depth", max_depth, 2, 256)
        self.max_spec_factor = _check_float("max_spec_factor", max_spec_factor, 0.0)
        self.max_spec_offset = _check_float("max_spec_offset", max_spec_offset, -128.0)
        self.min_token_prob = _check_float("min_token_prob", min_token_prob, 0.0, 1.0)
        self.token_budget = _check_int("token_budget", token_budget, 0)
        self.window = _check_int("window", window, 1)
        if local not in LOCAL_MODES:
            raise ValueError(f"local={local!r} is invalid; allowed: {', '.join(LOCAL_MODES)}")
        self.local = local
        if scope not in SCOPES:
            raise ValueError(f"scope={scope!r} is invalid; allowed: {', '.join(SCOPES)}")
        if scope == "tenant" and tenant_of is None:
            raise ValueError(
                "tenant_of=None is invalid; allowed with scope='tenant': a mapping or a callable "
                "request id -> tenant key"
            )
        if tenant_of is not None and not (isinstance(tenant_of, Mapping) or callable(tenant_of)):
            raise ValueError(
                f"tenant_of={tenant_of!r} is invalid; allowed: a mapping or a callable request id -> "
                "tenant key"
            )
        self.scope = scope
        self.tenant_of = tenant_of
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is invalid; allowed: {', '.join(BACKENDS)}")
        self.backend = backend
        self.max_states = _check_int("max_states", max_states, 1)
        self._index_cls = _TrieIndex if backend == "trie" else _ScanIndex
        self._lock = threading.Lock()
        self._states: OrderedDict[str, _Request] = OrderedDict()
        self._trees: dict[str, Any] = {}  # tenant -> global index
        # global sequences in first-seen order: (tenant, sid) -> [tokens, request id or None]
        self._fifo: OrderedDict[tuple[str, int], list[Any]] = OrderedDict()
        self._owner: dict[tuple[str, int], str] = {}
        self._global_tokens = 0
        self._next_sid = 0
        self._version = 0  # bumped by every change of any index (keys the per-request draft cache)
        self.evicted = 0
        self.last_features: dict[str, SuffixFeatures] = {}

    def config(self) -> dict[str, Any]:
        """The constructor parameters (JSON values; ``tenant_of`` is left out): what a replay needs to
        rebuild this proposer (``SuffixProposer(**config)`` for ``scope="engine"``)."""
        return {
            "max_k": self.max_k,
            "max_depth": self.max_depth,
            "max_spec_factor": self.max_spec_factor,
            "max_spec_offset": self.max_spec_offset,
            "min_token_prob": self.min_token_prob,
            "token_budget": self.token_budget,
            "window": self.window,
            "local": self.local,
            "scope": self.scope,
            "max_states": self.max_states,
        }

    # -- request state -------------------------------------------------------------------------
    def _tenant(self, rid: str) -> str:
        if self.scope != "tenant":
            return ""
        try:
            f = self.tenant_of
            t = f.get(rid) if isinstance(f, Mapping) else f(rid)  # type: ignore[misc, operator]
        except Exception:
            return ""
        return "" if t is None else str(t)

    def _new_sid(self, tenant: str) -> int:
        while (tenant, self._next_sid) in self._fifo:
            self._next_sid = (self._next_sid + 1) & 0x7FFFFFFF
        sid = self._next_sid
        self._next_sid = (sid + 1) & 0x7FFFFFFF
        return sid

    def _start(self, rid: str, n: int) -> _Request:
        tenant = self._tenant(rid)
        local = None
        if self.local == "always" or (self.local == "fallback" and self.token_budget == 0):
            local = self._index_cls(self.max_depth)
            local.add(0)
        gsid, entry = None, None
        if self.token_budget > 0:
            gsid = self._new_sid(tenant)
            tree = self._trees.get(tenant)
            if tree is None:
                tree = self._trees[tenant] = self._index_cls(self.max_depth)
            tree.add(gsid)
            entry = self._fifo[(tenant, gsid)] = [0, rid]
        st = _Request(tenant, local, gsid, entry, max(0, n - self.window))
        self._states[rid] = st
        while len(self._states) > self.max_states:
            self._release(next(iter(self._states)))
        return st

    def _ingest(self, rid: str, request: ProposalRequest) -> tuple[_Request | None, np.ndarray]:
        """Index the tokens of ``request`` (id ``rid``) not seen before; returns its state (None:
        nothing to index) and its tokens."""
        toks = request.token_ids
        if type(toks) is not np.ndarray or toks.dtype != np.int64 or toks.ndim != 1:
            toks = as_tokens(toks)
        n = int(toks.shape[0])
        st = self._states.get(rid)
        if st is not None and (n < st.base + st.n or int(toks[st.base + st.n - 1]) != st.last):
            self._release(rid)  # a different history under the same id: start over
            st = None
        if st is None:
            if n == 0:
                return None, toks
            st = self._start(rid, n)
        else:
            self._states.move_to_end(rid)
        if st.base + st.n < n:
            new = toks[st.base + st.n :].tolist()
            if st.local is not None:
                st.local.extend(0, new)
            if st.gsid is not None:
                self._trees[st.tenant].extend(st.gsid, new)
                st.gentry[0] += len(new)  # type: ignore[index]
                self._global_tokens += len(new)
            st.n += len(new)
            st.last = new[-1]
            self._version += 1
        return st, toks

    def _evict(self) -> None:
        while self._global_tokens > self.token_budget and self._fifo:
            (tenant, sid), (ntok, rid) = self._fifo.popitem(last=False)
            tree = self._trees[tenant]
            st = self._states.get(rid) if rid is not None else None
            if st is not None and st.gsid == sid and st.tenant == tenant:
                st.gsid, st.gentry = None, None
                if st.local is None and self.local == "fallback":  # it goes on with its own text
                    st.local = self._index_cls(self.max_depth)
                    st.local.add(0)
                    st.local.extend(0, tree.text(sid))
            tree.remove(sid)
            self._global_tokens -= ntok
            self.evicted += 1
            self._version += 1
            if len(tree) == 0:
                del self._trees[tenant]

    def _release(self, rid: str) -> None:
        st = self._states.pop(rid, None)
        if st is None or st.gsid is None:
            return
        st.gentry[1] = None  # type: ignore[index]
        self._trees[st.tenant].finish(st.gsid)

    # -- drafting ------------------------------------------------------------------------------
    def _draft(self, st: _Request, cap: int, vocab: int) -> tuple[np.ndarray, SuffixFeatures]:
        c = st.cached
        if c is not None and c[0] == self._version and c[1] == cap:
            return c[2], c[3]
        args = (cap, self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
        best, source = _NO_DRAFT, ""
        if st.local is not None:
            best = st.local.draft(0, *args)
            source = "local"
        if st.gsid is not None and best.score < cap:  # (a score is at most the draft length)
            g = self._trees[st.tenant].draft(st.gsid, *args, best.score)
            if g.score > best.score:
                best, source = g, "global"
        toks = best.tokens[:cap]
        if toks and not all(0 <= t < vocab for t in toks):  # ids outside the vocabulary: cut there
            toks = clean_draft(np.asarray(toks, dtype=np.int64), cap, vocab).tolist()
        if not toks:
            d, f = EMPTY, NO_FEATURES
        else:
            d = np.array(toks, dtype=np.int64)
            p = best.probs[: len(toks)]
            score = best.score if len(p) == len(best.probs) else sum(p)
            probs = np.array(p, dtype=np.float64)
            f = SuffixFeatures(best.match_length, p[0], score, probs, source)
        st.cached = (self._version, cap, d, f)
        return d, f

    # -- interface -----------------------------------------------------------------------------
    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        """Suffix drafts per request (see the class docstring and :meth:`Proposer.propose`).

        All requests' new tokens are indexed first, then the budget is enforced, then every request
        drafts: a request's draft does not depend on its position in the batch.
        """
        kl = check_ks(requests, ks)
        rids = [str(r.req_id) for r in requests]
        with self._lock:
            seen = [self._ingest(rid, r) for rid, r in zip(rids, requests, strict=True)]
            self._evict()
            out: list[np.ndarray] = []
            feats: dict[str, SuffixFeatures] = {}
            states = self._states
            for r, rid, k, (st, toks) in zip(requests, rids, kl, seen, strict=True):
                m = r.max_new_tokens
                cap = (
                    max(0, min(k, self.max_k, m - 1))
                    if type(m) is int
                    else draft_cap(r, k, self.max_k)
                )
                d, f = EMPTY, NO_FEATURES
                # (a request id given twice with different histories: only the last one drafts)
                if (
                    st is not None
                    and cap > 0
                    and st.base + st.n == toks.shape[0]
                    and st is states.get(rid)
                    and int(toks[-1]) == st.last
                ):
                    v = r.vocab_size
                    d, f = self._draft(st, cap, v if type(v) is int else as_int(v))
                out.append(d)
                feats[rid] = f
            self.last_features = feats
        return out

    def features(self, request: ProposalRequest) -> SuffixFeatures:
        """Features of the draft this proposer offers ``request`` now (k = ``max_k``, cut to its
        budget); cached from the last :meth:`propose` when nothing changed. Indexes the request's new
        tokens like :meth:`propose`. Never raises on request content."""
        rid = str(request.req_id)
        m = request.max_new_tokens
        cap = (
            min(self.max_k, m - 1) if type(m) is int else draft_cap(request, self.max_k, self.max_k)
        )
        cap = max(cap, 0)
        with self._lock:
            st = self._states.get(rid)
            c = None if st is None else st.cached
            if c is not None and c[0] == self._version and c[1] == cap:
                # nothing changed since the draft was made, if the request's history did not either
                ids = request.token_ids
                if (
                    type(ids) is np.ndarray
                    and ids.ndim == 1
                    and ids.dtype.kind in "iu"
                    and ids.shape[0] == st.base + st.n  # type: ignore[union-attr]
                    and int(ids[-1]) == st.last  # type: ignore[union-attr]
                ):
                    return c[3]
            st, _ = self._ingest(rid, request)
            self._evict()
            if st is None or cap <= 0 or st is not self._states.get(rid):
                return NO_FEATURES
            return self._draft(st, cap, as_int(request.vocab_size))[1]

    def match_length(self, request: ProposalRequest) -> int:
        """Match length of the draft available now (:meth:`features`; 0 if none)."""
        return self.features(request).match_length

    def match_feature(self, request: ProposalRequest) -> int:
        """The controller's context feature: the estimated probability that the first draft token is
        accepted, in tenths (0..10; :meth:`features`)."""
        return int(10.0 * self.features(request).probability + 1e-9)

    def release(self, req_id: str) -> None:
        """Drop the request's local index; its text stays in the global index until evicted."""
        with self._lock:
            self._release(str(req_id))

    def stats(self) -> dict[str, int]:
        """Sizes: ``global_tokens`` (<= ``token_budget``), ``sequences``, ``tenants``, ``nodes`` (all
        indexes, local ones included), ``requests`` (with state), ``evicted`` (sequences so far)."""
        with self._lock:
            nodes = sum(t.num_nodes for t in self._trees.values())
            nodes += sum(s.local.num_nodes for s in self._states.values() if s.local is not None)
            return {
                "global_tokens": self._global_tokens,
                "sequences": len(self._fifo),
                "tenants": len(self._trees),
                "nodes": nodes,
                "requests": len(self._states),
                "evicted": self.evicted,
            }

    def __len__(self) -> int:
        """Number of requests with state."""
        return len(self._states)
