"""Jacobi / lookahead proposer: the target's own predictions from the last step as the draft.

Jacobi decoding (Santilli et al. 2023) reuses the target's greedy predictions past the first
rejected position of the previous verification as the next guess (the *iterate*); lookahead
decoding (Fu et al. 2024) adds a pool of n-grams harvested from the Jacobi trajectories. This
proposer needs no model of its own: only what verification returned at the previous step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._fastpath import jacobi_next_np, lookahead_ngrams_np, pool_lookup_np, pool_update_np
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

INITS = ("repeat", "none")


@dataclass(slots=True)
class _State:
    pool: np.ndarray  # int64 [C, N], -1 = empty
    ptr: int = 0
    sync_key: tuple = ()  # what the last update was computed from
    iterate: np.ndarray = field(default_factory=lambda: EMPTY)
    iterate_start: int = -1  # absolute position of iterate[0]
    trajectory: deque = field(
        default_factory=deque
    )  # (start, draft) of the last N - 2 verified drafts


class JacobiProposer(Proposer):
    """Jacobi iterate completed by a lookahead n-gram pool (Santilli et al. 2023; Fu et al. 2024).

    Per request and step (state is updated once per step, from the request's
    ``last_draft`` / ``last_target_argmax`` / ``last_accepted``):

    1. **Iterate.** The Jacobi step of :func:`adaptive_spec.kernels.jacobi_step` on the previous
       step's verification: ``last_target_argmax[a + 1:]``, a = accepted prefix; it starts right
       after the last committed token.
    2. **Pool update.** The n-grams along the trajectory's diagonals (the last ``ngram - 2``
       verified drafts, the newest draft and the target's predictions, aligned by absolute
       position; :func:`~adaptive_spec.kernels.lookahead_ngrams`) go into the request's pool of
       ``pool_size`` distinct n-grams (ring eviction; :func:`~adaptive_spec.kernels.lookahead_pool_update`).
    3. **Pool candidate.** Chained lookups keyed on the last committed token: the continuation of
       the newest n-gram starting with it, then keyed on that continuation's last token, and so
       on, up to k tokens.
    4. **Choice.** The pool candidate when there is one, else the iterate; then completed to k
       tokens by chained pool lookups keyed on its last token. The pool candidate is the better
       one: it starts from the target's own last token, while every token of the iterate was
       predicted after the *rejected* draft token (this is also why lookahead decoding verifies
       pool n-grams rather than the iterate). The iterate is Jacobi's fallback when the pool has
       nothing for that token.
    5. **Initial guess** (no iterate, no pool hit, e.g. the first step or after a k = 0 step):
       with ``init="repeat"`` the last committed token repeated k times. Its verification costs
       one step of k extra positions but yields the target's predictions, i.e. the first
       iterate: without a guess Jacobi decoding never starts. ``init="none"`` returns an empty
       draft instead.

    Parameters
    ----------
    max_k : int
        Longest draft, 0..128.
    pool_size : int
        n-grams kept per request, 1..4096.
    ngram : int
        N of the pool's n-grams (key token + N - 1 continuation tokens), 2..16.
    init : {"repeat", "none"}
        Initial guess when there is no candidate (see 5.).
    max_states : int
        Per-request states kept at most (least recently used dropped first), >= 1, a guard for
        callers that never call :meth:`release`.

    Raises
    ------
    ValueError
        Invalid configuration (the message names the parameter, its value and the allowed range).

    Examples
    --------
    >>> import numpy as np
    >>> p = JacobiProposer(max_k=4)
    >>> # previous step: context [1], draft [3, 9, 9, 9]; the target accepted 3 and corrected to 4
    >>> r = ProposalRequest("a", np.array([1, 3, 4]), max_new_tokens=50, vocab_size=100,
    ...                     last_draft=np.array([3, 9, 9, 9]),
    ...                     last_target_argmax=np.array([3, 4, 5, 6, 7]), last_accepted=1)
    >>> p.propose([r], [4])[0].tolist()  # the Jacobi iterate: predictions past the rejection
    [5, 6, 7]
    """

    name = "jacobi"

    def __init__(
        self,
        max_k: int = 8,
        pool_size: int = 64,
        ngram: int = 3,
        init: str = "repeat",
        max_states: int = 4096,
    ) -> None:
        self.max_k = check_max_k(max_k)
        if (
            isinstance(pool_size, bool)
            or not isinstance(pool_size, int)
            or not 1 <= pool_size <= 4096
        ):
            raise ValueError(f"pool_size={pool_size!r}; expected an int in [1, 4096]")
        if isinstance(ngram, bool) or not isinstance(ngram, int) or not 2 <= ngram <= 16:
            raise ValueError(f"ngram={ngram!r}; expected an int in [2, 16]")
        if init not in INITS:
            raise ValueError(f"init={init!r}; allowed: {INITS}")
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
            raise ValueError(f"max_states={max_states!r}; expected an int >= 1")
        self.pool_size = pool_size
        self.ngram = ngram
        self.init = init
        self.max_states = max_states
        self._states: OrderedDict[str, _State] = OrderedDict()

    # -- state -------------------------------------------------------------------------------
    def _state(self, req_id: str) -> _State:
        st = self._states.get(req_id)
        if st is None:
            st = _State(pool=np.full((self.pool_size, self.ngram), -1, dtype=np.int64))
            self._states[req_id] = st
            while len(self._states) > self.max_states:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(req_id)
        return st

    def _sync(self, request: ProposalRequest, toks: np.ndarray) -> _State:
        """Apply the previous step's verification to the request's state (once per step)."""
        st = self._state(str(request.req_id))
        n = toks.shape[0]
        z = as_tokens(request.last_target_argmax)
        y = as_tokens(request.last_draft)
        key = (n, int(toks[-1]) if n else -1, z.tobytes(), y.tobytes(), request.last_accepted)
        if st.sync_key == key:
            return st
        st.sync_key = key
        st.iterate, st.iterate_start = EMPTY, -1
        if z.shape[0] == 0:
            return st
        k_prev = min(y.shape[0], z.shape[0] - 1)
        y, z = y[:k_prev], z[: k_prev + 1]
        a, nxt = jacobi_next_np(y, z, max(0, as_int(request.last_accepted)))
        start = n - (a + 1)  # absolute position of y[0]
        if start < 0:
            return st
        st.iterate, st.iterate_start = nxt, n
        if k_prev > 0:
            self._update_pool(st, start, y, z)
        return st

    def _update_pool(self, st: _State, start: int, y: np.ndarray, z: np.ndarray) -> None:
        levels = self.ngram - 1
        rows = [*st.trajectory, (start, y)][-levels:]
        base = start - (levels - 1)
        width = start + z.shape[0] - base
        grid = np.full((levels, width), -1, dtype=np.int64)
        # oldest first; missing levels (fewer past drafts than N - 2) stay unknown
        for r, (s0, tok) in enumerate(rows, start=levels - len(rows)):
            lo = max(s0, base)
            hi = min(s0 + tok.shape[0], base + width)
            if hi > lo:
                grid[r, lo - base : hi - base] = tok[lo - s0 : hi - s0]
        pred = np.full(width, -1, dtype=np.int64)
        pred[start - base :] = z
        st.ptr = pool_update_np(st.pool, st.ptr, lookahead_ngrams_np(grid, pred))
        if self.ngram > 2:
            st.trajectory.append((start, y.copy()))
            while len(st.trajectory) > self.ngram - 2:
                st.trajectory.popleft()

    # -- candidates ----------------------------------------------------------------------------
    def _chain(self, st: _State, key: int, limit: int) -> list[int]:
        out: list[int] = []
        while len(out) < limit:
            cont = pool_lookup_np(st.pool, st.ptr, key)
            if cont is None:
                break
            out.extend(int(t) for t in cont[: limit - len(out)])
            key = out[-1]
        return out

    def _candidate(self, st: _State, toks: np.ndarray, cap: int) -> np.ndarray:
        if cap <= 0 or toks.shape[0] == 0:
            return EMPTY
        base = self._chain(st, int(toks[-1]), cap)
        if not base and st.iterate_start == toks.shape[0]:
            base = [int(t) for t in st.iterate[:cap]]
        if base and len(base) < cap:
            base += self._chain(st, base[-1], cap - len(base))
        return np.asarray(base, dtype=np.int64) if base else EMPTY

    # -- interface -----------------------------------------------------------------------------
    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        """Jacobi/lookahead drafts per request (see the class docstring and :meth:`Proposer.propose`)."""
        kl = check_ks(requests, ks)
        out = []
        for r, k in zip(requests, kl, strict=True):
            toks = as_tokens(r.token_ids)
            cap = draft_cap(r, k, self.max_k)
            st = self._sync(r, toks)
            draft = self._candidate(st, toks, cap)
            if draft.shape[0] == 0 and cap > 0 and self.init == "repeat" and toks.shape[0]:
                draft = np.full(cap, toks[-1], dtype=np.int64)
            out.append(clean_draft(draft, cap, as_int(r.vocab_size)))
        return out

    def match_length(self, request: ProposalRequest) -> int:
        """Length of the iterate/pool candidate available now (the initial guess counts 0)."""
        toks = as_tokens(request.token_ids)
        st = self._sync(request, toks)
        cap = draft_cap(request, self.max_k, self.max_k)
        return int(
            clean_draft(self._candidate(st, toks, cap), cap, as_int(request.vocab_size)).shape[0]
        )

    def release(self, req_id: str) -> None:
        """Drop the request's iterate, trajectory and pool."""
        self._states.pop(str(req_id), None)

    def __len__(self) -> int:
        """Number of requests with state."""
        return len(self._states)
