"""AdaptiveSpec on a real in-process vLLM engine (tiny float32 model): attach/detach, refusals, faults,
and greedy identity under arm schedules that change every step."""

from __future__ import annotations

import json
import types

import pytest

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepView
from tests.conftest import tiny_prompts

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')"
)


def _generate(llm, prompts, max_tokens=32, **kw):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """No-speculation outputs: every request k = 0 through the controller."""
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = tiny_prompts(6, seed=1)
    with AdaptiveSpec(tiny_llm, ["none"], policy="none"):
        ref = _generate(tiny_llm, prompts, max_tokens=40)
    return prompts, ref


class CyclingPolicy(SpecPolicy):
    """Changes proposer and k every step (and per request), through ``arms`` in turn."""

    name = "cycling"

    def __init__(self, proposers, max_k, arms):
        super().__init__(proposers, max_k)
        self.arms = arms
        self.t = 0

    def decide(self, view: StepView) -> Decision:
        out = []
        for i, _r in enumerate(view.requests):
            out.append(self.arms[(self.t + i) % len(self.arms)])
        self.t += 1
        return Decision(out, [None] * len(out), [[] for _ in out])


class RaisingPolicy(SpecPolicy):
    name = "raising"

    def __init__(self, proposers, max_k, every=1):
        super().__init__(proposers, max_k)
        self.every, self.t = every, 0

    def decide(self, view: StepView) -> Decision:
        self.t += 1
        if self.t % self.every == 0:
            raise RuntimeError("policy bug")
        return Decision(
            [Arm("ngram", 2)] * len(view.requests),
            [None] * len(view.requests),
            [[]] * len(view.requests),
        )


def test_attach_detach_restores_engine(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec

    core = tiny_llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    rs = core.model_executor.driver_worker.worker.model_runner.rejection_sampler
    before = {id(o): set(vars(o)) for o in (core, sched, rs)}
    spec = AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"])
    assert "update_draft_token_ids" in vars(sched) and "post_step" in vars(core)
    spec.detach()
    for o in (core, sched, rs):
        assert set(vars(o)) == before[id(o)], f"{type(o).__name__} keeps patched attributes"
    # The engine alone (vLLM's own n-gram speculation) gives the same greedy tokens in float32.
    prompts, ref = reference
    assert _generate(tiny_llm, prompts, max_tokens=40) == ref
    spec.detach()  # idempotent


@pytest.mark.parametrize(
    "proposers",
    [["none", "ngram"], ["none", "jacobi"], ["none", "ngram", "jacobi"]],
)
def test_greedy_identity_adaptive(tiny_llm, reference, proposers):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    with AdaptiveSpec(tiny_llm, proposers, policy="adaptive", seed=3) as spec:
        out = _generate(tiny_llm, prompts, max_tokens=40)
    assert out == ref
    st = spec.stats()
    assert st["faults"] == 0
    assert st["by_category"]["all"]["emitted"] == sum(len(o) for o in ref)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 40])
def test_greedy_identity_arm_changes_every_step(tiny_llm, reference, max_tokens):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    arms = [
        Arm("ngram", 4),
        NO_SPEC,
        Arm("jacobi", 1),
        Arm("ngram", 1),
        Arm("jacobi", 4),
        Arm("ngram", 2),
        Arm("jacobi", 2),
    ]
    policy = CyclingPolicy(["ngram", "jacobi"], 4, arms)
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy) as spec:
        out = _generate(tiny_llm, prompts, max_tokens=max_tokens)
    assert out == [r[:max_tokens] for r in ref]
    st = spec.stats()
    assert st["faults"] == 0
    assert all(len(o) == max_tokens for o in out)  # max_tokens is exact


