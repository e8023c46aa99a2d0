"""Driving a server with vLLM's own serving-benchmark client (``vllm.benchmarks.serve``, what
``vllm bench serve`` runs), as a library (through :mod:`adaptive_spec.vllm.bench_client`).

vLLM's CPU wheel cannot start ``vllm bench serve`` (its console entry asks for the metadata of a
distribution named ``vllm``), so each client pass builds the same argparse namespace as that command:
``FlexibleArgumentParser`` + ``vllm.benchmarks.serve.add_cli_args`` + ``parse_args(argv)``, and awaits
``vllm.benchmarks.serve.main_async(namespace)``, which returns vLLM's result dictionary (with
``--save-detailed``: per-request texts, errors, TTFTs, ITLs and latencies; nothing is written to disk
by vLLM). Prompts go through vLLM's ``custom`` dataset: a JSONL file of ``{"prompt", "output_tokens"}``
lines, to which the client applies the model's chat template, sent to ``/v1/completions`` (streamed).

Two passes of one pattern (``mixtemp``: greedy and temperature 1.0) run concurrently in one event loop;
their figures are merged from the per-request data with vLLM's definitions (:func:`merge_passes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.commands.bench.serve_plan import ClientPass
from adaptive_spec.vllm.bench_client import client_namespace, run_clients

PERCENTILES = (50.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2el")


def write_dataset(path: Path, prompts: Sequence[str], max_tokens: int) -> Path:
    """Write vLLM's ``custom`` dataset file (JSONL: ``prompt``, ``output_tokens``) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "output_tokens": int(max_tokens)}) + "\n")
    return path


def client_argv(
    cpass: ClientPass,
    *,
    base_url: str,
    served_name: str,
    tokenizer: str,
    dataset: Path,
    max_tokens: int,
    seed: int,
    request_id_prefix: str,
    ignore_eos: bool = False,
) -> list[str]:
    """The ``vllm bench serve`` arguments for one client pass (its prompts are all of ``dataset``)."""
    argv = [
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        served_name,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        str(len(cpass.indices)),
        "--custom-output-len",
        str(max_tokens),
        "--disable-shuffle",
        "--no-oversample",
        "--seed",
        str(seed),
        "--temperature",
        f"{cpass.temperature:g}",
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        ",".join(f"{p:g}" for p in PERCENTILES),
        "--save-detailed",
        "--disable-tqdm",
        "--request-id-prefix",
        request_id_prefix,
        "--label",
        request_id_prefix.rstrip("-"),
    ]
    if cpass.ramp is not None:
        argv += [
            "--ramp-up-strategy",
            "linear",
            "--ramp-up-start-rps",
            str(cpass.ramp[0]),
            "--ramp-up-end-rps",
            str(cpass.ramp[1]),
        ]
    else:
        argv += [
            "--request-rate",
            "inf" if math.isinf(cpass.request_rate) else f"{cpass.request_rate:g}",
        ]
        argv += ["--burstiness", f"{cpass.burstiness:g}"]
    if ignore_eos:
        argv.append("--ignore-eos")
    return argv


def run_passes(
    argvs: list[list[str]], log: Path, timeout_s: float | None = None
) -> list[dict[str, Any]]:
    """Run the client passes concurrently (one event loop), vLLM's printout going to ``log``.

    Returns
    -------
    list of dict
        vLLM's result dictionary of each pass, in order.

    Raises
    ------
    TimeoutError
        After ``timeout_s`` seconds (the passes are cancelled).
    Exception
        Whatever vLLM's client raises (bad arguments, an unreachable server).
    """
    namespaces = [client_namespace(a) for a in argvs]

    async def bounded() -> list[dict[str, Any]]:
        return await asyncio.wait_for(run_clients(namespaces), timeout=timeout_s)

    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        log.open("a", encoding="utf-8") as f,
        contextlib.redirect_stdout(f),
        contextlib.redirect_stderr(f),
    ):
        return asyncio.run(bounded())


