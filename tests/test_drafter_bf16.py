"""The drafter's products in bf16 (:mod:`adaptive_spec.vllm.drafter_bf16`): one layer's conversion with
vLLM's own CPU dispatch, and the auto setting. The engine checks (every drafter linear layer converted,
greedy identity with the converted head) are in ``tests/test_correctness_eagle3.py``."""

from __future__ import annotations

import pytest
import torch

from adaptive_spec.vllm.drafter_bf16 import MARK, convert_layer, wants_bf16_drafter


def _dispatch():
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed")
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    return dispatch_cpu_unquantized_gemm


def test_convert_layer_computes_on_bf16_weights():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=False)
    w = layer.weight.detach().clone()
    assert convert_layer(layer, True, _dispatch())
    assert getattr(layer, MARK) is True
    # the float32 weight is freed, and the layer still reports the activations' dtype
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32
    x = torch.randn(3, 96)
    y = layer.cpu_linear(x, layer.weight, None)
    assert y.dtype == torch.float32 and y.shape == (3, 40)
    ref = (x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T).float()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    # and it is not the float32 product: the weights were rounded to bf16
    assert not torch.equal(y, x @ w.T)


def test_convert_layer_keeps_the_weight_when_asked():
    layer = torch.nn.Linear(32, 16, bias=False)
    w = layer.weight
    assert convert_layer(layer, False, _dispatch())
    assert layer.weight is w and w.dtype == torch.float32  # a tied LM head keeps its table


@pytest.mark.parametrize(
    "layer",
    [
        torch.nn.Linear(32, 16, bias=True),  # a bias: left to vLLM
        torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16),  # bf16 already
    ],
)
def test_convert_layer_leaves_other_layers_alone(layer):
    before = layer.weight
    assert not convert_layer(layer, True, _dispatch())
    assert layer.weight is before and not hasattr(layer, MARK)
    assert not hasattr(layer, "cpu_linear")


def test_wants_bf16_drafter(monkeypatch):
    import adaptive_spec.core.machine as machine

    monkeypatch.setattr(machine, "native_bf16", lambda flags=None: True)
    assert wants_bf16_drafter("float32") is True
    assert wants_bf16_drafter("bfloat16") is False  # its drafter is bf16 already
    assert wants_bf16_drafter("float32", False) is False
    monkeypatch.setattr(machine, "native_bf16", lambda flags=None: False)
    assert wants_bf16_drafter("float32") is False  # emulated bf16 is slower than float32
    assert wants_bf16_drafter("float32", True) is True
    with pytest.raises(ValueError, match="drafter_bf16='yes' is invalid"):
        wants_bf16_drafter("float32", "yes")  # type: ignore[arg-type]
