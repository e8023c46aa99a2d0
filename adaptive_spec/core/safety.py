"""The safety rule: deviate from a baseline only while the run stays within (1 - alpha) of it.

Conservative bandits (Wu et al., "Conservative Bandits", ICML 2016; Kazerouni et al., "Conservative
Contextual Linear Bandits", NeurIPS 2017) keep a learner's cumulative reward above ``(1 - alpha)``
times a known baseline's by playing the baseline whenever a lower confidence bound on the learner's
cumulative reward, including the action it is about to take, would fall below that line. Here the
reward is goodput, so the constraint is on committed tokens and step time::

    N + n_next  >=  (1 - alpha) * G_b * (T + t_next)

where ``N`` and ``T`` are the tokens the run committed and the time it took (measured, not
predicted), ``G_b`` is the **baseline's goodput on the same steps**, and ``n_next`` / ``t_next`` are a
lower bound on the next step's tokens and an upper bound on its time under the controller's
decision. The slack ``S = N - (1 - alpha) G_b T`` is a budget in tokens: playing the baseline adds
about ``alpha`` times its tokens to it, a deviation that pays adds more, one that loses spends it.

``G_b`` is not guessed: for a deterministic baseline proposer (n-gram lookup) the baseline's draft at
every step is known, and what it would have committed follows from the tokens the target committed
afterwards (the longest common prefix of its draft with them, plus the bonus token): under greedy
decoding exactly, under sampling unbiasedly (a one-hot draft token is accepted with the probability
that the target samples it). :class:`BaselineTracker` resolves these counterfactuals a few steps
later, once the tokens are known. The baseline's time on a step is the measured time plus the cost
table's difference between its draft tokens and the played ones, with a static arm's controller time
in place of the controller's own (:mod:`adaptive_spec.core.controller_cost`). That own time is paid
whichever decision is played; where it makes playing the baseline's decision lose slack too, a
deviation is allowed when its bounds make it no worse than the baseline's decision
(:meth:`ConservativeGuard.allows`).
"""

from __future__ import annotations

import math

import numpy as np

from adaptive_spec.core import controller_kernels as kern
from adaptive_spec.core.controller_kernels import Committed, Decided, Pending, Records, Tracked

_NO_FINISHED = np.zeros(0, dtype=np.bool_)
#: Decision records kept (row ``step % RECORDS``): a record still open this many decisions later is
#: dropped (its step time never came).
RECORDS = 4096


def _resolved_total(column: int, doc: str) -> property:
    """A read-only float view of one of a guard's ``resolved`` totals."""
    return property(lambda self: float(self.resolved[column]), doc=doc)


