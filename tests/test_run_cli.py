"""``adaptive-spec run`` refuses a bad flag before it builds the engine: one line on stderr naming the
flag, the value, what is allowed and the fix; exit status 2; a traceback only with ``--verbose``."""

from __future__ import annotations

import json

import pytest

from adaptive_spec.commands import cli, run


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if the engine would be built."""

    def build_engine(*_a, **_k):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr(run, "build_engine", build_engine)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Say hi."]}) + "\n")
    return path


def _run(argv, tmp_path, capsys) -> tuple[int, str]:
    try:
        rc = cli.main(["run", *argv, "--out", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "head", "allowed"),
    [
        (
            ["--proposers", "ngram,foo"],
            "--proposers='ngram,foo' is invalid (proposer 'foo' is not known)",
            "none, ngram, jacobi, suffix, draft",
        ),
        (["--proposers", ","], "--proposers=',' is invalid (no proposer)", "none, ngram"),
        (
            ["--policy", "bogus"],
            "--policy='bogus' is invalid (not a known policy name)",
            "adaptive, adaptive-ucb",
        ),
        (
            ["--policy", "static:ngram:99"],
            "--policy='static:ngram:99' is invalid (k=99 is out of range",
            "with k <= --max-k=8",
        ),
        (
            ["--policy", "static:jacobi:2", "--proposers", "none,ngram"],
            "--policy='static:jacobi:2' is invalid",
            "proposers in --proposers",
        ),
        (
            ["--temperature", "nan"],
            "argument --temperature: 'nan' is invalid",
            "a finite number >= 0",
        ),
        (["--temperature", "-1"], "argument --temperature: '-1' is invalid", "a finite number"),
        (
            ["--workload", "missing.jsonl"],
            "--workload='missing.jsonl' is invalid (not a built-in workload, and no such file)",
            "mixed, or a JSONL file",
        ),
        (["--model", "/nonexistent/model"], "--model='/nonexistent/model' is invalid", "a model"),
    ],
)
def test_bad_flags_are_refused_before_the_engine(
    argv, head, allowed, tmp_path, capsys, no_engine, jsonl
):
    if "--workload" not in argv:
        argv = [*argv, "--workload", str(jsonl)]
    rc, err = _run(argv, tmp_path, capsys)
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith(f"adaptive-spec run: error: {head}"), line
    assert "; allowed: " in line and "; fix: " in line
    assert allowed in line[line.index("; allowed: ") : line.index("; fix: ")], line
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", ": no prompts (the file has no JSON record)"),
        ("\n\n", ": no prompts (the file has no JSON record)"),
        ('{"turns": ["hi"]}\nnot json\n', ":2: not MT-Bench format"),
        ('{"question_id": 1}\n', ":1: not MT-Bench format"),
    ],
)
def test_bad_workload_files_are_refused_in_one_line(content, why, tmp_path, capsys, no_engine):
    path = tmp_path / "w.jsonl"
    path.write_text(content)
    rc, err = _run(["--workload", str(path)], tmp_path, capsys)
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith(f"adaptive-spec run: error: --workload='{path}' is invalid ({path}{why}")
    assert "; fix: " in line


def test_unwritable_state_is_refused(tmp_path, capsys, no_engine, jsonl):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, err = _run(["--workload", str(jsonl), "--state", str(blocker / "p.json")], tmp_path, capsys)
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith(f"adaptive-spec run: error: --state='{blocker}/p.json' is invalid")


def test_verbose_shows_the_traceback(tmp_path, capsys, no_engine):
    rc, err = _run(["--workload", "missing.jsonl", "--verbose"], tmp_path, capsys)
    assert rc == 2
    assert "Traceback" in err and "ConfigError" in err
    assert err.splitlines()[-1].startswith("adaptive-spec run: error: --workload='missing.jsonl'")


def test_good_flags_reach_the_engine(tmp_path, capsys, no_engine, jsonl):
    """The positive control: valid flags pass every check and get as far as building the engine."""
    with pytest.raises(AssertionError, match="the engine was built"):
        cli.main(
            [
                "run",
                "--workload",
                str(jsonl),
                "--policy",
                "static:ngram:8",
                "--temperature",
                "0.7",
                "--state",
                str(tmp_path / "s" / "p.json"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert capsys.readouterr().err == ""
