"""Distillation pieces: greedy-acceptance simulation, losses, batching, data files, checkpoints and
resume, LoRA training, and the CLI's validation (tiny float32 models on the CPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_spec.commands import distill as D
from tests.test_drafts_format import make_target


@pytest.fixture(autouse=True)
def one_thread():
    # Two threads on a busy 2-core machine can be 10x slower than one (OpenMP barriers).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp("d") / "t3", default_model_dir, layers=3)
    model, tok = D.load_target(path, "cpu", "float32")
    return path, model, tok


# -- greedy acceptance simulation ----------------------------------------------------------------
def test_simulate_greedy_examples():
    m = np.array([True, True, True, False, True, True, True, True, True], dtype=bool)
    # From position 1: run of 2 (pos 1, 2) then reject at 3 -> commit 3 tokens; j = 4: run of 4 (k = 4)
    # -> commit 5 tokens (4 + bonus); j = 9: done.
    assert D.simulate_greedy(m, 4) == (2, 8)
    assert D.simulate_greedy(m, 1) == (5, 8)  # 2 + 1 + 2 + 2 + 1 (cut by the end)
    assert D.simulate_greedy(np.zeros(5, bool), 3) == (4, 4)
    assert D.simulate_greedy(np.ones(1, bool), 2) == (0, 0)
    with pytest.raises(ValueError, match="k=0"):
        D.simulate_greedy(m, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 8))
def test_simulate_greedy_properties(match, k):
    m = np.array(match, dtype=bool)
    steps, emitted = D.simulate_greedy(m, k)
    # Every continuation token after the first is committed exactly once.
    assert emitted == len(m) - 1
    assert steps <= max(len(m) - 1, 0)
    if steps:
        assert 1.0 <= emitted / steps <= k + 1
    # More draft tokens never need more steps.
    assert D.simulate_greedy(m, k + 1)[0] <= steps


# -- losses ----------------------------------------------------------------------------------------
def test_distill_loss_kl_zero_at_teacher_and_positive_elsewhere():
    torch.manual_seed(0)
    head = torch.randn(50, 8)
    th = torch.randn(6, 8)
    tgt = (th @ head.T).argmax(-1)
    loss, st_ = D.distill_loss(th.clone(), th, head, tgt, loss="kl", chunk=4)
    assert float(loss) == pytest.approx(0.0, abs=1e-5) and st_["agree"] == 1.0
    loss2, _ = D.distill_loss(torch.randn(6, 8), th, head, tgt, loss="kl", chunk=4)
    assert float(loss2) > 0.01
    ce, _ = D.distill_loss(th.clone(), None, head, tgt, loss="ce")
    ref = torch.nn.functional.cross_entropy(th @ head.T, tgt)
    assert float(ce) == pytest.approx(float(ref), rel=1e-5)
    with pytest.raises(ValueError, match="loss='mse'"):
        D.distill_loss(th, th, head, tgt, loss="mse")
    with pytest.raises(ValueError, match="needs teacher_h or teacher_topk"):
        D.distill_loss(th, None, head, tgt, loss="kl")


def test_distill_loss_topk_is_bucketed_kl():
    torch.manual_seed(1)
    head = torch.randn(40, 8)
    th, sh = torch.randn(5, 8), torch.randn(5, 8, requires_grad=True)
    t_logp = torch.log_softmax(th @ head.T, -1)
    vals, ids = t_logp.topk(4, -1)
    tgt = ids[:, 0]
    loss, st_ = D.distill_loss(sh, None, head, tgt, loss="kl", teacher_topk=(ids, vals))
    s_logp = torch.log_softmax(sh @ head.T, -1)
    sv = s_logp.gather(1, ids)
    t_rest, s_rest = 1 - vals.exp().sum(-1), 1 - sv.exp().sum(-1)
    ref = ((vals.exp() * (vals - sv)).sum(-1) + t_rest * (t_rest.log() - s_rest.log())).mean()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-4)
    full = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    assert float(loss.detach()) <= float(full.detach()) + 1e-5  # coarsening never increases a KL
    loss.backward()
    assert sh.grad is not None and float(sh.grad.abs().sum()) > 0
    # At the teacher, the bucketed KL is zero.
    z, _ = D.distill_loss(th.clone(), None, head, tgt, loss="kl", teacher_topk=(ids, vals))
    assert float(z) == pytest.approx(0.0, abs=1e-5)
    assert 0.0 <= st_["agree"] <= 1.0


# -- batching and data files -----------------------------------------------------------------------
def _seq(n_prompt, n_cont, k=3, seed=0, split="train"):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 1000, n_prompt + n_cont).astype(np.int32)
    ids = rng.integers(3, 1000, (n_cont, k)).astype(np.int32)
    ids[:, 0] = toks[n_prompt:]
    lps = np.sort(rng.uniform(-5, 0, (n_cont, k)).astype(np.float16), axis=1)[:, ::-1].copy()
    return D.TokenSequence(toks, n_prompt, "code", split, ids, lps)


def test_collate_and_topk_alignment():
    seqs = [_seq(5, 7, seed=1), _seq(9, 4, seed=2), _seq(3, 20, seed=3)]
    ids, att, lm = D.collate(seqs, seq_len=16, pad_id=0)
    topk = D.collate_topk(seqs, seq_len=16)
    assert topk is not None
    sel = lm.nonzero(as_tuple=True)
    nxt = ids[sel[0], sel[1] + 1]
    # The top-1 of the sparse teacher is the next token at every loss position, in the same order.
    assert torch.equal(topk[0][:, 0], nxt)
    assert int(att.sum()) == 12 + 13 + 16
    # Sequence 3 is cut to its last 16 tokens: 15 loss positions, all in the continuation.
    assert int(lm[2].sum()) == 15
    with pytest.raises(ValueError, match="no sequences"):
        D.collate([], 8, 0)


def test_sequences_roundtrip(tmp_path):
    seqs = [_seq(5, 7, seed=1), _seq(4, 3, seed=2, split="eval")]
    seqs.append(D.TokenSequence(np.arange(6, dtype=np.int32), 2, "chat", "train"))
    D.save_sequences(seqs, tmp_path / "s.npz")
    back = D.load_sequences(tmp_path / "s.npz")
    assert len(back) == 3
    for a, b in zip(seqs, back, strict=True):
        assert np.array_equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert (a.category, a.split) == (b.category, b.split)
        assert (a.topk_ids is None) == (b.topk_ids is None)
        if a.topk_ids is not None:
            assert np.array_equal(a.topk_ids, b.topk_ids)
            assert np.array_equal(a.topk_logprobs, b.topk_logprobs)
    assert D.usable(back, "eval") == [back[1]]


def test_batch_order_is_deterministic_epochs():
    a = [D.batch_order(10, 3, s, seed=4) for s in range(6)]
    assert a == [D.batch_order(10, 3, s, seed=4) for s in range(6)]
    first_epoch = [i for b in a[:3] for i in b]
    assert len(first_epoch) == len(set(first_epoch))  # no repeats inside an epoch
    assert a[:3] != a[3:]  # a new permutation each epoch


def test_read_prompt_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        '{"text": "hello there", "category": "chat"}\n\n'
        '{"turns": ["what is 2+2?"], "category": "math", "split": "eval"}\n'
    )
    recs = D.read_prompt_file(p)
    assert [(r.category, r.text, r.split) for r in recs] == [
        ("chat", "hello there", "train"),
        ("math", "what is 2+2?", "eval"),
    ]
    p.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:1"):
        D.read_prompt_file(p)
    with pytest.raises(ValueError, match="skip=1 < eval_prompts=2"):
        D.load_prompts([str(p)], 3, eval_n=2, skip=1)
    with pytest.raises(ValueError, match=r"none of the workloads"):
        D.load_prompts(["no-such-source"], 3, eval_n=0, skip=0)


def test_sharegpt_filters():
    from adaptive_spec.commands.distill.prompts import _looks_like

    writing = [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Compose a persuasive email to my landlord about fixing the heating.",
        "I want you to act as a travel guide for Lisbon.",
        "Pretend you are a pirate captain and describe your ship.",
    ]
    not_writing = [
        "Write a python function that reverses a list.",  # code
        "Write me a C# snippet that sends out an email.",  # code the code filter misses
        "Write a blog post about how many apples 3 * 4 boxes hold.",  # arithmetic
        "What is the capital of France?",  # a question, no writing request
    ]
    assert all(_looks_like("sharegpt-writing", t) for t in writing)
    assert not any(_looks_like("sharegpt-writing", t) for t in not_writing)
    assert _looks_like("sharegpt-code", not_writing[0])
    assert _looks_like("sharegpt-math", "How many days are in 3 weeks?")


def test_sharegpt_writing_holds_out_its_first_prompts():
    ps = D.load_prompts(["sharegpt-writing:20"], 5, eval_n=4, skip=48)
    held = [p for p in ps if p.split == "eval"]
    train = [p for p in ps if p.split == "train"]
    assert len(held) == 4 and len(train) == 20
    assert {p.category for p in ps} == {"writing"}
    assert not {p.text for p in held} & {p.text for p in train}
    # the chat workload's first prompts (what benchmarks use) are never among them
    from adaptive_spec.commands.workloads import load_chat

    first = {p.text for p in load_chat(48)}
    assert not first & {p.text for p in ps}


# -- training, checkpoints, resume ---------------------------------------------------------------
def _data(model, tok, n=6, cont=12, seed=0):
    prompts = [D.TextPrompt("code", f"def f{i}(x): return x * {i}", "train") for i in range(n)]
    return D.generate_continuations(
        model,
        tok,
        prompts,
        max_new_tokens=cont,
        max_prompt_tokens=512,
        batch_size=n,
        device="cpu",
        seed=seed,
        progress=False,
    )


def _cfg(path, **kw):
    base = {
        "target": str(path),
        "data": ["x"],
        "steps": 4,
        "batch_size": 2,
        "seq_len": 64,
        "lr": 1e-3,
        "warmup": 1,
        "teacher": "online",
        "generator": "hf",
        "autocast": False,
        "save_every": 2,
    }
    base.update(kw)
    return D.DistillConfig(**base)


def _train(draft, model, seqs, cfg, ckpt_dir, params=None):
    """``train_draft`` of ``params`` (default: every layer of the cut), pad id 2, no progress bar."""
    if params is None:
        params = list(draft.model.layers.parameters())
    return D.train_draft(draft, params, model, seqs, cfg, ckpt_dir, pad_id=2, progress=False)


def test_train_resume_matches_uninterrupted(tiny, tmp_path, monkeypatch):
    path, model, tok = tiny
    seqs = D.usable(_data(model, tok), "train")
    torch.manual_seed(0)
    a = D.build_layer_cut(model, 1)
    ra = _train(a, model, seqs, _cfg(path), tmp_path / "a")
    assert ra["steps_done"] == 4 and np.isfinite(ra["loss"])
    # Interrupted (Ctrl-C) during step 3: the checkpoint holds steps 1-2 ...
    torch.manual_seed(0)
    b = D.build_layer_cut(model, 1)
    real_loss, calls = D.distill_loss, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(D.training, "distill_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        _train(b, model, seqs, _cfg(path), tmp_path / "b")
    monkeypatch.setattr(D.training, "distill_loss", real_loss)
    assert torch.load(tmp_path / "b" / "train.pt", weights_only=False)["step"] == 2
    # ... and a fresh process (other initial weights, other RNG state) resumes it to the same result.
    torch.manual_seed(123)
    c = D.build_layer_cut(model, 1)
    with torch.no_grad():
        for p in c.model.layers.parameters():
            p.add_(1.0)
    rc = _train(c, model, seqs, _cfg(path), tmp_path / "b")
    assert rc["steps_done"] == 4
    for pa, pc in zip(a.model.layers.parameters(), c.model.layers.parameters(), strict=True):
        torch.testing.assert_close(pa, pc)
    assert [h[0] for h in ra["history"]] == [h[0] for h in rc["history"]] == [1, 2, 3, 4]
    assert [h[1] for h in ra["history"]] == pytest.approx([h[1] for h in rc["history"]], rel=1e-4)


def test_check_resume_refuses_other_settings(tmp_path):
    cfg = _cfg("t")
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    D.check_resume(tmp_path, _cfg("t", steps=99, save_every=7))  # allowed changes
    with pytest.raises(ValueError, match="lr"):
        D.check_resume(tmp_path, _cfg("t", lr=0.5))


def test_distillation_raises_acceptance(tiny):
    """Training the 1-layer cut on the target's continuations raises its greedy agreement and accepted
    length on them (a random tiny target has no structure to generalise from: held-out gains are
    measured on the real model, docs/drafts.md)."""
    path, model, tok = tiny
    train = D.usable(_data(model, tok, n=8, cont=24), "train")
    torch.manual_seed(0)
    draft = D.build_layer_cut(model, 1)
    before = D.evaluate(draft, train, device="cpu", pad_id=2, autocast=False)["all"]
    _train(draft, model, train, _cfg(path, steps=40, lr=3e-3, batch_size=4), None)
    after = D.evaluate(draft, train, device="cpu", pad_id=2, autocast=False)["all"]
    assert after.agreement > before.agreement + 0.2
    assert after.tau(4) > before.tau(4) + 0.2


def test_lora_training_and_roundtrip(tiny, tmp_path):
    from adaptive_spec.vllm.lora_draft import LoraAdapter, load_lora_adapter, save_lora_adapter

    path, model, tok = tiny
    train = D.usable(_data(model, tok, n=8, cont=24, seed=1), "train")
    torch.manual_seed(0)
    draft = D.build_layer_cut(model, 1)
    base_state = {k: v.clone() for k, v in D.layer_state(draft).items()}
    before = D.evaluate(draft, train, device="cpu", pad_id=2, autocast=False)["all"]
    params = D.add_lora(draft, 4, 8.0, ["q_proj", "v_proj", "down_proj"], seed=0)
    assert len(params) == 6 and all(p.requires_grad for p in params)
    # B = 0 at the start: the adapted draft is the base draft.
    same = D.evaluate(draft, train, device="cpu", pad_id=2, autocast=False)["all"]
    assert same.agree == before.agree
    _train(draft, model, train, _cfg(path, steps=30, lr=5e-3, batch_size=4), None, params=params)
    after = D.evaluate(draft, train, device="cpu", pad_id=2, autocast=False)["all"]
    assert after.agreement > before.agreement
    # Base weights untouched.
    for k, v in D.layer_state(draft).items():
        if k in base_state:
            torch.testing.assert_close(v, base_state[k])
    w = D.lora_weights(draft)
    assert set(w) == {(0, "q_proj"), (0, "v_proj"), (0, "down_proj")}
    ad = LoraAdapter("code", 4, 8.0, w, base_draft={"name": "x", "weights_sha256": "y"})
    save_lora_adapter(ad, tmp_path / "ad")
    back = load_lora_adapter(tmp_path / "ad")
    assert back.rank == 4 and back.scale == 2.0 and set(back.weights) == set(w)
    # Loaded into a fresh cut, it reproduces the trained draft (up to bf16 storage).
    fresh = D.build_layer_cut(model, 1)
    D.load_lora_into(fresh, back)
    re = D.evaluate(fresh, train, device="cpu", pad_id=2, autocast=False)["all"]
    assert abs(re.agreement - after.agreement) < 0.05


def test_cli_rejects_bad_options(capsys):
    from adaptive_spec.commands.cli import build_parser

    parser = build_parser()
    for argv, msg in (
        (["--steps", "0"], "--steps=0"),
        (["--samples", "2"], "needs --gen-temperature"),
        (["--teacher", "topk", "--generator", "hf"], "needs --generator vllm"),
        (["--device", "tpu"], "--device='tpu'"),
        (["--lora", "bad name"], "adapter name"),
        (["--lr", "-1"], "--lr=-1"),
    ):
        args = parser.parse_args(["distill", "--out", "x", *argv])
        assert D.main(args) == 2
        assert msg in capsys.readouterr().out


def test_cli_end_to_end_hf(tiny, tmp_path, capsys):
    """`adaptive-spec distill` with the transformers generator and the online teacher: data, training,
    report, stored draft and export; a second run resumes (finds the finished checkpoint)."""
    from adaptive_spec.commands.cli import main
    from adaptive_spec.vllm import drafts

    path, _, _ = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"text": f"Write a poem number {i}", "category": "chat"}) + "\n"
            for i in range(6)
        )
    )
    argv = [
        "distill",
        "--target",
        str(path),
        "--data",
        str(prompts),
        "--prompts",
        "4",
        "--eval-prompts",
        "2",
        "--skip",
        "2",
        "--layers",
        "1",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--max-new-tokens",
        "8",
        "--generator",
        "hf",
        "--teacher",
        "online",
        "--no-autocast",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "out"),
        "--export",
        str(tmp_path / "exp"),
        "--no-progress",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "untrained-cut" in out and "tau@4" in out
    spec = drafts.read_draft_spec(tmp_path / "out")
    assert spec.num_layers == 1 and spec.training["steps_done"] == 3
    assert "all" in spec.measured["held_out"]
    assert (tmp_path / "exp" / "model.safetensors").exists()
    assert (tmp_path / "ck" / "data.npz").exists() and (tmp_path / "ck" / "train.pt").exists()
    argv[argv.index("--out") + 1] = str(tmp_path / "out2")
    argv.remove("--export")
    argv.remove(str(tmp_path / "exp"))
    assert main(argv) == 0
    assert drafts.read_draft_spec(tmp_path / "out2").weights_sha256 == spec.weights_sha256
    argv[argv.index("--lr") + 1 if "--lr" in argv else len(argv) :] = []
    bad = [*argv, "--lr", "0.5"]
    assert main(bad) == 2
    assert "other settings (lr)" in capsys.readouterr().out


def test_namespace_defaults_match_config():
    from adaptive_spec.commands.cli import build_parser

    args = build_parser().parse_args(["distill", "--out", "x"])
    assert isinstance(args, argparse.Namespace)
    cfg = D.command._config(args, Path("t"), None)
    assert cfg.teacher == "topk" and cfg.generator == "vllm" and cfg.loss == "kl"
