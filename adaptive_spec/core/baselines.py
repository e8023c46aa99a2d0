"""Non-adaptive reference policies, in the same :class:`~adaptive_spec.core.controller.SpecPolicy` framework.

* :class:`StaticPolicy`: one fixed arm for every request and step (what engines do today with one
  method and one ``num_speculative_tokens``).
* :class:`BatchSizeTablePolicy`: vLLM 0.32's dynamic speculation, a user-given table
  ``[[start, end, k], ...]`` from batch size to k for one proposer, per step.

:func:`default_baseline` is the adaptive controller's safe baseline: an n-gram batch-size table
(:data:`DEFAULT_NGRAM_TABLE`, measured on the embedded default, ``docs/benchmarks.md``).
"""

from __future__ import annotations

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepView


def _cut(arm: Arm, available: int) -> Arm:
    """The arm actually played when the proposer offers only ``available`` tokens."""
    k = min(arm.k, max(available, 0))
    return NO_SPEC if k == 0 else Arm(arm.proposer, k)


class StaticPolicy(SpecPolicy):
    """Always the same arm (cut to what the proposer offers and to the request's budget).

    Parameters
    ----------
    arm : Arm
        The arm to play; its proposer must be among ``proposers`` unless it is ``none``.
    """

    name = "static"

    def __init__(self, proposers: list[str], max_k: int, arm: Arm) -> None:
        super().__init__(proposers, max_k)
        if arm.k > max_k:
            raise ValueError(
                f"k={arm.k} is out of range; allowed: 0..{max_k} (num_speculative_tokens)"
            )
        if arm.k > 0 and arm.proposer not in self.proposers:
            raise ValueError(
                f"proposer={arm.proposer!r} is not enabled; enabled: {', '.join(self.proposers) or 'none'}"
            )
        self.arm = arm
        self.name = f"static:{arm}"

    def decide(self, view: StepView) -> Decision:
        arms = []
        for r in view.requests:
            d = r.drafts.get(self.arm.proposer)
            avail = 0 if d is None else min(len(d), r.max_new_tokens - 1)
            arms.append(_cut(self.arm, avail))
        return Decision(arms, [1.0] * len(arms), [[] for _ in arms])


class BatchSizeTablePolicy(SpecPolicy):
    """vLLM's ``num_speculative_tokens_per_batch_size`` table for one proposer: batch sizes in
    ``[start, end]`` use k; batch sizes outside every row use k = 0.

    Raises
    ------
    ValueError
        For a malformed table (rows must be ``[start, end, k]`` with ``1 <= start <= end`` and
        ``0 <= k <= max_k``).
    """

    name = "table"

    def __init__(
        self, proposers: list[str], max_k: int, proposer: str, table: list[list[int]]
    ) -> None:
        super().__init__(proposers, max_k)
        if proposer not in self.proposers:
            raise ValueError(
                f"proposer={proposer!r} is not enabled; enabled: {', '.join(self.proposers)}"
            )
        for row in table:
            if (
                not isinstance(row, list | tuple)
                or len(row) != 3
                or not all(isinstance(v, int) for v in row)
                or not (1 <= row[0] <= row[1])
                or not (0 <= row[2] <= max_k)
            ):
                raise ValueError(
                    f"table row {row!r} is invalid; allowed: [start, end, k] with 1 <= start <= end, 0 <= k <= {max_k}"
                )
        self.proposer = proposer
        self.table = [list(r) for r in table]
        self.name = f"table:{proposer}"

    def k_for(self, batch_size: int) -> int:
        for start, end, k in self.table:
            if start <= batch_size <= end:
                return k
        return 0

    def decide(self, view: StepView) -> Decision:
        k = self.k_for(view.batch_size)
        arm = NO_SPEC if k == 0 else Arm(self.proposer, k)
        arms = []
        for r in view.requests:
            d = r.drafts.get(self.proposer)
            avail = 0 if d is None else min(len(d), r.max_new_tokens - 1)
            arms.append(_cut(arm, avail))
        return Decision(arms, [1.0] * len(arms), [[] for _ in arms])


#: The n-gram batch-size table the adaptive controller holds as its baseline by default, in vLLM's
#: ``num_speculative_tokens_per_batch_size`` format: the best static n-gram k measured per concurrency
#: on the embedded default (``docs/benchmarks.md``), each k owning the batch sizes nearest to it (k = 1
#: from batch 9: at c=16 greedy, k = 1 is 1.015x of no speculation over three grids, k = 2 1.010x,
#: and replayed c=16 traces put k = 2 below k = 1).
DEFAULT_NGRAM_TABLE = ((1, 2, 8), (3, 8, 4), (9, 1 << 20, 1))


def default_baseline(proposers: list[str], max_k: int) -> SpecPolicy:
    """The default safe baseline: :data:`DEFAULT_NGRAM_TABLE` (k cut to ``max_k``) when ``ngram`` is
    enabled, else no speculation."""
    if "ngram" in proposers:
        rows = [[s, e, min(k, max_k)] for s, e, k in DEFAULT_NGRAM_TABLE]
        return BatchSizeTablePolicy(list(proposers), max_k, "ngram", rows)
    return StaticPolicy(list(proposers), max_k, NO_SPEC)


def default_baseline_spec(proposers: list[str], max_k: int) -> str:
    """:func:`default_baseline` as a policy name for :func:`adaptive_spec.core.policies.make_policy`."""
    if "ngram" in proposers:
        rows = ",".join(f"{s}-{e}={min(k, max_k)}" for s, e, k in DEFAULT_NGRAM_TABLE)
        return f"table:ngram:{rows}"
    return "none"
