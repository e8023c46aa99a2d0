"""Calibrated per-position acceptance: discounted counts per context cell, with priors.

For proposer ``p`` the controller needs ``alpha_j``: the probability that the target accepts draft
token ``j`` given that it accepted tokens ``1..j-1`` (the conditional acceptance that speculative
decoding's expected accepted length is built from, Leviathan et al. 2023). It is estimated per
**context cell**

    proposer x temperature bucket (greedy / sampled) x history bucket x match bucket x position j

as a Beta posterior over discounted counts: ``alpha = (accepted + a) / (trials + a + b)``, where the
prior ``(a, b)`` comes from a shipped prior state or a generic default. The cells are the context:

* **history bucket**: this request's own recent per-position acceptance for this proposer (an
  exponential moving average; none yet / < 0.2 / < 0.6 / >= 0.6). A request that copies text keeps
  copying; one that does not keeps rejecting;
* **match bucket**: the proposer's match feature (n-gram: the suffix n-gram length matched when every
  earlier occurrence of that suffix was followed by the same token, else 0, the bucket of a match whose
  occurrences disagree on what comes next; suffix:
  its own estimate of the first draft token's probability; Jacobi: the candidate's length), cut at
  per-proposer thresholds.

Counts are calibrated by construction (each cell's estimate is its own empirical frequency, shrunk to
the prior), learning is a few array additions per step, and a prediction is a table lookup: no model
fit on the step path. Labels are censored the usual way: positions ``1..a`` accepted, position
``a + 1`` rejected if the draft went on, later positions unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from adaptive_spec.core.controller_kernels import add_counts, posterior_mean

N_TEMP = 2  # greedy, sampled
N_HIST = 4  # no history, low, mid, high
N_MATCH = 4
HIST_EDGES = (0.2, 0.6)
#: Default match thresholds: bucket = number of thresholds <= match feature.
DEFAULT_MATCH_THRESHOLDS = (1, 3, 4)
MATCH_THRESHOLDS: dict[str, tuple[int, int, int]] = {
    "ngram": (1, 3, 4),
    "suffix": (4, 7, 9),  # its estimated first-token probability in tenths: < .4, < .7, < .9, >= .9
    "jacobi": (1, 3, 5),
}
#: Generic prior conditional acceptance at position 1 and at later positions (drafts that survive
#: their first token tend to go on), and its strength in pseudo-observations.
PRIOR_FIRST = 0.3
PRIOR_LATER = 0.6
PRIOR_STRENGTH = 2.0


def _counts_part(index: int, doc: str) -> property:
    """One of an :class:`AcceptanceModel`'s four count arrays, a view of its ``_counts``
    (assigning one copies into it)."""

    def get(self: AcceptanceModel) -> np.ndarray:
        return self._counts[index]

    def put(self: AcceptanceModel, value: np.ndarray | float) -> None:
        self._counts[index] = value

    return property(get, put, doc=doc)


def match_thresholds(proposer: str) -> tuple[int, int, int]:
    """Match-feature thresholds of ``proposer`` (draft-model proposers have no match feature)."""
    return MATCH_THRESHOLDS.get(proposer, DEFAULT_MATCH_THRESHOLDS)


def match_bucket_table(proposers: Sequence[str]) -> np.ndarray:
    """Match bucket of every proposer and match feature 0..63 (the number of the proposer's
    thresholds at or below the feature, at most ``N_MATCH - 1``): int64 [len(proposers), 64], so
    that bucketing a step's features is one lookup."""
    thresholds = np.array([match_thresholds(p) for p in proposers]).reshape(len(proposers), 3)
    feat = np.arange(64)
    return np.minimum(
        (feat[None, :, None] >= thresholds[:, None, :]).sum(axis=2), N_MATCH - 1
    ).astype(np.int64)


def history_bucket(rate: np.ndarray, n: np.ndarray) -> np.ndarray:
    """History bucket (int64) from a request's moving-average acceptance ``rate`` and its label count
    ``n`` (0: no history)."""
    b = 1 + (rate >= HIST_EDGES[0]).astype(np.int64) + (rate >= HIST_EDGES[1]).astype(np.int64)
    return np.where(n > 0, b, 0)


