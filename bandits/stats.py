"""The statistics the learners compose: each kind of evidence is kept by one object.

=======================  ==========================================================  =====================
object                   what it keeps                                               used by
=======================  ==========================================================  =====================
:class:`ArmSums`         per-arm weighted count, reward sum (and sum of squares),    UCB1, UCB-Tuned,
                         each observation discounting all earlier ones by ``gamma``  KL-UCB,
                         (``gamma = 1``: plain sums)                                 epsilon-greedy,
                                                                                     Gaussian Thompson
:class:`WindowSums`      the same over the last ``window`` observations (all arms    SW-UCB
                         together), from a ring buffer
:class:`BetaPosterior`   ``Beta(alpha0 + S_i, beta0 + N_i - S_i)`` over an           Beta Thompson,
                         :class:`ArmSums` (a fractional reward r is r of a success)  discounted Thompson
                                                                                     (``gamma < 1``)
:class:`ExpWeights`      cumulative (estimated) gains in the log domain, re-centred  EXP3, Hedge
                         to a maximum of 0, and their softmax at a learning rate
:class:`DisjointRidge`   one ridge regression (linear-Gaussian posterior) per arm    LinUCB
:class:`Groups`          row sums by group (arm): one stable sort and                the ridge and the
                         ``np.add.reduceat``                                         logistic updates
=======================  ==========================================================  =====================

Every object updates from a whole batch of observations (arm indices ``idx`` int64 ``[n]``, rewards
``r`` float64 ``[n]`` already validated and rescaled by :class:`~adaptive_spec.bandits.Policy`) in a few
numpy calls, equal to ``n`` single updates in order (up to floating-point summation order), and gives
its learned state as a dict of arrays (``get_data`` / ``set_data``, JSON-safe through
:meth:`Policy.state_dict <adaptive_spec.bandits.Policy.state_dict>`).

Why river's statistics are not used here (they are the reference in ``tests/test_bandits_river.py``):
``river.stats.Mean`` / ``Var``, ``river.proba.Beta`` and ``river.utils.Rolling`` hold one scalar
stream per object and learn one value per Python call, where an engine step brings 64 outcomes for
K arms at once; river's own bandits built on them take 3x to 130x longer per 64-request step than
these learners (the measured table in ``docs/bandits.md``). ``proba.Beta.update(x)`` counts any
truthy ``x`` as a full success, so a fractional reward (an acceptance rate) would be learned wrong;
``utils.Rolling`` windows one stream, while SW-UCB's window is the last ``window`` observations of
all arms together; and their state pickles but has no JSON form, which
:meth:`~adaptive_spec.bandits.Policy.state_dict` needs. river's drift detectors
(``drift.ADWIN``, ``drift.PageHinkley``) watch one univariate stream and would restart a learner
on an alarm; the non-stationary learners here forget passively, by a window or a discount, as their
papers define them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import softmax

from ._validation import check_array_field

__all__ = [
    "ArmSums",
    "BetaPosterior",
    "DisjointRidge",
    "ExpWeights",
    "Groups",
    "WindowSums",
    "discount_weights",
    "group_sum",
]

_CHUNK = 1 << 14  # rows per chunk of the outer products (bounds memory for huge batches)


def discount_weights(gamma: float, n: int) -> np.ndarray:
    """Weights ``gamma^(n-1-j)`` of the j-th of n observations learned in one batch, ``[n]``.

    Learning a batch with these weights after multiplying the old statistics by ``gamma^n``
    equals learning the n observations one at a time (each one discounting everything before).
    """
    return gamma ** np.arange(n - 1, -1, -1, dtype=np.float64)


class Groups:
    """Row sums per group (arm), for one grouping reused across several sums.

    Parameters
    ----------
    group : numpy.ndarray of int64, shape [n]
        Group of each row, in ``[0, n_groups)``.
    n_groups : int
        Number of groups G.

    Notes
    -----
    A stable sort and ``np.add.reduceat`` rather than ``np.add.at`` or a one-hot matrix product,
    which multithreaded BLAS makes slow for these small sizes on a loaded machine.
    """

    def __init__(self, group: np.ndarray, n_groups: int) -> None:
        self.order = np.argsort(group, kind="stable")
        g = group[self.order]
        self.starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if g.size else g
        self.ids = g[self.starts] if g.size else g
        self.n_groups = n_groups

    def sum(self, values: np.ndarray) -> np.ndarray:
        """``out[g] = sum of values[j] over rows j of group g``, ``values`` in sorted row order.

        Parameters
        ----------
        values : numpy.ndarray of float, shape [n, ...]
            Rows already permuted by :attr:`order`.

        Returns
        -------
        numpy.ndarray of float64, shape [n_groups, ...]
            Zeros for empty groups.
        """
        flat = values.reshape(values.shape[0], -1)  # reduceat is fastest on 2-D input
        out = np.zeros((self.n_groups, flat.shape[1]))
        if self.starts.size:
            out[self.ids] = np.add.reduceat(flat, self.starts, axis=0)
        return out.reshape(self.n_groups, *values.shape[1:])


def group_sum(idx: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Sum the rows of ``values`` by group, ``out[g] = sum_{j: idx[j] = g} values[j]``.

    Parameters
    ----------
    idx : numpy.ndarray of int, shape [n]
        Group (arm) of each row, in ``[0, n_groups)``.
    values : numpy.ndarray of float, shape [n, ...]
        Rows to add up, in their original order.
    n_groups : int
        Number of groups K.

    Returns
    -------
    numpy.ndarray of float64, shape [n_groups, ...]
        Per-group sums (zeros for empty groups), through :class:`Groups`.
    """
    groups = Groups(idx, n_groups)
    return groups.sum(values[groups.order])


