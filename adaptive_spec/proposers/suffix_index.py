"""The suffix index of the suffix proposer (:mod:`adaptive_spec.proposers.suffix`): token sequences
and the drafts their suffixes predict.

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

Conditional frequencies here count only occurrences that have a next token (ArcticInference divides
by all occurrences, including the one at the end of the context, which halves the first probability
of a continuation seen once).

:class:`TrieIndex` implements this; :class:`ScanIndex` is its brute-force reference (the same drafts,
for tests), written independently of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_MASK = 0xFFFFFFFF


@dataclass(slots=True)
class Draft:
    """One index's draft for a sequence.

    Attributes
    ----------
    tokens : list of int
        The draft tokens.
    probs : list of float
        Per token, the estimated probability that the draft up to it is accepted (non-increasing).
    score : float
        ``sum(probs)``: the estimated expected number of accepted draft tokens.
    match_length : int
        Tokens of the context's suffix the draft continues.
    """

    tokens: list[int]
    probs: list[float]
    score: float
    match_length: int


NO_DRAFT = Draft([], [], 0.0, 0)


def spec_budget(m: int, k: int, factor: float, offset: float) -> int:
    """Draft tokens allowed after a match of ``m`` tokens (ArcticInference's ``max_spec_factor``)."""
    return max(0, min(k, int(m * factor + offset + 1e-6)))


class TrieIndex:
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
    ) -> Draft:
        """Best draft for the active sequence ``sid`` whose score is above ``beat`` (else none).

        Same result as trying every match length in increasing order and keeping the best score
        (ties: the longer match); here the longest match is tried first, and a shorter one is skipped
        when ``budget x its first probability`` (an upper bound of its score: probabilities never
        increase along a draft) cannot beat the best so far, and the search stops when no shorter
        match's budget can.
        """
        act = self._act.get(sid)
        if act is None or k <= 0:
            return NO_DRAFT
        depth = self.depth
        cont, bcnt = self._cont, self._bcnt
        h = 0  # longest match with a continuation
        for m in range(1, min(len(act) - 1, depth - 1) + 1):
            u = act[-1 - m]
            if u < 0 or cont[u] == 0:
                break  # only this occurrence: no longer suffix has a continuation either
            h = m
        best = NO_DRAFT
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

    def _expand(self, u: int, m: int, budget: int, min_prob: float) -> Draft:
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
        return Draft(toks, probs, score, m)


class ScanIndex:
    """The reference: the same drafts as :class:`TrieIndex` by brute force over the stored text.

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
    ) -> Draft:
        """Every match length in increasing order, each drafted greedily; the best score wins (ties:
        the longer match) if it is above ``beat``."""
        if sid not in self.active or k <= 0:
            return NO_DRAFT
        ctx = self._text[sid]
        best = NO_DRAFT
        for m in range(1, min(len(ctx), self.depth - 1) + 1):
            pattern = ctx[len(ctx) - m :]
            if not self.next_counts(pattern):
                break
            toks: list[int] = []
            probs: list[float] = []
            score, prob = 0.0, 1.0
            while len(toks) < spec_budget(m, k, factor, offset) and len(pattern) < self.depth:
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
                best = Draft(toks, probs, score, m)
        return best if best.score > beat else NO_DRAFT
