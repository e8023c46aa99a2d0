"""Data-parallel replicas in replay: a workload split between N controllers that may share what they learn.

A data-parallel server runs N engine replicas, each with its own controller; with a shared state file
every replica pushes what it learned since its previous save and pulls what the others pushed
(:func:`adaptive_spec.core.state.sync_policy_state` under a file lock, then ``policy.add_learning``),
every ``save_every_s`` seconds and whenever it goes idle (``adaptive_spec/vllm/plugin/runtime.py``).
:func:`run_replicas` replays that:

* the requests are dealt round-robin by arrival (request ``j`` in arrival order goes to replica
  ``j mod N``), and each replica replays its share with its own policy
  (:class:`~adaptive_spec.sim.replay.ReplayRun`, the engine's step code), each on its own simulated
  clock; the replica whose clock is earliest steps next, so the replicas advance side by side;
* sharing replicas sync through the real :func:`~adaptive_spec.core.state.sync_policy_state` on one
  state file in a temporary directory, with the runtime's bookkeeping (:class:`SharedState`): after
  every ``sync_every`` of its requests completed, or every ``sync_every_s`` simulated seconds, and
  whenever it has no request left running. The pull is taken in at once (the runtime takes it in
  after the engine's next step: one step later);
* every replica's learned acceptance (its acceptance model's posterior means, [cells, max_k]) is kept
  after each of its completed requests, and its own observations (judged draft positions, not
  discounted) are counted step by step.

:func:`replica_study` runs one server over all requests, N sharing replicas and N replicas that do not
share, and measures the learned acceptance of each against the single server's after all requests:
the error is the mean absolute difference of the learned acceptance over proposers and positions,
weighted by the single server's judged positions there (:func:`acceptance_error`); a configuration
*reaches* a tolerance after ``n`` requests per replica when, from ``n`` on, every replica's error is
within it (:func:`reach`). One server over the same requests in the reverse order gives the error
that the order of the requests alone makes (the *order floor*): a tolerance below it asks for more
than the trace can tell. The learned acceptance compared is per proposer and position: each
proposer's posterior means averaged over the context cells with the single server's judged positions
(:func:`per_position`); the context cells themselves are too sparse on a trace of tens of requests
for a cell-by-cell comparison to say more than which cells each run happened to visit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.core.acceptance import AcceptanceModel
from adaptive_spec.core.protocol import SpecPolicy
from adaptive_spec.core.state import (
    combine_states,
    has_nonzero,
    policy_state_json,
    read_state_part,
    sync_policy_state,
)

from .cost_profiles import CostProfile
from .replay import ReplayResult, ReplayRun
from .requests import ReplayRequest

#: Default sync interval (simulated seconds): the serve runtime's default ``save_every_s``.
DEFAULT_SYNC_EVERY_S = 10.0


def split_round_robin(requests: Sequence[ReplayRequest], n: int) -> list[list[ReplayRequest]]:
    """Deal ``requests`` to ``n`` replicas by arrival (stable-sorted by ``arrival_s``): the ``j``-th
    to arrive goes to replica ``j mod n``. Raises ValueError unless ``1 <= n <= len(requests)``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(requests):
        raise ValueError(
            f"n_replicas={n!r} is invalid; allowed: an integer from 1 to the number of requests "
            f"({len(requests)})"
        )
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    shares: list[list[ReplayRequest]] = [[] for _ in range(n)]
    for j, i in enumerate(order):
        shares[j % n].append(requests[i])
    return shares


