"""One vLLM OpenAI-compatible server per configuration, for ``adaptive-spec bench serve``: its command line
and environment (as ``docs/serving.md``), start on loopback on a free port, readiness, a clean stop, and
``/metrics`` scrapes.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
vLLM's CPU wheel fails at start) in a new session, so that its engine-core child can be stopped with it;
its stdout and stderr go to a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.serve_plan import ServerConfig

HOST = "127.0.0.1"
#: Seconds between the plugin's metrics snapshots during a benchmark (the freshness of ``/metrics``).
PLUGIN_METRICS_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What every configuration's server shares.

    Attributes
    ----------
    model : Path
        Target model directory.
    served_name : str
        ``--served-model-name`` (the ``model`` field of requests).
    dtype : str
        ``--dtype``.
    max_model_len : int
        ``--max-model-len`` (tokens).
    max_num_seqs : int
        ``--max-num-seqs``: the largest batch.
    kv_cache_bytes : int
        ``--kv-cache-memory-bytes``.
    enforce_eager : bool
        ``--enforce-eager`` (fast start, slower decode).
    prefix_caching : bool
        ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``.
    max_k : int
        ``num_speculative_tokens`` of the plugin's engine (the largest k an arm may use).
    seed : int
        ``--seed`` and ``ADAPTIVE_SPEC_SEED``.
    extra_args : tuple of str
        Appended to every server's command line (``--server-arg``).
    multiprocessing : bool
        vLLM's default process layout (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine core in its own
        process, beside the API server); False keeps the engine core in the API server's process.
    drafter : Path or None
        The drafter's loadable directory, for configurations with ``draft`` / ``lora:<adapter>`` arms
        (None: no configuration needs one).
    drafter_method : str
        vLLM's speculative method for it: ``eagle3`` (an EAGLE-3 head) or ``draft_model``.
    """

    model: Path
    served_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    enforce_eager: bool
    prefix_caching: bool
    max_k: int
    seed: int = 0
    extra_args: tuple[str, ...] = field(default=())
    multiprocessing: bool = False
    drafter: Path | None = None
    drafter_method: str = "eagle3"

    def speculative_config(self, cfg: ServerConfig) -> dict[str, object] | None:
        """``cfg``'s ``--speculative-config`` object on these settings (its drafter, if it has one)."""
        drafter = str(self.drafter) if self.drafter is not None else None
        return cfg.speculative_config(self.max_k, drafter, self.drafter_method)


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(cfg: ServerConfig, settings: ServerSettings, port: int) -> list[str]:
    """The server's command line for configuration ``cfg`` (no plugin switch: that is environment)."""
    s = settings
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(s.model),
        "--served-model-name",
        s.served_name,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(s.kv_cache_bytes),
        "--seed",
        str(s.seed),
        "--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    spec = s.speculative_config(cfg)
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
        if spec.get("method") == "eagle3":
            from adaptive_spec.vllm.engine import EAGLE_BLOCK_SIZE

            cmd += ["--block-size", str(EAGLE_BLOCK_SIZE)]  # as build_llm gives an EAGLE engine
    if cfg.lora:
        # the adapters live in the drafter of the engine-core process (docs/serving.md)
        cmd += ["--distributed-executor-backend", "uni"]
    if cfg.plugin and cfg.kind == "adaptive":
        # Lets the engine core save the policy state when its busy loop ends (docs/serving.md).
        cmd += ["--shutdown-timeout", "5"]
    cmd += list(s.extra_args)
    return cmd


