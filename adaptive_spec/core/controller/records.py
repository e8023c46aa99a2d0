"""A step's records: the batch as the decision reads it, the pending decision, the committed rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptive_spec.core.protocol import RequestView, StepOutcome

_NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class BatchLists:
    """A decision's batch of ``N`` requests and ``P`` proposers, from one pass over its views."""

    req_ids: list[str]  # [N] request ids, in the batch's order
    ints: np.ndarray  # int64 [3 N + 2 N P]: output positions, budgets, temperature buckets (each
    #                   [N]), then offered draft lengths (cut to K) and match features ([N * P],
    #                   row-major over (request, proposer))
    parts: np.ndarray  # int64 [sum of the draft lengths]: the offered drafts concatenated
    temp: list[int]  # [N] temperature bucket (0 greedy, 1 sampled)

    @classmethod
    def gather(cls, reqs: list[RequestView], proposers: list[str], K: int) -> BatchLists:
        """The batch of ``reqs`` with the drafts of ``proposers`` (each cut to ``K`` tokens)."""
        N, P = len(reqs), len(proposers)
        req_ids: list[str] = [""] * N
        pos_l = [0] * N
        cap_l = [0] * N
        temp_l = [0] * N
        dlen = [0] * (N * P)
        mlen = [0] * (N * P)
        parts: list[np.ndarray] = []
        j = 0
        for i, r in enumerate(reqs):
            req_ids[i] = r.req_id
            pos_l[i] = r.num_output_tokens
            cap_l[i] = r.max_new_tokens
            temp_l[i] = 1 if r.temperature > 0 else 0
            dd = r.drafts
            if dd:
                for p in proposers:
                    d = dd.get(p)
                    if d is not None:
                        n = len(d)
                        if n:
                            if n > K:
                                d, n = d[:K], K
                            dlen[j] = n
                            parts.append(d)
                            mlen[j] = r.match_lengths.get(p, 0)
                    j += 1
            else:
                j += P
        ints = np.array(pos_l + cap_l + temp_l + dlen + mlen, dtype=np.int64)
        flat = np.concatenate(parts).astype(np.int64, copy=False) if parts else _NO_TOKENS
        return cls(req_ids, ints, flat, temp_l)


@dataclass(slots=True)
class PendingDecision:
    """The last decision, kept from :meth:`~adaptive_spec.core.controller.AdaptiveController.decide`
    to the observation of its step; its per-request arrays stay in the controller's
    :class:`~adaptive_spec.core.controller_kernels.StepBuffers` (rows ``0..n-1``)."""

    step: int  # the decision's number (the controller's n_steps when it decided)
    index: dict[str, int]  # request id -> row of the decided batch, 0..n-1
    n: int  # requests decided (N)
    all_same: bool  # the decision is the baseline's: no baseline draft to register
    batch_size: int  # the engine's batch size B (>= N)
    sampled: float  # share of the decided requests that sample (temperature > 0), in [0, 1]
    Vb: int  # draft tokens the baseline's decision verifies
    calibrate: bool  # keep the judged positions' predictions for the calibration report
    jacobi_played: bool  # some request played Jacobi (a probe aside): its outcome rates Jacobi


@dataclass(frozen=True, slots=True)
class OutcomeRows:
    """The requests of a step's outcome that a table knows (request id -> row or slot)."""

    keys: list[int]  # [n] their rows or slots
    lens: list[int]  # [n] tokens each committed
    tokens: list[int]  # [sum(lens)] those tokens, one request after another
    finished: list[int]  # rows or slots of those that finished
    done: list[str]  # ids of every finished request of the outcome, known or not

    @classmethod
    def of(cls, outcome: StepOutcome, index: dict[str, int]) -> OutcomeRows:
        """The outcome's requests found in ``index``."""
        keys: list[int] = []
        lens: list[int] = []
        flat: list[int] = []
        finished: list[int] = []
        done: list[str] = []
        for o in outcome.requests:
            if o.finished:
                done.append(o.req_id)
            i = index.get(o.req_id)
            if i is None:
                continue
            em = o.emitted_token_ids
            keys.append(i)
            lens.append(len(em))
            flat.extend(em)
            if o.finished:
                finished.append(i)
        return cls(keys, lens, flat, finished, done)