class ConservativeGuard:
    """Budget of a conservative controller against a baseline (see the module docstring).

    Parameters
    ----------
    alpha : float in [0, 1)
        Allowed shortfall: cumulative goodput is kept >= ``(1 - alpha)`` x the baseline's.

    Raises
    ------
    ValueError
        For ``alpha`` outside [0, 1).
    """

    def __init__(self, alpha: float = 0.02) -> None:
        if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
            raise ValueError(f"alpha={alpha!r} is invalid; allowed: 0 <= alpha < 1")
        self.alpha = float(alpha)
        self.tokens = 0.0  # N: committed by the run
        self.time_s = 0.0  # T: measured
        # On the resolved steps: the baseline's tokens and time, the run's tokens and time (float64
        # [4], summed in place by the compiled observation).
        self.resolved = np.zeros(4)
        self.deviations = 0
        self.refusals = 0
        self.probes = 0

    base_tokens = _resolved_total(0, "Baseline tokens on the resolved steps.")
    base_time_s = _resolved_total(1, "Baseline time on the resolved steps (s).")
    run_tokens_resolved = _resolved_total(2, "The run's tokens on the resolved steps.")
    run_time_resolved = _resolved_total(3, "The run's time on the resolved steps (s).")

    def baseline_goodput(self, fallback: float) -> float:
        """The baseline's goodput on the resolved steps (tokens/s), ``fallback`` before any."""
        tokens, time_s = self.resolved[0], self.resolved[1]
        if time_s > 0 and tokens > 0:
            return float(tokens / time_s)
        return fallback

    def slack(self, fallback_goodput: float) -> float:
        """``S = N - (1 - alpha) G_b T`` in tokens."""
        return (
            self.tokens - (1.0 - self.alpha) * self.baseline_goodput(fallback_goodput) * self.time_s
        )

    def allows(
        self,
        tokens_lcb: float,
        time_ucb: float,
        fallback_goodput: float,
        baseline_step: tuple[float, float] | None = None,
    ) -> bool:
        """Whether a deviation with at least ``tokens_lcb`` tokens in at most ``time_ucb`` seconds
        keeps the constraint.

        ``baseline_step``: the tokens and time (s) expected of the baseline's decision on this step
        when this controller plays it. Where playing it would lose slack too (the controller's own
        time beyond a static arm's, charged to the baseline, exceeds what ``alpha`` allows), the
        constraint cannot be restored by playing it; the deviation is then allowed when its slack
        change, from the bounds, is no worse than the baseline decision's expected one."""
        g = self.baseline_goodput(fallback_goodput)
        change = tokens_lcb - (1.0 - self.alpha) * g * time_ucb
        ok = self.slack(fallback_goodput) + change >= 0.0
        if not ok and baseline_step is not None:
            base_change = baseline_step[0] - (1.0 - self.alpha) * g * baseline_step[1]
            ok = base_change < 0.0 and change >= base_change
        if ok:
            self.deviations += 1
        else:
            self.refusals += 1
        return ok

    def add_step(self, tokens: float, time_s: float) -> None:
        """Count one measured step of the run."""
        if math.isfinite(time_s) and time_s > 0:
            self.tokens += tokens
            self.time_s += time_s

    def add_resolved(
        self, base_tokens: float, base_time_s: float, run_tokens: float, run_time_s: float
    ) -> None:
        """Count one step whose baseline counterfactual is fully resolved
        (:func:`adaptive_spec.core.controller_kernels.guard_add_resolved`)."""
        kern.guard_add_resolved(self.resolved, base_tokens, base_time_s, run_tokens, run_time_s)

    def ratio(self) -> float | None:
        """The run's goodput over the baseline's, on the resolved steps (None before any)."""
        if self.base_tokens <= 0 or self.run_time_resolved <= 0 or self.base_time_s <= 0:
            return None
        return (self.run_tokens_resolved / self.run_time_resolved) / (
            self.base_tokens / self.base_time_s
        )

    def as_dict(self) -> dict[str, float | int | None]:
        r = self.ratio()
        return {
            "alpha": self.alpha,
            "goodput_vs_baseline": None if r is None else round(r, 4),
            "deviations": self.deviations,
            "refusals": self.refusals,
            "probes": self.probes,
            "resolved_run_tokens": round(self.run_tokens_resolved, 1),
        }


