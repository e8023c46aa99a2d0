"""LoRA adapters inside the drafter's compiled pass (:mod:`adaptive_spec.vllm.lora_sites`).

A compiled vLLM engine (no ``enforce_eager``) of the tiny float32 target and its EAGLE-3 head
(``tests/test_correctness_eagle3.py`` makes both), built with ``lora_sites=True``, in a child pytest
process on this file (``ADAPTIVE_SPEC_SITES_INNER=1``; vLLM engines do not coexist well in one process).
Checks: the sites carry the dense reference; the adapters run inside compiled passes (the site operator
is called while the drafter's graph stays compiled); greedy identity with a batch mixing two adapters and
none; compiled passes draft what the same adapters draft eagerly; a failing update is counted, never
raised into vLLM; detach unbinds the sites.
"""

from __future__ import annotations

import os

import pytest

INNER = os.environ.get("ADAPTIVE_SPEC_SITES_INNER") == "1"
pytestmark = pytest.mark.vllm
vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)
K = 3


def test_lora_sites_in_vllm_child_process():
    """Runs the engine checks below in a fresh process and fails with their output if they fail."""
    if INNER:
        pytest.skip("inner run")
    from tests.conftest import run_child_pytest

    run_child_pytest(__file__, "ADAPTIVE_SPEC_SITES_INNER")


inner = pytest.mark.skipif(not INNER, reason="runs in the child process")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from adaptive_spec.vllm.eagle3 import assemble_cached_head
    from adaptive_spec.vllm.engine import build_llm
    from tests.test_correctness_eagle3 import tiny_target_and_head

    target, head = tiny_target_and_head()
    tmp = tmp_path_factory.mktemp("sites")
    loadable = assemble_cached_head(head, "float32", target_dir=target, root=tmp)
    return build_llm(
        target,
        dtype="float32",
        max_k=K,
        concurrency=4,
        method="eagle3",
        draft_model=loadable,
        max_model_len=512,
        kv_cache_gib=0.25,
        lora_sites=True,
    )


@pytest.fixture(scope="module")
def runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class _Counter:
    """Counts the site operator's calls that found an adapter bound and planned."""

    def __init__(self, mgr):
        self.applied = 0
        self.mgr = mgr
        self._orig = mgr._apply

        def apply(layer, fused, y, x):
            if mgr._runs:
                self.applied += 1
            return self._orig(layer, fused, y, x)

        mgr._apply = apply


def _run(llm, runner, mgr, plan, prompts, *, eager=False):
    """Greedy replies, the adapter of each request (by prompt index) set as it is added, and each
    drafting step's drafts; with ``eager`` every drafter pass runs uncompiled."""
    from vllm import SamplingParams

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    drafter = runner.drafter
    inner = drafter.model.model
    seen: list[str] = []
    drafts: list[list[list[int]]] = []
    orig_add = sched.add_request
    orig_propose = drafter.propose
    had_propose = "propose" in vars(drafter)  # the manager's own patch

    def add_request(request):
        seen.append(request.request_id)
        mgr.set_request_adapter(request.request_id, plan[len(seen) - 1])
        return orig_add(request)

    def propose(*args, **kwargs):
        out = orig_propose(*args, **kwargs)
        drafts.append(out.tolist())
        return out

    sched.add_request = add_request
    drafter.propose = propose
    flag = inner.do_not_compile
    inner.do_not_compile = eager
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        inner.do_not_compile = flag
        vars(sched).pop("add_request", None)
        if had_propose:
            drafter.propose = orig_propose
        else:
            vars(drafter).pop("propose", None)
    return [list(o.outputs[0].token_ids) for o in outs], drafts


@inner
def test_sites_in_the_compiled_graph(llm, runner):
    from adaptive_spec.vllm import lora_sites
    from adaptive_spec.vllm.lora_draft import FUSED, LoraDraftManager
    from tests.conftest import assert_lora_matches_dense, random_head_adapters, tiny_prompts

    inner = runner.drafter.model.model
    sites = lora_sites.sites_of(inner)
    assert sites is not None and set(sites) == {(0, f) for f in FUSED}, sites
    # vLLM compiled the head with the sites in it
    assert inner.compiled and not inner.do_not_compile

    prompts = tiny_prompts(4, length=12, seed=5)
    mgr = LoraDraftManager(llm, max_rank=4)
    try:
        assert mgr.in_compiled_pass
        ads = random_head_adapters(mgr)
        slots = {n: mgr.register(n, a) for n, a in ads.items()}
        ref, base_drafts = _run(llm, runner, mgr, [None] * 4, prompts)

        # The sites against a dense reference: runs of tokens merged (a, a), and one run for all tokens.
        for names, runs in (([None, "a", "a", "b", None, "b"], 3), (["b"] * 5, 1)):
            mgr._plan([(-1 if n is None else slots[n], 1) for n in names])
            assert len(mgr._runs) == runs, mgr._runs
            assert_lora_matches_dense(mgr, ads, names)

        # A batch mixing two adapters and none, in compiled passes.
        counter = _Counter(mgr)
        plan = [None, "a", "b", "a"]
        out, compiled_drafts = _run(llm, runner, mgr, plan, prompts)
        assert out == ref, "tokens differ with adapters"
        assert counter.applied > 0 and not inner.do_not_compile and inner.compiled
        assert compiled_drafts != base_drafts, "the adapters changed no draft"
        # The same adapters in eager passes draft the same tokens.
        out_eager, eager_drafts = _run(llm, runner, mgr, plan, prompts, eager=True)
        assert out_eager == ref
        assert eager_drafts == compiled_drafts, "compiled and eager passes drafted differently"

        # A failing adapter update never reaches vLLM: counted, and the pass goes on without adapters.
        def broken(layer, fused, y, x):
            raise RuntimeError("injected")

        mgr._apply = broken
        out_faulty, _ = _run(llm, runner, mgr, plan, prompts)
        assert out_faulty == ref and mgr.faults > 0, mgr.faults
    finally:
        mgr.detach()
    # Detached: the sites are unbound and the head drafts as it did without adapters.
    assert all(s not in lora_sites._bound for s in sites.values())
    mgr2 = LoraDraftManager(llm, max_rank=4)  # a new manager may bind the same sites
    try:
        out, drafts = _run(llm, runner, mgr2, [None] * 4, prompts)
        assert out == ref and drafts == base_drafts
    finally:
        mgr2.detach()
    with pytest.raises(ValueError, match="already bound"):
        lora_sites.bind(next(iter(sites.values())), lambda y, x: None)
        lora_sites.bind(next(iter(sites.values())), lambda y, x: None)
    lora_sites.unbind(next(iter(sites.values())))


def test_lora_sites_refused_without_a_drafter():
    from adaptive_spec.vllm.engine import build_llm

    with pytest.raises(ValueError, match="lora_sites=True needs a drafter"):
        build_llm(method="ngram", lora_sites=True)