def reverse_order(requests: Sequence[ReplayRequest]) -> list[ReplayRequest]:
    """The same requests arriving in the reverse order (copies; arrival times mirrored, ``t`` ->
    ``max - t``, so that the last to arrive comes first)."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    last = max((r.arrival_s for r in requests), default=0.0)
    return [
        dataclasses.replace(requests[i], arrival_s=last - requests[i].arrival_s)
        for i in reversed(order)
    ]


def _state(policy: SpecPolicy) -> dict[str, Any]:
    return json.loads(policy_state_json(policy))["state"]


class SharedState:
    """One replica's side of a shared state file, with the serve runtime's bookkeeping
    (``ServeRuntime._write_state`` / ``_take_pull``) run synchronously.

    ``own_base``: what this replica had learned itself at its previous sync (its start state before
    the first); ``pulled``: everything it took in from the others; ``file_seen``: the file's state
    at its previous sync. A sync pushes ``state - (own_base + pulled)`` (its own learning since) and
    adds ``file - file_seen`` (the others' pushes since) to the policy.

    Parameters
    ----------
    policy : SpecPolicy
        A fresh policy (nothing loaded from the file: the replicas start together).
    path : Path
        The shared state file.
    """

    def __init__(self, policy: SpecPolicy, path: Path) -> None:
        self.policy = policy
        self.path = Path(path)
        self.own_base: dict[str, Any] = _state(policy)
        self.file_seen: dict[str, Any] = self.own_base
        self.pulled: dict[str, Any] | None = None
        self.syncs = 0
        self.pulls = 0

    def sync(self) -> None:
        """Push this replica's learning to the file and take in the others' (raises OSError when the
        file cannot be written)."""
        pulled = self.pulled
        base = self.own_base if pulled is None else combine_states(self.own_base, pulled, +1)
        result = sync_policy_state(policy_state_json(self.policy), self.path, base, self.file_seen)
        self.own_base = result.mine if pulled is None else combine_states(result.mine, pulled, -1)
        self.file_seen = result.merged
        self.syncs += 1
        if result.others is None or not has_nonzero(result.others):
            return
        before = _state(self.policy)
        if not self.policy.add_learning(result.others):
            return
        applied = combine_states(_state(self.policy), before, -1)  # what it took in (counts >= 0)
        self.pulled = applied if pulled is None else combine_states(pulled, applied, +1)
        self.pulls += 1


@dataclass
class ReplicasRun:
    """What :func:`run_replicas` measured.

    Attributes
    ----------
    n_replicas : int
    sharing : bool
    results : list of ReplayResult
        Per replica.
    policies : list of SpecPolicy
        Per replica, as they ended.
    tables : list of list of numpy.ndarray
        ``tables[i][n]``: replica ``i``'s posterior-mean acceptance, float64 [cells, max_k], after it
        had completed ``n`` of its requests (``n = 0``: at the start).
    observed_trials, observed_accepts : list of numpy.ndarray
        Per replica, its own judged draft positions and accepted ones per cell and position
        (float64 [cells, max_k], whole numbers; not discounted, pulls excluded).
    syncs, pulls : list of int
        Per replica: merges into the shared file, and merges that brought the others' learning in.
    file_state : dict or None
        The shared file's ``state`` part at the end (None without sharing).
    makespan_s : float
        Simulated seconds until the last replica finished.
    """

    n_replicas: int
    sharing: bool
    results: list[ReplayResult]
    policies: list[SpecPolicy]
    tables: list[list[np.ndarray]]
    observed_trials: list[np.ndarray]
    observed_accepts: list[np.ndarray]
    syncs: list[int] = field(default_factory=list)
    pulls: list[int] = field(default_factory=list)
    file_state: dict[str, Any] | None = None
    makespan_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens, all replicas."""
        d = sum(r.drafted for r in self.results)
        return sum(r.accepted for r in self.results) / d if d else 0.0

    @property
    def goodput(self) -> float:
        """Committed tokens of all replicas per simulated second until the last one finished."""
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def _acceptance(policy: SpecPolicy) -> AcceptanceModel:
    acc = getattr(policy, "acceptance", None)
    if not isinstance(acc, AcceptanceModel):
        raise ValueError(
            f"policy {getattr(policy, 'name', policy)!r} has no learned acceptance (an "
            "AcceptanceModel); allowed: the adaptive controllers (adaptive, adaptive-ucb, ...)"
        )
    return acc


def run_replicas(
    requests: Sequence[ReplayRequest],
    make_policy: Callable[[int], SpecPolicy],
    profile: CostProfile,
    *,
    n_replicas: int,
    max_batch: int,
    share: bool,
    sync_every: int | None = None,
    sync_every_s: float | None = DEFAULT_SYNC_EVERY_S,
    proposers: list[str] | None = None,
    state_dir: str | Path | None = None,
) -> ReplicasRun:
    """Replay ``requests`` split between ``n_replicas`` replicas (see the module docstring).

    Parameters
    ----------
    requests : sequence of ReplayRequest
    make_policy : callable
        ``make_policy(i)``: replica ``i``'s fresh policy (with an acceptance model).
    profile : CostProfile
    n_replicas : int, 1 <= n_replicas <= len(requests)
    max_batch : int >= 1
        Each replica's largest batch.
    share : bool
        Whether the replicas sync through a shared state file.
    sync_every : int >= 1, optional
        Sync after every this many requests completed by a replica (instead of by time).
    sync_every_s : float > 0, optional
        Sync when this many simulated seconds of a replica's clock passed since its previous sync
        (used when ``sync_every`` is None).
    proposers : list of str, optional
        As :func:`~adaptive_spec.sim.replay.replay`.
    state_dir : path, optional
        Directory of the shared state file ``policy.json`` (default: a temporary directory, removed).

    Raises
    ------
    ValueError
        For a parameter outside its range or a policy without an acceptance model.
    """
    shares = split_round_robin(requests, n_replicas)
    if sync_every is not None and (
        isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
    ):
        raise ValueError(f"sync_every={sync_every!r} is invalid; allowed: None or an integer >= 1")
    if sync_every is None and not (
        isinstance(sync_every_s, (int, float)) and math.isfinite(sync_every_s) and sync_every_s > 0
    ):
        raise ValueError(
            f"sync_every_s={sync_every_s!r} is invalid; allowed: a finite number of seconds > 0 "
            "(or give sync_every)"
        )
    args = (shares, make_policy, profile, max_batch, share, sync_every, sync_every_s, proposers)
    if state_dir is None:
        with tempfile.TemporaryDirectory(prefix="adaptive-spec-replicas-") as tmp:
            return _run(*args, Path(tmp))
    return _run(*args, Path(state_dir))


def _run(
    shares: list[list[ReplayRequest]],
    make_policy: Callable[[int], SpecPolicy],
    profile: CostProfile,
    max_batch: int,
    share: bool,
    sync_every: int | None,
    sync_every_s: float | None,
    proposers: list[str] | None,
    state_dir: Path,
) -> ReplicasRun:
    n = len(shares)
    policies = [make_policy(i) for i in range(n)]
    models = [_acceptance(p) for p in policies]
    runs = [
        ReplayRun(s, p, profile, max_batch=max_batch, proposers=proposers)
        for s, p in zip(shares, policies, strict=True)
    ]
    path = state_dir / "policy.json"
    shared = [SharedState(p, path) for p in policies] if share else []
    tables = [[m.table().copy()] for m in models]
    obs_t = [np.zeros_like(m.table()) for m in models]
    obs_a = [np.zeros_like(m.table()) for m in models]
    next_req = [sync_every or 0] * n
    next_t = [sync_every_s or 0.0] * n
    while True:
        live = [i for i in range(n) if not runs[i].done]
        if not live:
            break
        i = min(live, key=lambda j: (runs[j].clock, j))
        run, model = runs[i], models[i]
        k = model.max_k
        tri0 = model.tri.reshape(-1, k).copy()
        acc0 = model.acc.reshape(-1, k).copy()
        u0 = model.n_updates
        done_before = run.finished
        run.step()
        u = model.n_updates - u0
        if u:  # the step's own labels: counts after minus the decayed counts before
            decay = model.discount**u
            obs_t[i] += np.rint(model.tri.reshape(-1, k) - decay * tri0)
            obs_a[i] += np.rint(model.acc.reshape(-1, k) - decay * acc0)
        if share:
            due = run.finished >= next_req[i] if sync_every else run.clock >= next_t[i]
            if due or not run.running:  # every interval, and when idle (as the runtime)
                shared[i].sync()
                next_req[i] = (run.finished // sync_every + 1) * sync_every if sync_every else 0
                next_t[i] = run.clock + (sync_every_s or 0.0)
        if run.finished > done_before:
            snap = model.table().copy()
            tables[i].extend(snap for _ in range(run.finished - done_before))
    return ReplicasRun(
        n_replicas=n,
        sharing=share,
        results=[r.result() for r in runs],
        policies=policies,
        tables=tables,
        observed_trials=obs_t,
        observed_accepts=obs_a,
        syncs=[s.syncs for s in shared] or [0] * n,
        pulls=[s.pulls for s in shared] or [0] * n,
        file_state=read_state_part(path) if share else None,
        makespan_s=max(r.clock for r in runs),
    )


# -- measuring the learned acceptance ---------------------------------------------------------------
def per_position(table: np.ndarray, weights: np.ndarray, n_proposers: int) -> np.ndarray:
    """Learned acceptance per proposer and position: each proposer's posterior means (``table``,
    float64 [cells, max_k]) averaged over its context cells with ``weights`` (same shape, >= 0):
    float64 [n_proposers, max_k], NaN where every weight is 0."""
    k = table.shape[-1]
    t = table.reshape(n_proposers, -1, k)
    w = weights.reshape(n_proposers, -1, k)
    tot = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, (w * t).sum(axis=1) / np.where(tot > 0, tot, 1.0), np.nan)


def acceptance_error(values: np.ndarray, reference: np.ndarray, weights: np.ndarray) -> float:
    """Weighted mean absolute difference of two arrays of acceptance probabilities of the same shape,
    over the entries with a positive weight (NaN entries must have weight 0); 0.0 when no weight
    is positive."""
    m = weights > 0
    w = float(weights[m].sum())
    if w <= 0:
        return 0.0
    return float((weights[m] * np.abs(values[m] - reference[m])).sum() / w)


def reach(errors: Sequence[float], tolerance: float) -> int | None:
    """The first index ``n`` from which every error is <= ``tolerance``, or None when the last one is
    above it."""
    n = len(errors)
    while n > 0 and errors[n - 1] <= tolerance:
        n -= 1
    return n if n < len(errors) else None


@dataclass
class ReplicaStudy:
    """One server, N sharing replicas and N replicas alone over the same requests
    (:func:`replica_study`), against the single server's learned acceptance at the end.

    The learned acceptance compared is per proposer and position (:func:`per_position`: the
    posterior means of the context cells averaged with the single server's judged positions there),
    and the error is its mean absolute difference from the single server's at the end, weighted by
    the single server's judged positions per proposer and position (:func:`acceptance_error`).

    Attributes
    ----------
    single, shared, alone : ReplicasRun
    reverse : ReplicasRun
        One server over the same requests in the reverse order: its error at the end
        (:attr:`order_floor`) is how much the end state depends on the order of the requests alone,
        below which a tolerance asks more than the data can tell.
    cell_weights : numpy.ndarray
        The single server's judged positions per cell and position, float64 [cells, max_k].
    reference : numpy.ndarray
        The single server's learned acceptance after all requests, float64 [proposers, max_k].
    weights : numpy.ndarray
        Its judged positions per proposer and position (the error's weights), float64 [proposers,
        max_k].
    tolerance : float
        The error within which a configuration counts as having reached the reference.
    proposers : list of str
    """

    single: ReplicasRun
    shared: ReplicasRun
    alone: ReplicasRun
    reverse: ReplicasRun
    cell_weights: np.ndarray
    reference: np.ndarray
    weights: np.ndarray
    tolerance: float
    proposers: list[str]

    def runs(self) -> dict[str, ReplicasRun]:
        n = self.shared.n_replicas
        return {
            "1 server": self.single,
            f"{n} replicas sharing": self.shared,
            f"{n} replicas alone": self.alone,
            "1 server, reverse order": self.reverse,
        }

    @property
    def order_floor(self) -> float:
        """The error of one server over the same requests in the reverse order, at the end."""
        return self.error(self.reverse.tables[0][-1])

    def learned(self, table: np.ndarray) -> np.ndarray:
        """Per proposer and position, the learned acceptance of a posterior-mean table."""
        return per_position(table, self.cell_weights, len(self.proposers))

    def error(self, table: np.ndarray) -> float:
        """The error of a posterior-mean table against the reference."""
        return acceptance_error(self.learned(table), self.reference, self.weights)

    def errors(self, run: ReplicasRun) -> list[np.ndarray]:
        """Per replica, its error after ``n`` of its requests (index ``n``)."""
        return [np.array([self.error(t) for t in tabs]) for tabs in run.tables]

    def worst(self, run: ReplicasRun) -> np.ndarray:
        """The largest error among the replicas after ``n`` requests each (up to the smallest share)."""
        errs = self.errors(run)
        m = min(len(e) for e in errs)
        return np.max([e[:m] for e in errs], axis=0)

    def reach(self, run: ReplicasRun) -> int | None:
        """Requests per replica after which every replica stays within :attr:`tolerance` (None: not
        reached by the end of its share)."""
        per = [reach(e, self.tolerance) for e in self.errors(run)]
        return None if any(r is None for r in per) else max(r for r in per if r is not None)

    def gap(self, run: ReplicasRun) -> float:
        """How far the replicas trail the single server at the same total of requests: the mean, over
        ``n = 1 .. m`` requests per replica (``m``: the smallest share), of the worst replica's error
        after ``n`` minus the single server's after ``N * n`` (``N`` replicas). About 0: the replicas
        together learn as fast as one server over all requests, i.e. in ``1/N`` of the requests
        each; positive: slower (replicas that do not share trail by their missing requests)."""
        w = self.worst(run)
        single = self.errors(self.single)[0]
        n = np.arange(1, len(w))
        if not n.size:
            return 0.0
        at = np.minimum(run.n_replicas * n, len(single) - 1)
        return float(np.mean(w[1:] - single[at]))

    def final_learned(self, run: ReplicasRun) -> np.ndarray:
        """Per proposer and position, the replicas' mean learned acceptance at the end."""
        return np.mean([self.learned(t[-1]) for t in run.tables], axis=0)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tolerance": self.tolerance,
            "order_floor": round(self.order_floor, 5),
            "proposers": self.proposers,
            "reference_learned": _rounded(self.reference),
            "reference_judged_positions": self.weights.astype(int).tolist(),
            "configurations": {},
        }
        for name, run in self.runs().items():
            errs = self.errors(run)
            out["configurations"][name] = {
                "replicas": run.n_replicas,
                "sharing": run.sharing,
                "requests_per_replica": [len(t) - 1 for t in run.tables],
                "reach_requests_per_replica": self.reach(run),
                "gap_to_single_at_same_total": round(self.gap(run), 5),
                "final_error": [round(float(e[-1]), 5) for e in errs],
                "error_by_requests": [[round(float(x), 5) for x in e] for e in errs],
                "learned": _rounded(self.final_learned(run)),
                "syncs": run.syncs,
                "pulls": run.pulls,
                "tokens": run.tokens,
                "acceptance_rate": round(run.acceptance_rate, 4),
                "goodput_tok_s": round(run.goodput, 3),
                "makespan_s": round(run.makespan_s, 3),
            }
        return out