def test_controller_fault_falls_back(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    policy = RaisingPolicy(["ngram"], 4, every=2)
    with AdaptiveSpec(tiny_llm, ["none", "ngram"], policy=policy) as spec:
        out = _generate(tiny_llm, prompts, max_tokens=40)
    assert out == ref
    assert spec.faults > 0
    assert spec.stats()["faults"] == spec.faults


def test_engine_ngram_drafter_runs_only_for_a_failed_decision(tiny_llm, reference):
    """While the controller decides, vLLM's own n-gram drafter is skipped (its drafts would be
    discarded); when a decision fails, the engine's own drafts are made from that step's arrays and
    handed to the scheduler, as without the controller. Same tokens either way."""
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    runner = (
        tiny_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    )
    calls: list[int] = []
    inner = runner.drafter.propose

    def counted(*a, **kw):
        out = inner(*a, **kw)
        calls.append(len(out))
        return out

    runner.drafter.propose = counted
    try:
        with AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="static:ngram:4") as spec:
            out = _generate(tiny_llm, prompts, max_tokens=40)
        assert out == ref and spec.faults == 0
        assert not calls, "vLLM's n-gram drafter ran while the controller decided"
        with AdaptiveSpec(
            tiny_llm, ["none", "ngram"], policy=RaisingPolicy(["ngram"], 4, every=3)
        ) as spec:
            out = _generate(tiny_llm, prompts, max_tokens=40)
        assert out == ref and spec.faults > 0
        # Once per failed decision (a step whose drafts go to the scheduler), never otherwise.
        assert 0 < len(calls) <= spec.faults, (len(calls), spec.faults)
        assert "propose" in vars(runner.drafter)  # restored to this test's wrapper on detach
    finally:
        del runner.drafter.propose
    assert "propose" not in vars(runner.drafter)


def test_refusals(tiny_llm, monkeypatch):
    from adaptive_spec.vllm import AdaptiveSpec, AttachError
    from adaptive_spec.vllm.checks import model_runner

    with pytest.raises(ValueError, match="proposer='magic'"):
        AdaptiveSpec(tiny_llm, ["none", "magic"])
    with pytest.raises(ValueError, match="draft model"):
        AdaptiveSpec(tiny_llm, ["none", "draft"])
    with pytest.raises(ValueError, match=r"k=9 is out of range; allowed: 0..4"):
        AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="static:ngram:9")
    with pytest.raises(ValueError, match="policy='bogus'"):
        AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="bogus")
    with pytest.raises(AttachError, match=r"vllm\.LLM"):
        AdaptiveSpec(object())
    mp_llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace())
    )
    with pytest.raises(AttachError, match="answers no utility calls"):
        AdaptiveSpec(mp_llm)
    v2 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})()
    core = types.SimpleNamespace(
        model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=v2))
        )
    )
    with pytest.raises(AttachError, match="V2 model runner"):
        model_runner(core)
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(AttachError, match=r"supports vLLM 0\.32\.0 exactly"):
        AdaptiveSpec(tiny_llm)
    # Nothing was left attached by the refused constructions.
    sched = tiny_llm.llm_engine.engine_core.engine_core.scheduler
    assert "update_draft_token_ids" not in vars(sched)


def test_trace_written(tiny_llm, reference, tmp_path):
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, ref = reference
    path = tmp_path / "trace.jsonl"
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], trace=path):
        _generate(tiny_llm, prompts, max_tokens=40)
    tr = read_trace(path)
    assert not tr.truncated and tr.end is not None
    assert tr.header["max_k"] == 4 and tr.header["version"] == 1
    assert len(tr.requests) == len(prompts)
    emitted = sum(r["emitted"] for s in tr.steps for r in s["requests"])
    assert emitted == sum(len(o) for o in ref)
    for s in tr.steps:
        assert s["step_time_s"] > 0
        for r in s["requests"]:
            assert 0 <= r["accepted"] <= r["drafted"] and r["emitted"] <= r["accepted"] + 1
            assert len(r["emitted_token_ids"]) == r["emitted"]
    # Output tokens reassembled from the trace equal the generated ones.
    by_req: dict[str, list[int]] = {}
    for s in tr.steps:
        for r in s["requests"]:
            by_req.setdefault(r["req_id"], []).extend(r["emitted_token_ids"])
    assert sorted(map(tuple, by_req.values())) == sorted(map(tuple, ref))


