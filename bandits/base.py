"""The bandit policy base class: one interface, bookkeeping in one place.

Every policy in :mod:`adaptive_spec.bandits` derives from :class:`Policy` and writes only its
decision rule and its update (river's pattern); the base class validates arm ids, contexts and
rewards, owns the seeded :class:`numpy.random.Generator`, keeps the per-arm counts and the
state round trip, and breaks ties uniformly at random.

The verbs, the same for every policy:

* ``pull(context=None) -> arm_id`` and ``pull_batch(contexts=None, n=None) -> list[arm_id]``
* ``update(arm, reward, context=None)`` and ``update_batch(arms, rewards, contexts=None)``
  (one call for a whole engine step's outcomes, vectorised with numpy)
* ``update_full(rewards_per_arm, context=None)`` when every arm's reward is known after the
  fact (full information, e.g. deterministic proposers scored on the emitted tokens)
* ``probabilities(context=None)`` / ``probabilities_batch(...)`` where the action distribution
  has a closed form (EXP3, Hedge, epsilon-greedy and the deterministic index policies)
* ``state_dict()`` / ``load_state_dict(state)`` / ``Policy.from_state_dict(state)``
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from ._choice import argmax_random_ties, sample_categorical, uniform_over_max
from ._validation import (
    check_arms,
    check_finite_array,
    check_matrix,
    check_none_flagged,
    check_positive_int,
    check_reward_range,
    check_seed,
    check_vector,
    rng_from_state,
    rng_state,
    to_jsonable,
)

__all__ = ["ArmId", "Policy", "argmax_random_ties", "sample_categorical"]

ArmId = int | str

_STATE_VERSION = 1


class Policy(abc.ABC):
    """Base class of every bandit policy: bookkeeping, validation, seeding and state.

    Subclasses set the class attributes below and implement :meth:`_learn` plus either
    :meth:`_scores` (index and sampling policies: the arm with the largest score is pulled) or
    :meth:`_probs` with ``randomized = True`` (the arm is drawn from the distribution). Their
    learned state lives in statistic objects (:mod:`adaptive_spec.bandits.stats`) named by
    ``_stats``, and their hyperparameters in attributes named as their keyword arguments, so that
    :meth:`state_dict` needs no code of theirs (scikit-learn's ``get_params`` convention).

    Parameters
    ----------
    arms : sequence of str or int
        The arm ids, distinct. Order matters: array outputs (:meth:`probabilities`,
        :attr:`counts`) follow it.
    seed : int or None
        Seed of the policy's :class:`numpy.random.Generator` (PCG64).
    reward_range : (float, float) or None
        For policies that assume bounded rewards: rewards must lie in ``[low, high]`` and are
        rescaled to [0, 1] before learning. ``None`` for policies that take any finite reward.
    dim : int or None
        Context dimension; required by contextual policies, ignored (must be ``None``) otherwise.

    Attributes
    ----------
    name : str
        The registry name (see :func:`adaptive_spec.bandits.make_policy`).
    contextual : bool
        Whether decisions depend on the context.
    randomized : bool
        Whether the arm is drawn from :meth:`probabilities` (EXP3, Hedge, epsilon-greedy).
    has_probabilities : bool
        Whether :meth:`probabilities` is available in closed form.
    full_information_only : bool
        Whether the policy learns only from :meth:`update_full` (Hedge).
    requires_bounded_rewards : bool
        Whether ``reward_range`` may not be ``None``.
    binary_rewards : bool
        Whether every reward must be exactly 0 or 1 (logistic Thompson sampling).
    """

    name: ClassVar[str] = ""
    contextual: ClassVar[bool] = False
    randomized: ClassVar[bool] = False
    has_probabilities: ClassVar[bool] = True
    full_information_only: ClassVar[bool] = False
    requires_bounded_rewards: ClassVar[bool] = False
    binary_rewards: ClassVar[bool] = False
    #: Attributes holding the learned statistics (objects with ``get_data`` / ``set_data``).
    _stats: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        seed: int | None = None,
        reward_range: tuple[float, float] | None = None,
        dim: int | None = None,
    ) -> None:
        self._arms = check_arms(arms)
        self._index = {a: i for i, a in enumerate(self._arms)}
        self._seed = check_seed(seed)
        self._rng = np.random.default_rng(self._seed)
        self._reward_range = check_reward_range(reward_range)
        if self.requires_bounded_rewards and self._reward_range is None:
            raise ValueError(
                f"reward_range must be a pair (low, high) for {self.name}: it assumes bounded rewards"
            )
        if self.contextual:
            self._dim: int | None = check_positive_int("dim", dim)
        elif dim is not None:
            raise ValueError(
                f"dim must be None for the non-contextual policy {self.name}, got {dim!r}"
            )
        else:
            self._dim = None
        self._counts = np.zeros(len(self._arms), dtype=np.int64)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def arms(self) -> list[ArmId]:
        """The arm ids, in construction order (a copy)."""
        return list(self._arms)

    @property
    def n_arms(self) -> int:
        """Number of arms K."""
        return len(self._arms)

    @property
    def dim(self) -> int | None:
        """Context dimension (``None`` for non-contextual policies)."""
        return self._dim

    @property
    def counts(self) -> np.ndarray:
        """Observations learned per arm, int64 ``[K]`` (a copy)."""
        return self._counts.copy()

    @property
    def n_updates(self) -> int:
        """Total observations learned (each arm of a full-information round counts once)."""
        return int(self._counts.sum())

    @property
    def reward_range(self) -> tuple[float, float] | None:
        """Rewards' allowed range, or ``None`` if any finite reward is accepted."""
        return self._reward_range

    @property
    def seed(self) -> int | None:
        """Seed the policy was built with."""
        return self._seed

    def arm_index(self, arm: Any) -> int:
        """Position of ``arm`` in :attr:`arms`.

        Raises
        ------
        ValueError
            If ``arm`` is not one of the policy's arms.
        """
        try:
            return self._index[arm]
        except (KeyError, TypeError):
            pass
        shown = self._arms if len(self._arms) <= 20 else [*self._arms[:20], "..."]
        raise ValueError(f"arm {arm!r} is not one of this policy's arms {shown}") from None

    def _arm_indices(self, arms: Any) -> np.ndarray:
        if isinstance(arms, (str, bytes)) or np.ndim(arms) != 1:
            raise ValueError(f"arms must be a 1-D sequence of arm ids, got {arms!r:.80}")
        return np.fromiter((self.arm_index(a) for a in arms), dtype=np.int64, count=len(arms))

    # ------------------------------------------------------------------ input checks
    def _check_context(self, context: Any) -> np.ndarray | None:
        """Return a single context as ``[1, dim]`` (contextual) or ``None``."""
        if self.contextual:
            if context is None:
                raise ValueError(f"context is required by the contextual policy {self.name}")
            return check_vector("context", context, self._dim)[None, :]
        if context is not None:
            check_vector("context", context)
        return None

    def _check_contexts(self, contexts: Any, n: Any) -> tuple[np.ndarray | None, int]:
        """Return the batch of contexts ``[n, dim]`` (or ``None``) and its size."""
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"n must be an integer >= 0, got {n!r}")
            n = int(n)
        if contexts is None:
            if self.contextual:
                raise ValueError(f"contexts are required by the contextual policy {self.name}")
            if n is None:
                raise ValueError("give contexts (an array [n, dim]) or the batch size n")
            return None, n
        if self.contextual:
            X = check_matrix("contexts", contexts, self._dim)
        else:
            X = np.asarray(contexts, dtype=np.float64)
            if X.ndim != 2:
                raise ValueError(f"contexts must have shape [n, d], got shape {X.shape}")
            check_finite_array("contexts", X)
        if n is not None and n != X.shape[0]:
            raise ValueError(f"n={n} does not match contexts with {X.shape[0]} rows")
        return (X if self.contextual else None), X.shape[0]

    def _check_rewards(self, rewards: Any, length: int | None, name: str = "rewards") -> np.ndarray:
        r = check_vector(name, rewards, length)
        return self._scale(r, name)

    def _scale(self, r: np.ndarray, name: str) -> np.ndarray:
        if self.binary_rewards:
            check_none_flagged(name, r, (r != 0.0) & (r != 1.0), f"must be 0 or 1 for {self.name}")
        if self._reward_range is None:
            return r
        lo, hi = self._reward_range
        check_none_flagged(name, r, (r < lo) | (r > hi), f"must lie in reward_range [{lo}, {hi}]")
        if lo == 0.0 and hi == 1.0:
            return r
        return (r - lo) / (hi - lo)

    # ------------------------------------------------------------------ decisions
    def pull(self, context: np.ndarray | None = None) -> ArmId:
        """Choose one arm.

        Parameters
        ----------
        context : array_like of float, shape [dim], optional
            Required by contextual policies; others accept (and ignore) any finite 1-D vector.

        Returns
        -------
        str or int
            The chosen arm id.

        Raises
        ------
        ValueError
            If a contextual policy gets no context, or the context has the wrong shape or
            holds NaN/inf.
        """
        X = self._check_context(context)
        return self._arms[int(self._choose(X, 1)[0])]

    def pull_batch(
        self, contexts: np.ndarray | None = None, *, n: int | None = None
    ) -> list[ArmId]:
        """Choose an arm for each of ``n`` requests at once (no learning in between).

        Parameters
        ----------
        contexts : array_like of float, shape [n, dim], optional
            One context per request; required by contextual policies.
        n : int, optional
            Batch size, for non-contextual policies called without contexts.

        Returns
        -------
        list of arm ids, length n

        Raises
        ------
        ValueError
            On missing or malformed contexts, or ``n`` inconsistent with them.
        """
        idx = self.pull_batch_indices(contexts, n=n)
        arms = self._arms
        return [arms[i] for i in idx.tolist()]

    def pull_batch_indices(
        self, contexts: np.ndarray | None = None, *, n: int | None = None
    ) -> np.ndarray:
        """As :meth:`pull_batch`, but return positions in :attr:`arms`, int64 ``[n]``."""
        X, size = self._check_contexts(contexts, n)
        if size == 0:
            return np.zeros(0, dtype=np.int64)
        return self._choose(X, size)

    def probabilities(self, context: np.ndarray | None = None) -> np.ndarray:
        """The probability of each arm being pulled next, float64 ``[K]`` in :attr:`arms` order.

        Raises
        ------
        NotImplementedError
            For sampling policies without a closed form (Thompson sampling variants).
        ValueError
            On a malformed context.
        """
        X = self._check_context(context)
        return self._probs_checked(X, 1)[0]

    def probabilities_batch(
        self, contexts: np.ndarray | None = None, *, n: int | None = None
    ) -> np.ndarray:
        """Per-request action probabilities (propensities), float64 ``[n, K]``.

        Raises
        ------
        NotImplementedError
            For sampling policies without a closed form (Thompson sampling variants).
        ValueError
            On malformed contexts or ``n``.
        """
        X, size = self._check_contexts(contexts, n)
        return self._probs_checked(X, size)

    def _probs_checked(self, X: np.ndarray | None, n: int) -> np.ndarray:
        if not self.has_probabilities:
            raise NotImplementedError(
                f"{self.name} has no closed-form action probabilities (it samples a posterior)"
            )
        if n == 0:
            return np.zeros((0, self.n_arms))
        p = self._probs(X, n)
        return np.broadcast_to(p, (n, self.n_arms)).copy() if p.ndim == 1 else p

    def _choose(self, X: np.ndarray | None, n: int) -> np.ndarray:
        """Arm indices ``[n]`` for ``n`` requests (contexts ``X`` ``[n, dim]`` or ``None``)."""
        if self.randomized:
            return sample_categorical(self._probs(X, n), n, self._rng)
        return argmax_random_ties(self._scores(X, n), n, self._rng)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        """Arm scores, ``[K]`` (shared by all rows) or ``[n, K]``; the argmax is pulled."""
        raise NotImplementedError

    def _probs(self, X: np.ndarray | None, n: int) -> np.ndarray:
        """Action distribution ``[K]`` or ``[n, K]``; default: argmax of the scores."""
        return uniform_over_max(self._scores(X, n))

    # ------------------------------------------------------------------ learning
    def update(self, arm: ArmId, reward: float, context: np.ndarray | None = None) -> None:
        """Learn one observed reward of the pulled arm.

        Parameters
        ----------
        arm : str or int
            The arm that was pulled.
        reward : float
            Its reward, finite (and inside :attr:`reward_range` when that is set).
        context : array_like of float, shape [dim], optional
            The context it was pulled in; required by contextual policies.

        Raises
        ------
        ValueError
            On an unknown arm, a NaN/inf or out-of-range reward, or a malformed context; the
            policy is left unchanged.
        NotImplementedError
            For full-information-only policies (Hedge): use :meth:`update_full`.
        """
        self._refuse_bandit_feedback()
        i = self.arm_index(arm)
        r = self._check_rewards([reward], 1, "reward")
        X = self._check_context(context)
        self._learn(np.array([i], dtype=np.int64), r, X)
        self._counts[i] += 1

    def update_batch(
        self, arms: Sequence[ArmId], rewards: np.ndarray, contexts: np.ndarray | None = None
    ) -> None:
        """Learn a batch of observations in one vectorised call.

        For every policy except EXP3 this is equivalent to calling :meth:`update` on each row
        in order (up to floating-point summation order); EXP3 importance-weights the whole batch with the current probabilities (the
        ones the batch was drawn with by :meth:`pull_batch`).

        Parameters
        ----------
        arms : sequence of arm ids, length n
        rewards : array_like of float, shape [n]
        contexts : array_like of float, shape [n, dim], optional
            Required by contextual policies.

        Raises
        ------
        ValueError
            On an unknown arm, mismatched lengths, NaN/inf or out-of-range rewards, or
            malformed contexts; the policy is left unchanged.
        NotImplementedError
            For full-information-only policies (Hedge): use :meth:`update_full`.
        """
        self._refuse_bandit_feedback()
        idx = self._arm_indices(arms)
        n = idx.shape[0]
        r = self._check_rewards(rewards, n)
        if self.contextual:
            if contexts is None:
                raise ValueError(f"contexts are required by the contextual policy {self.name}")
            X = check_matrix("contexts", contexts, self._dim)
            if X.shape[0] != n:
                raise ValueError(f"contexts has {X.shape[0]} rows but arms has {n} entries")
        else:
            if contexts is not None:
                self._check_contexts(contexts, n)
            X = None
        if n == 0:
            return
        self._learn(idx, r, X)
        self._counts += np.bincount(idx, minlength=self.n_arms)

    def update_full(self, rewards_per_arm: np.ndarray, context: np.ndarray | None = None) -> None:
        """Learn every arm's reward for one or more rounds (full information).

        Parameters
        ----------
        rewards_per_arm : array_like of float, shape [K] or [n, K]
            Reward of every arm (in :attr:`arms` order) for one round, or for ``n`` rounds.
        context : array_like of float, shape [dim] or [n, dim], optional
            The round's context (rows matching ``rewards_per_arm``); required by contextual
            policies.

        Raises
        ------
        ValueError
            On a wrong shape, NaN/inf or out-of-range rewards, or malformed contexts; the
            policy is left unchanged.
        """
        R = np.asarray(rewards_per_arm, dtype=np.float64)
        if R.ndim not in (1, 2) or R.shape[-1] != self.n_arms:
            raise ValueError(
                f"rewards_per_arm must have shape [{self.n_arms}] or [n, {self.n_arms}], "
                f"got shape {R.shape}"
            )
        R = np.atleast_2d(R)
        check_finite_array("rewards_per_arm", R)
        R = self._scale(R, "rewards_per_arm")
        n = R.shape[0]
        if self.contextual:
            if context is None:
                raise ValueError(f"context is required by the contextual policy {self.name}")
            X = np.asarray(context, dtype=np.float64)
            X = check_matrix("context", X[None, :] if X.ndim == 1 else X, self._dim)
            if X.shape[0] != n:
                raise ValueError(f"context has {X.shape[0]} rows but rewards_per_arm has {n}")
        else:
            if context is not None:
                check_finite_array("context", np.asarray(context, dtype=np.float64))
            X = None
        if n == 0:
            return
        self._learn_full(R, X)
        self._counts += n

    def _refuse_bandit_feedback(self) -> None:
        if self.full_information_only:
            raise NotImplementedError(
                f"{self.name} learns from every arm's reward: call update_full(rewards_per_arm)"
            )

    @abc.abstractmethod
    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        """Learn rows ``(idx[j], r[j], X[j])`` in order; rewards already validated and scaled."""

    def _learn_full(self, R: np.ndarray, X: np.ndarray | None) -> None:
        """Full information, ``R`` ``[n, K]``: default, every arm observed once per round."""
        n, k = R.shape
        idx = np.tile(np.arange(k, dtype=np.int64), n)
        Xk = None if X is None else np.repeat(X, k, axis=0)
        self._learn(idx, R.ravel(), Xk)

    # ------------------------------------------------------------------ state
    def _params(self) -> dict[str, Any]:
        """Constructor keyword arguments (other than ``arms``) that rebuild this policy: each
        keyword-only parameter of ``__init__``, read from the attribute of the same name."""
        sig = inspect.signature(type(self).__init__)
        return {
            k: getattr(self, k)
            for k, p in sig.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def _get_data(self) -> dict[str, Any]:
        """Learned state: the statistic objects' arrays / Python scalars."""
        data: dict[str, Any] = {}
        for attr in self._stats:
            data.update(getattr(self, attr).get_data())
        return data

    def _set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`_get_data`'s output (values may be lists after JSON)."""
        for attr in self._stats:
            getattr(self, attr).set_data(data)

    def state_dict(self) -> dict[str, Any]:
        """Full state as a JSON-serialisable dict (round trips bit for bit, RNG included).

        Returns
        -------
        dict
            Keys ``class``, ``name``, ``version``, ``arms``, ``params`` (constructor keyword
            arguments), ``counts``, ``rng`` (bit generator state) and ``data`` (the policy's
            learned statistics as nested lists of Python floats/ints).
        """
        return {
            "class": type(self).__name__,
            "name": self.name,
            "version": _STATE_VERSION,
            "arms": list(self._arms),
            "params": {k: to_jsonable(v) for k, v in self._params().items()},
            "counts": self._counts.tolist(),
            "rng": rng_state(self._rng),
            "data": {k: to_jsonable(v) for k, v in self._get_data().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly after ``json.dumps``/``json.loads``).

        Arms and hyperparameters are taken from ``state``; afterwards the policy makes the
        same pulls as the one that produced the state.

        Raises
        ------
        ValueError
            If ``state`` was produced by another policy class or is malformed.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state).__name__}")
        missing = {"class", "version", "arms", "params", "counts", "rng", "data"} - state.keys()
        if missing:
            raise ValueError(f"state is missing key(s) {sorted(missing)}")
        if state["class"] != type(self).__name__ or state["version"] != _STATE_VERSION:
            raise ValueError(
                f"state is for {state['class']!r} version {state['version']!r}; "
                f"expected {type(self).__name__!r} version {_STATE_VERSION}"
            )
        if not isinstance(state["params"], dict):
            raise ValueError(f"state['params'] must be a dict, got {state['params']!r:.80}")
        try:
            fresh = type(self)(state["arms"], **state["params"])
        except TypeError as exc:
            raise ValueError(f"state['params'] do not fit {type(self).__name__}: {exc}") from exc
        counts = np.asarray(state["counts"])
        if counts.shape != (fresh.n_arms,) or counts.dtype.kind != "i" or (counts < 0).any():
            raise ValueError(f"state['counts'] must be {fresh.n_arms} non-negative ints")
        fresh._counts = counts.astype(np.int64)
        fresh._rng = rng_from_state(state["rng"])
        try:
            fresh._set_data(state["data"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"state['data'] is malformed for {type(self).__name__}: {exc}"
            ) from exc
        self.__dict__.update(fresh.__dict__)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Policy:
        """Build a policy of the class recorded in ``state`` (any subclass of ``cls`` by name).

        Raises
        ------
        ValueError
            If no subclass of ``cls`` is registered under ``state['name']``, or the state is
            malformed.
        """
        name = state.get("name") if isinstance(state, dict) else None
        found = {c.name: c for c in _subclasses(Policy) if c.name}
        policy_cls = found.get(str(name))
        if policy_cls is None:
            raise ValueError(f"unknown policy {name!r}; allowed: {', '.join(sorted(found))}")
        if not issubclass(policy_cls, cls):
            raise ValueError(f"state is for {policy_cls.__name__}, not {cls.__name__}")
        obj = policy_cls.__new__(policy_cls)
        obj.load_state_dict(state)
        return obj

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        """Keyword arguments for the generic test suite (river's pattern)."""
        yield {"dim": 4} if cls.contextual else {}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}(n_arms={self.n_arms}, {params}) [n_updates={self.n_updates}]"


def _subclasses(cls: type[Policy]) -> list[type[Policy]]:
    """Every subclass of ``cls``, recursively."""
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
