"""How a policy turns scores or probabilities into arms: argmax with random ties, categorical draws.

Both work on one row shared by a batch (``[K]``) or one row per request (``[n, K]``), with the
policy's seeded generator, so a batch of decisions costs a few numpy calls.
"""

from __future__ import annotations

import numpy as np

__all__ = ["argmax_random_ties", "sample_categorical", "uniform_over_max"]


def argmax_random_ties(scores: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Row-wise argmax, ties broken uniformly at random.

    Parameters
    ----------
    scores : numpy.ndarray of float, shape [K] or [n, K]
        Arm scores; a 1-D array is shared by all ``n`` rows. ``+inf`` is allowed (arms never
        tried); NaN is not.
    n : int
        Number of rows to decide.
    rng : numpy.random.Generator
        Source of the tie-breaking randomness (drawn only when there is a tie).

    Returns
    -------
    numpy.ndarray of int64, shape [n]
        The chosen arm index per row.
    """
    if scores.ndim == 1:
        ties = np.flatnonzero(scores == scores.max())
        if ties.size == 1:
            return np.full(n, ties[0], dtype=np.int64)
        return rng.choice(ties, size=n).astype(np.int64)
    is_max = scores == scores.max(axis=1, keepdims=True)
    if (is_max.sum(axis=1) == 1).all():
        return scores.argmax(axis=1).astype(np.int64)
    noise = rng.random(scores.shape)
    return np.where(is_max, noise, -1.0).argmax(axis=1).astype(np.int64)


def sample_categorical(probs: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one arm index per row from a categorical distribution by inversion.

    Parameters
    ----------
    probs : numpy.ndarray of float, shape [K] or [n, K]
        Non-negative probabilities summing to 1 (per row); a 1-D array is shared by all rows.
    n : int
        Number of draws.
    rng : numpy.random.Generator
        Source of one uniform per row.

    Returns
    -------
    numpy.ndarray of int64, shape [n]
        Arm indices; an arm of probability 0 is never returned.
    """
    u = rng.random(n)
    cdf = np.cumsum(probs, axis=-1)
    if probs.ndim == 1:
        cdf /= cdf[-1]
        return np.searchsorted(cdf, u, side="right").astype(np.int64)
    cdf /= cdf[:, -1:]
    return (cdf <= u[:, None]).sum(axis=1).astype(np.int64)


def uniform_over_max(scores: np.ndarray) -> np.ndarray:
    """The action distribution of an argmax with uniform tie-breaking, same shape as scores."""
    is_max = scores == scores.max(axis=-1, keepdims=True)
    return is_max / is_max.sum(axis=-1, keepdims=True)
