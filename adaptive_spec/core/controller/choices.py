"""What a decision plays beyond the allocation: cost probes, epsilon-greedy arms, the worth of LoRA
adapters, and the features it logs."""

from __future__ import annotations

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.controller_kernels import StepBuffers

#: Logged per request in the trace (``Decision.features``), in this order.
DECISION_FEATURES = (
    "temperature_bucket",
    "history_bucket",  # of the chosen proposer (or of the best one when k = 0)
    "match_bucket",
    "expected_tokens",  # predicted tokens committed with the played arm
    "played_baseline",  # 1 when the safety rule played the baseline's decision
)


def arm_table(proposers: list[str], max_k: int) -> list[list[Arm]]:
    """Arm objects by ``[proposer index][k]``, ``k`` in ``0..max_k``; row -1 (the last, for proposer
    index -1) is ``none`` for every k."""
    table = [[NO_SPEC] + [Arm(p, k) for k in range(1, max_k + 1)] for p in proposers]
    table.append([NO_SPEC] * (max_k + 1))
    return table


def probe_ks(g: np.ndarray) -> np.ndarray:
    """A verification to keep measuring what speculation costs, at a realistic operating point: the
    draft tokens whose predicted acceptance is at least 0.25 (at least the best one, at most
    ``max(4, N // 4)`` of them, so a probe costs a fraction of a step).

    ``g``: float64 [N, K], each request's gains (``-inf`` where not offered). Returns int64 [N]: the
    k per request."""
    N, K = g.shape
    flat = np.where(np.isfinite(g), g, -1.0).reshape(-1)
    order = np.argsort(-flat, kind="stable")
    n = int((flat >= 0.25).sum())
    n = min(max(n, 1), max(4, N // 4), int((flat >= 0).sum()))
    return np.bincount(order[:n] // K, minlength=N).astype(np.int64)


def eps_greedy(
    arms: list[Arm],
    avail: np.ndarray,
    proposers: list[str],
    epsilon: float,
    rng: np.random.Generator,
) -> tuple[list[Arm], list[float | None]]:
    """Per request, with probability ``epsilon`` an arm drawn uniformly from those its offered
    drafts allow (``avail`` int64 [N, P]: offered lengths), else its own; with the exact propensity
    of the arm played (for off-policy evaluation)."""
    out, props = [], []
    for i, arm in enumerate(arms):
        options = [NO_SPEC] + [
            Arm(p, c) for pi, p in enumerate(proposers) for c in range(1, int(avail[i, pi]) + 1)
        ]
        pick = arm
        if rng.random() < epsilon:
            pick = options[int(rng.integers(len(options)))]
        prop = (1.0 - epsilon) * (1.0 if pick == arm else 0.0) + epsilon / len(options)
        out.append(pick)
        props.append(prop)
    return out, props


def adapter_gain(
    buf: StepBuffers, N: int, adapted: np.ndarray, draft_index: int, jpos: np.ndarray
) -> float | None:
    """The decision's predicted extra tokens from LoRA-adapted drafts: over the requests whose
    allocation plays one, its expected tokens minus those of the best other offered proposer at the
    same k (at most its offered length; the base ``draft`` proposer, index ``draft_index`` (-1:
    none), counts as offered, since it drafts wherever no adapter applies). None when no adapted
    draft was offered this step. Read before the safety rule may replace the allocation.

    ``buf``: the decision's buffers (rows ``0..N-1``); ``adapted``: bool [P], the LoRA-adapted
    proposers; ``jpos``: int64 [K], ``0..K-1``."""
    P = buf.P
    bi = buf.ints
    avail = bi[:N, :P]
    if not (avail[:, adapted] > 0).any():
        return None
    ks, played = bi[:N, buf.c_ks], bi[:N, buf.c_choice]
    rows = np.flatnonzero((ks > 0) & (played >= 0) & adapted[np.maximum(played, 0)])
    if rows.size == 0:
        return 0.0
    n = rows.size
    av = avail[rows]
    if draft_index >= 0:
        # The base draft drafts where no adapter applies: its acceptance cell prices it at the
        # same k for the requests whose last drafts came from an adapter.
        av[:, draft_index] = np.maximum(av[:, draft_index], ks[rows])
    a = np.where(jpos[None, None, :] < av[:, :, None], buf.alpha[rows], 0.0)
    e = np.cumsum(np.cumprod(a, axis=2), axis=2)  # expected accepted tokens at k = j + 1
    e_k = e[np.arange(n), :, ks[rows] - 1]  # [n, P]
    e_played = e_k[np.arange(n), played[rows]]
    e_alt = np.where(adapted[None, :], 0.0, e_k).max(axis=1)
    return float(np.maximum(e_played - e_alt, 0.0).sum())


def decision_features(
    buf: StepBuffers,
    N: int,
    slots: np.ndarray,
    hist_b: np.ndarray,
    temp: list[int],
    jpos: np.ndarray,
    played_baseline: bool,
) -> list[list[float]]:
    """Per request, the :data:`DECISION_FEATURES` of the decision in ``buf`` (rows ``0..N-1``):
    ``slots`` int64 [N], ``hist_b`` int64 [slots, P] (history buckets), ``temp`` the temperature
    buckets, ``jpos`` int64 [K] ``0..K-1``."""
    bi = buf.ints
    rows = np.arange(N)
    ks, g = bi[:N, buf.c_ks], buf.g[:N]
    exp_played = np.where(jpos[None, :] < ks[:, None], g, 0.0).sum(axis=1) + 1.0
    cp = bi[:N, buf.c_played]
    cp = np.where(cp >= 0, cp, bi[:N, buf.c_choice])
    hb, mb = hist_b[slots, cp].tolist(), bi[rows, buf.P + cp].tolist()
    flag = 1.0 if played_baseline else 0.0
    return [
        [float(temp[i]), float(hb[i]), float(mb[i]), round(float(e), 4), flag]
        for i, e in enumerate(exp_played.tolist())
    ]
