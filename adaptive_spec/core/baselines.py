"""Non-adaptive reference policies, in the same :class:`~adaptive_spec.core.controller.SpecPolicy` framework.

* :class:`StaticPolicy`: one fixed arm for every request and step (what engines do today with one
  method and one ``num_speculative_tokens``).
* :class:`BatchSizeTablePolicy`: vLLM 0.32's dynamic speculation, a user-given table
  ``[[start, end, k], ...]`` from batch size to k for one proposer, per step.

:func:`default_baseline` is the adaptive controller's safe baseline: an n-gram batch-size table
(:data:`DEFAULT_NGRAM_TABLE`, measured on the embedded default, ``docs/results.md``). The
controller plays a baseline as a :class:`BaselineRule` (:func:`baseline_rule`).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.core.arms import NO_SPEC, Arm, drafts_with_drafter
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

    def drafter_k_cap(self) -> int:
        """The arm's k when the engine's drafter makes its drafts, else 0: a static arm takes nothing
        longer, so the drafter never runs passes it cannot use."""
        return self.arm.k if drafts_with_drafter(self.arm.proposer) else 0

    def drafter_preference(self, req_id: str, candidates: list[str]) -> str | None:
        """The arm's own proposer when it is one of the drafter's (``draft`` / ``lora:<name>``), so that
        a ``lora:<name>`` arm's requests are drafted with that adapter; else ``None``."""
        return self.arm.proposer if self.arm.proposer in candidates else None


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
#: on the embedded default (``docs/results.md``), each k owning the batch sizes nearest to it (k = 1
#: from batch 9: at c=16 greedy, k = 1 is 1.015x of no speculation over three grids, k = 2 1.010x,
#: and replayed c=16 traces put k = 2 below k = 1).
DEFAULT_NGRAM_TABLE = ((1, 2, 8), (3, 8, 4), (9, 1 << 20, 1))


def baseline_policy(
    name: str, proposers: list[str], max_k: int
) -> StaticPolicy | BatchSizeTablePolicy | None:
    """The non-adaptive policy that ``name`` denotes: ``none``, ``static:<proposer>:<k>`` or
    ``table:<proposer>:<start>-<end>=<k>,...`` (:func:`adaptive_spec.core.policies.make_policy`'s
    names of these policies); None for any other name.

    Raises
    ------
    ValueError
        For a malformed name of one of them, or an arm, proposer or k the engine cannot run.
    """
    if name == "none":
        return StaticPolicy(proposers, max_k, NO_SPEC)
    if name.startswith("static:"):
        return StaticPolicy(proposers, max_k, Arm.parse(name.removeprefix("static:")))
    if not name.startswith("table:"):
        return None
    proposer, _, spec = name.removeprefix("table:").partition(":")
    rows = []
    try:
        for part in spec.split(","):
            rng, _, k = part.partition("=")
            start, _, end = rng.partition("-")
            rows.append([int(start), int(end), int(k)])
    except ValueError:
        raise ValueError(
            f"policy={name!r} is invalid; expected e.g. 'table:ngram:1-2=8,3-8=4,9-256=1'"
        ) from None
    return BatchSizeTablePolicy(proposers, max_k, proposer, rows)


def default_baseline(proposers: list[str], max_k: int) -> SpecPolicy:
    """The default safe baseline: :data:`DEFAULT_NGRAM_TABLE` (k cut to ``max_k``) when ``ngram`` is
    enabled, else no speculation."""
    if "ngram" in proposers:
        rows = [[s, e, min(k, max_k)] for s, e, k in DEFAULT_NGRAM_TABLE]
        return BatchSizeTablePolicy(list(proposers), max_k, "ngram", rows)
    return StaticPolicy(list(proposers), max_k, NO_SPEC)


@dataclass(frozen=True, slots=True)
class BaselineRule:
    """A safe baseline as the adaptive controller plays it: one proposer's k per batch size."""

    proposer: str | None  # the proposer that drafts; None: no speculation
    table: tuple[tuple[int, int, int], ...]  # (start, end, k) rows: batch sizes start..end use k
    name: str  # the baseline policy's name ("none" without speculation)

    def k_at(self, batch_size: int, max_k: int) -> int:
        """The baseline's k at ``batch_size`` (0 outside every row), at most ``max_k``."""
        for start, end, k in self.table:
            if start <= batch_size <= end:
                return min(int(k), max_k)
        return 0


def baseline_rule(
    baseline: str | SpecPolicy | None, proposers: list[str], max_k: int
) -> BaselineRule:
    """The rule of a safe baseline given as a name (:func:`baseline_policy`), a
    :class:`StaticPolicy` or :class:`BatchSizeTablePolicy`, or None (:func:`default_baseline`).

    Raises
    ------
    ValueError
        For another name or policy, or a proposer outside ``proposers``.
    """
    if baseline is None:
        baseline = default_baseline(proposers, max_k)
    if isinstance(baseline, str):
        try:
            parsed = baseline_policy(baseline, ["none", *proposers], max_k)
        except ValueError as e:
            raise ValueError(f"baseline={baseline!r} is invalid: {e}") from None
        baseline = baseline if parsed is None else parsed
    if isinstance(baseline, StaticPolicy):
        arm = baseline.arm
        proposer = arm.proposer if arm.k else None
        table = ((1, 1 << 30, arm.k),)
    elif isinstance(baseline, BatchSizeTablePolicy):
        proposer = baseline.proposer
        table = tuple((s, e, k) for s, e, k in baseline.table)
    else:
        raise ValueError(
            f"baseline={baseline!r} is invalid; allowed: none, static:<proposer>:<k>, "
            "table:<proposer>:<start>-<end>=<k>,... (a proposer this controller enables)"
        )
    if proposer is not None and proposer not in proposers:
        raise ValueError(
            f"baseline proposer {proposer!r} is not enabled; enabled: "
            f"{', '.join(proposers) or 'none'}"
        )
    return BaselineRule(proposer, table, baseline.name if proposer else "none")


def default_baseline_spec(proposers: list[str], max_k: int) -> str:
    """:func:`default_baseline` as a policy name for :func:`adaptive_spec.core.policies.make_policy`."""
    if "ngram" in proposers:
        rows = ",".join(f"{s}-{e}={min(k, max_k)}" for s, e, k in DEFAULT_NGRAM_TABLE)
        return f"table:ngram:{rows}"
    return "none"
