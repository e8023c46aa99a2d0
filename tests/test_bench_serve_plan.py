"""``adaptive-spec bench serve`` without a server: configuration and pattern parsing, the server command
lines, the client's argv (vLLM's own parser), merging client passes, ratios, identity, the tuned table,
the goals, and the CLI's argument errors."""

from __future__ import annotations

import json
import math

import pytest

from adaptive_spec.commands.bench import serve_plan as sp
from adaptive_spec.commands.bench.serve_client import client_argv, merge_passes, per_request
from adaptive_spec.commands.bench.serve_server import (
    ServerSettings,
    by_label,
    counters,
    delta,
    server_command,
    server_env,
)
from adaptive_spec.commands.bench.serve_summary import (
    acceptance,
    goals,
    greedy_identity,
    summarize_pattern,
    tuned_table,
)


def test_server_configs_parse_and_order():
    cfgs = sp.parse_server_configs(
        ["adaptive-warm", "adaptive", "vllm-dynamic", "static:ngram:8", "none", "vllm-ngram"], 8
    )
    assert [c.name for c in cfgs] == [
        "none",
        "static:ngram:8",
        "vllm-ngram",
        "vllm-dynamic",
        "adaptive",
        "adaptive-warm",
    ]
    by = {c.name: c for c in cfgs}
    assert not by["none"].speculative and by["none"].speculative_config(8) is None
    s = by["static:ngram:8"]
    assert s.plugin and s.policy == "static:ngram:8" and s.proposers == ("none", "ngram")
    assert s.speculative_config(8)["num_speculative_tokens"] == 8  # the plugin's engine: max_k
    v = by["vllm-ngram"]
    assert not v.plugin and v.kind == "static" and v.k == 8
    assert (
        sp.parse_server_config("vllm-ngram:2").speculative_config(8)["num_speculative_tokens"] == 2
    )
    assert by["vllm-dynamic"].table is None
    t = sp.parse_server_config("vllm-dynamic:1-2=8,3-16=2")
    spec = t.speculative_config(8)
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 8], [3, 16, 2]]
    assert by["adaptive-warm"].warm and by["adaptive-warm"].policy == "adaptive"
    assert sp.parse_server_config("adaptive-ucb").policy == "adaptive-ucb"


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("static:suffix:2", "proposer 'suffix' is invalid"),
        ("static:lora:c d:2", "proposer 'lora:c d' is invalid"),
        ("static:ngram:9", "k=9 is out of range; allowed: 1..8"),
        ("static:ngram:x", "k='x' is invalid"),
        ("vllm-dynamic:2-4=8", "start at 1"),
        ("vllm-dynamic:1-4", "table row '1-4' is invalid"),
        ("vllm-dynamic:1-4=9", "above --max-k=8"),
        ("fast", "is not known; allowed: none"),
    ],
)
def test_server_config_errors_name_the_entry(name, needle):
    with pytest.raises(ValueError, match="--configs entry") as e:
        sp.parse_server_config(name, 8)
    assert needle in str(e.value)


def test_server_configs_refuse_duplicates_and_empty():
    with pytest.raises(ValueError, match="duplicates"):
        sp.parse_server_configs(["none", "none"])
    with pytest.raises(ValueError, match="empty"):
        sp.parse_server_configs([])


def test_patterns_expand_from_rates():
    pats = sp.expand_patterns(["steady", "ramp", "burst", "mixtemp", "steady:2"], (8, 0.5, 2))
    assert [p.name for p in pats] == [
        "steady:0.5",
        "steady:2",
        "steady:8",
        "ramp:1-4",
        "burst:2:0.25",
        "mixtemp:2:0.25",
    ]
    ramp = pats[3].passes(10)
    assert len(ramp) == 1 and ramp[0].ramp == (1, 4) and ramp[0].greedy
    burst = pats[4].passes(10)[0]
    assert burst.burstiness == 0.25 and burst.request_rate == 2 and burst.ramp is None


def test_mixtemp_splits_requests_and_rate():
    p = sp.parse_pattern("mixtemp:4:0.25")
    greedy, hot = p.passes(12)
    assert hot.indices == (3, 7, 11) and hot.temperature == 1.0 and not hot.greedy
    assert set(greedy.indices) | set(hot.indices) == set(range(12))
    assert not set(greedy.indices) & set(hot.indices)
    assert greedy.request_rate + hot.request_rate == pytest.approx(4.0)
    assert hot.request_rate == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("ramp:0-4", "1 <= start < end"),
        ("ramp:4-2", "1 <= start < end"),
        ("ramp:0.5-2", "integers"),
        ("steady:-1", "must be > 0"),
        ("steady:fast", "not a number"),
        ("burst:inf:0.5", "finite rate"),
        ("mixtemp:2:1.5", "0 < share < 1"),
        ("poisson:2", "allowed: steady:<rate>"),
    ],
)
def test_pattern_errors_name_the_entry(spec, needle):
    with pytest.raises(ValueError, match="--patterns entry") as e:
        sp.parse_pattern(spec)
    assert needle in str(e.value)


