"""Input checks and RNG (de)serialisation shared by every learner in :mod:`adaptive_spec.bandits`.

Every public entry point of the package validates its arguments here so that bad input
raises a :class:`ValueError` (or :class:`TypeError`) naming the parameter, the offending
value and what is allowed, and so that NaN or infinite numbers are rejected, never absorbed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "check_arms",
    "check_array_field",
    "check_binary",
    "check_finite_array",
    "check_matrix",
    "check_none_flagged",
    "check_nonneg_weights",
    "check_positive_float",
    "check_positive_int",
    "check_rate_or_horizon",
    "check_reward_range",
    "check_seed",
    "check_unit_interval",
    "check_vector",
    "rng_from_state",
    "rng_state",
    "to_jsonable",
]


def _describe(value: Any) -> str:
    """Return a short repr of ``value`` for an error message (arrays are summarised)."""
    if isinstance(value, np.ndarray):
        return f"array(shape={value.shape}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1, else raise.

    Raises
    ------
    ValueError
        If ``value`` is not an integer (bools are refused) or is < 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {_describe(value)}")
    return int(value)


def check_positive_float(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a finite ``float`` > 0 (or >= 0 with ``allow_zero``), else raise.

    Raises
    ------
    ValueError
        If ``value`` is not a real number, is NaN/infinite, or is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a finite real number, got {_describe(value)}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or (v == 0.0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {_describe(value)}")
    return v


def check_unit_interval(
    name: str, value: Any, *, low_open: bool = True, high_open: bool = False
) -> float:
    """Return ``value`` as a float in the unit interval, (0, 1] by default, else raise.

    Parameters
    ----------
    name : str
        Parameter name used in the error message.
    value : Any
        The value to check.
    low_open, high_open : bool
        Whether 0 and 1 are excluded.

    Raises
    ------
    ValueError
        If ``value`` is not a finite real number inside the interval.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {_describe(value)}")
    v = float(value)
    lo_ok = v > 0.0 if low_open else v >= 0.0
    hi_ok = v < 1.0 if high_open else v <= 1.0
    if not (math.isfinite(v) and lo_ok and hi_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must lie in {interval}, got {_describe(value)}")
    return v


def check_seed(value: Any) -> int | None:
    """Return ``seed`` as ``None`` or a non-negative ``int``, else raise ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"seed must be None or a non-negative integer, got {_describe(value)}")
    return int(value)


def check_finite_array(name: str, arr: np.ndarray) -> None:
    """Raise ``ValueError`` if ``arr`` holds a NaN or an infinity."""
    if not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr.ravel()))
        raise ValueError(
            f"{name} must be finite; found {bad.size} NaN/inf value(s), "
            f"first at flat index {int(bad[0])} ({arr.ravel()[bad[0]]!r})"
        )


def _as_float_array(name: str, value: Any) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numeric, got {_describe(value)}") from exc
    return arr


def check_matrix(name: str, value: Any, n_cols: int) -> np.ndarray:
    """Return ``value`` as a finite float64 array of shape ``[n, n_cols]``.

    Raises
    ------
    ValueError
        If it is not numeric, not 2-D, has the wrong number of columns, or holds NaN/inf.
    """
    arr = _as_float_array(name, value)
    if arr.ndim != 2 or arr.shape[1] != n_cols:
        raise ValueError(f"{name} must have shape [n, {n_cols}], got shape {arr.shape}")
    check_finite_array(name, arr)
    return arr


def check_vector(name: str, value: Any, length: int | None = None) -> np.ndarray:
    """Return ``value`` as a finite float64 1-D array (of ``length`` entries if given).

    Raises
    ------
    ValueError
        If it is not numeric, not 1-D, has the wrong length, or holds NaN/inf.
    """
    arr = _as_float_array(name, value)
    if arr.ndim != 1 or (length is not None and arr.shape[0] != length):
        want = f"[{length}]" if length is not None else "[n]"
        raise ValueError(f"{name} must have shape {want}, got shape {arr.shape}")
    check_finite_array(name, arr)
    return arr


def check_none_flagged(name: str, arr: np.ndarray, bad: np.ndarray, requirement: str) -> None:
    """Raise ``ValueError`` naming the first entry of ``arr`` flagged in ``bad`` (same shape).

    The message reads ``"{name} {requirement}; found {value} at flat index {i}"``.
    """
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(f"{name} {requirement}; found {arr.ravel()[i]!r} at flat index {i}")


def check_binary(name: str, value: Any, length: int) -> np.ndarray:
    """Return ``value`` as a float64 array of shape ``[length]`` with entries in {0, 1}.

    Raises
    ------
    ValueError
        If the shape is wrong, an entry is NaN/inf, or an entry is not exactly 0 or 1.
    """
    arr = check_vector(name, value, length)
    check_none_flagged(name, arr, (arr != 0.0) & (arr != 1.0), "must hold only 0 or 1")
    return arr


def check_nonneg_weights(name: str, value: Any, length: int) -> np.ndarray:
    """Return ``value`` as a finite, non-negative float64 array of shape ``[length]``.

    Raises
    ------
    ValueError
        If the shape is wrong or an entry is NaN/inf or negative.
    """
    arr = check_vector(name, value, length)
    check_none_flagged(name, arr, arr < 0.0, "must be >= 0")
    return arr


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """Return the bit generator's state as a JSON-serialisable dict (ints stay exact)."""
    return copy.deepcopy(rng.bit_generator.state)


def rng_from_state(state: Any) -> np.random.Generator:
    """Rebuild a :class:`numpy.random.Generator` from :func:`rng_state`'s output.

    Raises
    ------
    ValueError
        If ``state`` does not describe a numpy bit generator.
    """
    if not isinstance(state, dict) or "bit_generator" not in state:
        raise ValueError(
            f"rng state must be a dict with key 'bit_generator', got {_describe(state)}"
        )
    name = state["bit_generator"]
    cls = getattr(np.random, str(name), None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, np.random.BitGenerator):
        raise ValueError(f"rng state names an unknown bit generator {name!r}")
    bit_gen = cls()
    try:
        bit_gen.state = copy.deepcopy(state)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"rng state is not a valid {name} state: {exc}") from exc
    return np.random.Generator(bit_gen)