class BaselineTracker:
    """Resolves the baseline's counterfactual tokens per request and step.

    Each decision registers, per request, the baseline's draft (int64, up to ``max_k``) at that
    request's output position; each observation appends the tokens the request committed. A pending
    draft is resolved once the committed tokens decide it: at its first mismatch, once ``k + 1``
    tokens are known (all ``k`` accepted plus the bonus), or when the request finishes (the baseline
    could not have emitted past the end). A step is resolved when all its requests are.

    Parameters
    ----------
    max_k : int
        Longest baseline draft.
    history : int
        Committed tokens remembered per request (must exceed ``max_k + 1``).
    """

    def __init__(self, max_k: int, history: int = 64) -> None:
        if history <= max_k + 1:
            raise ValueError(f"history={history} is invalid; allowed: > max_k + 1 = {max_k + 1}")
        self.K = max_k
        self.H = history
        # Tokens committed per slot: the last ``history`` in a ring, and how many (absolute).
        self.committed = Committed(
            np.zeros((16, history), dtype=np.int64), np.zeros(16, dtype=np.int64)
        )
        # Pending drafts: the first ``n_pending`` rows of these arrays (grown by doubling).
        self.n_pending = 0
        self._alloc_pending(64)
        # Per decision, row ``step % RECORDS``: [baseline tokens so far, unresolved drafts, baseline
        # time, run tokens, run time] (:func:`adaptive_spec.core.controller_kernels.records_open`).
        self.records = Records(
            np.zeros((RECORDS, 5)),
            np.full(RECORDS, -1, dtype=np.int64),
            np.zeros(2, dtype=np.int64),
        )

    @property
    def ring(self) -> np.ndarray:
        """The last ``history`` committed tokens per slot, int64 [slots, history]."""
        return self.committed.ring

    @property
    def length(self) -> np.ndarray:
        """Tokens committed per slot (absolute output position), int64 [slots]."""
        return self.committed.length

    def tracked(self, resolved: np.ndarray) -> Tracked:
        """The arrays an observation updates in place, with a guard's ``resolved`` totals."""
        return Tracked(self.committed, self.pending_drafts, self.records, resolved)

    def record(self, step: int) -> list[float] | None:
        """The open record of decision ``step`` (a copy), None when it has none."""
        i = step % RECORDS
        rec, rec_step, _ = self.records
        return rec[i].tolist() if rec_step[i] == step else None

    def open_steps(self) -> int:
        """Decisions whose records are still open."""
        return int(np.count_nonzero(self.records.step >= 0))  # a closed or dropped row holds -1

    def _alloc_pending(self, capacity: int) -> None:
        n = self.n_pending
        old = self.pending_drafts if n else ()
        self.pending_drafts = Pending(
            *(np.zeros(capacity, dtype=np.int64) for _ in range(4)),
            np.zeros((capacity, self.K), dtype=np.int64),
        )
        for new, prev in zip(self.pending_drafts, old, strict=False):
            new[:n] = prev[:n]

    def _reserve(self, count: int) -> None:
        """Room for ``count`` more pending drafts (the arrays grow by doubling)."""
        need = self.n_pending + count
        if need > self.pending_drafts.slot.shape[0]:
            self._alloc_pending(max(need, 2 * self.pending_drafts.slot.shape[0]))

    def ensure(self, n_slots: int) -> None:
        """Room for ``n_slots`` slots (the ring and the lengths grow by doubling, keeping theirs)."""
        ring, length = self.committed
        if n_slots > ring.shape[0]:
            grow = max(n_slots, 2 * ring.shape[0])
            new = Committed(
                np.zeros((grow, self.H), dtype=np.int64), np.zeros(grow, dtype=np.int64)
            )
            new.ring[: ring.shape[0]] = ring
            new.length[: length.shape[0]] = length
            self.committed = new

    def reset_slot(self, slot: int, position: int) -> None:
        """A slot (re)starts at output position ``position``; its pending drafts are dropped."""
        self.ensure(slot + 1)
        self.length[slot] = position
        n = self.n_pending
        pend = self.pending_drafts
        drop = pend.slot[:n] == slot
        if drop.any():
            rec, rec_step, _ = self.records
            for s in np.unique(pend.step[:n][drop]).tolist():
                i = s % RECORDS
                if rec_step[i] == s:
                    rec[i, 1] -= int((drop & (pend.step[:n] == s)).sum())
            keep = np.flatnonzero(~drop)
            m = keep.size
            for arr in pend:
                arr[:m] = arr[keep]
            self.n_pending = m

    def add_drafts(
        self,
        step: int,
        slots: np.ndarray,
        positions: np.ndarray,
        drafts: np.ndarray,
        ks: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> None:
        """Register the baseline's drafts of one decision for the requests that played something
        else: ``drafts`` int64 [n, >= max(ks)] (first ``ks`` valid), at output ``positions`` of
        ``slots``; ``rows`` (bool [n], default all) selects the requests to register (the others'
        baseline tokens are their own, given to :meth:`set_step_times`)."""
        n = len(slots)
        sel = np.ones(n, dtype=np.bool_) if rows is None else rows
        count = int(sel.sum()) if n else 0
        kern.records_open(self.records, step, count)
        if count == 0:
            return
        self._reserve(count)
        self.n_pending = kern.tracker_add(
            self.pending_drafts,
            self.n_pending,
            step,
            np.ascontiguousarray(slots, dtype=np.int64),
            np.ascontiguousarray(positions, dtype=np.int64),
            np.ascontiguousarray(drafts, dtype=np.int64),
            np.ascontiguousarray(ks, dtype=np.int64),
            np.ascontiguousarray(sel, dtype=np.bool_),
        )

    def register(
        self, step: int, decided: Decided, base_proposer: int, all_same: bool
    ) -> np.ndarray:
        """Register one decision (:func:`adaptive_spec.core.controller_kernels.register_baseline`): the
        baseline's drafts of the requests whose played arm (``decided.ks``, ``decided.choice``)
        differs from the baseline's (``decided.kb`` tokens of proposer index ``base_proposer``, -1:
        none), none when ``all_same``. Returns ``same`` bool [n]: the rows whose tokens are the
        baseline's (the others are registered)."""
        self._reserve(len(decided.slots))
        self.n_pending, count, same = kern.register_baseline(
            self.pending_drafts, self.n_pending, step, decided, base_proposer, all_same
        )
        kern.records_open(self.records, step, count)
        return same

    def set_step_times(
        self,
        step: int,
        base_time_s: float,
        run_tokens: float,
        run_time_s: float,
        base_tokens_known: float = 0.0,
    ) -> None:
        """Complete a step's record: the baseline's time on it, the run's tokens and time, and the
        baseline tokens already known (requests that played the baseline's own arm)."""
        i = step % RECORDS
        if self.records.step[i] == step:
            rec = self.records.rec[i]
            rec[0] += base_tokens_known
            rec[2], rec[3], rec[4] = base_time_s, run_tokens, run_time_s

    def commit(self, slots: np.ndarray, tokens: list[np.ndarray]) -> None:
        """Append committed tokens per slot."""
        if len(slots) == 0:
            return
        lens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        flat = np.concatenate(tokens).astype(np.int64, copy=False) if lens.sum() else None
        self.commit_flat(np.asarray(slots), lens, flat)

    def commit_flat(self, slots: np.ndarray, lens: np.ndarray, flat: np.ndarray | None) -> None:
        """Append committed tokens: ``flat`` holds ``lens[i]`` tokens for ``slots[i]``, in order."""
        if flat is None or flat.size == 0:
            return
        kern.tracker_commit(
            self.committed,
            np.ascontiguousarray(slots, dtype=np.int64),
            np.ascontiguousarray(lens, dtype=np.int64),
            np.ascontiguousarray(flat, dtype=np.int64),
        )

    def resolve(
        self, finished: np.ndarray | None = None, into: np.ndarray | None = None
    ) -> list[tuple[int, list[float]]]:
        """Resolve what the committed tokens decide. ``finished``: bool per slot (those requests
        emit nothing more); ``into``: a guard's ``resolved`` array (float64 [4]) that the completed
        steps are counted into (:meth:`ConservativeGuard.add_resolved`). Returns the steps completed
        now as ``(step, [baseline tokens, unresolved drafts (<= 0), baseline time, run tokens, run
        time])``, oldest first."""
        if self.n_pending:
            fin = _NO_FINISHED if finished is None else np.ascontiguousarray(finished, np.bool_)
            self.n_pending, steps, emitted = kern.tracker_resolve(
                self.committed, self.pending_drafts, self.n_pending, fin
            )
            kern.records_resolve(self.records, steps, emitted)
        return self.complete(into)

    def complete(self, into: np.ndarray | None = None) -> list[tuple[int, list[float]]]:
        """Close the complete records (:func:`adaptive_spec.core.controller_kernels.records_complete`),
        counted into ``into`` when given; returned as in :meth:`resolve`."""
        acc = np.zeros(4) if into is None else into
        done = kern.records_complete(self.records, acc)
        rec = self.records.rec
        return [(s, rec[s % RECORDS].tolist()) for s in done.tolist()]

    def pending(self) -> int:
        """Pending baseline drafts (registered, not yet resolved)."""
        return self.n_pending
