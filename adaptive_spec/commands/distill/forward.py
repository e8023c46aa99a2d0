"""Forward passes of the target and the draft during distillation: final normed hidden states, under
bf16 autocast when asked."""

from __future__ import annotations

import contextlib
from typing import Any


def final_hidden(model: Any, ids: Any, att: Any) -> Any:
    """Final normed hidden states [B, T, H] of a Llama causal LM (no LM head)."""
    return model.model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state


def bf16_autocast(device: str, enabled: bool) -> Any:
    """A context running ``device``'s (``cpu``, ``cuda[:N]``) operations in bfloat16 where torch's
    autocast does, or a no-op when not ``enabled``."""
    import torch

    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(
        device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16
    )
