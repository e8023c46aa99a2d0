"""`adaptive_spec.commands.identity.compare_greedy` on hand-built outputs: where a near-tie ends."""

from __future__ import annotations

from types import SimpleNamespace

from adaptive_spec.commands.identity import compare_greedy


def _out(tokens: list[int], margins: list[float] | None = None) -> SimpleNamespace:
    """A vLLM-like RequestOutput: token ids and, per position, a top-2 logprobs dict whose top-1
    minus top-2 is the given margin."""
    lps = None
    if margins is not None:
        lps = [
            {t: SimpleNamespace(logprob=0.0), t + 1: SimpleNamespace(logprob=-m)}
            for t, m in zip(tokens, margins, strict=True)
        ]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=lps)])


def test_a_margin_of_two_bf16_quanta_is_a_near_tie_and_a_wider_one_a_violation() -> None:
    # Two bf16 quanta of 0.125 as vLLM reports them (float32): 0.25 + 2**-24, measured in a run.
    two_quanta = 0.2500000596046448
    cases = [two_quanta, 0.25, 0.0, 0.2501, 0.5]
    ref = [_out([1, 2, 3], [1.0, m, 1.0]) for m in cases]
    cand = [_out([1, 9, 9]) for _ in cases]
    res = compare_greedy(ref, cand)
    assert [d["near_tie"] for d in res["details"]] == [True, True, True, False, False]
    assert (res["identical"], res["near_tie"], res["violations"]) == (0, 3, 2)
    # Identical outputs need no logprobs.
    same = compare_greedy([_out([1, 2])], [_out([1, 2])])
    assert (same["identical"], same["violations"]) == (1, 0)
