"""The drafter's pass plan: the largest k in use, probes while it is unused or fully used, and the
cap a static arm puts on it."""

from __future__ import annotations

import pytest

from adaptive_spec.core.drafter_passes import DrafterPasses


def test_plan_follows_the_largest_chosen_k():
    p = DrafterPasses(4, gap=8, grow_every=4)
    assert p.next == 4  # the first step drafts in full
    assert p.plan([2, 1, 0], [4, 4, 4]) == 2
    assert p.plan([1, 0, 0], [2, 2, 2]) == 1
    assert p.plan([3], [4]) == 3


def test_idle_plan_is_zero_with_doubling_probes():
    p = DrafterPasses(4, gap=2, max_gap=8, grow_every=4)
    plans = [p.plan([0, 0], [4, 4]) for _ in range(20)]
    # probes at gaps 2, 4, 8, 8 ... (each unused probe doubles the gap)
    assert [i for i, n in enumerate(plans) if n] == [1, 5, 13]
    assert all(n in (0, 4) for n in plans)
    assert p.probes == 3
    # a request drafting again resets the gap
    assert p.plan([2], [4]) == 2 and p.gap == 2


def test_idle_probes_follow_the_last_use_at_its_k():
    """Idle probes draft the k last taken (not the full length), at doubling gaps."""
    p = DrafterPasses(4, gap=1)
    assert p.plan([2], [4]) == 2
    plans = [p.plan([0], [2]) for _ in range(16)]
    # probes at the k last used (2) after 1, 2, 4 and 8 steps without use
    assert [i for i, n in enumerate(plans) if n] == [0, 2, 6, 14]
    assert set(plans) == {0, 2}
    assert p.plan([1], [2]) == 1 and p.gap == 1


def test_full_use_probes_for_longer_chains():
    p = DrafterPasses(4, grow_every=3)
    plans = [p.plan([2], [2]) for _ in range(7)]
    assert plans == [2, 2, 4, 2, 2, 4, 2]
    assert p.as_dict()["probes"] == 2


def test_bad_settings_name_the_parameter():
    with pytest.raises(ValueError, match="max_k=0"):
        DrafterPasses(0)
    with pytest.raises(ValueError, match="gap=9, max_gap=8"):
        DrafterPasses(4, gap=9, max_gap=8)
    with pytest.raises(ValueError, match="grow_every=0"):
        DrafterPasses(4, grow_every=0)


def test_baseline_is_not_charged_the_passes_beyond_its_k():
    from adaptive_spec.core.drafter_passes import passes_not_in_baseline

    # 3 draft passes + the KV-cache pass took 4 ms: 1 ms each
    assert passes_not_in_baseline(0.004, 3, 0) == pytest.approx(0.003)
    assert passes_not_in_baseline(0.004, 3, 2) == pytest.approx(0.001)
    assert passes_not_in_baseline(0.004, 3, 4) == 0.0
    assert passes_not_in_baseline(0.004, None, 0) == 0.0  # passes not planned: all fixed
    assert passes_not_in_baseline(0.0, 3, 0) == 0.0


def test_drafter_k_cap_of_policies():
    """A static arm caps the drafter's k at its own k (0 for a proposer the drafter does not serve);
    a learning policy leaves it open."""
    from adaptive_spec.core.arms import Arm, drafts_with_drafter
    from adaptive_spec.core.baselines import StaticPolicy
    from adaptive_spec.core.controller import AdaptiveController

    props = ["ngram", "draft", "lora:code"]
    assert StaticPolicy(props, 4, Arm("draft", 2)).drafter_k_cap() == 2
    assert StaticPolicy(props, 4, Arm("lora:code", 3)).drafter_k_cap() == 3
    assert StaticPolicy(props, 4, Arm("ngram", 4)).drafter_k_cap() == 0
    assert AdaptiveController(props, 4).drafter_k_cap() is None
    assert [drafts_with_drafter(p) for p in ["none", "ngram", "draft", "lora:x"]] == [
        False,
        False,
        True,
        True,
    ]