def outer_group_sum(idx: np.ndarray, X: np.ndarray, Z: np.ndarray, n_groups: int) -> np.ndarray:
    """``out[g] = sum_{j in g} X[j] Z[j]^T``, shape ``[n_groups, dx, dz]``, in bounded memory."""
    out = np.zeros((n_groups, X.shape[1], Z.shape[1]))
    for start in range(0, idx.shape[0], _CHUNK):
        sl = slice(start, start + _CHUNK)
        out += group_sum(idx[sl], X[sl, :, None] * Z[sl, None, :], n_groups)
    return out


class ArmSums:
    """Per-arm weighted count ``N_i``, reward sum ``S_i`` and optionally ``Q_i = sum r^2``.

    Every observation first multiplies every arm's statistics by ``gamma``, then adds its own:
    ``N_i <- gamma N_i + 1{arm i}``, ``S_i <- gamma S_i + r 1{arm i}``. With ``gamma = 1`` these are
    plain counts and sums; with ``gamma < 1`` the memory is about ``1 / (1 - gamma)`` observations
    (Raj & Kalyani 2017, discounted Thompson sampling). A batch of n observations equals
    n single updates (:func:`discount_weights`).

    Parameters
    ----------
    n_arms : int
        Number of arms K.
    gamma : float, default 1.0
        Discount per observation, in (0, 1] (validated by the owning policy).
    squares : bool, default False
        Also keep ``Q_i`` (UCB-Tuned's variance).

    Attributes
    ----------
    counts, sums : numpy.ndarray of float64, shape [K]
    sq_sums : numpy.ndarray of float64, shape [K], or None
    """

    def __init__(self, n_arms: int, *, gamma: float = 1.0, squares: bool = False) -> None:
        self.n_arms, self.gamma = n_arms, gamma
        self.counts = np.zeros(n_arms)
        self.sums = np.zeros(n_arms)
        self.sq_sums: np.ndarray | None = np.zeros(n_arms) if squares else None

    def learn(self, idx: np.ndarray, r: np.ndarray) -> None:
        """Add observations ``(idx[j], r[j])`` in order."""
        k = self.n_arms
        if self.gamma == 1.0:
            decay, w = 1.0, np.ones(idx.shape[0])
        else:
            decay, w = self.gamma ** idx.shape[0], discount_weights(self.gamma, idx.shape[0])
        self.counts = decay * self.counts + np.bincount(idx, weights=w, minlength=k)
        self.sums = decay * self.sums + np.bincount(idx, weights=w * r, minlength=k)
        if self.sq_sums is not None:
            self.sq_sums = decay * self.sq_sums + np.bincount(idx, weights=w * r * r, minlength=k)

    def means(self) -> np.ndarray:
        """Mean reward per arm, float64 ``[K]`` (NaN for an arm never observed)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.counts > 0, self.sums / self.counts, np.nan)

    def get_data(self) -> dict[str, Any]:
        """The statistics as arrays (keys ``counts``, ``sums`` and, if kept, ``sq_sums``)."""
        data = {"counts": self.counts, "sums": self.sums}
        if self.sq_sums is not None:
            data["sq_sums"] = self.sq_sums
        return data

    def set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`get_data`'s output.

        Raises
        ------
        ValueError
            On a missing key, a wrong shape, NaN/inf or a negative count.
        """
        shape = (self.n_arms,)
        counts = check_array_field(data, "counts", shape)
        if (counts < 0).any():
            raise ValueError("counts must be >= 0")
        sums = check_array_field(data, "sums", shape)
        sq = None if self.sq_sums is None else check_array_field(data, "sq_sums", shape)
        self.counts, self.sums, self.sq_sums = counts, sums, sq


