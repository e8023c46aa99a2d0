"""The policy-state file: atomic writes under injected faults (an error, or the process killed, between
writing the temporary file and renaming it), stale temporary files removed at start, the writability
check, and refused files moved aside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_spec.core import state
from adaptive_spec.core.errors import ConfigError
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.state import (
    StatePathError,
    StateSaveError,
    check_writable_path,
    load_or_set_aside,
    policy_state_json,
    prepare_state_path,
    remove_stale_temp_files,
    save_policy_state,
)

ROOT = Path(__file__).resolve().parent.parent


def _policy(n_steps: int, proposers=("none", "ngram")):
    p = make_policy("adaptive", list(proposers), 4)
    p.n_steps = n_steps
    return p


def _temp_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_error_between_write_and_rename_keeps_the_old_state(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    save_policy_state(_policy(7), path)
    old = path.read_bytes()
    renamed = []

    def failing_replace(src, dst):
        renamed.append(
            Path(src).read_text()
        )  # the new state was fully written to the temporary file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.os, "replace", failing_replace)
    with pytest.raises(StateSaveError) as e:
        save_policy_state(_policy(8), path)
    assert str(e.value).startswith(f"policy_state='{path}': the policy state cannot be written")
    assert "No space left on device" in str(e.value) and "fix: " in str(e.value)
    assert json.loads(renamed[0])["state"]["n_steps"] == 8
    assert path.read_bytes() == old  # intact
    assert _temp_files(tmp_path) == []  # the temporary file was removed


def test_kill_between_write_and_rename_keeps_the_old_state(tmp_path):
    """A process killed (SIGKILL) after writing the temporary file, before the rename: the old file is
    intact, and the temporary file it left is removed by the next start's prepare_state_path."""
    path = tmp_path / "policy.json"
    save_policy_state(_policy(7), path)
    old = path.read_bytes()
    code = (
        "import os, signal, sys\n"
        "from adaptive_spec.core import state\n"
        "from adaptive_spec.core.policies import make_policy\n"
        "p = make_policy('adaptive', ['none', 'ngram'], 4); p.n_steps = 8\n"
        "state.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)\n"
        "state.save_policy_state(p, sys.argv[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, timeout=120
    )
    assert out.returncode == -signal.SIGKILL, out.stderr.decode()[-2000:]
    assert path.read_bytes() == old
    (left,) = _temp_files(tmp_path)  # what a killed save leaves behind
    assert left.startswith(".policy.json.")
    assert json.loads((tmp_path / left).read_text())["state"]["n_steps"] == 8
    # The next start cleans it up and loads the old state.
    assert prepare_state_path(path) == [tmp_path / left]
    assert _temp_files(tmp_path) == []
    fresh = _policy(0)
    assert load_or_set_aside(fresh, path) is True and fresh.n_steps == 7


def test_only_this_files_temporary_files_are_removed(tmp_path):
    path = tmp_path / "policy.json"
    ours = [".policy.json.abcdefgh", ".policy.json.a1_b2c3d"]
    others = [
        ".policy.json.short",
        ".policy.json.ABCDEFGH",
        ".policy.json.abcdefgh.bak",
        ".other.json.abcdefgh",
        "policy.json.refused-1700000000",
        "policy.json",
    ]
    for name in ours + others:
        (tmp_path / name).write_text("x")
    assert sorted(p.name for p in remove_stale_temp_files(path)) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
    assert remove_stale_temp_files(tmp_path / "missing-dir" / "p.json") == []


def test_writability_check(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StatePathError) as e:
        check_writable_path(blocker / "policy.json", "--state")
    assert isinstance(e.value, ConfigError)
    msg = str(e.value)
    assert msg.startswith(f"--state='{blocker}/policy.json' is invalid (cannot write in {blocker}")
    assert "; allowed: a file path in a directory" in msg and "; fix: " in msg
    with pytest.raises(StatePathError, match=r"^ADAPTIVE_SPEC_STATE=.* \(it is a directory\)"):
        check_writable_path(tmp_path, "ADAPTIVE_SPEC_STATE")
    target = tmp_path / "a" / "b" / "policy.json"
    assert check_writable_path(target, "x") == target
    assert target.parent.is_dir() and list(target.parent.iterdir()) == []
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(StatePathError, match="PermissionError"):
            check_writable_path(ro / "policy.json", "x")


def test_refused_file_is_moved_aside(tmp_path):
    path = tmp_path / "policy.json"
    saved = policy_state_json(_policy(5, ("none", "jacobi")))  # valid, for other proposers
    path.write_text(saved)
    fresh = _policy(0)
    assert load_or_set_aside(fresh, path) is False and fresh.n_steps == 0
    (aside,) = tmp_path.glob("policy.json.refused-*")
    assert aside.read_text() == saved and not path.exists()
    path.write_text("{truncated")
    assert load_or_set_aside(_policy(0), path) is False
    assert len(list(tmp_path.glob("policy.json.refused-*"))) == 2  # a second name, not overwritten
    assert aside.read_text() == saved
    assert load_or_set_aside(_policy(0), path) is False  # no file: nothing to do