def test_calibrated_rates_and_rounding():
    assert sp.calibrated_rates(1.37) == (0.34, 1.4, 5.5)
    assert sp.round_rate(0.0123) == 0.012
    assert sp.round_rate(123.0) == 120.0
    with pytest.raises(ValueError):
        sp.round_rate(math.inf)
    with pytest.raises(ValueError, match="--rates"):
        sp.expand_patterns(["steady"], (0, 1))


def _settings(**kw):
    base = {
        "model": __import__("pathlib").Path("/m"),
        "served_name": "m",
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "kv_cache_bytes": 1 << 28,
        "enforce_eager": True,
        "prefix_caching": False,
        "max_k": 8,
    }
    base.update(kw)
    return ServerSettings(**base)


def test_server_command_and_env(tmp_path):
    s = _settings(extra_args=("--foo",))
    none = sp.parse_server_config("none")
    cmd = server_command(none, s, 1234)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--speculative-config" not in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert "--no-enable-prefix-caching" in cmd and cmd[-1] == "--foo"
    base = {"PATH": "/bin", "ADAPTIVE_SPEC": "1", "ADAPTIVE_SPEC_POLICY": "none"}
    env = server_env(none, s, base=base)
    assert not any(k.startswith("ADAPTIVE_SPEC") for k in env)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["PATH"] == "/bin"

    static = sp.parse_server_config("static:ngram:2")
    env = server_env(static, s, base=base)
    assert env["ADAPTIVE_SPEC"] == "1" and env["ADAPTIVE_SPEC_POLICY"] == "static:ngram:2"
    assert env["ADAPTIVE_SPEC_PROPOSERS"] == "none,ngram" and "ADAPTIVE_SPEC_STATE" not in env
    adaptive = sp.parse_server_config("adaptive")
    env = server_env(adaptive, s, state=tmp_path / "p.json", base=base)
    assert env["ADAPTIVE_SPEC_STATE"] == str(tmp_path / "p.json")
    assert "ADAPTIVE_SPEC_PROPOSERS" not in env  # the plugin's default proposers
    cmd = server_command(adaptive, _settings(enforce_eager=False, prefix_caching=True), 1)
    assert "--shutdown-timeout" in cmd and "--enforce-eager" not in cmd
    assert "--enable-prefix-caching" in cmd
    # --multiprocessing: vLLM's default process layout, for every configuration alike.
    mp = _settings(multiprocessing=True)
    assert server_env(none, mp, base=base)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server_env(adaptive, mp, base=base)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_drafter_configs_run_on_the_drafters_engine(tmp_path):
    """``draft`` / ``lora:<adapter>`` arms run on the drafter's engine: ``--speculative-config`` names
    the head (``eagle3``) with ``num_speculative_tokens = max_k`` and 32-token KV-cache blocks (vLLM
    drops an EAGLE engine's prefix-cache hit back by one block); LoRA arms add the ``uni`` executor
    (the adapters live in the engine-core process's drafter); ``adaptive+lora`` expands into every
    adapter the drafter stores."""
    by = {c.name: c for c in sp.parse_server_configs(
        ["static:draft:2", "static:lora:code:2", "adaptive+draft", "adaptive+lora", "adaptive"], 8
    )}  # fmt: skip
    assert all(by[n].drafter for n in by if n != "adaptive") and not by["adaptive"].drafter
    assert by["static:draft:2"].proposers == ("none", "draft") and by["static:draft:2"].k == 2
    assert by["static:lora:code:2"].proposers == ("none", "draft", "lora:code")
    assert by["adaptive+draft"].proposers == ("none", "ngram", "jacobi", "draft")
    assert by["adaptive+draft"].kind == "adaptive" and by["adaptive+draft"].policy == "adaptive"
    head = tmp_path / "head"
    s = _settings(drafter=head)
    cmd = server_command(by["adaptive+draft"], s, 1)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 8}
    assert cmd[cmd.index("--block-size") + 1] == "32"  # the EAGLE engine's block size (build_llm's)
    assert "--distributed-executor-backend" not in cmd
    env = server_env(by["adaptive+draft"], s, state=tmp_path / "p.json", base={})
    assert env["ADAPTIVE_SPEC_PROPOSERS"] == "none,ngram,jacobi,draft"
    cmd = server_command(by["static:lora:code:2"], s, 1)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    lora = by["adaptive+lora"].with_adapters(["chat", "code"])
    assert lora.proposers == ("none", "ngram", "jacobi", "draft", "lora:chat", "lora:code")
    assert lora.lora and by["static:draft:2"].with_adapters([]) is by["static:draft:2"]
    with pytest.raises(ValueError, match="needs LoRA adapters"):
        by["adaptive+lora"].with_adapters([])
    with pytest.raises(ValueError, match="needs a drafter directory"):
        server_command(by["static:draft:2"], _settings(), 1)
    # the n-gram engine of the other plugin configurations is unchanged
    assert s.speculative_config(by["adaptive"])["method"] == "ngram"