def check_rate_or_horizon(
    rate_name: str, rate: Any, horizon: Any, check_rate: Any
) -> tuple[float | None, int | None]:
    """Validate a learning rate and a horizon to tune it for, of which at most one may be given.

    ``check_rate(rate_name, rate)`` validates the rate; the horizon must be an integer >= 1.

    Raises
    ------
    ValueError
        If both are given, or either is out of range.
    """
    if rate is not None and horizon is not None:
        raise ValueError(f"give {rate_name} or horizon, not both")
    return (
        None if rate is None else check_rate(rate_name, rate),
        None if horizon is None else check_positive_int("horizon", horizon),
    )


def check_array_field(data: dict[str, Any], key: str, shape: tuple[int, ...]) -> np.ndarray:
    """Read ``data[key]`` as a finite float64 array of ``shape`` (for restoring a state).

    Raises
    ------
    ValueError
        If the shape is wrong or an entry is NaN/inf (KeyError if ``key`` is missing).
    """
    arr = np.asarray(data[key], dtype=np.float64)
    if arr.shape != shape:
        raise ValueError(f"{key} must have shape {shape}, got {arr.shape}")
    check_finite_array(key, arr)
    return arr


def check_arms(arms: Any) -> list[int | str]:
    """Return ``arms`` as a list of distinct ``int``/``str`` ids (they must survive JSON).

    Raises
    ------
    ValueError
        If ``arms`` is not a non-empty sequence of distinct str or int ids (bools are refused).
    """
    if isinstance(arms, (str, bytes)) or not isinstance(arms, (Sequence, np.ndarray)):
        raise ValueError(
            f"arms must be a non-empty list of arm ids (str or int), got {type(arms).__name__}"
        )
    out: list[int | str] = []
    for a in arms:
        if isinstance(a, (bool, np.bool_)):
            raise ValueError(f"arms must hold str or int ids, got the bool {a!r}")
        if isinstance(a, (int, np.integer)):
            out.append(int(a))
        elif isinstance(a, str):
            out.append(str(a))
        else:
            raise ValueError(
                f"arms must hold str or int ids (JSON round trip), got {a!r} "
                f"of type {type(a).__name__}"
            )
    if not out:
        raise ValueError("arms must hold at least one arm id, got an empty list")
    if len(set(out)) != len(out):
        dup = sorted({repr(a) for a in out if out.count(a) > 1})
        raise ValueError(f"arms must be distinct, got duplicates {', '.join(dup)}")
    return out


def check_reward_range(value: Any) -> tuple[float, float] | None:
    """Return ``None`` or a finite pair ``(low, high)`` with ``low < high``, else raise ``ValueError``."""
    if value is None:
        return None
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward_range must be None or a pair (low, high), got {value!r}") from exc
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"reward_range must be finite with low < high, got {value!r}")
    return (lo, hi)


def to_jsonable(value: Any) -> Any:
    """numpy arrays and scalars (and tuples) as plain lists and Python numbers, for ``json.dumps``."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return [to_jsonable(v) for v in value]
    return value
