"""Counterfactual drafts: n-gram rerun, draft-model teacher forcing, expected acceptance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from adaptive_spec.sim.counterfactual import (
    acceptance_probs,
    build_counterfactuals,
    check_logged,
    draft_model_counterfactual,
    expected_accepted_length,
    ngram_counterfactual,
    torch_causal_lm,
)
from adaptive_spec.sim.requests import matched_length

from adaptive_spec.core.trace import TraceWriter, read_trace
from adaptive_spec.proposers import NgramProposer, ProposalRequest
from adaptive_spec.proposers.base import controller_feature


def test_ngram_rerun_equals_proposer_on_each_prefix() -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 40, size=20)
    # prompt[4:7] once more, followed by a token the prompt did not have there (41): when the output
    # copies prompt[:8], that suffix's occurrences disagree on what comes next.
    out = np.concatenate(
        [prompt[5:15], prompt[4:7], [41], rng.integers(3, 40, size=10), prompt[:8]]
    )
    table, feats = ngram_counterfactual(prompt, out, 5, max_tokens=44, min_n=2, max_n=3)
    prop = NgramProposer(min_n=2, max_n=3, max_k=5)
    seq = np.concatenate([prompt, out])
    assert len(table) == len(out)
    split = 0
    for n in range(len(out)):
        r = ProposalRequest("x", seq[: len(prompt) + n], 44 - n, 1000)
        d = prop.propose([r], [5])[0]
        np.testing.assert_array_equal(table[n], d)
        # The controller's feature, as the step driver computes it in the engine.
        assert feats[n] == (controller_feature(prop, r) if d.size else 0)
        split += bool(d.size) and prop.match_feature(r) == 0 < prop.match_length(r)
    assert sum(d.size > 0 for d in table) > 5  # the lookup found matches
    assert split > 0  # and some whose occurrences disagree (feature 0, not the match length)


def _write_trace(path: Path, prompt: np.ndarray, out: np.ndarray, k: int) -> None:
    """A hand-written engine-style trace: n-gram drafts logged where a static ngram:k run decided."""
    prop = NgramProposer(min_n=2, max_n=4, max_k=k)
    w = TraceWriter(
        path, {"max_k": k, "proposers": ["none", "ngram"], "policy": f"static:ngram:{k}"}
    )
    w.request(
        {
            "req_id": "r",
            "category": None,
            "prompt_token_ids": prompt.tolist(),
            "temperature": 0.0,
            "max_tokens": len(out),
        }
    )
    w.step(
        {
            "step": 0,
            "step_time_s": 0.03,
            "batch_size": 1,
            "num_verified_tokens": 0,
            "requests": [
                {
                    "req_id": "r",
                    "arm": "none",
                    "drafted": 0,
                    "accepted": 0,
                    "emitted": 1,
                    "emitted_token_ids": [int(out[0])],
                    "num_output_before": 0,
                    "features": None,
                    "propensity": None,
                    "cf_drafts": None,
                    "target_argmax": None,
                }
            ],
        }
    )
    n, step = 1, 1
    seq = np.concatenate([prompt, out])
    while n < len(out):
        d = prop.propose([ProposalRequest("r", seq[: len(prompt) + n], len(out) - n, 1000)], [k])[0]
        a = matched_length(d, out[n:])
        e = min(a + 1, len(out) - n)
        w.step(
            {
                "step": step,
                "step_time_s": 0.03,
                "batch_size": 1,
                "num_verified_tokens": int(d.size),
                "requests": [
                    {
                        "req_id": "r",
                        "arm": f"ngram:{d.size}" if d.size else "none",
                        "drafted": int(d.size),
                        "accepted": a,
                        "emitted": e,
                        "emitted_token_ids": out[n : n + e].tolist(),
                        "num_output_before": n,
                        "features": [1.0],
                        "propensity": 1.0,
                        "cf_drafts": {"ngram": d.tolist()},
                        "target_argmax": None,
                    }
                ],
            }
        )
        n += e
        step += 1
    w.close()


def test_rerun_matches_logged_drafts(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 30, size=30)
    out = np.concatenate([prompt[3:20], rng.integers(3, 30, size=15), prompt[10:25]])
    _write_trace(tmp_path / "t.jsonl", prompt, out, 4)
    tr = read_trace(tmp_path / "t.jsonl")
    cf = build_counterfactuals(tr)
    chk = check_logged(tr, cf, "ngram")
    assert chk["compared"] > 10 and chk["equal"] == chk["compared"] == chk["same_accepted"]
    # A different n-gram configuration is detected as a mismatch somewhere.
    cf_other = build_counterfactuals(tr, min_n=1, max_n=1)
    assert check_logged(tr, cf_other, "ngram")["equal"] < chk["compared"]


def _greedy_draft(fn, prefix: np.ndarray, k: int) -> np.ndarray:
    seq = list(prefix)
    out = []
    for _ in range(k):
        t = int(fn(np.asarray(seq))[-1])
        out.append(t)
        seq.append(t)
    return np.asarray(out, dtype=np.int64)


def test_teacher_forcing_gives_exact_accepted_lengths() -> None:
    V = 7

    def fn(ids: np.ndarray) -> np.ndarray:  # a deterministic "draft model": next = f(prev two)
        prev = np.concatenate([[0], ids[:-1]])
        return (ids * 3 + prev) % V

    rng = np.random.default_rng(2)
    prompt = rng.integers(0, V, size=5)
    # The target output: follows the draft model's rule most of the time, with deviations.
    seq = list(prompt)
    for _ in range(60):
        t = int(fn(np.asarray(seq))[-1])
        seq.append(t if rng.random() < 0.7 else int(rng.integers(0, V)))
    out = np.asarray(seq[len(prompt) :], dtype=np.int64)
    k = 5
    table = draft_model_counterfactual(fn, prompt, out, k)
    for n in range(len(out)):
        true = _greedy_draft(fn, np.concatenate([prompt, out[:n]]), k)
        got = table[n]
        assert got.shape == (k,)
        a = matched_length(true, out[n:])
        assert matched_length(got, out[n:]) == a
        np.testing.assert_array_equal(got[: min(a + 1, k)], true[: min(a + 1, k)])


def test_torch_causal_lm_wrapper() -> None:
    torch.manual_seed(0)
    V = 11

    class Bigram(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(V, V)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x)

    m = Bigram()
    fn = torch_causal_lm(m)
    ids = np.arange(8) % V
    np.testing.assert_array_equal(fn(ids), m.emb.weight.argmax(dim=-1).numpy()[ids])
    table = draft_model_counterfactual(fn, np.array([3]), np.array([1, 2, 3, 4]), 3, max_tokens=4)
    assert [len(d) for d in table] == [3, 2, 1, 0]  # capped at max_tokens - n - 1


def test_draft_model_errors() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        draft_model_counterfactual(lambda x: x, np.array([], dtype=np.int64), np.array([1]), 2)
    with pytest.raises(ValueError, match="shape"):
        draft_model_counterfactual(lambda x: x[:-1], np.array([1]), np.array([1, 2]), 2)


def test_expected_accepted_length_geometric_and_monte_carlo() -> None:
    a, k = 0.7, 6
    closed = (1 - a ** (k + 1)) / (1 - a) - 1
    assert expected_accepted_length(np.full(k, a)) == pytest.approx(closed)
    rng = np.random.default_rng(0)
    p = rng.uniform(0.2, 1.0, size=k)
    sims = (rng.random((200_000, k)) < p).cumprod(axis=1).sum(axis=1).mean()
    assert expected_accepted_length(p) == pytest.approx(sims, abs=0.02)
    assert expected_accepted_length(np.zeros(0)) == 0.0
    with pytest.raises(ValueError):
        expected_accepted_length(np.array([1.5]))


def test_acceptance_probs_rejection_sampling_rule() -> None:
    np.testing.assert_allclose(acceptance_probs(np.array([0.2, 0.9])), [0.2, 0.9])
    np.testing.assert_allclose(
        acceptance_probs(np.array([0.2, 0.9]), np.array([0.4, 0.3])), [0.5, 1.0]
    )
    with pytest.raises(ValueError):
        acceptance_probs(np.array([0.2]), np.array([0.0]))


def test_record_cli_stores_rerun_drafts(tmp_path: Path) -> None:
    from adaptive_spec.sim.counterfactual import read_counterfactuals
    from adaptive_spec.sim.trace_io import load_replay_trace

    from adaptive_spec.commands.cli import main as cli_main

    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 30, size=24)
    out = np.concatenate([prompt[2:18], rng.integers(3, 30, size=10), prompt[5:20]])
    src = tmp_path / "t.jsonl"
    _write_trace(src, prompt, out, 4)
    dst = tmp_path / "t_cf.jsonl"
    assert cli_main(["record", str(src), "--out", str(dst)]) == 0
    cf = read_counterfactuals(dst)
    assert cf.sources == {"ngram": "rerun"} and len(cf.tables["r"]["ngram"]) == len(out)
    wl = load_replay_trace(dst)
    assert wl.ngram_check["compared"] > 5
    assert wl.ngram_check["equal"] == wl.ngram_check["compared"]
    assert wl.coverage["ngram"] == 1.0 and wl.requests[0].match_features["ngram"].shape == (
        len(out),
    )
    assert cli_main(["record"]) == 2


@pytest.mark.slow  # imports transformers (about 10 s here) and runs ~100 small forwards
def test_record_cli_with_a_transformers_draft_model(tmp_path: Path) -> None:
    """``record --draft-model``: a (tiny, random) transformers causal LM's teacher-forced drafts give
    the accepted lengths of its own greedy autoregressive drafts."""
    from adaptive_spec.sim.counterfactual import read_counterfactuals
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaptive_spec.commands.cli import main as cli_main

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    mdir = tmp_path / "draft"
    model.save_pretrained(mdir)
    fn = torch_causal_lm(model)
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 30, size=12)
    seq = list(prompt)
    for _ in range(30):  # the "target" follows the draft model 60 % of the time
        t = int(fn(np.asarray(seq))[-1])
        seq.append(t if rng.random() < 0.6 else int(rng.integers(3, 30)))
    out = np.asarray(seq[len(prompt) :], dtype=np.int64)
    src = tmp_path / "t.jsonl"
    _write_trace(src, prompt, out, 4)
    assert cli_main(["record", str(src), "--draft-model", str(mdir)]) == 0
    cf = read_counterfactuals(src)
    assert cf.sources["draft"] == "teacher-forced"
    table = cf.tables["r"]["draft"]
    accepted = []
    for n in range(1, len(out)):
        k = table[n].size  # 4, cut to the budget near the end
        if k == 0:
            continue
        true = _greedy_draft(fn, np.concatenate([prompt, out[:n]]), k)
        a = matched_length(true, out[n:])
        assert matched_length(table[n], out[n:]) == a
        accepted.append(a)
    assert max(accepted) >= 2