def test_drafter_configs_resolve_the_shipped_head_and_its_adapters(default_model_dir, capsys):
    from adaptive_spec.commands.bench.serve_resolve import Plan, resolve_drafter
    from adaptive_spec.commands.cli import build_parser, main
    from adaptive_spec.vllm.eagle3 import default_head_path, head_adapters, shipped_head_dir

    argv = ["bench", "serve", "--dtype", "float32", "--configs", "none,adaptive+lora"]
    plan = Plan(build_parser().parse_args(argv))
    drafter, method = resolve_drafter(plan, build_parser().parse_args(argv))
    assert drafter == default_head_path("float32") and method == "eagle3"
    names = sorted(head_adapters(shipped_head_dir()))
    assert names and plan.configs[1].proposers[4:] == tuple(f"lora:{n}" for n in names)
    # no drafter for the tiny model of --quick, nor an adapter the head does not store
    for extra, needle in [
        (["--quick", "--configs", "none,static:draft:2"], "give --draft-model DIR"),
        (["--configs", "none,static:lora:poetry:2"], "no adapter 'poetry'"),
        (["--configs", "none,adaptive+draft", "--draft-model", "/nonexistent"], "not a directory"),
    ]:
        assert main(["bench", "serve", "--dry-run", "--dtype", "float32", *extra]) == 2
        assert needle in capsys.readouterr().out


def _result(ttfts, latencies, lens, texts, itls=None, errors=None, duration=10.0):
    n = len(ttfts)
    return {
        "duration": duration,
        "ttfts": ttfts,
        "latencies": latencies,
        "output_lens": lens,
        "generated_texts": texts,
        "itls": itls or [[0.1] * max(0, k - 1) for k in lens],
        "errors": errors or [""] * n,
    }


