"""The client side of ``adaptive-spec bench serve``: each load pattern sent to a ready server through
vLLM's serving-benchmark client, the server's ``/metrics`` read before and after, and each run recorded
with the checks that nothing was lost."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.serve_plan import ClientPass, Pattern, ServerConfig
from adaptive_spec.commands.bench.serve_resolve import Plan, RunPrompts
from adaptive_spec.commands.bench.serve_server import ServerSettings

#: Output tokens of each warm-up request.
WARMUP_TOKENS = 8


def slug(name: str) -> str:
    """A configuration or pattern name as a file-name part (``static:ngram:4`` -> ``static_ngram_4``)."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


class ClientPasses:
    """Sends the run's prompts to one server at a time.

    Parameters
    ----------
    plan : Plan
    settings : ServerSettings
    args : argparse.Namespace
        ``seed``, ``pattern_timeout`` (s) and ``ignore_eos``.
    work : Path
        The work directory: datasets, client logs and raw client results go there.
    console : rich Console
    prompts : RunPrompts
    notes : list of str
        The run's notes, appended to.
    """

    def __init__(
        self,
        plan: Plan,
        settings: ServerSettings,
        args: argparse.Namespace,
        work: Path,
        console: Any,
        prompts: RunPrompts,
        notes: list[str],
    ) -> None:
        self.plan = plan
        self.settings = settings
        self.args = args
        self.work = work
        self.console = console
        self.prompts = prompts
        self.notes = notes

    def _client_log(self, cfg: ServerConfig) -> Path:
        return self.work / f"client-{slug(cfg.name)}.log"

    def _dataset(self, pattern: Pattern, label: str, indices: tuple[int, ...]) -> Path:
        from adaptive_spec.commands.bench.serve_client import write_dataset

        path = self.work / "datasets" / f"{slug(pattern.name)}-{label}.jsonl"
        if not path.exists():
            prompts = self.prompts.measured
            write_dataset(path, [prompts[i] for i in indices], self.plan.max_tokens)
        return path

    def _argv(
        self,
        cp: ClientPass,
        server: Any,
        dataset: Path,
        *,
        max_tokens: int,
        seed: int,
        prefix: str,
        ignore_eos: bool,
    ) -> list[str]:
        from adaptive_spec.commands.bench.serve_client import client_argv

        return client_argv(
            cp,
            base_url=server.url,
            served_name=self.settings.served_name,
            tokenizer=str(self.settings.model),
            dataset=dataset,
            max_tokens=max_tokens,
            seed=seed,
            request_id_prefix=prefix,
            ignore_eos=ignore_eos,
        )

    def warmup(self, cfg: ServerConfig, server: Any) -> None:
        """Send the warm-up prompts (:data:`WARMUP_TOKENS` tokens each, all at once), not measured."""
        from adaptive_spec.commands.bench.serve_client import run_passes, write_dataset

        warm = self.prompts.warmup
        path = write_dataset(self.work / "datasets" / "warmup.jsonl", warm, WARMUP_TOKENS)
        cp = ClientPass("warmup", 0.0, tuple(range(len(warm))))
        argv = self._argv(
            cp,
            server,
            path,
            max_tokens=WARMUP_TOKENS,
            seed=self.args.seed,
            prefix=f"{slug(cfg.name)}-warmup-",
            ignore_eos=False,
        )
        with self.console.status(f"{cfg.name}: {len(warm)} warm-up requests"):
            res = run_passes([argv], self._client_log(cfg), self.args.pattern_timeout)
        if res[0].get("failed"):
            self.notes.append(f"{cfg.name}: {res[0]['failed']} warm-up requests failed")

    def run_pattern(
        self, cfg: ServerConfig, server: Any, pattern: Pattern, step: str, record: bool = True
    ) -> dict[str, Any]:
        """Run one pattern on a ready server and return its run (printed as one line, ``step`` in
        front). A recorded run also has ``texts`` (request index -> text), and vLLM's raw results are
        kept in the work directory; an unrecorded one (the calibration) uses datasets of its own.

        Returns
        -------
        dict
            ``config``, ``pattern``, ``kind``, ``wall_s`` and either ``error`` or the merged client
            figures (:func:`~adaptive_spec.commands.bench.serve_client.merge_passes`, ``texts`` only
            when recorded), ``passes``, ``server`` (counter deltas), ``acceptance`` and ``checks``.
        """
        from adaptive_spec.commands.bench.serve_client import merge_passes, run_passes, vllm_summary
        from adaptive_spec.commands.bench.serve_server import counters, delta, scrape
        from adaptive_spec.commands.bench.serve_summary import acceptance

        passes = pattern.passes(self.plan.requests)
        tag = "" if record else "cal-"
        argvs = [
            self._argv(
                cp,
                server,
                self._dataset(pattern, f"{tag}{cp.label}", cp.indices),
                max_tokens=self.plan.max_tokens,
                seed=self.args.seed + k,
                prefix=f"{slug(cfg.name)}-{slug(pattern.name)}-{tag}{cp.label}-",
                ignore_eos=bool(self.args.ignore_eos),
            )
            for k, cp in enumerate(passes)
        ]
        before = counters(scrape(server.url))
        t0 = time.monotonic()
        run: dict[str, Any] = {"config": cfg.name, "pattern": pattern.name, "kind": pattern.kind}
        with self.console.status(
            f"{cfg.name} / {pattern.name}: {self.plan.requests} requests ({len(passes)} client pass"
            f"{'es' if len(passes) > 1 else ''})"
        ):
            try:
                results = run_passes(argvs, self._client_log(cfg), self.args.pattern_timeout)
            except TimeoutError:
                results = None
                run["error"] = (
                    f"the client did not finish in {self.args.pattern_timeout:.0f} s (--pattern-timeout)"
                )
            except Exception as e:
                results = None
                run["error"] = f"vLLM's client failed: {type(e).__name__}: {e}"
            if results is not None:
                merged = merge_passes(list(zip(passes, results, strict=True)), self.plan.requests)
                after = self._settle(server.url, before, merged)
                server_delta = delta(after, before)
                run.update({k: v for k, v in merged.items() if k != "texts"})
                run["passes"] = [
                    {
                        "label": cp.label,
                        "temperature": cp.temperature,
                        "requests": len(cp.indices),
                        "request_rate": cp.request_rate,
                        "burstiness": cp.burstiness,
                        "ramp": list(cp.ramp) if cp.ramp else None,
                        "vllm": vllm_summary(res),
                    }
                    for cp, res in zip(passes, results, strict=True)
                ]
                run["server"] = server_delta
                run["acceptance"] = acceptance(server_delta)
                run["checks"] = run_checks(run, server_delta)
                if record:
                    raw = self.work / "raw" / f"{slug(cfg.name)}-{slug(pattern.name)}.json"
                    raw.parent.mkdir(parents=True, exist_ok=True)
                    raw.write_text(json.dumps(results, default=str), encoding="utf-8")
                    run["texts"] = merged["texts"]
        run["wall_s"] = time.monotonic() - t0
        self._report_line(pattern, run, step)
        return run

    def _settle(self, url: str, before: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
        """``/metrics`` after a pattern, once vLLM counted the completed requests and the plugin's
        snapshot caught up with the tokens sent (or after 10 s)."""
        from adaptive_spec.commands.bench.serve_server import (
            PLUGIN_METRICS_INTERVAL_S,
            counters,
            scrape,
        )

        deadline = time.monotonic() + 10.0
        while True:
            after = counters(scrape(url))
            done = after["requests_finished"] - before["requests_finished"] >= merged["completed"]
            if "plugin" in after:
                emitted = sum(after["plugin"]["emitted"].values()) - sum(
                    before.get("plugin", {}).get("emitted", {}).values()
                )
                done = done and emitted >= merged["total_output_tokens"]
            if done or time.monotonic() > deadline:
                return after
            time.sleep(PLUGIN_METRICS_INTERVAL_S)

    def _report_line(self, pattern: Pattern, run: dict[str, Any], step: str) -> None:
        from adaptive_spec.commands.bench.serve_summary import headline

        if "error" in run:
            self.console.print(f"  [{step}] {pattern.name}: [red]{run['error']}[/]")
            return
        acc, length = headline(run)
        bad = run["failed"] + run["lost"]
        self.console.print(
            f"  [{step}] {pattern.name}: {run['completed']}/{run['sent']} answered"
            + (f" ([red]{bad} failed/lost[/])" if bad else "")
            + f", {run['output_tok_s']:.1f} tok/s, TPOT p50 {run['tpot_ms']['p50'] or 0:.0f} ms"
            + (f", acceptance {acc:.0%}, accepted length {length:.2f}" if acc is not None else "")
            + f" ({run['wall_s']:.0f} s)"
        )


def run_checks(run: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """Nothing lost: the client accounted for every request sent, and the server's counters agree with
    what the client received (vLLM's finished requests and generated tokens; the plugin's emitted
    tokens)."""
    reasons = server.get("requests_finished_by_reason") or {}
    served_ok = sum(v for k, v in reasons.items() if k not in ("abort", "error"))
    out: dict[str, Any] = {
        "all_accounted": run["lost"] == 0 and run["completed"] + run["failed"] == run["sent"],
        "server_completed": int(served_ok),
        "server_completed_matches": int(served_ok) == run["completed"],
        "server_generation_tokens": int(server.get("generation_tokens", 0)),
        "generation_tokens_match": int(server.get("generation_tokens", 0))
        == run["total_output_tokens"],
    }
    if "plugin" in server:
        emitted = int(sum(server["plugin"]["emitted"].values()))
        out["plugin_emitted_tokens"] = emitted
        out["plugin_emitted_matches"] = emitted == run["total_output_tokens"]
    return out
