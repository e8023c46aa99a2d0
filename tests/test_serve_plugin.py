"""The ``vllm serve`` plugin without an engine: configuration, registration, the vLLM-config check, the
metrics snapshot and collector, and the runtime's saving logic (on a stand-in engine core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from adaptive_spec.core.errors import ConfigError
from adaptive_spec.core.metrics import SpecMetrics
from adaptive_spec.core.policies import make_policy
from adaptive_spec.vllm import plugin, prom
from adaptive_spec.vllm.plugin import ServeConfig, ServeRuntime, check_vllm_config

ROOT = Path(__file__).resolve().parent.parent


# -- configuration ----------------------------------------------------------------------------------
def test_switch_off_by_default_and_when_false(tmp_path):
    assert ServeConfig.from_env({}) is None
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text("{}")
    for off in ("0", "false", "No", "off", ""):
        assert (
            ServeConfig.from_env({"ADAPTIVE_SPEC": off, "ADAPTIVE_SPEC_CONFIG": str(cfg_file)})
            is None
        )
    # Individual variables alone do not switch it on.
    assert ServeConfig.from_env({"ADAPTIVE_SPEC_POLICY": "none"}) is None


def test_switch_on_defaults_and_env_values():
    cfg = ServeConfig.from_env({"ADAPTIVE_SPEC": "1"})
    assert cfg == ServeConfig()
    assert cfg.proposers == ("none", "ngram", "jacobi") and cfg.state is None
    cfg = ServeConfig.from_env(
        {
            "ADAPTIVE_SPEC": "yes",
            "ADAPTIVE_SPEC_PROPOSERS": " none, ngram ",
            "ADAPTIVE_SPEC_POLICY": "adaptive-ucb",
            "ADAPTIVE_SPEC_STATE": "/tmp/s.json",
            "ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "7",
            "ADAPTIVE_SPEC_SAVE_EVERY_S": "2.5",
            "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0.25",
            "ADAPTIVE_SPEC_SEED": "-3",
            "ADAPTIVE_SPEC_NGRAM_MIN": "1",
            "ADAPTIVE_SPEC_NGRAM_MAX": "5",
        }
    )
    assert cfg.proposers == ("none", "ngram")
    assert cfg.policy == "adaptive-ucb"
    assert cfg.state == Path("/tmp/s.json")
    assert (cfg.save_every_steps, cfg.save_every_s, cfg.metrics_interval_s) == (7, 2.5, 0.25)
    assert (cfg.seed, cfg.ngram_min, cfg.ngram_max) == (-3, 1, 5)


def test_config_file_then_env_overrides(tmp_path):
    f = tmp_path / "adaptive.json"
    f.write_text(
        json.dumps(
            {"proposers": ["none", "jacobi"], "policy": "static:jacobi:2", "state": "a.json"}
        )
    )
    cfg = ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(f)})
    assert cfg.proposers == ("none", "jacobi") and cfg.policy == "static:jacobi:2"
    assert cfg.state == Path("a.json")
    cfg = ServeConfig.from_env(
        {
            "ADAPTIVE_SPEC_CONFIG": str(f),
            "ADAPTIVE_SPEC_POLICY": "adaptive",
            "ADAPTIVE_SPEC_STATE": "",
        }
    )
    assert cfg.policy == "adaptive" and cfg.state is None and cfg.proposers == ("none", "jacobi")


@pytest.mark.parametrize(
    ("env", "head", "allowed"),
    [
        ({"ADAPTIVE_SPEC": "maybe"}, "ADAPTIVE_SPEC='maybe' is invalid", "1/true/yes/on"),
        (
            {"ADAPTIVE_SPEC_POLICY": "bogus"},
            "ADAPTIVE_SPEC_POLICY='bogus' is invalid (not a known policy name)",
            "adaptive, adaptive-ucb",
        ),
        ({"ADAPTIVE_SPEC_POLICY": ""}, "ADAPTIVE_SPEC_POLICY='' is invalid", "adaptive, "),
        (
            {"ADAPTIVE_SPEC_POLICY": "static:ngram:x"},
            "ADAPTIVE_SPEC_POLICY='static:ngram:x' is invalid (arm='ngram:x' is invalid",
            "static:<proposer>:<k>",
        ),
        (
            {"ADAPTIVE_SPEC_PROPOSERS": "ngram,foo"},
            "ADAPTIVE_SPEC_PROPOSERS='ngram,foo' is invalid (proposer 'foo' is not known)",
            "none, ngram, jacobi, suffix, draft",
        ),
        (
            {"ADAPTIVE_SPEC_PROPOSERS": ""},
            "ADAPTIVE_SPEC_PROPOSERS='' is invalid (an empty list)",
            "a non-empty comma-separated list",
        ),
        (
            {"ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "0"},
            "ADAPTIVE_SPEC_SAVE_EVERY_STEPS='0' is invalid",
            "an integer >= 1",
        ),
        (
            {"ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "ten"},
            "ADAPTIVE_SPEC_SAVE_EVERY_STEPS='ten' is invalid",
            "an integer >= 1",
        ),
        (
            {"ADAPTIVE_SPEC_SAVE_EVERY_S": "-5"},
            "ADAPTIVE_SPEC_SAVE_EVERY_S='-5' is invalid",
            "a finite number of seconds > 0",
        ),
        (
            {"ADAPTIVE_SPEC_SAVE_EVERY_S": "inf"},
            "ADAPTIVE_SPEC_SAVE_EVERY_S='inf' is invalid",
            "a finite number of seconds > 0",
        ),
        (
            {"ADAPTIVE_SPEC_METRICS_INTERVAL_S": "nan"},
            "ADAPTIVE_SPEC_METRICS_INTERVAL_S='nan' is invalid",
            "a finite number of seconds > 0",
        ),
        (
            {"ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0"},
            "ADAPTIVE_SPEC_METRICS_INTERVAL_S='0' is invalid",
            "a finite number of seconds > 0",
        ),
        ({"ADAPTIVE_SPEC_SEED": "abc"}, "ADAPTIVE_SPEC_SEED='abc' is invalid", "an integer"),
        (
            {"ADAPTIVE_SPEC_NGRAM_MIN": "5", "ADAPTIVE_SPEC_NGRAM_MAX": "3"},
            "ADAPTIVE_SPEC_NGRAM_MIN='5' and ADAPTIVE_SPEC_NGRAM_MAX='3' are invalid together",
            "ngram_min <= ngram_max",
        ),
    ],
)
def test_config_errors_name_the_variable_value_allowed_and_fix(env, head, allowed):
    """One line: the variable (not the field), the value as given, what is allowed and the fix."""
    env = {"ADAPTIVE_SPEC": "1", **env}
    with pytest.raises(ConfigError) as e:
        ServeConfig.from_env(env)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(head), msg
    assert "; allowed: " in msg and "; fix: " in msg
    assert allowed in msg[msg.index("; allowed: ") : msg.index("; fix: ")], msg
    var = head.split("=", 1)[0]
    assert f"fix: set {var}" in msg


def test_config_file_errors_name_the_file_and_key(tmp_path):
    f = tmp_path / "adaptive.json"
    f.write_text(json.dumps({"policy": "bogus"}))
    with pytest.raises(ConfigError) as e:
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(f)})
    msg = str(e.value)
    assert msg.startswith(f"{f}: policy='bogus' is invalid (not a known policy name); allowed: ")
    assert f"fix: set 'policy' in {f} to a valid value" in msg
    f.write_text(json.dumps({"save_every_s": -5, "seed": 1}))
    with pytest.raises(ConfigError, match=rf"^{f}: save_every_s=-5 is invalid; allowed: a finite"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(f)})
    f.write_text(json.dumps({"seed": "abc"}))
    with pytest.raises(ConfigError, match=rf"^{f}: seed='abc' is invalid; allowed: an integer"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(f)})
    # A variable overrides the file's key, and an error then names the variable.
    f.write_text(json.dumps({"seed": 1}))
    with pytest.raises(ConfigError, match=r"^ADAPTIVE_SPEC_SEED='x' is invalid"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(f), "ADAPTIVE_SPEC_SEED": "x"})


def test_config_python_errors_name_the_parameter():
    with pytest.raises(ConfigError, match=r"^seed='x' is invalid; allowed: an integer; fix: pass"):
        ServeConfig(seed="x")
    with pytest.raises(ConfigError, match=r"^proposers='ngram' is invalid; allowed: "):
        ServeConfig(proposers="ngram")


def test_config_file_errors(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match=r"^ADAPTIVE_SPEC_CONFIG=.*cannot be read as JSON"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(missing)})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(bad)})
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(arr)})
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"polcy": "adaptive"}))
    with pytest.raises(ValueError, match=rf"^{unknown}: unknown key 'polcy'; allowed: .*policy"):
        ServeConfig.from_env({"ADAPTIVE_SPEC_CONFIG": str(unknown)})
    with pytest.raises(ValueError, match="save_every_steps=True"):
        ServeConfig.from_mapping({"save_every_steps": True})


def test_unwritable_state_or_trace_path_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = ServeConfig.from_env(
        {"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_STATE": str(blocker / "sub" / "policy.json")}
    )
    with pytest.raises(ConfigError) as e:
        cfg.check_paths()
    msg = str(e.value)
    assert msg.startswith(
        f"ADAPTIVE_SPEC_STATE='{blocker}/sub/policy.json' is invalid (cannot write"
    )
    assert "; allowed: a file path in a directory that" in msg and "; fix: " in msg
    cfg = ServeConfig.from_env({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_STATE": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"is invalid \(it is a directory\)"):
        cfg.check_paths()
    cfg = ServeConfig.from_env(
        {"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_TRACE": str(blocker / "t.jsonl")}
    )
    with pytest.raises(ConfigError, match=r"^ADAPTIVE_SPEC_TRACE="):
        cfg.check_paths()
    # A directory that does not exist yet is created; nothing is left in it.
    good = tmp_path / "new" / "dir" / "policy.json"
    ServeConfig(state=good, trace=tmp_path / "t" / "trace.jsonl").check_paths()
    assert good.parent.is_dir() and list(good.parent.iterdir()) == []
    assert list((tmp_path / "t").iterdir()) == []


# -- the check of vLLM's configuration ---------------------------------------------------------------
def _vllm_config(method="ngram", k=4, backend="uni", device="cpu", async_scheduling=False):
    spec = (
        None if method is None else types.SimpleNamespace(method=method, num_speculative_tokens=k)
    )
    return types.SimpleNamespace(
        speculative_config=spec,
        parallel_config=types.SimpleNamespace(distributed_executor_backend=backend),
        device_config=types.SimpleNamespace(device_type=device),
        scheduler_config=types.SimpleNamespace(async_scheduling=async_scheduling),
    )


def test_check_vllm_config_accepts_and_refuses():
    cfg = ServeConfig()
    check_vllm_config(_vllm_config(), cfg)
    check_vllm_config(_vllm_config(method="draft_model"), ServeConfig(proposers=("none", "draft")))
    with pytest.raises(ConfigError, match="--speculative-config"):
        check_vllm_config(_vllm_config(method=None), cfg)
    with pytest.raises(ConfigError, match="method='suffix' is invalid"):
        check_vllm_config(_vllm_config(method="suffix"), cfg)
    with pytest.raises(ConfigError, match=r"proposer 'draft' needs a draft-model engine"):
        check_vllm_config(_vllm_config(), ServeConfig(proposers=("none", "draft")))
    # The multiprocess executors: the runner side runs on every rank (adaptive_spec.vllm.workers).
    check_vllm_config(_vllm_config(backend="mp"), cfg)
    check_vllm_config(_vllm_config(backend="ray", device="cuda"), cfg)
    with pytest.raises(ConfigError, match="--distributed-executor-backend='external_launcher'"):
        check_vllm_config(_vllm_config(backend="external_launcher"), cfg)
    lora = ServeConfig(proposers=("none", "lora:code"))
    with pytest.raises(ConfigError, match="lora:code needs the drafter in the engine-core process"):
        check_vllm_config(_vllm_config(method="draft_model", backend="mp"), lora)
    with pytest.raises(ConfigError, match="--no-async-scheduling"):
        check_vllm_config(_vllm_config(async_scheduling=True), cfg)
    with pytest.raises(
        ConfigError, match=r"^policy='static:ngram:9' is invalid \(k=9 is out of range"
    ):
        check_vllm_config(_vllm_config(), ServeConfig(policy="static:ngram:9"))


def test_check_vllm_config_names_the_variable_of_a_k_above_the_engine():
    cfg = ServeConfig.from_env({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_POLICY": "static:ngram:99"})
    with pytest.raises(ConfigError) as e:
        check_vllm_config(_vllm_config(k=4), cfg)
    msg = str(e.value)
    assert msg.startswith("ADAPTIVE_SPEC_POLICY='static:ngram:99' is invalid (k=99 is out of range")
    assert "; allowed: a policy whose k are at most num_speculative_tokens=4" in msg
    assert "; fix: use k <= 4, or raise num_speculative_tokens in --speculative-config" in msg
    cfg = ServeConfig.from_env({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_PROPOSERS": "none,draft"})
    with pytest.raises(ConfigError, match=r"^ADAPTIVE_SPEC_PROPOSERS='none,draft' is invalid"):
        check_vllm_config(_vllm_config(), cfg)


# -- registration (fresh interpreters: register() acts once per process) ----------------------------
def _run_python(code: str, env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_SPEC")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_register_without_switch_changes_nothing():
    code = (
        "import sys\n"
        "from adaptive_spec.vllm import plugin\n"
        "plugin.register(); plugin.register()\n"
        "import os\n"
        "print('vllm' in sys.modules, 'adaptive_spec.vllm.attach' in sys.modules,"
        " 'ADAPTIVE_SPEC_METRICS_DIR' in os.environ)\n"
    )
    assert _run_python(code, {}).split() == ["False", "False", "False"]


@pytest.mark.vllm
def test_register_with_switch_patches_once(tmp_path):
    pytest.importorskip("vllm")
    code = (
        "import os\n"
        "from adaptive_spec.vllm import plugin\n"
        "plugin.register()\n"
        "from vllm.v1.engine.core import EngineCoreProc\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from prometheus_client import REGISTRY\n"
        "loop, cfg = EngineCoreProc.run_busy_loop, EngineArgs.create_engine_config\n"
        "plugin.registration._registered = False  # past the once-per-process guard\n"
        "plugin.register()\n"
        "cols = [c for c in REGISTRY._collector_to_names if type(c).__name__ == 'SnapshotCollector']\n"
        "print(loop._adaptive_spec_wrapped, cfg._adaptive_spec_wrapped,"
        " EngineCoreProc.run_busy_loop is loop, EngineArgs.create_engine_config is cfg, len(cols),"
        " os.environ['ADAPTIVE_SPEC_METRICS_DIR'])\n"
    )
    out = _run_python(code, {"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_METRICS_DIR": str(tmp_path)})
    assert out.split() == ["True", "True", "True", "True", "1", str(tmp_path)]


@pytest.mark.vllm
def test_register_gives_the_engine_core_time_for_the_final_save():
    """With vLLM's default --shutdown-timeout 0 its process manager sends SIGTERM to the engine core and
    kills it at once; after register() it waits up to SHUTDOWN_GRACE_S for the process to exit (requests
    are still aborted at once). Other timeouts are vLLM's own."""
    pytest.importorskip("vllm")
    code = (
        "from vllm.v1.engine import utils\n"
        "from adaptive_spec.vllm import plugin\n"
        "orig = utils.get_engine_process_shutdown_timeout\n"
        "plugin.register()\n"
        "f = utils.get_engine_process_shutdown_timeout\n"
        "print(orig(0, 0), f is not orig, f(0, 0), f(0, None), f(5, 5), f(0, 3), f(None, None))\n"
    )
    out = _run_python(code, {"ADAPTIVE_SPEC": "1"})
    assert out.split() == ["0", "True", str(plugin.SHUTDOWN_GRACE_S), "None", "5", "3", "None"]


