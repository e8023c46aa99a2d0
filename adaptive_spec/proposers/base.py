"""The proposer interface: one ``propose()`` per step for a batch of requests.

Every proposer is *total*: for any request content (empty context, garbage ids, a single token
repeated 10,000 times, no EOS) ``propose`` returns, per request, 0..k int64 draft tokens in
[0, vocab_size), cut to ``max_new_tokens - 1``, in bounded time, and never raises. Invalid
*configuration* is refused at construction with a ValueError.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class ProposalRequest:
    """What a proposer sees of one request at one engine step.

    Attributes
    ----------
    req_id : str
        Stable request id (keys per-request state).
    token_ids : np.ndarray
        int64 [n]: prompt + committed output tokens so far (n >= 0).
    max_new_tokens : int
        Tokens this request may still emit; drafts are capped at ``max_new_tokens - 1``.
    vocab_size : int
        Draft ids must lie in [0, vocab_size).
    last_draft : np.ndarray or None
        int64 [k_prev]: draft tokens verified at the previous step.
    last_target_argmax : np.ndarray or None
        int64 [k_prev + 1]: target argmax at each verified position of the previous step (index
        j = the target's prediction after draft[:j]); index ``last_accepted`` is the
        bonus/correction token already committed.
    last_accepted : int
        Draft tokens accepted at the previous step.
    """

    req_id: str
    token_ids: np.ndarray
    max_new_tokens: int
    vocab_size: int
    last_draft: np.ndarray | None = None
    last_target_argmax: np.ndarray | None = None
    last_accepted: int = 0


class Proposer(ABC):
    """Drafts tokens for a batch of requests (one proposer per module, vLLM ``v1/spec_decode`` style)."""

    name: str = ""

    @abstractmethod
    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        """Draft up to ``ks[i]`` tokens for each request.

        Parameters
        ----------
        requests : sequence of ProposalRequest
        ks : sequence of int
            Draft length wanted per request (>= 0; values above the proposer's ``max_k`` are cut).

        Returns
        -------
        list of np.ndarray
            Per request, int64 draft tokens of length 0..ks[i] (and <= max_new_tokens - 1), all in
            [0, vocab_size).

        Raises
        ------
        ValueError
            ``len(ks) != len(requests)`` or a negative k (never for request content).
        """

    @abstractmethod
    def match_length(self, request: ProposalRequest) -> int:
        """Cheap feature for the controller: length of the candidate available now (0 if none)."""

    def release(self, req_id: str) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Drop any per-request state of ``req_id`` (no-op when there is none)."""


def controller_feature(proposer: Any, request: ProposalRequest) -> int:
    """The controller's match feature of ``request`` for ``proposer``: its own ``match_feature``
    when it has one (n-gram: the matched length, 0 when the suffix's occurrences disagree on the
    next token; suffix: its estimated first-token probability in tenths), else its
    ``match_length``. The step driver and the replay's recomputed drafts both take it from here."""
    feature = getattr(proposer, "match_feature", None) or proposer.match_length
    return int(feature(request))


def check_max_k(max_k: object) -> int:
    """Validate a proposer's ``max_k`` (int in [0, 128]); return it."""
    if isinstance(max_k, bool) or not isinstance(max_k, int | np.integer) or not 0 <= max_k <= 128:
        raise ValueError(f"max_k={max_k!r}; expected an int in [0, 128]")
    return int(max_k)


def check_ks(requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[int]:
    """Validate the per-request draft lengths of one ``propose`` call."""
    if len(ks) != len(requests):
        raise ValueError(f"ks has {len(ks)} entries but there are {len(requests)} requests")
    out = []
    for i, k in enumerate(ks):
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            raise ValueError(f"ks[{i}]={k!r}; expected an int >= 0")
        out.append(int(k))
    return out


def as_tokens(x: object) -> np.ndarray:
    """Coerce request content to a 1-D int64 array; anything unusable becomes empty."""
    if x is None:
        return EMPTY
    try:
        arr = np.asarray(x)
        if arr.dtype.kind not in "iub" and (arr.dtype.kind != "f" or not np.isfinite(arr).all()):
            return EMPTY
        return arr.astype(np.int64, copy=False).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        return EMPTY


def as_int(x: object, default: int = 0) -> int:
    """Coerce a scalar field to int; anything unusable becomes ``default``."""
    try:
        return int(x)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return default


def draft_cap(request: ProposalRequest, k: int, max_k: int) -> int:
    """Longest allowed draft: min(k, max_k, max_new_tokens - 1), at least 0."""
    return max(0, min(k, max_k, as_int(request.max_new_tokens) - 1))


def clean_draft(draft: np.ndarray, cap: int, vocab_size: int) -> np.ndarray:
    """Cut ``draft`` to ``cap`` tokens and before its first id outside [0, vocab_size)."""
    d = draft[: max(cap, 0)]
    bad = (d < 0) | (d >= vocab_size)
    if bad.any():
        d = d[: int(np.argmax(bad))]
    return np.ascontiguousarray(d, dtype=np.int64)
