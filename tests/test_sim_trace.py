"""Trace reader behaviours the replay relies on, and the counterfactual lines stored in traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS
from adaptive_spec.sim.counterfactual import (
    Counterfactuals,
    read_counterfactuals,
    write_counterfactuals,
)
from adaptive_spec.sim.requests import outputs_from_trace, requests_from_trace
from adaptive_spec.sim.synthetic import CODE, make_requests, record_trace, stationary

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.baselines import StaticPolicy
from adaptive_spec.core.trace import SCHEMA, VERSION, TraceWriter, read_trace


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    reqs = make_requests(stationary(CODE, 5, 30), 4, seed=3)
    pol = StaticPolicy(["ngram", "jacobi"], 4, Arm("ngram", 3))
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    record_trace(path, reqs, pol, PRESETS["cpu-smollm2"], max_batch=2, step_time_noise=0.02)
    return path, reqs


def test_header_schema_and_version(recorded: tuple[Path, list]) -> None:
    tr = read_trace(recorded[0])
    assert tr.header["schema"] == SCHEMA and tr.header["version"] == VERSION
    assert tr.header["max_k"] == 4 and tr.end is not None and not tr.truncated


def test_unknown_version_refused(tmp_path: Path, recorded: tuple[Path, list]) -> None:
    lines = recorded[0].read_text().split("\n")
    head = json.loads(lines[0])
    head["version"] = VERSION + 1
    bad = tmp_path / "v2.jsonl"
    bad.write_text("\n".join([json.dumps(head), *lines[1:]]))
    with pytest.raises(ValueError, match="version"):
        read_trace(bad)


def test_unknown_schema_and_empty_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"schema": "something-else", "version": VERSION}) + "\n")
    with pytest.raises(ValueError, match="not an adaptive-spec trace"):
        read_trace(other)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_trace(empty)


def test_cut_mid_line_loads_complete_steps(tmp_path: Path, recorded: tuple[Path, list]) -> None:
    full = read_trace(recorded[0])
    text = recorded[0].read_text()
    lines = text.split("\n")
    step_idx = [i for i, line in enumerate(lines) if '"type":"step"' in line]
    cut_at = step_idx[len(step_idx) // 2]
    cut = tmp_path / "cut.jsonl"
    # Everything up to that step line, then half of it (a crash while writing).
    cut.write_text("\n".join(lines[:cut_at]) + "\n" + lines[cut_at][: len(lines[cut_at]) // 2])
    tr = read_trace(cut)
    assert tr.truncated and tr.truncated_at_line == cut_at + 1
    n_steps_before = sum(1 for line in lines[:cut_at] if '"type":"step"' in line)
    assert len(tr.steps) == n_steps_before < len(full.steps)
    assert tr.steps == full.steps[:n_steps_before]
    # The replay can still use the complete prefix.
    reqs = requests_from_trace(tr)
    assert reqs and all(len(r) >= 1 for r in reqs)


def test_missing_end_line_is_reported(tmp_path: Path, recorded: tuple[Path, list]) -> None:
    lines = [ln for ln in recorded[0].read_text().split("\n") if ln and '"type":"end"' not in ln]
    p = tmp_path / "noend.jsonl"
    p.write_text("\n".join(lines) + "\n")
    tr = read_trace(p)
    assert tr.truncated and tr.truncated_at_line is None and tr.end is None


def test_corrupt_middle_line_raises(tmp_path: Path, recorded: tuple[Path, list]) -> None:
    lines = recorded[0].read_text().split("\n")
    lines[3] = "{not json"
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="line 4"):
        read_trace(p)


def test_outputs_and_counterfactual_lines_roundtrip(recorded: tuple[Path, list]) -> None:
    path, reqs = recorded
    tr = read_trace(path)
    outs = outputs_from_trace(tr)
    for r in reqs:
        np.testing.assert_array_equal(outs[r.req_id], r.output_token_ids)
    cf = read_counterfactuals(path)
    assert cf.sources == {"jacobi": "synthetic", "ngram": "synthetic"}
    for r in reqs:
        for p in ("ngram", "jacobi"):
            got = cf.tables[r.req_id][p]
            assert len(got) == len(r)
            for a, b in zip(got, r.drafts[p], strict=True):
                np.testing.assert_array_equal(a, b)
    # read_trace ignores the counterfactual lines: the step and request lines are all there.
    assert len(tr.requests) == len(reqs)


def test_missing_steps_detected(tmp_path: Path, recorded: tuple[Path, list]) -> None:
    lines = recorded[0].read_text().split("\n")
    step_idx = [i for i, line in enumerate(lines) if '"type":"step"' in line]
    del lines[step_idx[3]]
    p = tmp_path / "gap.jsonl"
    p.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="misses steps"):
        outputs_from_trace(read_trace(p))


def test_write_counterfactuals_replaces_and_keeps_end(
    tmp_path: Path, recorded: tuple[Path, list]
) -> None:
    path, reqs = recorded
    copy = tmp_path / "copy.jsonl"
    copy.write_text(path.read_text())
    r0 = reqs[0]
    new = [np.array([7, 7], dtype=np.int64)] * len(r0)
    write_counterfactuals(
        copy, copy, Counterfactuals({r0.req_id: {"ngram": new}}, {}, {"ngram": "rerun"})
    )
    cf = read_counterfactuals(copy)
    assert all((d == 7).all() for d in cf.tables[r0.req_id]["ngram"])  # replaced
    assert len(cf.tables[reqs[1].req_id]["ngram"]) == len(reqs[1])  # others kept
    tr = read_trace(copy)
    assert tr.end is not None and tr.header["counterfactuals"]["ngram"] == "rerun"
    last = copy.read_text().rstrip("\n").split("\n")[-1]
    assert json.loads(last)["type"] == "end"


def test_writer_header_fields(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "t.jsonl", {"max_k": 2, "proposers": ["none", "ngram"]})
    w.request(
        {
            "req_id": "a",
            "prompt_token_ids": [1],
            "category": None,
            "temperature": 0.0,
            "max_tokens": 3,
        }
    )
    w.close()
    tr = read_trace(tmp_path / "t.jsonl")
    assert tr.requests["a"]["prompt_token_ids"] == [1] and not tr.truncated
