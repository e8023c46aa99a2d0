"""The deferred KV-cache pass of an EAGLE head (adaptive_spec.vllm.deferred_kv), without an engine:
what is stashed (vLLM's input shift), what a flush writes (the last value of each slot, in write
order, no padding slots), forced flushes, refusals and faults. The engine-level check, that the drafts
and the first draft pass are those of vLLM's own pass, is ``kv-deferred`` in
``tests/test_correctness_eagle3.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from adaptive_spec.vllm.deferred_kv import DeferredDrafterKV, deferrable, install_deferred_kv
from adaptive_spec.vllm.patches import InstancePatches


def fake_drafter(layers: int = 1, method: str = "eagle3", dp: int = 1) -> Any:
    return SimpleNamespace(
        method=method,
        model=SimpleNamespace(model=SimpleNamespace(layers=[object()] * layers)),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp)),
        input_ids=torch.zeros(64, dtype=torch.int32),
        max_num_tokens=64,
        num_speculative_tokens=4,
        _last_draft_probs="stale",
    )


def cad(query_lens: list[int], slots: list[int]) -> Any:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        query_start_loc=qsl,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        batch_size=lambda: len(query_lens),
    )


class Recorder(DeferredDrafterKV):
    """Records what the batched pass would write instead of running a model."""

    def __init__(self, drafter: Any, **kw: Any) -> None:
        super().__init__(drafter, **kw)
        self.writes: list[tuple[list[int], list[int], list[int], torch.Tensor]] = []

    def _write(self, ids: Any, pos: Any, slots: Any, hidden: Any) -> None:
        self.writes.append((ids.tolist(), pos.tolist(), slots.tolist(), hidden.clone()))


def step(kv: DeferredDrafterKV, tokens, positions, slots, query_lens, next_ids, base: float):
    n = len(tokens)
    hidden = base + torch.arange(n, dtype=torch.float32).view(n, 1).repeat(1, 3)
    return kv.wrap(lambda *a, **k: "vllm")(
        num_speculative_tokens=0,
        target_token_ids=torch.tensor(tokens, dtype=torch.int32),
        target_positions=torch.tensor(positions),
        target_hidden_states=hidden,
        next_token_ids=torch.tensor(next_ids),
        token_indices_to_sample=None,
        common_attn_metadata=cad(query_lens, slots),
        sampling_metadata=None,
    )


def test_stash_shifts_inputs_like_vllm_and_flush_keeps_last_write_per_slot():
    d = fake_drafter()
    kv = Recorder(d)
    # step 1: request a prefills 3 tokens (slots 10-12), request b decodes 1 (slot 20)
    out = step(kv, [5, 6, 7, 9], [0, 1, 2, 7], [10, 11, 12, 20], [3, 1], [8, 30], base=0.0)
    assert out.shape == (2, 0) and out.dtype == torch.int64
    assert d.num_speculative_tokens == 0 and d._last_draft_probs is None
    assert kv.writes == []  # nothing written on a step without draft passes
    # step 2: a decodes at slot 13; b's slot 20 written again (a later value); c is padding
    step(kv, [8, 30, 0], [3, 7, 0], [13, 20, -1], [1, 1, 1], [40, 31, 0], base=100.0)
    assert kv.stats()["stashed"] == 7 and kv.deferred_steps == 2
    drafted = kv.wrap(lambda *a, **k: "vllm")(2, "args")  # a drafting step flushes first
    assert drafted == "vllm"
    (ids, pos, slots, hidden), *rest = kv.writes
    assert rest == []
    # EAGLE's shift: position p reads the token at p + 1, each request's last position the next token
    assert slots == [10, 11, 12, 13, 20]  # write order kept, slot 20 once, padding dropped
    assert ids == [6, 7, 8, 40, 31]
    assert pos == [0, 1, 2, 3, 7]
    assert hidden[-1, 0].item() == 101.0  # slot 20's last value (step 2, row 1)
    assert kv.stats() == {"deferred_steps": 2, "flushes": 1, "flushed_tokens": 5, "stashed": 0}


def test_stash_past_max_tokens_flushes_at_once():
    kv = Recorder(fake_drafter(), max_tokens=4)
    step(kv, [1, 2, 3], [0, 1, 2], [0, 1, 2], [3], [4], base=0.0)
    assert kv.writes == []
    step(kv, [4], [3], [3], [1], [5], base=10.0)
    assert len(kv.writes) == 1 and kv.writes[0][2] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("drafter", "why"),
    [
        (fake_drafter(layers=2), "one decoder layer"),
        (fake_drafter(method="draft_model"), "not an EAGLE head"),
        (fake_drafter(dp=2), "data parallelism"),
    ],
)
def test_refused_where_a_later_write_would_differ(drafter, why):
    assert why in deferrable(drafter)
    with pytest.raises(ValueError, match=why):
        DeferredDrafterKV(drafter)
    patches = InstancePatches()
    assert install_deferred_kv(drafter, patches) is None  # vLLM's own pass stays
    assert "propose" not in vars(drafter)


def test_bad_max_tokens_is_named():
    with pytest.raises(ValueError, match="max_tokens=0"):
        DeferredDrafterKV(fake_drafter(), max_tokens=0)


def test_a_failed_deferral_runs_vllms_pass_and_is_a_fault():
    kv = Recorder(fake_drafter())
    faults: list[str] = []
    calls: list[int] = []

    def vllm_propose(n: int, *a: Any, **k: Any) -> str:
        calls.append(n)
        return "vllm"

    wrapped = kv.wrap(vllm_propose, lambda where, e: faults.append(where))
    assert wrapped(0, "not", "tensors") == "vllm"  # the stash fails on these arguments
    assert calls == [0] and faults == ["drafter kv deferral"]
    assert kv.stats()["stashed"] == 0


def test_install_patches_propose_and_flushes_when_restored():
    d = fake_drafter()
    d.propose = lambda *a, **k: "vllm"
    patches = InstancePatches()
    kv = install_deferred_kv(d, patches)
    assert kv is not None
    recorded: list[int] = []
    kv._write = lambda ids, pos, slots, hidden: recorded.extend(slots.tolist())  # type: ignore[method-assign]
    step_args = dict(
        target_token_ids=torch.tensor([1, 2], dtype=torch.int32),
        target_positions=torch.tensor([0, 1]),
        target_hidden_states=torch.zeros(2, 3),
        next_token_ids=torch.tensor([3]),
        token_indices_to_sample=None,
        common_attn_metadata=cad([2], [4, 5]),
        sampling_metadata=None,
    )
    d.propose(num_speculative_tokens=0, **step_args)
    assert recorded == []
    patches.restore()
    assert recorded == [4, 5]
    assert d.propose() == "vllm"  # the instance attribute set before install is back