class AcceptanceModel:
    """Discounted Beta counts of per-position acceptance per context cell (see the module docstring).

    Parameters
    ----------
    proposers : sequence of str
        Proposer names, in the order their index is used (``p`` below).
    max_k : int >= 1
        Positions modelled.
    discount : float in (0, 1]
        Multiplies every count once per :meth:`update` call (one engine step): a memory of about
        ``1 / (1 - discount)`` steps.
    prior_strength : float > 0
        Pseudo-observations of the generic prior (used where no prior state was loaded).

    Raises
    ------
    ValueError
        For a parameter outside its range.

    Examples
    --------
    >>> m = AcceptanceModel(["ngram"], 4)
    >>> z = np.zeros(1, dtype=np.int64)
    >>> for _ in range(50):
    ...     m.update(z, z, z, z + 3, np.array([4]), np.array([0]))
    >>> bool(m.mean(z, z, z, z + 3)[0, 0] > 0.9)
    True
    """

    def __init__(
        self,
        proposers: Sequence[str],
        max_k: int,
        *,
        discount: float = 0.9995,
        prior_strength: float = PRIOR_STRENGTH,
    ) -> None:
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 1")
        if not (0.0 < discount <= 1.0):
            raise ValueError(f"discount={discount!r} is invalid; allowed: 0 < discount <= 1")
        if not (prior_strength > 0 and math.isfinite(prior_strength)):
            raise ValueError(
                f"prior_strength={prior_strength!r} is invalid; allowed: a finite number > 0"
            )
        self.proposers = list(proposers)
        self.max_k = max_k
        self.discount = float(discount)
        P = len(self.proposers)
        self.shape = (P, N_TEMP, N_HIST, N_MATCH, max_k)
        first = np.full(max_k, PRIOR_LATER)
        first[0] = PRIOR_FIRST
        self._ncells = P * N_TEMP * N_HIST * N_MATCH
        # acc, tri, prior_a, prior_b in one array (the properties below are views of it), and its
        # [4, cells, max_k] view: what the controller's kernels take, one argument for all four.
        self._counts = np.zeros((4, *self.shape))
        self._counts4 = self._counts.reshape(4, self._ncells, max_k)
        self.prior_a = prior_strength * first
        self.prior_b = prior_strength * (1 - first)
        self._mean: np.ndarray | None = None
        self.n_updates = 0
        #: Proposers whose counts and prior came from a loaded state (a shipped prior or a saved run).
        self.loaded: frozenset[str] = frozenset()

    # -- the counts (views of one array; assigning one copies into it) -------------------------------
    @property
    def counts4(self) -> np.ndarray:
        """``acc``, ``tri``, ``prior_a``, ``prior_b`` as one float64 [4, cells, max_k] view (what the
        controller's kernels take and update in place)."""
        v = self._counts4
        if v.base is not self._counts:  # a copy of this model (deepcopy, pickle) has its own arrays
            v = self._counts4 = self._counts.reshape(4, self._ncells, self.max_k)
        return v

    acc = _counts_part(
        0, "Discounted accepted counts, float64 [P, N_TEMP, N_HIST, N_MATCH, max_k]."
    )
    tri = _counts_part(
        1, "Discounted trials (judged positions), float64, the shape of :attr:`acc`."
    )
    prior_a = _counts_part(2, "Beta prior pseudo-acceptances, float64, the shape of :attr:`acc`.")
    prior_b = _counts_part(3, "Beta prior pseudo-rejections, float64, the shape of :attr:`acc`.")

    # -- indexing ---------------------------------------------------------------------------------
    def cell(self, p: np.ndarray, t: np.ndarray, h: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Flat cell index (int64) of each ``(proposer, temperature, history, match)`` row."""
        return ((p * N_TEMP + t) * N_HIST + h) * N_MATCH + m

    # -- prediction -------------------------------------------------------------------------------
    def table(self) -> np.ndarray:
        """Posterior mean of every cell: float64 [cells, max_k] (cached until the next update)."""
        if self._mean is None:
            self._mean = posterior_mean(self.acc, self.tri, self.prior_a, self.prior_b)
        return self._mean

    def mean(self, p: np.ndarray, t: np.ndarray, h: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Posterior-mean conditional acceptance, float64 [n, max_k], for ``n`` context rows."""
        return self.table()[self.cell(p, t, h, m)]

    def counts(self, p: np.ndarray, t: np.ndarray, h: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Effective observations (prior included) per row and position, float64 [n, max_k]."""
        n = (self.tri + self.prior_a + self.prior_b).reshape(self._ncells, self.max_k)
        return n[self.cell(p, t, h, m)]

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        """One Thompson draw of every cell from its Beta posterior: float64 [cells, max_k]."""
        a = (self.acc + self.prior_a).reshape(self._ncells, self.max_k)
        b = (self.tri - self.acc + self.prior_b).reshape(self._ncells, self.max_k)
        return rng.beta(np.maximum(a, 1e-6), np.maximum(b, 1e-6))

    def optimistic(self, bonus: float) -> np.ndarray:
        """Posterior mean plus ``bonus`` posterior standard deviations, clipped to [0, 1]:
        float64 [cells, max_k] (an upper confidence bound for ``ucb`` exploration)."""
        a = (self.acc + self.prior_a).reshape(self._ncells, self.max_k)
        n = (self.tri + self.prior_a + self.prior_b).reshape(self._ncells, self.max_k)
        mu = a / n
        sd = np.sqrt(mu * (1 - mu) / (n + 1))
        return np.clip(mu + bonus * sd, 0.0, 1.0)

    # -- learning ---------------------------------------------------------------------------------
    def update(
        self,
        p: np.ndarray,
        t: np.ndarray,
        h: np.ndarray,
        m: np.ndarray,
        n_ones: np.ndarray,
        n_zero: np.ndarray,
    ) -> None:
        """Learn censored labels for ``n`` rows: positions ``1..n_ones[i]`` accepted, then ``n_zero[i]``
        (0 or 1) rejected position. Every count decays by ``discount`` first (once per call)."""
        p = np.asarray(p, dtype=np.int64)
        cells = self.cell(p, np.asarray(t), np.asarray(h), np.asarray(m)).astype(np.int64)
        ones = np.broadcast_to(np.asarray(n_ones, dtype=np.int64), cells.shape)
        zero = np.broadcast_to(np.asarray(n_zero, dtype=np.int64), cells.shape)
        add_counts(
            self.counts4[0],
            self.counts4[1],
            np.ascontiguousarray(cells),
            np.ascontiguousarray(ones),
            np.ascontiguousarray(zero),
            self.discount,
        )
        self.counts_changed()

    def counts_changed(self) -> None:
        """Count one learning step and drop the cached posterior means (after the counts were
        changed in place, e.g. by :func:`adaptive_spec.core.controller_kernels.learn`)."""
        self.n_updates += 1
        self._mean = None

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "proposers": list(self.proposers),
            "max_k": self.max_k,
            "shape": list(self.shape),
            "acc": np.round(self.acc, 4).tolist(),
            "tri": np.round(self.tri, 4).tolist(),
            "prior_a": np.round(self.prior_a, 4).tolist(),
            "prior_b": np.round(self.prior_b, 4).tolist(),
            "n_updates": self.n_updates,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, max_weight: float | None = None) -> None:
        """Restore counts saved by :meth:`state_dict` for the proposers both share (others keep
        their prior). ``max_weight`` caps each cell's loaded trials (keeping its mean), so that new
        traffic can move a loaded estimate within about that many observations. Raises ValueError
        for a state of another shape (nothing is changed then)."""
        try:
            props = list(state["proposers"])
            shape = tuple(int(x) for x in state["shape"])
            acc = np.asarray(state["acc"], dtype=float)
            tri = np.asarray(state["tri"], dtype=float)
            pa = np.asarray(state["prior_a"], dtype=float)
            pb = np.asarray(state["prior_b"], dtype=float)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"acceptance state has a missing or malformed field ({e})") from None
        if shape[1:] != self.shape[1:] or any(x.shape != shape for x in (acc, tri, pa, pb)):
            raise ValueError(
                f"acceptance state has shape {shape}; this model has {self.shape} (other max_k or cells)"
            )
        if (
            not all(np.isfinite(x).all() and (x >= 0).all() for x in (acc, tri, pa, pb))
            or (acc > tri + 1e-6).any()
        ):
            raise ValueError("acceptance state has negative, non-finite or inconsistent counts")
        if max_weight is not None:
            scale = np.minimum(1.0, max_weight / np.maximum(tri, 1e-12))
            acc, tri = acc * scale, tri * scale
        new = [(self.proposers.index(p), i) for i, p in enumerate(props) if p in self.proposers]
        for dst, src in new:
            self.acc[dst], self.tri[dst] = acc[src], tri[src]
            self.prior_a[dst], self.prior_b[dst] = pa[src], pb[src]
        self.loaded = self.loaded | {self.proposers[dst] for dst, _ in new}
        n = state.get("n_updates", 0)
        self.n_updates = int(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0
        self._mean = None

    def add_delta(self, delta: Mapping[str, Any]) -> None:
        """Add other replicas' learning to the counts, in place: ``delta`` is the difference of two
        :meth:`state_dict` documents of this layout (``acc`` and ``tri`` differences; how a state file
        shared by replicas is pulled, :func:`adaptive_spec.core.state.sync_policy_state`). Counts stay
        >= 0 and ``acc <= tri``. Raises ValueError for another layout (nothing is changed then)."""
        try:
            props = list(delta["proposers"])
            d_acc = np.asarray(delta["acc"], dtype=float)
            d_tri = np.asarray(delta["tri"], dtype=float)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"acceptance delta has a missing or malformed field ({e})") from None
        if props != self.proposers or d_acc.shape != self.shape or d_tri.shape != self.shape:
            raise ValueError(
                f"acceptance delta has proposers {props} and shape {d_acc.shape}; this model has "
                f"{self.proposers} and {self.shape}"
            )
        if not (np.isfinite(d_acc).all() and np.isfinite(d_tri).all()):
            raise ValueError("acceptance delta has non-finite counts")
        tri = np.maximum(self.tri + d_tri, 0.0)
        self.acc = np.clip(self.acc + d_acc, 0.0, tri)  # assigning copies into the shared array
        self.tri = tri
        self._mean = None

    def set_prior_from_counts(self, strength: float) -> None:
        """Turn the current counts into the prior (each cell's mean, ``strength`` pseudo-observations
        where it has at least that many, fewer where it has less) and clear the counts: how a
        shipped prior state is made from a training run."""
        n = self.tri + self.prior_a + self.prior_b
        mu = (self.acc + self.prior_a) / n
        w = np.minimum(n, strength)
        self.prior_a, self.prior_b = w * mu, w * (1 - mu)
        self.acc = 0.0
        self.tri = 0.0
        self._mean = None
