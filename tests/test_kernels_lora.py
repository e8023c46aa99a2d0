"""Multi-LoRA BGMV (PyTorch reference) against a per-token dense computation."""

from __future__ import annotations

import pytest
import torch
from adaptive_spec.kernels import lora_bgmv


@pytest.mark.parametrize("per_adapter_scale", [False, True])
def test_each_token_gets_its_own_adapter(per_adapter_scale: bool) -> None:
    g = torch.Generator().manual_seed(3)
    t, din, dout, r, n_ad = 9, 12, 10, 3, 4
    x = torch.randn(t, din, generator=g, dtype=torch.float64)
    a = torch.randn(n_ad, din, r, generator=g, dtype=torch.float64)
    b = torch.randn(n_ad, r, dout, generator=g, dtype=torch.float64)
    idx = torch.tensor([0, -1, 3, 2, 2, -1, 1, 0, 3])
    y0 = torch.randn(t, dout, generator=g, dtype=torch.float64).float()
    scale = torch.tensor([0.5, 1.0, 2.0, 0.25]) if per_adapter_scale else 0.75
    y = lora_bgmv(y0.clone(), x.float(), a.float(), b.float(), idx, scale)
    for i in range(t):
        if idx[i] < 0:
            assert torch.equal(y[i], y0[i])
            continue
        s = scale[idx[i]].item() if per_adapter_scale else scale
        expect = y0[i].double() + s * (x[i] @ a[idx[i]] @ b[idx[i]])
        assert torch.allclose(y[i].double(), expect, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused() -> None:
    y, x = torch.zeros(2, 4), torch.zeros(2, 3)
    a, b = torch.zeros(2, 3, 1), torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="indices contains"):
        lora_bgmv(y, x, a, b, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="lora_a has shape"):
        lora_bgmv(y, x, torch.zeros(2, 5, 1), b, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="scale has 3 entries"):
        lora_bgmv(y, x, a, b, torch.tensor([0, 1]), torch.ones(3))
