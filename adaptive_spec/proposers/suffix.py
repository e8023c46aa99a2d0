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

Each index is a depth-bounded suffix trie (:mod:`adaptive_spec.proposers.suffix_index`, which also
gives the drafting rule: ArcticInference's path speculation, each draft scored by the sum of its
per-position probability estimates).

With both indexes, the request's draft is the global one when its score is strictly higher than the
local one's, else the local one.

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
from .suffix_index import NO_DRAFT, ScanIndex, TrieIndex

SCOPES = ("engine", "tenant")
LOCAL_MODES = ("fallback", "always", "never")
BACKENDS = ("trie", "reference")
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
class _Request:
    tenant: str
    local: Any  # TrieIndex | ScanIndex | None
    gsid: int | None  # sequence id in the tenant's global index; None when not (or no longer) there
    gentry: list[Any] | None  # its first-seen-order entry: [tokens, request id]
    base: int  # history position of the first indexed token
    n: int = 0  # tokens indexed
    last: int = 0  # last token indexed
    cached: tuple[int, int, np.ndarray, SuffixFeatures, int] | None = (
        None  # (version, cap, draft, feats, vocab)
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
        self._index_cls = TrieIndex if backend == "trie" else ScanIndex
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
        if c is not None and c[0] == self._version and c[1] == cap and c[4] == vocab:
            return c[2], c[3]
        args = (cap, self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
        best, source = NO_DRAFT, ""
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
        st.cached = (self._version, cap, d, f, vocab)
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
