"""adaptive-spec bench worker pieces that need no engine: proposers per configuration, policy
construction (including the SmartSpec/BanditSpec peers) and the model-length cap."""

from __future__ import annotations

import json

import pytest

from adaptive_spec.commands.bench.resolve import model_max_len
from adaptive_spec.commands.bench.worker_cell import config_proposers, make_bench_policy


@pytest.mark.parametrize(
    ("name", "proposers"),
    [
        ("none", ["none"]),
        ("static:ngram:4", ["none", "ngram"]),
        ("static:jacobi:2", ["none", "jacobi"]),
        ("smartspec:ngram", ["none", "ngram"]),
        ("banditspec:jacobi", ["none", "jacobi"]),
        ("adaptive", ["none", "ngram", "jacobi"]),
        ("adaptive-warm", ["none", "ngram", "jacobi"]),
        ("adaptive+draft", ["none", "ngram", "jacobi", "draft"]),
        ("adaptive+lora", ["none", "ngram", "jacobi", "draft", "lora:code", "lora:math"]),
        ("static:lora:code:4", ["none", "lora:code"]),
    ],
)
def test_each_configuration_enables_only_its_proposers(name, proposers):
    assert config_proposers(name, "main", ["code", "math"]) == proposers


@pytest.mark.parametrize(
    ("name", "expected", "cls"),
    [
        ("none", "static:none", "StaticPolicy"),
        ("static:ngram:4", "static:ngram:4", "StaticPolicy"),
        ("adaptive", "adaptive", "AdaptiveController"),
        ("adaptive-warm", "adaptive", "AdaptiveController"),
        ("adaptive+suffix", "adaptive", "AdaptiveController"),
        ("adaptive-ngram", "adaptive", "AdaptiveController"),
        ("smartspec:ngram", "smartspec:ngram", "SmartSpecPolicy"),
        ("banditspec:ngram", "banditspec:ngram", "BanditSpecPolicy"),
        ("table:ngram:1-2=4,3-16=1", "table:ngram", "BatchSizeTablePolicy"),
    ],
)
def test_make_bench_policy_names(name, expected, cls):
    pol = make_bench_policy(name, config_proposers(name, "main"), 8)
    assert pol.name == expected
    assert type(pol).__name__ == cls
    if name.startswith(("smartspec", "banditspec")):
        assert pol.proposer == "ngram"


def test_make_bench_policy_refuses_unknown():
    with pytest.raises(ValueError, match="not"):
        make_bench_policy("greedy-oracle", ["none", "ngram"], 8)
    with pytest.raises(ValueError):
        make_bench_policy("static:ngram:9", ["none", "ngram"], 8)


def test_max_model_len_is_capped_by_the_model(tmp_path):
    assert model_max_len(None) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert model_max_len(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert model_max_len(str(tmp_path)) == 4096
    assert model_max_len(str(tmp_path / "missing")) == 4096


@pytest.mark.parametrize(
    ("temperature", "mode", "expected"),
    [(1.0, "sampled", True), (0.5, "sampled", True), (0.0, "sampled", False), (1.0, "off", False)],
)
def test_ignore_eos_applies_to_sampled_cells_only(temperature, mode, expected):
    from adaptive_spec.commands.bench.plan import Cell
    from adaptive_spec.commands.bench.resolve import ignores_eos

    cell = Cell("mixed", 16, temperature, 32, 64, ("none", "adaptive"))
    assert ignores_eos(cell, mode) is expected


@pytest.mark.parametrize("flag", [True, False, None])
def test_a_cells_ignore_eos_reaches_its_sampling_parameters(default_model_dir, tmp_path, flag):
    """The worker builds each cell's SamplingParams from the payload; a payload written before the
    flag existed stops at EOS."""
    pytest.importorskip(
        "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
    )
    from transformers import AutoTokenizer

    from adaptive_spec.commands.bench.worker_cell import CellState

    class _Tokenizing:  # CellState needs only the engine's tokenizer
        def __init__(self) -> None:
            self.tok = AutoTokenizer.from_pretrained(default_model_dir)

        def get_tokenizer(self):
            return self.tok

    payload = {
        "id": "mixed/c16/t1",
        "slug": "mixed_c16_t1",
        "temperature": 1.0,
        "max_tokens": 64,
        "texts": ["Say hello."],
        "categories": ["chat"],
        "configs": ["none"],
    }
    if flag is not None:
        payload["ignore_eos"] = flag
    cell = CellState(_Tokenizing(), payload, tmp_path)
    assert cell.params.ignore_eos is bool(flag)
    assert cell.params.max_tokens == 64 and cell.params.temperature == 1.0