class BetaPosterior(ArmSums):
    """Beta posterior of each arm's success probability over (discounted) reward sums.

    Arm i's posterior is ``Beta(alpha0 + S_i, beta0 + N_i - S_i)``: a reward r in [0, 1] counts as
    r of a success and 1 - r of a failure (the expected update of Agrawal & Goyal's Bernoulli
    trick, without its extra noise); with ``gamma < 1`` the pseudo-counts decay per observation
    (Raj & Kalyani 2017, discounted Thompson sampling).

    Parameters
    ----------
    n_arms : int
    alpha0, beta0 : float
        Prior pseudo-counts, > 0 (validated by the owning policy).
    gamma : float, default 1.0
        Discount per observation, in (0, 1].
    """

    def __init__(self, n_arms: int, alpha0: float, beta0: float, *, gamma: float = 1.0) -> None:
        super().__init__(n_arms, gamma=gamma)
        self.alpha0, self.beta0 = alpha0, beta0

    def params(self) -> tuple[np.ndarray, np.ndarray]:
        """Beta parameters ``(alpha, beta)`` of every arm, float64 ``[K]`` each."""
        return self.alpha0 + self.sums, self.beta0 + np.maximum(self.counts - self.sums, 0.0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """One posterior draw per request and arm, float64 ``[n, K]``."""
        a, b = self.params()
        return rng.beta(a, b, size=(n, self.n_arms))


class WindowSums:
    """Per-arm count and reward sum over the last ``window`` observations of all arms together.

    A ring buffer keeps the window's (arm, reward) pairs; the sums are maintained incrementally and
    recomputed exactly from the buffer every time it wraps, so rounding never accumulates
    (Garivier & Moulines 2011, SW-UCB). A batch of n observations advances the window by n.

    Parameters
    ----------
    n_arms : int
    window : int
        Observations kept, >= 1 (validated by the owning policy).

    Attributes
    ----------
    counts : numpy.ndarray of int64, shape [K]
    sums : numpy.ndarray of float64, shape [K]
    """

    def __init__(self, n_arms: int, window: int) -> None:
        self.n_arms, self.window = n_arms, window
        self._buf_arm = np.full(window, -1, dtype=np.int64)
        self._buf_reward = np.zeros(window)
        self._pos = 0
        self._recount()

    def _recount(self) -> None:
        valid = self._buf_arm >= 0
        arms = self._buf_arm[valid]
        self.counts = np.bincount(arms, minlength=self.n_arms).astype(np.int64)
        self.sums = np.bincount(
            arms, weights=self._buf_reward[valid], minlength=self.n_arms
        ).astype(np.float64)

    def learn(self, idx: np.ndarray, r: np.ndarray) -> None:
        """Add observations ``(idx[j], r[j])`` in order, dropping those that leave the window."""
        n, w = idx.shape[0], self.window
        if n >= w:  # the batch fills the whole window; keep the ring layout of n single updates
            slots = (self._pos + np.arange(n - w, n)) % w
            self._buf_arm[slots] = idx[-w:]
            self._buf_reward[slots] = r[-w:]
            self._pos = (self._pos + n) % w
            self._recount()
            return
        slots = (self._pos + np.arange(n)) % w
        old = self._buf_arm[slots]
        keep = old >= 0
        self.counts -= np.bincount(old[keep], minlength=self.n_arms)
        self.sums -= np.bincount(
            old[keep], weights=self._buf_reward[slots][keep], minlength=self.n_arms
        )
        self._buf_arm[slots] = idx
        self._buf_reward[slots] = r
        self.counts += np.bincount(idx, minlength=self.n_arms)
        self.sums += np.bincount(idx, weights=r, minlength=self.n_arms)
        wrapped = self._pos + n >= w
        self._pos = (self._pos + n) % w
        if wrapped:
            self._recount()

    def get_data(self) -> dict[str, Any]:
        """The buffer, its position and the incrementally kept sums."""
        return {
            "buf_arm": self._buf_arm,
            "buf_reward": self._buf_reward,
            "pos": self._pos,
            "win_sums": self.sums,
        }

    def set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`get_data`'s output.

        Raises
        ------
        ValueError
            On wrong shapes, arm indices out of range, NaN/inf or a bad position.
        """
        buf_arm = np.asarray(data["buf_arm"])
        buf_reward = np.asarray(data["buf_reward"], dtype=np.float64)
        if buf_arm.shape != (self.window,) or buf_reward.shape != (self.window,):
            raise ValueError(f"buffers must have {self.window} entries")
        if buf_arm.dtype.kind != "i" or (buf_arm < -1).any() or (buf_arm >= self.n_arms).any():
            raise ValueError("buf_arm must hold arm indices or -1")
        if not np.isfinite(buf_reward).all():
            raise ValueError("buf_reward must be finite")
        pos = data["pos"]
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < self.window:
            raise ValueError(f"pos must be an int in [0, {self.window}), got {pos!r}")
        win_sums = check_array_field(data, "win_sums", (self.n_arms,))
        self._buf_arm = buf_arm.astype(np.int64)
        self._buf_reward = buf_reward
        self._pos = pos
        self._recount()
        # The incrementally maintained sums may differ from a recount in the last bits.
        self.sums = win_sums


class ExpWeights:
    """Exponential weights: cumulative gains ``G_i`` kept re-centred to a maximum of 0.

    The action distribution at learning rate eta is ``softmax(eta G)``, which the re-centring does
    not change but keeps from overflowing for any number of updates (river's ``Exp3`` multiplies
    raw weights and overflows). EXP3 adds importance-weighted gain estimates ``r / p_i`` at rate
    ``gamma / K`` (Auer et al. 2002); Hedge adds every arm's reward at rate ``eta_t``
    (Freund & Schapire 1997).

    Parameters
    ----------
    n_arms : int
    """

    def __init__(self, n_arms: int) -> None:
        self.gains = np.zeros(n_arms)

    def add(self, gains: np.ndarray) -> None:
        """Add one gain per arm, float ``[K]``, and re-centre."""
        self.gains += gains
        self.gains -= self.gains.max()

    def softmax(self, eta: float) -> np.ndarray:
        """``softmax(eta G)``, float64 ``[K]``."""
        return softmax(eta * self.gains)

    def get_data(self) -> dict[str, Any]:
        """The re-centred gains (key ``gains``)."""
        return {"gains": self.gains}

    def set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`get_data`'s output (ValueError on a wrong shape or NaN/inf)."""
        self.gains = check_array_field(data, "gains", self.gains.shape)


class DisjointRidge:
    """One ridge regression per arm: ``A_a = reg I + sum x x^T``, ``b_a = sum r x``.

    The coefficients' posterior is Gaussian, ``N(theta_a, v^2 A_a^{-1})`` with
    ``theta_a = A_a^{-1} b_a`` (Li et al. 2010). Keeps ``A_a^{-1}`` and
    ``theta_a`` up to date for the arms touched by each batch (a batched LAPACK inverse of the
    ``dim x dim`` matrices).

    Parameters
    ----------
    n_arms : int
        Number of arms K.
    dim : int
        Context dimension d.
    reg : float
        Ridge regulariser (prior precision), > 0.
    """

    def __init__(self, n_arms: int, dim: int, reg: float) -> None:
        self.n_arms, self.dim, self.reg = n_arms, dim, reg
        self.A = np.broadcast_to(reg * np.eye(dim), (n_arms, dim, dim)).copy()
        self.b = np.zeros((n_arms, dim))
        self.A_inv = np.broadcast_to(np.eye(dim) / reg, (n_arms, dim, dim)).copy()
        self.theta = np.zeros((n_arms, dim))

    def refresh(self, arms: np.ndarray | None = None) -> None:
        """Recompute inverse and coefficients for ``arms`` (all by default)."""
        sel = slice(None) if arms is None else arms
        inv = np.linalg.inv(self.A[sel])
        self.A_inv[sel] = inv
        self.theta[sel] = np.einsum("kij,kj->ki", inv, self.b[sel])

    def learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray) -> None:
        """Add observations ``(idx[j], r[j], X[j])``; order-independent up to rounding."""
        self.A += outer_group_sum(idx, X, X, self.n_arms)
        self.b += group_sum(idx, X * r[:, None], self.n_arms)
        self.refresh(np.unique(idx))

    def moments(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted mean ``x . theta_a`` and ``x^T A_a^{-1} x`` for every row and arm, ``[n, K]``."""
        mean = X @ self.theta.T
        var = np.einsum("knd,nd->nk", X @ self.A_inv, X)
        return mean, np.maximum(var, 0.0)

    def get_data(self) -> dict[str, Any]:
        """Sufficient statistics (the inverse is derived)."""
        return {"A": self.A, "b": self.b}

    def set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`get_data`'s output and recompute the derived arrays.

        Raises
        ------
        ValueError
            On a wrong shape or NaN/inf.
        """
        k, d = self.n_arms, self.dim
        A = check_array_field(data, "A", (k, d, d))
        b = check_array_field(data, "b", (k, d))
        self.A, self.b = A, b
        self.refresh()