def test_category_stats_charge_finished_requests(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, _ = reference
    with AdaptiveSpec(
        tiny_llm, ["none", "ngram"], category_of=lambda ids: f"c{len(ids) % 2}"
    ) as spec:
        _generate(tiny_llm, prompts, max_tokens=8)
    cats = spec.stats()["by_category"]
    assert set(cats) <= {"c0", "c1"}, (
        cats
    )  # no "all" bucket for time charged after a request finished
    assert all(c["goodput_tok_s"] > 0 for c in cats.values())


# -- one controller per engine ------------------------------------------------------------------------
def _engine_methods(llm):
    """(object, name) -> what the instance holds for each method AdaptiveSpec hooks (None: the class's)."""
    core = llm.llm_engine.engine_core.engine_core
    rs = core.model_executor.driver_worker.worker.model_runner.rejection_sampler
    names = {
        core.scheduler: (
            "schedule",
            "update_from_output",
            "update_draft_token_ids",
            "finish_requests",
        ),
        core: ("post_step",),
        rs: ("forward",),
    }
    return {(id(o), n): (o, vars(o).get(n)) for o, ns in names.items() for n in ns}


def _assert_plain_engine(llm, before):
    for (_, name), (obj, held) in _engine_methods(llm).items():
        assert held is before[(id(obj), name)][1], f"{type(obj).__name__}.{name} is not restored"
        # The engine's own method: the class's function bound to the instance.
        assert getattr(obj, name).__func__ is getattr(type(obj), name), name
    core = llm.llm_engine.engine_core.engine_core
    assert not any(k.startswith("_adaptive_spec") for k in vars(core))


def test_second_controller_is_refused_and_detach_restores_the_engine(tiny_llm, reference):
    from adaptive_spec.vllm import AdaptiveSpec, AttachError

    prompts, ref = reference
    before = _engine_methods(tiny_llm)
    first = AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"])
    hooked = _engine_methods(tiny_llm)
    with pytest.raises(AttachError) as e:
        AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="static:ngram:2")
    msg = str(e.value)
    assert "already has an AdaptiveSpec attached" in msg and "fix: call detach() on it first" in msg
    assert AdaptiveSpec.attached(tiny_llm) is first
    # The refused one changed nothing: the first one's hooks are still the ones installed.
    assert {k: v[1] for k, v in _engine_methods(tiny_llm).items()} == {
        k: v[1] for k, v in hooked.items()
    }
    assert _generate(tiny_llm, prompts, max_tokens=40) == ref
    steps, learned = first.metrics.steps, first.policy.n_steps
    assert steps > 0 and learned > 0
    first.detach()
    _assert_plain_engine(tiny_llm, before)
    assert AdaptiveSpec.attached(tiny_llm) is None
    # A detached object no longer observes or learns.
    assert _generate(tiny_llm, prompts, max_tokens=40) == ref
    assert (first.metrics.steps, first.policy.n_steps) == (steps, learned)
    # The engine takes a new controller; detaching it, then the old one again, leaves it plain.
    second = AdaptiveSpec(tiny_llm, ["none", "ngram"], policy="static:ngram:2")
    assert _generate(tiny_llm, prompts[:2], max_tokens=8) == [r[:8] for r in ref[:2]]
    assert second.metrics.steps > 0
    second.detach()
    first.detach()
    _assert_plain_engine(tiny_llm, before)