def _register(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_SPEC")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", "from adaptive_spec.vllm import plugin; plugin.register()"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_register_refuses_bad_config_in_one_line_with_status_2():
    out = _register({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_PROPOSERS": "none,warp"})
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "adaptive-spec: error: ADAPTIVE_SPEC_PROPOSERS='none,warp' is invalid (proposer 'warp' is not "
        "known); allowed: a non-empty comma-separated list of none, ngram, jacobi, suffix, draft, "
        "lora:<adapter>; fix: set ADAPTIVE_SPEC_PROPOSERS to a valid value (e.g. none,ngram,jacobi) "
        "or unset it for the default"
    ]
    # The debug switch shows the traceback.
    out = _register({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_SEED": "abc", "ADAPTIVE_SPEC_DEBUG": "1"})
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ConfigError: ADAPTIVE_SPEC_SEED='abc'" in out.stderr


def test_register_refuses_an_unwritable_state_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = _register({"ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_STATE": str(blocker / "policy.json")})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"adaptive-spec: error: ADAPTIVE_SPEC_STATE='{blocker}/policy.json'")


def test_ensure_metrics_dir_creates_and_exports(tmp_path):
    env: dict[str, str] = {}
    d = plugin.ensure_metrics_dir(env)
    try:
        assert d.is_dir() and env[plugin.ENV_METRICS_DIR] == str(d)
        assert plugin.ensure_metrics_dir(env) == d
    finally:
        d.rmdir()
    assert plugin.ensure_metrics_dir({plugin.ENV_METRICS_DIR: str(tmp_path)}) == tmp_path


# -- metrics snapshot and collector --------------------------------------------------------------------
def _filled_metrics() -> SpecMetrics:
    m = SpecMetrics()
    m.add_request_step("ngram:4", "ngram", None, drafted=4, accepted=3, emitted=4, time_share_s=0.0)
    m.add_request_step("ngram:4", "ngram", None, drafted=4, accepted=0, emitted=1, time_share_s=0.0)
    m.add_request_step(
        "jacobi:2", "jacobi", None, drafted=2, accepted=1, emitted=2, time_share_s=0.0
    )
    m.add_request_step("none", "none", None, drafted=0, accepted=0, emitted=1, time_share_s=0.0)
    m.add_step(0.030, 0.001)
    m.add_step(0.050, 0.002)
    m.faults = 2
    return m


def _scrape(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_snapshot_round_trip_and_collector(tmp_path):
    from prometheus_client import CollectorRegistry

    info = {
        "policy": "adaptive",
        "proposers": ["none", "ngram"],
        "max_k": 4,
        "engine_method": "ngram",
    }
    state = {"loaded": True, "saves": 3, "save_failures": 1, "last_save_time": 1.7e9}
    snap0 = prom.metrics_snapshot(
        _filled_metrics(),
        engine=0,
        info=info,
        estimated_acceptance={"ngram": 0.4, "jacobi": 0.1},
        policy_learned_steps=12,
        state=state,
    )
    snap1 = prom.metrics_snapshot(SpecMetrics(), engine=1, info=info)
    json.dumps(snap0)  # JSON-serialisable
    prom.write_snapshot(snap0, tmp_path)
    prom.write_snapshot(snap1, tmp_path)
    (tmp_path / "engine-7.json").write_text("{half a fi")  # skipped, not fatal
    (tmp_path / "engine-8.json").write_text(json.dumps({"format": "other"}))
    assert [s["engine"] for s in prom.read_snapshots(tmp_path)] == [0, 1]

    reg = CollectorRegistry()
    col = prom.register_collector(tmp_path, reg)
    assert prom.register_collector(tmp_path, reg) is col
    v = _scrape(reg)
    e0 = (("engine", "0"),)

    def get(name, **labels):
        return v[(name, tuple(sorted({"engine": "0", **labels}.items())))]

    assert get("adaptive_spec_arm_choices_total", proposer="ngram", k="4") == 2
    assert get("adaptive_spec_arm_choices_total", proposer="jacobi", k="2") == 1
    assert get("adaptive_spec_arm_choices_total", proposer="none", k="0") == 1
    assert get("adaptive_spec_drafted_tokens_total", proposer="ngram") == 8
    assert get("adaptive_spec_accepted_tokens_total", proposer="ngram") == 3
    assert get("adaptive_spec_emitted_tokens_total", proposer="ngram") == 5
    assert get("adaptive_spec_estimated_acceptance", proposer="ngram") == pytest.approx(0.4)
    assert v[("adaptive_spec_step_time_seconds_count", e0)] == 2
    assert v[("adaptive_spec_step_time_seconds_sum", e0)] == pytest.approx(0.080)
    assert v[("adaptive_spec_controller_time_seconds_sum", e0)] == pytest.approx(0.003)
    assert v[("adaptive_spec_controller_faults_total", e0)] == 2
    assert v[("adaptive_spec_policy_learned_steps", e0)] == 12
    assert v[("adaptive_spec_state_loaded", e0)] == 1
    assert v[("adaptive_spec_state_saves_total", e0)] == 3
    assert v[("adaptive_spec_state_save_failures_total", e0)] == 1
    assert v[("adaptive_spec_state_last_save_timestamp_seconds", e0)] == pytest.approx(1.7e9)
    assert v[("adaptive_spec_state_loaded", (("engine", "1"),))] == 0
    assert v[("adaptive_spec_step_time_seconds_count", (("engine", "1"),))] == 0
    info_labels = {
        "engine": "0",
        "policy": "adaptive",
        "proposers": "none,ngram",
        "max_k": "4",
        "engine_method": "ngram",
    }
    assert v[("adaptive_spec_info", tuple(sorted(info_labels.items())))] == 1
    assert all(name.startswith("adaptive_spec_") for name, _ in v)


def test_collector_with_no_directory_yields_no_samples(tmp_path):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    prom.register_collector(tmp_path / "nowhere", reg)
    assert _scrape(reg) == {}
    with pytest.raises(ValueError, match="engine=-1 is invalid"):
        prom.metrics_snapshot(SpecMetrics(), engine=-1, info={})


# -- the runtime on a stand-in engine core ------------------------------------------------------------
class _FakeScheduler:
    def __init__(self) -> None:
        self.unfinished = 1

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


class _FakeSpec:
    """What ServeRuntime uses of AdaptiveSpec, with a real policy and real counters."""

    def __init__(self, core, proposers, policy="adaptive", seed=0, **_kw) -> None:
        self.core = core
        self.proposer_names = list(proposers)
        self.max_k = 4
        self.engine_method = "ngram"
        self.engine_key = {"model": "fake", "dtype": "float32", "threads": 1, "device": "cpu"}
        self.policy = make_policy(policy, self.proposer_names, self.max_k, seed=seed)
        self.metrics = SpecMetrics()
        self.faults = 0
        self.detached = False
        self._had = "post_step" in vars(core)
        core.post_step = self._post_step

    def _post_step(self, model_executed: bool) -> None:
        if model_executed:
            self.metrics.add_step(0.01, 0.0001)
            self.metrics.add_request_step("ngram:2", "ngram", None, 2, 1, 2, 0.0)
            self.policy.n_steps += 1  # stands for learning

    def _fault(self, where, err) -> None:
        self.faults += 1
        raise AssertionError(f"unexpected fault in {where}: {err!r}")

    def detach(self) -> None:
        self.detached = True
        if not self._had:
            del self.core.post_step


@pytest.fixture
def fake_core(monkeypatch):
    from adaptive_spec.vllm import attach

    monkeypatch.setattr(
        attach.AdaptiveSpec,
        "attach_engine_core",
        classmethod(lambda cls, core, proposers, **kw: _FakeSpec(core, proposers, **kw)),
    )
    return types.SimpleNamespace(scheduler=_FakeScheduler(), engine_index=0)


def _wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_runtime_saves_periodically_at_idle_and_at_close(fake_core, tmp_path):
    from adaptive_spec.core.state import FORMAT

    state = tmp_path / "state" / "policy.json"
    cfg = ServeConfig(state=state, save_every_steps=5, save_every_s=3600, metrics_interval_s=0.05)
    rt = ServeRuntime(fake_core, cfg, metrics_dir=tmp_path / "m")
    assert rt.spec.policy.drain_margin is None  # a server: per-step goodput, never makespan
    assert not rt.state_loaded and not state.exists()
    snap = prom.read_snapshots(tmp_path / "m")
    assert len(snap) == 1 and snap[0]["steps"] == 0  # written at attach
    for i in range(1, 13):
        fake_core.post_step(True)
        if i in (5, 10):  # a save is due after steps 5 and 10
            _wait_for(lambda i=i: rt.saves == i // 5)
            doc = json.loads(state.read_text())
            assert doc["format"] == FORMAT and doc["state"]["n_steps"] == i
    assert rt.saves == 2
    fake_core.scheduler.unfinished = 0  # the engine goes idle: the state is saved at once
    fake_core.post_step(True)
    _wait_for(lambda: rt.saves == 3)
    assert json.loads(state.read_text())["state"]["n_steps"] == 13
    saves = rt.saves
    fake_core.post_step(False)  # idle polling steps save nothing more
    time.sleep(0.1)
    assert rt.saves == saves
    _wait_for(lambda: prom.read_snapshots(tmp_path / "m")[0]["steps"] == 13)
    assert rt.max_serialise_s < 0.05
    fake_core.scheduler.unfinished = 2
    fake_core.post_step(True)
    rt.close()
    rt.close()  # idempotent
    assert rt.spec.detached and "post_step" not in vars(fake_core)
    assert json.loads(state.read_text())["state"]["n_steps"] == 14
    snap = prom.read_snapshots(tmp_path / "m")[0]
    assert snap["steps"] == 14 and snap["state"]["saves"] == rt.saves
    assert snap["proposers"]["ngram"] == {
        "drafted": 28,
        "accepted": 14,
        "emitted": 28,
        "request_steps": 14,
    }
    assert not rt._writer.is_alive()
    # No temporary files left behind (the lock file of the merges stays, empty).
    assert sorted(p.name for p in state.parent.iterdir()) == [".policy.json.lock", "policy.json"]


def test_runtime_loads_state_and_refuses_bad_files(fake_core, tmp_path, caplog):
    state = tmp_path / "policy.json"
    cfg = ServeConfig(proposers=("none", "ngram"), state=state, metrics_interval_s=0.05)
    rt = ServeRuntime(fake_core, cfg)
    for _ in range(3):
        fake_core.post_step(True)
    rt.close()
    assert json.loads(state.read_text())["state"]["n_steps"] == 3
    rt2 = ServeRuntime(fake_core, cfg)
    assert rt2.state_loaded and rt2.spec.policy.n_steps == 3
    rt2.close()
    # Incompatible: no proposer in common (a state of overlapping proposers loads the shared ones).
    cfg3 = ServeConfig(proposers=("none", "jacobi"), state=state, metrics_interval_s=0.05)
    with caplog.at_level("WARNING"):
        rt3 = ServeRuntime(fake_core, cfg3)
    assert not rt3.state_loaded and rt3.spec.policy.n_steps == 0
    refused = list(tmp_path.glob("policy.json.refused-*"))
    assert len(refused) == 1 and not state.exists()
    assert "refused" in caplog.text and str(refused[0]) in caplog.text
    rt3.close()
    assert json.loads(state.read_text())["state"]["proposers"] == ["jacobi"]
    # Corrupt.
    state.write_text('{"format": "adaptive-spec-policy-state", "vers')
    rt4 = ServeRuntime(fake_core, cfg3)
    assert not rt4.state_loaded
    assert len(list(tmp_path.glob("policy.json.refused-*"))) == 2
    rt4.close()


def test_runtime_refuses_an_unwritable_state_path(fake_core, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^state='.*/file/sub/policy.json' is invalid \(cannot"):
        ServeRuntime(fake_core, ServeConfig(state=blocker / "sub" / "policy.json"))
    assert "post_step" not in vars(fake_core)  # detached again


def test_runtime_removes_stale_temporary_files_at_start(fake_core, tmp_path):
    state = tmp_path / "policy.json"
    stale = [tmp_path / ".policy.json.k2x_9q0a", tmp_path / ".policy.json.abcdefgh"]
    for p in stale:
        p.write_text('{"half": ')
    other = [tmp_path / ".policy.json.keep", tmp_path / ".other.json.abcdefgh", tmp_path / "notes"]
    for p in other:
        p.write_text("x")
    rt = ServeRuntime(fake_core, ServeConfig(state=state, metrics_interval_s=0.05))
    rt.close()
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in other)
    assert json.loads(state.read_text())["format"] == "adaptive-spec-policy-state"


def test_runtime_save_failure_is_counted_not_raised(fake_core, tmp_path):
    state_dir = tmp_path / "state"
    cfg = ServeConfig(state=state_dir / "policy.json", save_every_steps=1)
    rt = ServeRuntime(fake_core, cfg, metrics_dir=tmp_path / "m")
    state_dir.rmdir()
    state_dir.write_text("x")  # the directory became a file after the start: every write fails
    fake_core.post_step(True)
    _wait_for(lambda: rt.save_failures >= 1)
    rt.close()
    assert rt.saves == 0 and rt.save_failures >= 2  # the periodic one and the final one
    assert prom.read_snapshots(tmp_path / "m")[0]["state"]["save_failures"] == rt.save_failures


def test_writer_keeps_only_the_newest_pending_state(fake_core, tmp_path):
    cfg = ServeConfig(state=tmp_path / "p.json", metrics_interval_s=3600)
    rt = ServeRuntime(fake_core, cfg)
    gate = threading.Lock()
    gate.acquire()
    written = []
    orig = plugin.ServeRuntime._write_state

    def slow_write(self, data, seq, pulled):
        with gate:
            written.append(seq)
        orig(self, data, seq, pulled)

    rt._write_state = types.MethodType(slow_write, rt)
    rt._writer.put_state("{}", 101, None)
    _wait_for(lambda: rt._writer._pending is None)  # the writer took 101 and waits on the gate
    rt._writer.put_state("{}", 102, None)
    rt._writer.put_state('{"x": 1}', 103, None)  # supersedes 102
    gate.release()
    _wait_for(lambda: written == [101, 103])
    rt.close()
    assert written[:2] == [101, 103]