def server_env(
    cfg: ServerConfig,
    settings: ServerSettings,
    *,
    state: Path | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: ``base`` (default ``os.environ``) without any ``ADAPTIVE_SPEC*``
    variable, ``VLLM_ENABLE_V1_MULTIPROCESSING`` as ``settings.multiprocessing`` says (the same for
    every configuration, so that they differ only by what is measured), and for plugin configurations
    ``ADAPTIVE_SPEC=1`` with the policy, proposers, seed, metrics interval and state file."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith("ADAPTIVE_SPEC")
    }
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if settings.multiprocessing else "0",
            "VLLM_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cfg.plugin:
        env["ADAPTIVE_SPEC"] = "1"
        env["ADAPTIVE_SPEC_POLICY"] = str(cfg.policy)
        env["ADAPTIVE_SPEC_SEED"] = str(settings.seed)
        env["ADAPTIVE_SPEC_METRICS_INTERVAL_S"] = str(PLUGIN_METRICS_INTERVAL_S)
        if cfg.proposers:
            env["ADAPTIVE_SPEC_PROPOSERS"] = ",".join(cfg.proposers)
        if state is not None:
            env["ADAPTIVE_SPEC_STATE"] = str(state)
    return env


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with the tail of its log."""


class Server:
    """A vLLM API server process: :meth:`start`, :meth:`wait_ready`, :meth:`stop` (also as a context
    manager, which always stops it).

    Parameters
    ----------
    cmd, env
        From :func:`server_command` and :func:`server_env`.
    port : int
        The port in ``cmd``.
    log : Path
        Receives the server's stdout and stderr.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.cmd = cmd
        self.env = env
        self.port = port
        self.log = log
        self.url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the process (returns at once)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until ``/health`` answers 200 and ``/v1/models`` lists the served model.

        Returns
        -------
        float
            Seconds from :meth:`start` to ready.

        Raises
        ------
        ServerError
            If the process exits first, or after ``timeout_s`` seconds.
        """
        assert self.proc is not None and self.started_at is not None, "start() first"
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the server exited with code {self.proc.returncode} while starting (log "
                    f"{self.log}):\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                if get(self.url + "/health", timeout=2.0)[0] == 200:
                    status, body = get(self.url + "/v1/models", timeout=5.0)
                    if status == 200 and json.loads(body).get("data"):
                        return time.monotonic() - self.started_at
            if time.monotonic() - self.started_at > timeout_s:
                raise ServerError(
                    f"the server was not ready after {timeout_s:.0f} s (--start-timeout; log "
                    f"{self.log}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL of the process group; also kills any
        process of the group still alive a few seconds after the server exited (the engine core).

        Returns
        -------
        dict
            ``returncode``, ``stop_s`` (seconds), ``clean`` (exited on SIGTERM and left nothing behind),
            ``killed`` (SIGKILL was needed).
        """
        if self.proc is None:
            return {"returncode": None, "stop_s": 0.0, "clean": True, "killed": False}
        t0 = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
                _killpg(self.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
        # The engine core (same session) normally exits with the server; give it a moment.
        deadline = time.monotonic() + 5.0
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            killed = True
            _killpg(self.proc.pid)
        rc = self.proc.returncode
        return {
            "returncode": rc,
            "stop_s": time.monotonic() - t0,
            "clean": not killed,
            "killed": killed,
        }


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """HTTP GET: (status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


# -- /metrics ------------------------------------------------------------------------------------------
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """Every sample of the server's ``/metrics``: ``{(sample name, sorted labels): value}``.

    Raises
    ------
    OSError
        If the server does not answer.
    """
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(url.rstrip("/") + "/metrics", timeout=timeout)
    if status != 200:
        raise OSError(f"GET {url}/metrics answered {status}")
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(m: Samples, name: str) -> float:
    """Sum of a sample over its labels (0 when absent)."""
    return sum(v for (n, _), v in m.items() if n == name)


def by_label(m: Samples, name: str, *labels: str) -> dict[str, float]:
    """A sample summed by the values of ``labels`` (joined with ``/``)."""
    out: dict[str, float] = {}
    for (n, lbl), v in m.items():
        if n != name:
            continue
        d = dict(lbl)
        key = "/".join(d.get(x, "") for x in labels)
        out[key] = out.get(key, 0.0) + v
    return out


def has(m: Samples, name: str) -> bool:
    return any(n == name for n, _ in m)


def counters(m: Samples) -> dict[str, Any]:
    """The counters ``bench serve`` reads before and after each run (cumulative since the server
    started): vLLM's requests and tokens, vLLM's ``vllm:spec_decode_*`` and the plugin's
    ``adaptive_spec_*`` series."""
    out: dict[str, Any] = {
        "requests_finished": total(m, "vllm:request_success_total"),
        "requests_finished_by_reason": by_label(m, "vllm:request_success_total", "finished_reason"),
        "generation_tokens": total(m, "vllm:generation_tokens_total"),
        "prompt_tokens": total(m, "vllm:prompt_tokens_total"),
        "preemptions": total(m, "vllm:num_preemptions_total"),
    }
    if has(m, "vllm:spec_decode_num_drafts_total"):
        out["spec"] = {
            "drafts": total(m, "vllm:spec_decode_num_drafts_total"),
            "draft_tokens": total(m, "vllm:spec_decode_num_draft_tokens_total"),
            "accepted_tokens": total(m, "vllm:spec_decode_num_accepted_tokens_total"),
            "accepted_per_position": by_label(
                m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"
            ),
        }
    if has(m, "adaptive_spec_info"):
        out["plugin"] = {
            "drafted": by_label(m, "adaptive_spec_drafted_tokens_total", "proposer"),
            "accepted": by_label(m, "adaptive_spec_accepted_tokens_total", "proposer"),
            "emitted": by_label(m, "adaptive_spec_emitted_tokens_total", "proposer"),
            "arm_choices": by_label(m, "adaptive_spec_arm_choices_total", "proposer", "k"),
            "steps": total(m, "adaptive_spec_step_time_seconds_count"),
            "step_time_s": total(m, "adaptive_spec_step_time_seconds_sum"),
            "controller_time_s": total(m, "adaptive_spec_controller_time_seconds_sum"),
            "faults": total(m, "adaptive_spec_controller_faults_total"),
            "learned_steps": total(m, "adaptive_spec_policy_learned_steps"),
            "state_loaded": total(m, "adaptive_spec_state_loaded"),
            "snapshot_time": total(m, "adaptive_spec_snapshot_timestamp_seconds"),
        }
    return out


def delta(after: Any, before: Any) -> Any:
    """``after - before`` for numbers and (nested) dicts of numbers; keys missing before count as 0.
    Gauges (``learned_steps``, ``state_loaded``, ``snapshot_time``) keep their value after."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {
            k: v
            if k in ("learned_steps", "state_loaded", "snapshot_time")
            else delta(v, before.get(k))
            for k, v in after.items()
        }
    return float(after) - float(before or 0.0)