def test_constructor_arguments_are_checked_naming_the_parameter(tiny_llm, tmp_path):
    from adaptive_spec.core.state import StatePathError
    from adaptive_spec.vllm import AdaptiveSpec

    before = _engine_methods(tiny_llm)
    cases = [
        ({"proposers": "ngram"}, r"^proposers='ngram' is invalid; allowed: a non-empty list"),
        ({"proposers": []}, r"^proposers=\[\] is invalid"),
        ({"proposers": ["none", "foo"]}, r"^proposers=\['none', 'foo'\] is invalid \(proposer="),
        ({"policy": 3}, r"^policy=3 is invalid; allowed: a policy name or a SpecPolicy"),
        ({"policy": "bogus"}, r"^policy='bogus' is invalid \(not a known policy name\); allowed"),
        ({"policy": "static:ngram:9"}, r"^policy='static:ngram:9' is invalid \(k=9 is out of"),
        ({"seed": "abc"}, r"^seed='abc' is invalid; allowed: an integer"),
        ({"ngram_min": 2.5}, r"^ngram_min=2.5 is invalid; allowed: an integer"),
        ({"trace": 5}, r"^trace=5 is invalid; allowed: a file path or None"),
        ({"category_of": "code"}, r"^category_of='code' is invalid"),
        ({"lora_adapters": ["code"]}, r"^lora_adapters=\['code'\] is invalid"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            AdaptiveSpec(tiny_llm, **kw)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StatePathError, match=r"^policy_state='.*/file/policy.json' is invalid \("):
        AdaptiveSpec(tiny_llm, policy_state=blocker / "policy.json")
    assert AdaptiveSpec.attached(tiny_llm) is None
    _assert_plain_engine(tiny_llm, before)


# -- policy state in process ----------------------------------------------------------------------------
def test_refused_policy_state_is_moved_aside_never_overwritten(tiny_llm, reference, tmp_path):
    from adaptive_spec.core.state import policy_state_json
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, _ = reference
    path = tmp_path / "policy.json"
    # A valid state, saved for another max_k (num_speculative_tokens): refused here, and must survive.
    other = make_policy("adaptive", ["none", "ngram"], 8)
    other.n_steps = 123
    saved = policy_state_json(other)
    path.write_text(saved)
    stale = tmp_path / ".policy.json.abcd_123"  # a temporary file an interrupted save left
    stale.write_text('{"half"')
    spec = AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy_state=path)
    assert spec.policy.n_steps == 0 and not stale.exists()
    (aside,) = tmp_path.glob("policy.json.refused-*")
    assert aside.read_text() == saved and not path.exists()
    _generate(tiny_llm, prompts[:2], max_tokens=8)
    spec.detach()
    assert aside.read_text() == saved  # kept
    assert json.loads(path.read_text())["state"]["n_steps"] == spec.policy.n_steps > 0
    # The new file loads on the next attach; nothing more is set aside.
    again = AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy_state=path)
    try:
        assert again.policy.n_steps == spec.policy.n_steps
    finally:
        again.detach()
    assert len(list(tmp_path.glob("policy.json.refused-*"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json", aside.name]


@pytest.mark.parametrize("how", ["detach", "with"])
def test_unwritable_policy_state_at_detach_is_reported_and_the_trace_closed(
    tiny_llm, reference, tmp_path, how
):
    from adaptive_spec.core.state import StateSaveError
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec

    prompts, _ = reference
    before = _engine_methods(tiny_llm)
    state_dir = tmp_path / "state"
    trace = tmp_path / "trace.jsonl"
    kw = {"policy_state": state_dir / "policy.json", "trace": trace}
    with pytest.raises(StateSaveError) as e:
        if how == "detach":
            spec = AdaptiveSpec(tiny_llm, ["none", "ngram"], **kw)
            _generate(tiny_llm, prompts[:2], max_tokens=8)
            state_dir.rmdir()
            state_dir.write_text("now a file")  # every save fails from here on
            spec.detach()
        else:
            with AdaptiveSpec(tiny_llm, ["none", "ngram"], **kw) as spec:
                _generate(tiny_llm, prompts[:2], max_tokens=8)
                state_dir.rmdir()
                state_dir.write_text("now a file")
    msg = str(e.value)
    assert msg.startswith(f"policy_state='{state_dir}/policy.json': the policy state cannot be")
    assert "fix: " in msg
    assert isinstance(e.value, OSError)
    assert state_dir.read_text() == "now a file"
    tr = read_trace(trace)  # closed: complete, with its end record
    assert not tr.truncated and tr.end is not None and tr.steps
    _assert_plain_engine(tiny_llm, before)
    assert AdaptiveSpec.attached(tiny_llm) is None
    spec.detach()  # idempotent: nothing more raised


def test_failed_save_does_not_hide_the_blocks_exception(tiny_llm, tmp_path, caplog):
    from adaptive_spec.vllm import AdaptiveSpec

    state_dir = tmp_path / "state"
    with (
        caplog.at_level("ERROR", logger="adaptive_spec.vllm.attach"),
        pytest.raises(KeyError, match="from the block"),
        AdaptiveSpec(tiny_llm, ["none", "ngram"], policy_state=state_dir / "p.json"),
    ):
        state_dir.rmdir()
        state_dir.write_text("x")
        raise KeyError("from the block")
    assert "the policy state cannot be written" in caplog.text
    assert AdaptiveSpec.attached(tiny_llm) is None
