"""An EAGLE-3 head as the ``draft`` proposer, in a subprocess (one vLLM engine per process).

The target is a tiny float32 Llama of 4 layers; the head is trained here, in seconds, on the target's
own greedy replies with the project's trainer (:mod:`adaptive_spec.commands.distill.eagle3_train`), so
that it agrees with the target on some tokens but not all and both accepted and rejected drafts occur.
It is stored and assembled as the shipped head is (:mod:`adaptive_spec.vllm.eagle3`) and loaded by vLLM
as ``method: "eagle3"``. The worker checks:

* greedy identity with no speculation for the draft arm at k = 0, 1, 2, max, for a schedule that
  changes proposer and k every step, and for the adaptive controller;
* acceptance through vLLM is partly right (the head's alignment is vLLM's);
* the drafter's passes per step follow the largest k the decisions use (``num_spec_tokens_to_schedule``,
  counted at the drafter), 0 passes beyond the KV-cache pass when no request drafts with it, and a
  static arm's k at most (no probes for longer chains a static arm never takes);
* the KV-cache pass deferred on steps without draft passes (:mod:`adaptive_spec.vllm.deferred_kv`)
  leaves the drafter's cache as vLLM's own pass does: the first draft pass of every drafting step,
  which attends to all earlier positions, gives the same output at each request's rows up to the one
  its drafts are sampled from (later rows, at drafts rejected this step, are discarded), and the head
  drafts the same tokens;
* the head's linear layers run their products on bf16 weights in this float32 engine where the CPU
  has native bf16 (:mod:`adaptive_spec.vllm.drafter_bf16`), the target's never: every check above
  then runs with the converted head;
* LoRA adapters on the head (:class:`adaptive_spec.vllm.lora_draft.LoraDraftManager` on vLLM's EAGLE-3
  drafter): the hooks against a dense reference, including ``qkv_proj`` over the head's 2 x hidden
  input; greedy identity with requests of one batch on different adapters or none, each request's
  drafts made with its own adapter; and ``lora:<name>`` arms under the adaptive controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = (
    "identity-k0",
    "identity-k1",
    "identity-k2",
    "identity-kmax",
    "identity-every-step",
    "identity-adaptive",
    "acceptance-mixed",
    "passes-follow-k",
    "passes-static-cap",
    "passes-idle",
    "kv-deferred",
    "lora-hooks",
    "lora-mixed",
    "lora-adaptive",
    "drafter-prior",
    "drafter-bf16",
    "block-size",
)
TIMEOUT_S = 420


def make_tiny_head(target_dir: Path, out: Path, *, steps: int = 120) -> Path:
    """Train a small EAGLE-3 head for the tiny target on its greedy replies to loop-prone and random
    prompts, store it in ``out`` (kept if present) and return ``out``."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from adaptive_spec.commands.distill.eagle3_data import (
        aux_layers,
        build_features,
        draft_vocabulary,
        target_to_draft,
    )
    from adaptive_spec.commands.distill.eagle3_head import Eagle3Head
    from adaptive_spec.commands.distill.eagle3_train import HeadTraining, train_head
    from adaptive_spec.commands.distill.sequences import TokenSequence
    from adaptive_spec.vllm.drafts import tensor_sha256
    from adaptive_spec.vllm.eagle3 import save_head

    if (out / "head.json").exists():
        return out
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(100, 3000, 8)) for _ in range(24)]
    prompts += [[7] * 8, [100, 200] * 4, [5, 6, 7] * 3]
    seqs = []
    for p in prompts:
        with torch.no_grad():
            ids = target.generate(
                torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0
            )[0]
        seqs.append(TokenSequence(ids.numpy().astype(np.int32), len(p), "tiny"))
    feats = build_features(target, seqs, seq_len=64, progress=False)
    vocab = int(target.config.vocab_size)
    ids, _ = draft_vocabulary(feats.labels.numpy(), vocab, 512)
    t2d = torch.as_tensor(target_to_draft(ids, vocab))
    head = Eagle3Head.from_target(target, torch.as_tensor(ids))
    cfg = HeadTraining(steps=steps, batch_size=8, ttt_steps=3, lr=3e-3, warmup=10, autocast=False)
    train_head(head, feats, list(range(len(seqs))), t2d, cfg, None, progress=False)
    save_head(
        head.head_state_dict(),
        out,
        name="tiny-eagle3",
        base_model="tiny-llama",
        aux_layers=aux_layers(int(target.config.num_hidden_layers)),
        embed_sha256=tensor_sha256(target.model.embed_tokens.weight),
        lm_head_sha256=tensor_sha256(target.lm_head.weight),
    )
    return out