def _stats(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p99 of values in seconds, as milliseconds (None when empty)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values, dtype=float) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def _error_line(text: str) -> str:
    """The last non-empty line of an error (a traceback's exception), at most 200 characters."""
    lines = [x.strip() for x in (text or "").strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "error without a message")[:200]


def per_request(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-request records of one vLLM result (``--save-detailed``), in the order sent.

    A request succeeded when its first chunk arrived (vLLM sets a TTFT > 0 only then) and no error
    followed (a stream broken after its first chunk has a TTFT and an error).
    """
    n = len(result.get("ttfts") or [])
    out = []
    for i in range(n):
        ttft = float(result["ttfts"][i] or 0.0)
        ok = ttft > 0.0 and not (result["errors"][i] or "")
        out.append(
            {
                "ok": ok,
                "ttft": ttft,
                "latency": float(result["latencies"][i] or 0.0),
                "itl": [float(x) for x in (result["itls"][i] or [])],
                "output_len": int(result["output_lens"][i] or 0),
                "text": result["generated_texts"][i] if ok else None,
                "error": None if ok else _error_line(result["errors"][i]),
            }
        )
    return out


def merge_passes(passes: list[tuple[ClientPass, dict[str, Any]]], n_sent: int) -> dict[str, Any]:
    """The pattern's figures from its passes' per-request data, with vLLM's definitions: TPOT =
    (latency - TTFT) / (output tokens - 1) for requests with more than one output token; ITL = every
    gap between streamed chunks; throughputs over the duration (the longest pass's, when several ran
    concurrently); mean concurrency = sum of latencies / duration (Little's law).

    Returns
    -------
    dict
        ``sent``, ``completed``, ``failed``, ``lost`` (sent but neither answered nor failed: must be 0),
        ``errors`` ({message: count}), ``duration_s``, ``total_output_tokens``, ``output_tok_s``,
        ``request_throughput`` (requests/s), ``mean_concurrency``, ``ttft_ms``, ``tpot_ms``,
        ``itl_ms``, ``e2el_ms`` (each ``mean``, ``p50``, ``p99``), and ``texts``
        ({request index: text or None}) and ``greedy_indices``.
    """
    records: dict[int, dict[str, Any]] = {}
    greedy: list[int] = []
    duration = 0.0
    for cpass, result in passes:
        recs = per_request(result)
        duration = max(duration, float(result.get("duration") or 0.0))
        for idx, rec in zip(cpass.indices, recs, strict=False):
            records[idx] = rec
        if cpass.greedy:
            greedy += list(cpass.indices)
    ok = [r for r in records.values() if r["ok"]]
    errors: dict[str, int] = {}
    for r in records.values():
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    total_out = sum(r["output_len"] for r in ok)
    tpots = [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]
    itls = [x for r in ok for x in r["itl"]]
    dur = duration if duration > 0 else float("nan")
    return {
        "sent": n_sent,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "lost": n_sent - len(records),
        "errors": errors,
        "duration_s": duration,
        "total_output_tokens": total_out,
        "output_tok_s": total_out / dur if ok else 0.0,
        "request_throughput": len(ok) / dur if ok else 0.0,
        "mean_concurrency": sum(r["latency"] for r in ok) / dur if ok else 0.0,
        "ttft_ms": _stats([r["ttft"] for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls),
        "e2el_ms": _stats([r["latency"] for r in ok]),
        "texts": {i: records[i]["text"] for i in sorted(records)},
        "greedy_indices": sorted(greedy),
    }


VLLM_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "spec_decode_acceptance_rate",
    "spec_decode_acceptance_length",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "request_rate",
    "burstiness",
    "ramp_up_start_rps",
    "ramp_up_end_rps",
)


def vllm_summary(result: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own scalar figures of one pass (as ``vllm bench serve`` prints them)."""
    return {k: result[k] for k in VLLM_FIELDS if k in result}