def test_merge_passes_uses_vllms_definitions():
    p = sp.parse_pattern("mixtemp:2:0.5")
    greedy, hot = p.passes(4)
    assert greedy.indices == (0, 2) and hot.indices == (1, 3)
    r_g = _result([0.5, 0.0], [2.5, 0.0], [5, 0], ["a", ""], errors=["", "Traceback\nBoom: x\n"])
    r_h = _result([1.0, 1.0], [3.0, 2.0], [3, 1], ["b", "c"], duration=12.0)
    m = merge_passes([(greedy, r_g), (hot, r_h)], 4)
    assert (m["sent"], m["completed"], m["failed"], m["lost"]) == (4, 3, 1, 0)
    assert m["errors"] == {"Boom: x": 1}
    assert m["duration_s"] == 12.0 and m["total_output_tokens"] == 9
    assert m["output_tok_s"] == pytest.approx(9 / 12) and m["request_throughput"] == pytest.approx(
        3 / 12
    )
    # TPOT over requests with more than one token: (2.5-0.5)/4 = 0.5 s, (3-1)/2 = 1 s
    assert m["tpot_ms"]["mean"] == pytest.approx(750.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert m["texts"] == {0: "a", 1: "b", 2: None, 3: "c"} and m["greedy_indices"] == [0, 2]
    assert m["mean_concurrency"] == pytest.approx((2.5 + 3 + 2) / 12)
    # A pass that returned fewer records than it sent: the rest are lost, never silently dropped.
    short = _result([0.5], [1.0], [2], ["a"])
    assert merge_passes([(greedy, short)], 2)["lost"] == 1
    assert per_request(_result([0.0], [0.0], [0], [""]))[0]["error"] == "error without a message"
    # A stream broken after its first chunk has a TTFT and an error: failed, as vLLM counts it.
    broken = per_request(
        _result([0.3], [1.0], [0], ["ab"], errors=["Traceback\nClientPayloadError: x"])
    )
    assert not broken[0]["ok"] and broken[0]["error"] == "ClientPayloadError: x"


METRICS_TEXT = """# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
# TYPE adaptive_spec_info gauge
adaptive_spec_info{engine="0",policy="adaptive",proposers="none,ngram",max_k="8",engine_method="ngram"} 1.0
# TYPE adaptive_spec_drafted_tokens counter
adaptive_spec_drafted_tokens_total{engine="0",proposer="ngram"} 40.0
# TYPE adaptive_spec_accepted_tokens counter
adaptive_spec_accepted_tokens_total{engine="0",proposer="ngram"} 12.0
# TYPE adaptive_spec_emitted_tokens counter
adaptive_spec_emitted_tokens_total{engine="0",proposer="ngram"} 22.0
adaptive_spec_emitted_tokens_total{engine="0",proposer="none"} 28.0
# TYPE adaptive_spec_arm_choices counter
adaptive_spec_arm_choices_total{engine="0",proposer="ngram",k="4"} 10.0
adaptive_spec_arm_choices_total{engine="0",proposer="none",k="0"} 30.0
# TYPE adaptive_spec_step_time_seconds summary
adaptive_spec_step_time_seconds_count{engine="0"} 20.0
adaptive_spec_step_time_seconds_sum{engine="0"} 2.0
# TYPE adaptive_spec_controller_time_seconds summary
adaptive_spec_controller_time_seconds_count{engine="0"} 20.0
adaptive_spec_controller_time_seconds_sum{engine="0"} 0.1
# TYPE adaptive_spec_policy_learned_steps gauge
adaptive_spec_policy_learned_steps{engine="0"} 20.0
"""


def _samples(text):
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_counters_delta_and_acceptance():
    m = _samples(METRICS_TEXT)
    assert by_label(m, "vllm:request_success_total", "finished_reason")["stop"] == 3.0
    c = counters(m)
    assert c["requests_finished"] == 6 and c["generation_tokens"] == 50
    d = delta(c, {"requests_finished": 1.0, "spec": {"drafts": 5.0}})
    assert (
        d["requests_finished"] == 5 and d["spec"]["drafts"] == 5 and d["spec"]["draft_tokens"] == 40
    )
    assert d["plugin"]["learned_steps"] == 20  # a gauge keeps its value
    acc = acceptance(c)
    assert acc["vllm"]["acceptance_rate"] == pytest.approx(0.3)
    assert acc["vllm"]["accepted_length"] == pytest.approx(2.2)  # 1 + 12 / 10
    assert acc["vllm"]["per_position"] == [0.8, 0.4]
    pl = acc["plugin"]
    assert pl["acceptance_rate"] == pytest.approx(0.3) and pl["accepted_length"] == pytest.approx(
        50 / 40
    )
    assert pl["arm_mix"] == {"ngram/4": 0.25, "none/0": 0.75}
    assert pl["controller_overhead"] == pytest.approx(0.05)
    assert acceptance({"requests_finished": 1})["vllm"] is None


def _run(tok_s, tpot_p99, texts=None, conc=2.0, failed=0):
    return {
        "completed": 4 - failed,
        "sent": 4,
        "failed": failed,
        "lost": 0,
        "output_tok_s": tok_s,
        "mean_concurrency": conc,
        "tpot_ms": {"mean": tpot_p99, "p50": tpot_p99, "p99": tpot_p99},
        "texts": texts or {0: "a", 1: "b", 2: "c", 3: "d"},
        "greedy_indices": [0, 1, 2, 3],
    }


def test_ratios_identity_and_best_static():
    names = ["none", "static:ngram:2", "static:ngram:8", "vllm-ngram:8", "adaptive"]
    configs = {c.name: c for c in sp.parse_server_configs(names)}
    runs = {
        "none": _run(100, 50),
        "static:ngram:2": _run(120, 45, texts={0: "a", 1: "b", 2: "cX", 3: "d"}),
        "static:ngram:8": _run(150, 40),
        "vllm-ngram:8": _run(200, 30, failed=1),  # lost a request: never the best static
        "adaptive": _run(165, 35),
    }
    s = summarize_pattern("steady:2", runs, configs)
    assert s["best_static"] == "static:ngram:8" and s["best_static_tpot_p99"] == "static:ngram:8"
    assert runs["adaptive"]["ratio_to_none"] == pytest.approx(1.65)
    assert runs["adaptive"]["ratio_to_best_static"] == pytest.approx(1.1)
    assert runs["adaptive"]["tpot_p99_to_best_static"] == pytest.approx(35 / 40)
    assert "identity" not in runs["none"]
    ident = runs["static:ngram:2"]["identity"]
    assert (ident["compared"], ident["identical"], ident["differing"]) == (4, 3, 1)
    assert ident["examples"][0]["index"] == 2 and ident["examples"][0]["position"] == 1
    missing = greedy_identity({"texts": {0: "a"}}, {"texts": {0: None}, "greedy_indices": [0]})
    assert missing["skipped"] == 1 and missing["compared"] == 0


def test_tuned_table_and_goals():
    names = ["none", "static:ngram:2", "static:ngram:8", "vllm-dynamic", "adaptive"]
    configs = {c.name: c for c in sp.parse_server_configs(names)}
    runs = {
        "none": {"steady:1": _run(100, 50, conc=1.2), "steady:8": _run(200, 90, conc=14)},
        "static:ngram:2": {"steady:1": _run(120, 45), "steady:8": _run(230, 80)},
        "static:ngram:8": {"steady:1": _run(150, 40), "steady:8": _run(190, 95)},
    }
    table, best = tuned_table(runs, configs, ["steady:1", "steady:8"], 16)
    assert best == {1: 8, 14: 2}
    assert table == [[1, 3, 8], [4, 16, 2]]
    assert tuned_table({}, configs, ["steady:1"], 16) == (None, {})
    runs["vllm-dynamic"] = {"burst:2:0.25": _run(100, 60)}
    runs["static:ngram:2"]["burst:2:0.25"] = _run(100, 60)
    runs["adaptive"] = {
        "steady:1": _run(148, 41),
        "steady:8": _run(180, 85),
        "burst:2:0.25": _run(115, 55),
    }
    g = {
        (x["goal"], x["pattern"]): x
        for x in goals(
            runs, configs, {"steady:1": "steady", "steady:8": "steady", "burst:2:0.25": "burst"}
        )
    }
    assert g[("steady", "steady:1")]["met"] is True  # 148 / 150 >= 0.98
    assert g[("steady", "steady:8")]["met"] is False  # below no speculation
    assert g[("dynamic", "burst:2:0.25")]["measured"] == pytest.approx(1.15)
    assert g[("dynamic", "burst:2:0.25")]["met"] is True


def test_client_argv_parses_with_vllms_own_parser(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed")
    from adaptive_spec.vllm.bench_client import client_namespace

    common = {
        "base_url": "http://127.0.0.1:1",
        "served_name": "m",
        "tokenizer": "/m",
        "dataset": tmp_path / "d.jsonl",
        "max_tokens": 16,
        "seed": 3,
        "request_id_prefix": "x-",
    }
    hot = sp.parse_pattern("mixtemp:4:0.25").passes(8)[1]
    ns = client_namespace(client_argv(hot, **common))
    assert ns.dataset_name == "custom" and ns.num_prompts == 2 and ns.custom_output_len == 16
    assert ns.temperature == 1.0 and ns.request_rate == pytest.approx(1.0) and ns.save_detailed
    assert ns.disable_shuffle and ns.no_oversample and ns.ramp_up_strategy is None
    assert ns.metric_percentiles == "50,99" and ns.seed == 3
    ramp = sp.parse_pattern("ramp:1-6").passes(8)[0]
    ns = client_namespace(client_argv(ramp, **common, ignore_eos=True))
    assert ns.ramp_up_strategy == "linear" and (ns.ramp_up_start_rps, ns.ramp_up_end_rps) == (1, 6)
    assert math.isinf(ns.request_rate) and ns.temperature == 0.0 and ns.ignore_eos


def test_cli_refuses_bad_flags_and_keeps_bench(capsys):
    from adaptive_spec.commands.bench import command as bench
    from adaptive_spec.commands.bench import serve
    from adaptive_spec.commands.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--quick"])
    assert args.func is bench.main and args.bench_command is None
    args = build_parser().parse_args(["bench", "serve", "--quick"])
    assert args.func is serve.main and args.out == "runs/bench-serve"
    for argv, needle in [
        (["--configs", "none,static:ngram:99"], "k=99 is out of range"),
        (["--patterns", "ramp:0-3"], "--patterns entry 'ramp:0-3'"),
        (["--rates", "a,b"], "--rates='a,b' is invalid"),
        (["--configs", "none,adaptive-warm"], "--warm-state"),
        (["--hot-share", "1.5"], "--hot-share=1.5 is invalid"),
    ]:
        assert main(["bench", "serve", "--dry-run", *argv]) == 2
        assert needle in capsys.readouterr().out