# -- worker ----------------------------------------------------------------------------------------
def tiny_target_and_head() -> tuple[Path, Path]:
    """The tiny float32 target (4 layers) and its trained head, made once in the cache directory."""
    from filelock import FileLock

    from adaptive_spec.core.paths import cache_dir
    from adaptive_spec.vllm.models import default_model_path
    from adaptive_spec.vllm.tiny_model import make_tiny_model

    target = cache_dir() / "tiny-llama-f32-4l"
    head = cache_dir() / "tiny-llama-f32-4l-eagle3-v2"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        make_tiny_model(target, default_model_path("bfloat16"), layers=4)
        make_tiny_head(target, head)
    return target, head


def _worker(target_dir: str, head_dir: str, out_path: str, tmp: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from adaptive_spec.core.arms import NO_SPEC, Arm
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.eagle3 import assemble_cached_head
    from adaptive_spec.vllm.engine import build_llm
    from tests.scripted import (
        MAX_K,
        ScriptedPolicy,
        check_bookkeeping,
        core_prompts,
        every_step,
        fixed,
        generate,
        greedy,
        reference,
        references_for,
    )

    results: dict[str, dict[str, Any]] = {}

    def check(name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
            results[name] = {
                "ok": True,
                "detail": f"{detail or ''} ({time.perf_counter() - t0:.1f} s)",
            }
        except BaseException as e:
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}",
            }
        Path(out_path).write_text(json.dumps(results, indent=1), encoding="utf-8")

    loadable = assemble_cached_head(head_dir, "float32", target_dir=target_dir, root=tmp)
    llm = build_llm(
        target_dir,
        dtype="float32",
        max_k=MAX_K,
        concurrency=4,
        method="eagle3",
        draft_model=loadable,
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_gib=0.25,
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    passes: list[int] = []
    drafts_made: list[list[list[int]]] = []
    # per drafting step, the output of the drafter's first pass at the rows drafts are built from
    kv_seen: list[Any] = []
    orig = runner.drafter.propose

    model = runner.drafter.model
    orig_forward = model.forward
    first_pass: dict[str, Any] = {"want": False, "rows": None}

    def recording_forward(*args: Any, **kw: Any) -> Any:
        # the first pass of a drafting step attends to the drafter's cached keys and values of every
        # earlier position: its output is what the drafts are built from
        out = orig_forward(*args, **kw)
        if first_pass["want"]:
            first_pass["want"] = False
            h = (out[0] if isinstance(out, tuple) else out).detach()
            kv_seen.append(h[first_pass["rows"]].clone())
        return out

    model.forward = recording_forward

    def used_rows(kw: dict[str, Any]) -> Any:
        # Each request's rows up to the one its drafts are sampled from: the rows after it (the
        # positions of drafts rejected at this step) are discarded, and the last of them reads
        # whatever the drafter's input buffer held (vLLM's input shift never writes it).
        import torch

        cad = kw["common_attn_metadata"]
        starts = cad.query_start_loc[:-1].tolist()
        ends = kw.get("token_indices_to_sample")
        ends = (cad.query_start_loc[1:] - 1 if ends is None else ends).tolist()
        return torch.tensor([i for a, b in zip(starts, ends, strict=True) for i in range(a, b + 1)])

    def counting(num_speculative_tokens: int, *args: Any, **kw: Any) -> Any:
        # vLLM's own drafter calls: with the KV-cache pass deferred, steps without draft passes
        # never get here (the deferral answers them)
        passes.append(int(num_speculative_tokens))
        first_pass["want"] = bool(num_speculative_tokens)
        if num_speculative_tokens:
            first_pass["rows"] = used_rows(kw)
        out = orig(num_speculative_tokens, *args, **kw)
        if num_speculative_tokens:
            drafts_made.append(out.tolist())
        return out

    runner.drafter.propose = counting
    prompts = core_prompts()
    ref = references_for(prompts, reference(llm, prompts, greedy(12)))
    traces: dict[str, Any] = {}

    def run(name, policy, proposers=("none", "ngram", "jacobi", "draft"), defer=True):
        path = Path(tmp) / f"{name}.jsonl"
        passes.clear()
        drafts_made.clear()
        kv_seen.clear()
        with AdaptiveSpec(
            llm,
            list(proposers),
            policy=policy,
            trace=path,
            trace_argmax=True,
            defer_drafter_kv=defer,
        ) as spec:
            if isinstance(policy, ScriptedPolicy):
                policy.bind(spec)
            outs = generate(llm, prompts, greedy(12))
        traces[name] = read_trace(path)
        return outs, spec, list(passes)

    def identity(name, policy, proposers=("none", "ngram", "jacobi", "draft")):
        def fn():
            outs, spec, _ = run(name, policy, proposers)
            got = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
            assert got == ref, "tokens differ from no speculation"
            s = check_bookkeeping(traces[name], got)
            assert spec.stats()["faults"] == 0, spec.stats()["faults"]
            return f"{s}"

        return fn

    arms = ["draft", "ngram", "jacobi"]
    check("identity-k0", identity("k0", ScriptedPolicy(arms, MAX_K, fixed(NO_SPEC))))
    for k, label in ((1, "k1"), (2, "k2"), (MAX_K, "kmax")):
        check(
            f"identity-{label}",
            identity(label, ScriptedPolicy(arms, MAX_K, fixed(Arm("draft", k)))),
        )
    every = ScriptedPolicy(arms, MAX_K, every_step(arms))
    check("identity-every-step", identity("every", every))
    check("identity-adaptive", identity("adaptive", "adaptive", ("none", "ngram", "draft")))

    def acceptance_mixed():
        rows = [r for s in traces["kmax"].steps for r in s["requests"] if r["drafted"] > 0]
        acc = sum(r["accepted"] for r in rows)
        drafted = sum(r["drafted"] for r in rows)
        assert 0 < acc < drafted, f"accepted {acc} of {drafted}: the head must be partly right"
        return f"accepted {acc}/{drafted}"

    check("acceptance-mixed", acceptance_mixed)

    def passes_follow_k():
        _, spec, seen = run(
            "passes-k2", ScriptedPolicy(arms, MAX_K, fixed(Arm("draft", 2))), defer=False
        )
        decode = seen[1:]  # the first step drafts in full
        assert decode and max(decode) <= MAX_K, seen
        at_k = sum(n == 2 for n in decode)
        assert at_k >= 0.6 * len(decode), f"passes per step {seen}: mostly 2 expected"
        assert all(n in (2, MAX_K) for n in decode), seen  # 2, or a probe for longer chains
        st = spec.stats()
        assert st["drafter_passes"] == sum(seen[: len(seen)]), (st["drafter_passes"], seen)
        return f"passes per step {seen}"

    check("passes-follow-k", passes_follow_k)

    def passes_static_cap():
        # a static arm never takes longer chains: after the first step the drafter runs its k passes
        # and no probe beyond them; a static arm of another proposer, none at all
        _, _, seen = run("passes-static", "static:draft:2", ("none", "ngram", "draft"), defer=False)
        assert seen[1:] and all(n <= 2 for n in seen[1:]), seen
        assert seen[1:].count(2) >= 0.8 * len(seen[1:]), seen
        _, _, other = run("passes-static-ngram", "static:ngram:2", ("none", "ngram", "draft"))
        assert all(n == 0 for n in other), other  # deferred: the drafter never drafts
        return f"static:draft:2 passes per step {seen}"

    check("passes-static-cap", passes_static_cap)

    def passes_idle():
        _, _, seen = run("passes-none", ScriptedPolicy(arms, MAX_K, fixed(NO_SPEC)), defer=False)
        decode = seen[1:]
        assert decode.count(0) >= 0.8 * len(decode), f"passes per step {seen}: mostly 0 expected"
        # no drafter proposer at all: never a pass beyond the KV-cache one
        _, _, none_seen = run("passes-ngram", "static:ngram:2", ("none", "ngram"), defer=False)
        assert all(n == 0 for n in none_seen[1:]), none_seen
        # with the KV-cache pass deferred, those steps never reach vLLM's drafter
        _, spec, deferred_seen = run(
            "passes-none-deferred", ScriptedPolicy(arms, MAX_K, fixed(NO_SPEC))
        )
        kv = spec.stats()["drafter_kv"]
        assert 0 not in deferred_seen, deferred_seen
        assert kv["deferred_steps"] == len(seen) - len(deferred_seen), (kv, seen, deferred_seen)
        return f"{decode.count(0)}/{len(decode)} steps without draft passes; deferred: {kv}"

    check("passes-idle", passes_idle)

    def kv_deferred():
        # Bursts of drafting between runs of steps without draft passes: the deferred KV-cache pass
        # must leave the drafter's cache as vLLM's own pass does, so the drafts are the same.
        def bursts(key: Any, n_out: int, step: int, index: int) -> Arm:
            return Arm("draft", 2) if (step // 3) % 3 == 0 else NO_SPEC

        got = {}
        for defer in (False, True):
            outs, spec, seen = run(f"kv-{defer}", ScriptedPolicy(arms, MAX_K, bursts), defer=defer)
            got[defer] = (
                [list(o.token_ids) for o in outs],
                list(seen),
                [list(d) for d in drafts_made],
                list(kv_seen),
                spec.stats(),
            )
        off, on = got[False], got[True]
        kv = on[4]["drafter_kv"]
        assert kv["deferred_steps"] > 0 and kv["flushes"] > 0 and kv["stashed"] == 0, kv
        assert on[0] == off[0], "outputs differ"
        assert on[1] == [n for n in off[1] if n], (on[1], off[1])
        assert on[2] == off[2], "the head drafted other tokens with its KV-cache pass deferred"
        assert len(on[3]) == len(off[3]) == len(on[2]) and on[3], (len(on[3]), len(off[3]))
        pairs = [(a, b) for a, b in zip(on[3], off[3], strict=True) if b.numel()]
        assert pairs and all(a.shape == b.shape for a, b in pairs)
        diff = max(float((a - b).abs().max()) for a, b in pairs)
        scale = max(float(b.abs().max()) for _, b in pairs)
        assert diff <= 1e-4 * max(1.0, scale), f"the first draft pass differs by {diff}"
        return f"{kv}; {len(on[2])} drafting steps with the same drafts; first pass max diff {diff:.2e}"

    check("kv-deferred", kv_deferred)

    # -- LoRA adapters on the head ------------------------------------------------------------------

    from adaptive_spec.vllm.lora_draft import (
        LoraDraftManager,
        save_lora_adapter,
    )
    from tests.conftest import assert_lora_matches_dense
    from tests.conftest import random_head_adapters as random_adapters

    def lora_hooks():
        mgr = LoraDraftManager(llm, max_rank=4)
        try:
            ads = random_adapters(mgr)
            assert (
                mgr.num_layers == 1
                and mgr.shapes["self_attn.qkv_proj"][0] == 2 * (mgr.shapes["self_attn.o_proj"][0])
            ), mgr.shapes  # the head's attention reads embedding and fused state side by side
            for n, a in ads.items():
                mgr.register(n, a)
            assert_lora_matches_dense(mgr, ads, [None, "a", "b", "a", None])
        finally:
            mgr.detach()
        return "hooks equal the dense reference"

    check("lora-hooks", lora_hooks)

    def lora_mixed():
        mgr = LoraDraftManager(llm, max_rank=4)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        plan = [None, "a", "b", None, "a"]
        seen: list[str] = []
        try:
            for n, a in random_adapters(mgr).items():
                mgr.register(n, a)
            orig_add = sched.add_request

            def add_request(request):
                seen.append(request.request_id)
                mgr.set_request_adapter(request.request_id, plan[(len(seen) - 1) % len(plan)])
                return orig_add(request)

            sched.add_request = add_request
            outs, spec, _ = run(
                "lora-mixed", ScriptedPolicy(arms, MAX_K, fixed(Arm("draft", MAX_K)))
            )
        finally:
            vars(sched).pop("add_request", None)
            mgr.detach()
        got = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
        assert got == ref, "tokens differ from no speculation"
        assert spec.stats()["faults"] == 0
        adapter = {rid: plan[i % len(plan)] for i, rid in enumerate(seen)}
        for rid, want in adapter.items():
            assert mgr.adapter_of_last_drafts(rid) == want, (rid, want)
        drafted = {None: 0, "a": 0, "b": 0}
        accepted = dict(drafted)
        for st in traces["lora-mixed"].steps:
            for r in st["requests"]:
                a = adapter[r["req_id"]]
                drafted[a] += r["drafted"]
                accepted[a] += r["accepted"]
        base = accepted[None] / max(drafted[None], 1)
        lora = (accepted["a"] + accepted["b"]) / max(drafted["a"] + drafted["b"], 1)
        # random adapters make most drafts wrong; the base head's stay partly right in the same batches
        assert drafted["a"] > 0 and drafted["b"] > 0 and base > lora, (drafted, accepted)
        return f"acceptance base {base:.2f}, adapted {lora:.2f}"

    check("lora-mixed", lora_mixed)

    def lora_adaptive():
        probe = LoraDraftManager(llm, max_rank=4)
        try:
            ads = random_adapters(probe)
        finally:
            probe.detach()
        dirs = {n: save_lora_adapter(a, Path(tmp) / "adapters" / n) for n, a in ads.items()}
        path = Path(tmp) / "lora-adaptive.jsonl"
        props = ["none", "ngram", "draft", "lora:a", "lora:b"]
        with AdaptiveSpec(llm, props, policy="adaptive", lora_adapters=dirs, trace=path) as spec:
            assert spec.lora is not None and spec.lora.adapters == ("a", "b")
            outs = generate(llm, prompts, greedy(12))
        got = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
        assert got == ref, "tokens differ from no speculation"
        st = spec.stats()
        assert st["faults"] == 0 and st["lora_faults"] == 0, (st["faults"], st["lora_faults"])
        runner_drafter = runner.drafter
        assert not runner_drafter.model.model.layers[0].self_attn.qkv_proj._forward_hooks
        # a static lora arm drafts with its adapter (the policy names it as the drafter's preference)
        with AdaptiveSpec(llm, props, policy="static:lora:a:2", lora_adapters=dirs) as static:
            outs = generate(llm, prompts, greedy(12))
            by = static.stats()["by_proposer"]
        got = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
        assert got == ref, "tokens differ from no speculation (static:lora:a:2)"
        assert by.get("lora:a", {}).get("drafted", 0) > 0, by
        return (
            f"by proposer {json.dumps({p: v.get('drafted') for p, v in st['by_proposer'].items()})}"
        )

    check("lora-adaptive", lora_adaptive)

    def drafter_prior():
        # calibrate --head-prior's learning, on this engine: the exploring controller drafts with the
        # head, and its row becomes a prior that the draft and lora arms of this drafter start from
        from adaptive_spec.commands.calibrate_head import learn_drafter_prior
        from adaptive_spec.core.controller import AdaptiveController
        from adaptive_spec.core.priors import select_rows

        got = learn_drafter_prior(llm, prompts, max_tokens=12, strength=20.0, progress=False)
        assert got.key["drafter"] == Path(loadable).name, got.key
        assert got.state["proposers"] == ["draft"] and got.observed > 0, got
        assert 0.0 < got.first < 1.0, got.first  # the tiny head is partly right
        a = np.asarray(got.state["prior_a"])
        b = np.asarray(got.state["prior_b"])
        assert (a + b).max() <= 20.0 + 1e-6 and (a[..., 0] + b[..., 0]).max() > 2.0, (a, b)
        ctrl = AdaptiveController(["ngram", "draft", "lora:a"], MAX_K)
        before = ctrl.acceptance.prior_a.copy()
        ctrl.acceptance.load_state_dict(select_rows(got.state, {"draft": "lora:a"}))
        after = ctrl.acceptance.prior_a
        assert (after[:2] == before[:2]).all() and (after[2] != before[2]).any()
        return f"{got.observed:.0f} observations, position 1 acceptance {got.first:.2f}"

    check("drafter-prior", drafter_prior)

    def drafter_bf16():
        from adaptive_spec.core.machine import native_bf16
        from adaptive_spec.vllm.drafter_bf16 import bf16_layers

        got = bf16_layers(runner.drafter.model)
        # fc, qkv_proj, o_proj, gate_up_proj, down_proj and the LM head
        want = 6 if native_bf16() else 0
        assert got == want, f"{got} bf16 layers in the drafter, expected {want}"
        assert bf16_layers(runner.model) == 0, "the target's layers must stay float32"
        return f"{got} drafter layers in bf16"

    check("drafter-bf16", drafter_bf16)

    def block_size():
        # build_llm gives an EAGLE engine small KV-cache blocks: vLLM drops its prefix-cache hits
        # back by one block
        from adaptive_spec.vllm.engine import EAGLE_BLOCK_SIZE

        got = runner.vllm_config.cache_config.block_size
        assert got == EAGLE_BLOCK_SIZE, got
        return f"block size {got}"

    check("block-size", block_size)


# -- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3_results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    pytest.importorskip(
        "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
    )
    target, head = tiny_target_and_head()
    tmp = tmp_path_factory.mktemp("eagle3")
    out = tmp / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.test_correctness_eagle3",
        str(target),
        str(head),
        str(out),
        str(tmp),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"worker timed out after {TIMEOUT_S} s; output tail: {str(e.stdout or '')[-1500:]}"
    results = json.loads(out.read_text()) if out.exists() else {}
    results["_tail"] = {"ok": None, "detail": tail}
    return results


@pytest.mark.vllm
@pytest.mark.parametrize("name", CHECKS)
def test_eagle3_engine(eagle3_results, name):
    r = eagle3_results.get(name)
    if r is None:
        pytest.fail(f"the worker did not reach check {name!r}: {eagle3_results['_tail']['detail']}")
    assert r["ok"], r["detail"]


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
