"""CI smoke test of ``adaptive-spec bench``, for correctness only (never speed): the tiny float32 model, in
a subprocess, every engine kind (main, the engine without speculative decoding built beside it in the
same process, vLLM's tuned table, HF), greedy and sampled cells; checks the JSON, the greedy identity of
every greedy run (exact in float32), the goals section, the plots and that the table is printed last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')")

# One configuration per code path (banditspec, vllm-ngram and Jacobi arms share these paths; their
# pieces have their own tests), to keep this test near a minute on a quiet machine.
CONFIGS = "none,nospec,static:ngram:2,smartspec:ngram,adaptive,adaptive-warm,vllm-dynamic,hf-greedy,hf-pld"


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    questions = tmp / "questions.jsonl"
    turns = [
        "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
        "Count: one two three, one two three, one two three.",
        "Write a list: apple, banana, apple, banana, apple.",
        "Say yes no yes no yes no.",
    ]
    questions.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "smoke", "turns": [t]}) + "\n"
            for i, t in enumerate(turns)
        )
    )
    out = tmp / "out"
    cmd = [
        sys.executable,
        "-m",
        "adaptive_spec.commands.cli",
        "bench",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--eager",
        "--max-k",
        "4",
        "--workloads",
        str(questions),
        "--concurrency",
        "1,2",
        "--temperatures",
        "0,1",
        "--configs",
        CONFIGS,
        "--prompts",
        "2",
        "--max-tokens",
        "8",
        "--repeats",
        "2",
        "--confirm",
        "1",
        "--out",
        str(out),
        "--trace-evaluated",
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", COLUMNS="200")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    return proc, out


def test_exit_code_and_table_printed_last(bench_run):
    proc, _ = bench_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    goals_at = text.index("Goals (embedded default model)")
    table_at = text.index("adaptive-spec bench: goodput")
    assert goals_at < table_at
    assert "results:" in text[:table_at]


def test_json_records_every_figure(bench_run):
    _, out = bench_run
    data = json.loads((out / "bench.json").read_text())
    assert data["schema"] == "adaptive-spec-bench" and data["mode"] == "custom"
    env = data["environment"]
    assert env["cpu_model"] and env["logical_cpus"] >= 1 and env["torch_threads"] >= 1
    for lib in ("torch", "vllm", "transformers"):
        assert env["versions"][lib]
    assert len(env["git"]["commit"]) == 40
    cells = {c["id"]: c for c in data["cells"]}
    assert set(cells) == {f"questions/c{c}/t{t}" for c in (1, 2) for t in (0, 1)}
    table = data["dynamic_tables"]["questions"]["table"]
    assert table[0][0] == 1 and table[-1][1] == 2
    for cid, cell in cells.items():
        greedy = cid.endswith("t0")
        expected = set(CONFIGS.split(","))
        if not (greedy and "/c1/" in cid):
            expected -= {"hf-greedy", "hf-pld"}
        assert set(cell["summary"]) == expected, cid
        assert "baselines" in cell and "dynamic" in cell["baselines"]
        for name, s in cell["summary"].items():
            assert "error" not in s, (cid, name, s.get("error"))
            # One confirmation round: adaptive, the best static arm, none and nospec (built in the
            # main engine's process) run once more.
            trio = name in ("adaptive", "static:ngram:2", "none", "nospec")
            assert s["repeats"] == (3 if trio else 2) and s["goodput_tok_s"] > 0, (cid, name)
            confirm = [r for r in cell["configs"][name]["runs"] if r.get("confirm")]
            assert [r["repeat"] for r in confirm] == ([2] if trio else []), (cid, name)
            assert s["ratio_to_none"] is not None
            if greedy and name != "hf-greedy":
                # float32: greedy identity is exact token equality (docs/correctness.md).
                ident = s["identity"]
                assert ident["identical"] == ident["total"] == 2 * s["repeats"], (cid, name, ident)
                assert s["valid"]
            if not greedy:
                assert "identity" not in s and s["valid"]
            if s["kind"] == "adaptive":
                assert 0 <= s["controller_overhead"] < 1
        nospec = cell["configs"]["nospec"]
        assert nospec["engine"] == "nospec" and nospec["same_process"], cid
        assert cell["summary"]["nospec"]["ratio_method"] == "paired", cid
        # --ignore-eos sampled (the default): sampled cells decode every request to max_tokens.
        assert cell["ignore_eos"] is (not greedy), cid
        for name, entry in cell["configs"].items():
            for r in entry["runs"]:
                assert 0 < r["output_tokens"] <= 2 * 8, (cid, name)
                if not greedy:
                    assert r["output_tokens"] == 2 * 8, (cid, name)
                # Which step-cost table the run priced steps with: the cold controller's says (the
                # tiny model has no shipped table: measured on this machine); a run whose policy
                # prices nothing has none.
                if name == "adaptive":
                    assert r["cost_table_source"].startswith("calibrated"), (cid, r)
                elif name in (
                    "none",
                    "nospec",
                    "static:ngram:2",
                    "vllm-dynamic",
                    "hf-greedy",
                    "hf-pld",
                ):
                    assert "cost_table_source" not in r, (cid, name)
        if greedy:
            prep = cell["prepare"]["main"]
            assert prep["warm_trained_on"] == "held-out prompts"
        assert cell["best_static"] == "static:ngram:2"


def test_goals_section_and_plots(bench_run):
    _, out = bench_run
    data = json.loads((out / "bench.json").read_text())
    ids = [g["id"] for g in data["goals"]]
    with_adaptive = [c["id"] for c in data["cells"] if "adaptive" in c["summary"]]
    assert with_adaptive and ids == [f"A:{c}" for c in with_adaptive] + ["B", "C", "D"]
    for g in data["goals"]:
        assert set(g) >= {"id", "description", "measured", "threshold", "met"}
        if g["id"].startswith("A:"):
            # Judged in every cell that ran adaptive and a valid static arm.
            assert g["threshold"] == 0.98 and isinstance(g["measured"], float)
            assert g["met"] is (g["measured"] >= 0.98)
            # Paired run by run: 2 repeats + 1 confirmation round.
            assert g["pairs"] == 3
        else:
            # No 'mixed' cell and no concurrency-16 cell in this grid: nothing else can be judged.
            assert g["met"] is None
    names = {os.path.basename(p) for p in data["plots"]}
    assert "goodput_all.png" in names
    assert "arms_questions_c2_t0.png" in names and "goodput_questions_c1_t1.png" in names
    for p in data["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_markdown_export_has_every_row(bench_run):
    """``python -m adaptive_spec.commands.bench.report bench.json``: the goals and one row per cell and
    configuration, with the same figures as the JSON."""
    import subprocess
    import sys

    _, out = bench_run
    data = json.loads((out / "bench.json").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "adaptive_spec.commands.bench.report", str(out / "bench.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    md = proc.stdout
    assert data["environment"]["git"]["commit"][:7] in md.splitlines()[0]
    assert "Step-cost table of the runs that price steps: calibrated" in md.splitlines()[0]
    assert md.count("\n| B |") == 1 and "| D |" in md and "| A:" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(rows) == sum(len(c["summary"]) for c in data["cells"])
    cell = data["cells"][0]
    s = cell["summary"]["none"]
    assert f"{s['goodput_tok_s']:.1f}" in md


def test_trace_of_the_evaluated_prompts(bench_run):
    """``--trace-evaluated``: every cell with ``adaptive`` has a trace of a cold-start ``adaptive``
    pass on the prompts the timed runs decode (not the held-out prompts of the ``adaptive-warm``
    training trace), complete and readable by replay's loader; in a greedy cell it commits exactly
    the tokens of each timed ``adaptive`` run."""
    from adaptive_spec.sim.trace_io import load_replay_trace

    from adaptive_spec.core.trace import read_trace

    _, out = bench_run
    data = json.loads((out / "bench.json").read_text())
    for cell in data["cells"]:
        prep = cell["prepare"]["main"]
        trace = read_trace(prep["eval_trace"])
        assert not trace.truncated and trace.header["policy"] == "adaptive", cell["id"]
        prompts = {tuple(r["prompt_token_ids"]) for r in trace.requests.values()}
        assert len(prompts) == 2, cell["id"]  # --prompts 2
        committed = sum(q["emitted"] for s in trace.steps for q in s["requests"])
        if cell["id"].endswith("t0"):
            train = read_trace(prep["trace"])
            held_out = {tuple(r["prompt_token_ids"]) for r in train.requests.values()}
            assert prompts.isdisjoint(held_out), cell["id"]
            runs = cell["configs"]["adaptive"]["runs"]
            assert {r["output_tokens"] for r in runs} == {committed}, cell["id"]
        assert len(load_replay_trace(prep["eval_trace"]).requests) == 2