def _rounded(a: np.ndarray) -> list[list[float | None]]:
    return [[None if math.isnan(x) else round(float(x), 4) for x in row] for row in a]


def replica_study(
    requests: Sequence[ReplayRequest],
    make_policy: Callable[[int], SpecPolicy],
    profile: CostProfile,
    *,
    n_replicas: int,
    max_batch: int,
    tolerance: float = 0.02,
    sync_every: int | None = None,
    sync_every_s: float | None = DEFAULT_SYNC_EVERY_S,
    proposers: list[str] | None = None,
) -> ReplicaStudy:
    """Replay one server over ``requests``, then ``n_replicas`` replicas sharing a state file and
    ``n_replicas`` that do not (:func:`run_replicas`; replica ``i``'s policy is ``make_policy(i)``, the
    single server's ``make_policy(0)``), and one server over the requests in the reverse order
    (:func:`reverse_order`), and compare their learned acceptance with the single server's at the
    end.

    Raises
    ------
    ValueError
        As :func:`run_replicas`, or ``tolerance`` outside (0, 1).
    """
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
        raise ValueError(f"tolerance={tolerance!r} is invalid; allowed: a number in (0, 1)")
    kw: dict[str, Any] = dict(
        max_batch=max_batch, sync_every=sync_every, sync_every_s=sync_every_s, proposers=proposers
    )
    single = run_replicas(requests, make_policy, profile, n_replicas=1, share=False, **kw)
    shared = run_replicas(requests, make_policy, profile, n_replicas=n_replicas, share=True, **kw)
    alone = run_replicas(requests, make_policy, profile, n_replicas=n_replicas, share=False, **kw)
    rev = run_replicas(
        reverse_order(requests), make_policy, profile, n_replicas=1, share=False, **kw
    )
    proposers_ = list(_acceptance(single.policies[0]).proposers)
    cell_w = single.observed_trials[0]
    P, k = len(proposers_), cell_w.shape[-1]
    return ReplicaStudy(
        single=single,
        shared=shared,
        alone=alone,
        reverse=rev,
        cell_weights=cell_w,
        reference=per_position(single.tables[0][-1], cell_w, P),
        weights=cell_w.reshape(P, -1, k).sum(axis=1),
        tolerance=float(tolerance),
        proposers=proposers_,
    )
