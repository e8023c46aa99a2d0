"""The HF transformers peer (prompt-lookup assisted generation) on the tiny float32 model: exact greedy
identity, divergence detection, the worker's result layout and its refusals."""

from __future__ import annotations

import pytest

from adaptive_spec.commands.bench.hf_peer import (
    greedy_identity,
    hf_generate,
    load_hf_model,
    run_hf_group,
    top2_logprobs_at,
)
from tests.conftest import tiny_prompts


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, "float32")


def test_prompt_lookup_equals_plain_greedy_in_float32(tiny_hf):
    model, _ = tiny_hf
    for p in tiny_prompts(2, length=16, seed=3):
        ref = hf_generate(model, p, 16)
        pld = hf_generate(model, p, 16, prompt_lookup_num_tokens=4, max_matching_ngram_size=2)
        assert pld == ref
        assert 1 <= len(ref) <= 16


def test_identity_counts_a_clear_divergence_as_a_violation(tiny_hf):
    model, _ = tiny_hf
    prompts = tiny_prompts(2, length=16, seed=4)
    ref = [hf_generate(model, p, 12) for p in prompts]
    same = greedy_identity(model, prompts, ref, [list(r) for r in ref])
    assert (same["identical"], same["violations"], same["total"]) == (2, 0, 2)
    bad = [list(r) for r in ref]
    top = top2_logprobs_at(model, prompts[1], ref[1], 5)
    assert next(iter(top)) == ref[1][5]  # the greedy token is the top-1 at that position
    runner_up = next(t for t in top if t != ref[1][5])
    bad[1][5] = runner_up
    res = greedy_identity(model, prompts, ref, bad)
    assert res["identical"] == 1
    d = res["details"][0]
    assert d["index"] == 1 and d["position"] == 5
    lp = sorted((v.logprob for v in top.values()), reverse=True)
    assert d["margin"] == pytest.approx(lp[0] - lp[1])
    # The tiny model's margins are large (tests/tiny_model.py): beyond the near-tie tolerance, a violation.
    assert d["margin"] > 0.25
    assert (res["violations"], res["near_tie"]) == (1, 0)


def test_refusals(tiny_model_dir, tiny_hf, tmp_path):
    model, _ = tiny_hf
    with pytest.raises(ValueError, match="dtype='float16'"):
        load_hf_model(tiny_model_dir, "float16")
    with pytest.raises(FileNotFoundError, match="model_dir"):
        load_hf_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="prompt_ids"):
        hf_generate(model, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        hf_generate(model, [5, 6], 0)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=0"):
        hf_generate(model, [5, 6], 4, prompt_lookup_num_tokens=0)
    with pytest.raises(ValueError, match="position=9"):
        top2_logprobs_at(model, [5, 6], [1, 2], 9)
    with pytest.raises(ValueError, match="same length"):
        greedy_identity(model, [[1]], [[1]], [])


def test_run_hf_group_layout(tiny_model_dir, tmp_path):
    spec = {
        "model": str(tiny_model_dir),
        "dtype": "float32",
        "repeats": 2,
        "pld_tokens": 4,
        "cells": [
            {
                "id": "t/c1/t0",
                "texts": ["Say hello twice.", "List three colours."],
                "max_tokens": 6,
                "configs": ["hf-greedy", "hf-pld"],
            }
        ],
    }
    out = tmp_path / "hf.json"
    res = run_hf_group(spec, out)
    assert out.exists()
    cfg = res["cells"]["t/c1/t0"]["configs"]
    for name in ("hf-greedy", "hf-pld"):
        assert [r["repeat"] for r in cfg[name]["runs"]] == [0, 1]
        for r in cfg[name]["runs"]:
            assert r["output_tokens"] == 12  # random weights rarely emit EOS within 6 tokens
            assert r["goodput_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    for r in cfg["hf-pld"]["runs"]:
        assert r["valid"] and r["identity"]["identical"] == 2
    bad = dict(spec, cells=[dict(spec["cells"][0], configs=["hf-pld"])])
    with pytest.raises(ValueError, match="hf-greedy"):
        run_hf_group(bad)
    bad = dict(spec, cells=[dict(spec["cells"][0], configs=["hf-greedy", "none"])])
    with pytest.raises(ValueError, match="not HF peer configurations"):
        run_hf_group(bad)
