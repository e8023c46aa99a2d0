"""The run of ``adaptive-spec bench serve``: the resolved plan (:class:`Plan`, from the command line), the
prompts, and :class:`Runner`, which starts one server per configuration, runs every load pattern through
vLLM's client and records each run with the checks that nothing was lost."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.serve_plan import (
    DEFAULT_CONFIGS,
    DEFAULT_RATES,
    PATTERN_HELP,
    PATTERN_KINDS,
    QUICK_CONFIGS,
    QUICK_RATES,
    Pattern,
    ServerConfig,
    calibrated_rates,
    expand_patterns,
    parse_pattern,
    parse_server_configs,
)
from adaptive_spec.core.machine import default_dtype

#: --quick: settings for a CI-size smoke run on the tiny float32 model.
QUICK = {"requests": 6, "max_tokens": 32, "warmup": 1, "kv_cache_gib": 0.25, "max_num_seqs": 8}
FULL = {"requests": 32, "max_tokens": 128, "warmup": 2, "kv_cache_gib": 1.0, "max_num_seqs": 16}


def csv_list(text: str | None) -> list[str]:
    """The non-empty, stripped items of a comma-separated flag value."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _default_mt_bench() -> str | None:
    from adaptive_spec.commands.bench.plan import MT_BENCH_DEFAULT

    return str(MT_BENCH_DEFAULT) if MT_BENCH_DEFAULT.is_file() else None


def load_prompts(sources: list[str], n: int, *, seed: int, mt_bench: str | None) -> list[str]:
    """``n`` prompt texts interleaved round-robin from ``sources`` (fewer if the sources run out).

    Raises
    ------
    ValueError
        For an unknown source or an unreadable file.
    FileNotFoundError
        If a data package or the MT-Bench file is missing.
    """
    from adaptive_spec.commands.workloads import load_workload

    if not sources:
        raise ValueError("--workloads is empty; allowed: built-in names, mtbench, or JSONL paths")
    per = -(-n // len(sources))
    pools: list[list[str]] = []
    for src in sources:
        if src == "mtbench":
            if not mt_bench or not Path(mt_bench).is_file():
                raise FileNotFoundError(
                    f"--workloads mtbench needs --mt-bench=<question.jsonl> (not found: {mt_bench})"
                )
            src = mt_bench
        path = Path(src)
        if path.suffix == ".jsonl" and path.is_file() and _is_custom_format(path):
            pools.append(_read_custom(path, per))
        else:
            pools.append([p.text for p in load_workload(src, per, seed=seed)])
    out = [pool[i] for i in range(per) for pool in pools if i < len(pool)]
    return out[:n]


def _is_custom_format(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                return isinstance(rec, dict) and "prompt" in rec and "turns" not in rec
    return False


def _read_custom(path: Path, n: int) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{i}: not a JSON object with a 'prompt' field") from None
            if len(out) >= n:
                break
    return out


def _model_max_len(model: Path, wanted: int) -> int:
    try:
        cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
        return min(wanted, int(cfg.get("max_position_embeddings") or wanted))
    except (OSError, ValueError):
        return wanted


class Plan:
    """The resolved run: settings, configurations, pattern specs (expanded now, or after calibration).

    Raises
    ------
    ValueError
        For any invalid flag value, naming the flag.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        q = bool(args.quick)
        d = QUICK if q else FULL
        self.quick = q
        self.mode = "quick" if q else "full"
        self.requests = args.requests or d["requests"]
        self.max_tokens = args.max_tokens or d["max_tokens"]
        self.warmup = d["warmup"] if args.warmup is None else args.warmup
        self.max_num_seqs = args.max_num_seqs or d["max_num_seqs"]
        self.kv_cache_gib = args.kv_cache_gib or d["kv_cache_gib"]
        self.dtype = args.dtype or ("float32" if q else default_dtype())
        self.eager = bool(args.eager or q)
        self.max_k = args.max_k
        names = (
            csv_list(args.configs)
            if args.configs
            else list(QUICK_CONFIGS if q else DEFAULT_CONFIGS)
        )
        self.configs: list[ServerConfig] = parse_server_configs(names, self.max_k)
        self.warm_state = Path(args.warm_state).expanduser() if args.warm_state else None
        if any(c.warm for c in self.configs):
            if self.warm_state is None and not any(c.name == "adaptive" for c in self.configs):
                raise ValueError(
                    "--configs has adaptive-warm but neither 'adaptive' (whose saved state it loads) nor "
                    "--warm-state=<policy-state file>"
                )
            if self.warm_state is not None and not self.warm_state.is_file():
                raise ValueError(f"--warm-state={args.warm_state!r} is not a file")
        self.pattern_specs = csv_list(args.patterns)
        if not self.pattern_specs:
            raise ValueError(f"--patterns is empty; allowed: {PATTERN_HELP}")
        for spec in self.pattern_specs:
            if spec not in PATTERN_KINDS:
                parse_pattern(spec)  # fails early, naming the entry
        try:
            rates = [float(x) for x in csv_list(args.rates)] if args.rates else None
        except ValueError:
            raise ValueError(
                f"--rates={args.rates!r} is invalid; allowed: comma-separated rates > 0 (requests/s)"
            ) from None
        self.rates = tuple(rates) if rates else (QUICK_RATES if q else DEFAULT_RATES)
        self.calibrate = bool(args.calibrate)
        if not 0 < args.hot_share < 1:
            raise ValueError(f"--hot-share={args.hot_share:g} is invalid; allowed: 0 < share < 1")
        self.burstiness = args.burstiness
        self.hot_share = args.hot_share
        self.patterns: list[Pattern] | None = None
        self.expand(self.rates)  # validates the rates; redone after --calibrate
        if self.calibrate:
            self.patterns = None

    def expand(self, rates: tuple[float, ...]) -> list[Pattern]:
        self.rates = tuple(rates)
        self.patterns = expand_patterns(
            self.pattern_specs, self.rates, burstiness=self.burstiness, hot_share=self.hot_share
        )
        return self.patterns


# -- running ----------------------------------------------------------------------------------------
class Runner:
    """Runs the plan: one server per configuration, one client call per pattern (see the module
    docstring). Results accumulate in :attr:`runs` (``{config: {pattern: run}}``)."""

    def __init__(self, plan: Plan, args: argparse.Namespace, console: Any) -> None:
        from adaptive_spec.commands.bench.serve_server import ServerSettings

        self.plan = plan
        self.args = args
        self.console = console
        self.out = Path(args.out)
        self.work = self.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        model = self._model(args)
        self.settings = ServerSettings(
            model=model,
            served_name="tiny" if plan.quick and not args.model else "smollm2",
            dtype=plan.dtype,
            max_model_len=_model_max_len(model, args.max_model_len),
            max_num_seqs=plan.max_num_seqs,
            kv_cache_bytes=int(plan.kv_cache_gib * (1 << 30)),
            enforce_eager=plan.eager,
            prefix_caching=bool(args.prefix_caching),
            max_k=plan.max_k,
            seed=args.seed,
            extra_args=tuple(args.server_arg),
        )
        self.runs: dict[str, dict[str, dict[str, Any]]] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.texts: dict[str, dict[str, dict[int, str | None]]] = {}
        self.notes: list[str] = []
        self.calibration: dict[str, Any] | None = None
        self.tables: dict[str, Any] = {}
        self._prestarted: dict[str, tuple[Any, dict[str, Any], Path | None]] = {}
        self._client_ready = threading.Event()
        self._client_error: BaseException | None = None

    @staticmethod
    def _model(args: argparse.Namespace) -> Path:
        if args.model:
            path = Path(args.model).expanduser()
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"--model={args.model!r} is not a model directory (no config.json)"
                )
            return path
        if args.quick:
            from adaptive_spec.vllm.tiny_model import tiny_model_path

            return tiny_model_path()
        from adaptive_spec.vllm.models import default_model_path

        return default_model_path(args.dtype or default_dtype())

    # -- the client library is imported in the background while the first server starts ---------------
    def import_client(self) -> None:
        from adaptive_spec.vllm import bench_client

        def work() -> None:
            try:
                bench_client.preload()
            except BaseException as e:  # reported when the client is first needed
                self._client_error = e
            finally:
                self._client_ready.set()

        threading.Thread(target=work, name="import-vllm-bench", daemon=True).start()

    def _wait_client(self) -> None:
        self._client_ready.wait()
        if self._client_error is not None:
            raise RuntimeError(
                f"cannot import vllm.benchmarks.serve ({type(self._client_error).__name__}: "
                f"{self._client_error}); install vLLM's CPU build: pip install -e '.[cpu]'"
            )

    # -- datasets -----------------------------------------------------------------------------------
    def prepare_prompts(self) -> None:
        plan = self.plan
        need = plan.requests + plan.warmup
        prompts = load_prompts(
            csv_list(self.args.workloads),
            need,
            seed=self.args.seed,
            mt_bench=self.args.mt_bench or _default_mt_bench(),
        )
        if len(prompts) < need:
            if len(prompts) <= plan.warmup:
                raise ValueError(
                    f"--workloads={self.args.workloads!r} gave {len(prompts)} prompts; need more than "
                    f"--warmup={plan.warmup}"
                )
            self.notes.append(
                f"the workloads gave {len(prompts)} prompts: {len(prompts) - plan.warmup} requests per "
                f"pattern instead of {plan.requests}"
            )
            plan.requests = len(prompts) - plan.warmup
        self.prompts = prompts[: plan.requests]
        self.warmup_prompts = prompts[plan.requests : plan.requests + plan.warmup]

    def _dataset(self, pattern: Pattern, label: str, indices: tuple[int, ...]) -> Path:
        from adaptive_spec.commands.bench.serve_client import write_dataset

        path = self.work / "datasets" / f"{_slug(pattern.name)}-{label}.jsonl"
        if not path.exists():
            write_dataset(path, [self.prompts[i] for i in indices], self.plan.max_tokens)
        return path

    # -- one configuration --------------------------------------------------------------------------
    def _state_path(self, cfg: ServerConfig) -> Path | None:
        if cfg.kind != "adaptive":
            return None
        state_dir = self.out / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / f"{cfg.name}.json"
        if cfg.warm:
            src = self.warm_source()
            if src is None:
                return None
            if path.exists():
                path.unlink()
            shutil.copyfile(src, path)  # the warm server saves into its own copy
        elif path.exists():
            path.unlink()  # cold start
        return path

    def warm_source(self) -> Path | None:
        if self.plan.warm_state is not None:
            return self.plan.warm_state
        cold = self.out / "state" / "adaptive.json"
        return cold if cold.is_file() else None

    def resolve(self, cfg: ServerConfig) -> ServerConfig | None:
        """The configuration ready to start (a bare vllm-dynamic gets its tuned table), or None (and a
        note) when it cannot run."""
        if cfg.kind == "table" and cfg.table is None:
            from adaptive_spec.commands.bench.serve_summary import tuned_table

            configs = {c.name: c for c in self.plan.configs}
            steady = [p.name for p in self.plan.patterns or [] if p.kind == "steady"]
            table, best = tuned_table(self.runs, configs, steady, self.plan.max_num_seqs)
            if table is None:
                self.notes.append(
                    f"{cfg.name} skipped: no steady pattern with both 'none' and a static n-gram run to "
                    "tune its table from; give one with --configs vllm-dynamic:1-2=8,3-8=4,9-16=2"
                )
                return None
            self.tables[cfg.name] = {"best_k_by_concurrency": best, "table": table}
            self.console.print(
                f"[bold]vLLM table[/] (best static n-gram k by the concurrency 'none' saw: {best}): {table}"
            )
            return cfg.with_table(table)
        if cfg.warm and self.warm_source() is None:
            self.notes.append(
                f"{cfg.name} skipped: 'adaptive' saved no policy state (see its server log) and no "
                "--warm-state was given"
            )
            return None
        return cfg

    def launch(self, cfg: ServerConfig) -> tuple[Any, dict[str, Any], Path | None] | None:
        """Resolve ``cfg`` and start its server process (returns at once): (server, info, state file),
        or None (with a note) when the configuration cannot run."""
        from adaptive_spec.commands.bench.serve_server import (
            Server,
            free_port,
            server_command,
            server_env,
        )

        resolved = self.resolve(cfg)
        if resolved is None:
            self.console.print(f"[yellow]{cfg.name}: skipped[/] ({self.notes[-1]})")
            return None
        cfg = resolved
        state = self._state_path(cfg)
        port = free_port()
        cmd = server_command(cfg, self.settings, port)
        env = server_env(cfg, self.settings, state=state)
        log = self.work / f"server-{_slug(cfg.name)}.log"
        info: dict[str, Any] = {
            "command": cmd,
            "env": {k: v for k, v in env.items() if k.startswith(("ADAPTIVE_SPEC", "VLLM_"))},
            "speculative_config": cfg.speculative_config(self.plan.max_k),
            "log": str(log),
            "port": port,
            "state": str(state) if state else None,
        }
        server = Server(cmd, env, port, log)
        server.start()
        return server, info, state

    def _prestart(self, index: int) -> None:
        """``--overlap-starts``: start configuration ``index`` (0-based) now, unless it depends on runs
        still to come (a table tuned from them, a warm start from a state not saved yet)."""
        if index >= len(self.plan.configs):
            return
        nxt = self.plan.configs[index]
        if (nxt.kind == "table" and nxt.table is None) or nxt.warm or nxt.name in self._prestarted:
            return
        try:
            launched = self.launch(nxt)
        except Exception as e:  # it is started again, in order, when its turn comes
            self.notes.append(f"{nxt.name}: early start failed ({type(e).__name__}: {e})")
            return
        if launched is not None:
            self.console.print(f"  (started {nxt.name}'s server early: --overlap-starts)")
            self._prestarted[nxt.name] = launched

    def stop_prestarted(self) -> None:
        """Stop servers started early that never ran (an interrupted run)."""
        for server, _info, _state in self._prestarted.values():
            server.stop()
        self._prestarted.clear()

    def run_config(self, index: int, cfg: ServerConfig) -> None:
        """Start (or take the pre-started) server of ``cfg``, warm it up, run every pattern, stop it."""
        from adaptive_spec.commands.bench.serve_server import ServerError, counters, scrape

        n_cfg = len(self.plan.configs)
        t0 = time.monotonic()
        launched = self._prestarted.pop(cfg.name, None)
        if launched is None:
            launched = self.launch(cfg)
        if launched is None:
            return
        server, info, state = launched
        log = server.log
        if self.args.overlap_starts or (self.plan.quick and self.args.overlap_starts is None):
            self._prestart(index)  # the next server starts while this one starts and is measured
        self.servers[cfg.name] = info
        self.runs.setdefault(cfg.name, {})
        self.console.print(f"[bold][{index}/{n_cfg}] {cfg.name}[/]: server log {log}")
        try:
            with self.console.status(f"{cfg.name}: waiting for the server to be ready"):
                info["ready_s"] = server.wait_ready(self.args.start_timeout)
            self.console.print(f"  ready after {info['ready_s']:.0f} s on {server.url}")
            self._wait_client()
            first = counters(scrape(server.url))
            if "plugin" in first:
                info["state_loaded"] = bool(first["plugin"]["state_loaded"])
                info["learned_steps_at_start"] = first["plugin"]["learned_steps"]
                if cfg.warm and not info["state_loaded"]:
                    self.notes.append(f"{cfg.name}: the server did not load {state} (see {log})")
            elif cfg.plugin:
                raise ServerError(
                    f"the plugin is not active on {cfg.name}'s server (no adaptive_spec_* series on "
                    f"/metrics); see {log}"
                )
            if self.plan.warmup:
                self._warmup(cfg, server)
            if self.plan.patterns is None:
                self._calibrate(cfg, server)
            assert self.plan.patterns is not None
            for j, pattern in enumerate(self.plan.patterns, 1):
                if not server.alive():
                    raise ServerError(f"the server died (see {log}):\n{server.log_tail(1500)}")
                self.run_pattern(cfg, server, pattern, f"{j}/{len(self.plan.patterns)}")
        except Exception as e:  # recorded; the other configurations still run
            msg = str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
            info["error"] = msg.splitlines()[0] if msg else type(e).__name__
            self.console.print(f"[red]{cfg.name}: {msg}[/]", markup=False)
        finally:
            with self.console.status(f"{cfg.name}: stopping the server"):
                info["stop"] = server.stop()
            info["total_s"] = time.monotonic() - t0
            if not info["stop"]["clean"]:
                self.notes.append(f"{cfg.name}: the server needed SIGKILL to stop")
            if state is not None:
                info["state_saved"] = state.is_file()
            self.console.print(
                f"  stopped ({'cleanly' if info['stop']['clean'] else 'with SIGKILL'}, "
                f"{info['stop']['stop_s']:.1f} s); {info['total_s']:.0f} s for {cfg.name}"
            )

    def _argvs(
        self, cfg: ServerConfig, server: Any, pattern: Pattern, passes: list[Any], tag: str
    ) -> list[list[str]]:
        from adaptive_spec.commands.bench.serve_client import client_argv

        return [
            client_argv(
                cp,
                base_url=server.url,
                served_name=self.settings.served_name,
                tokenizer=str(self.settings.model),
                dataset=self._dataset(pattern, f"{tag}{cp.label}", cp.indices),
                max_tokens=self.plan.max_tokens,
                seed=self.args.seed + k,
                request_id_prefix=f"{_slug(cfg.name)}-{_slug(pattern.name)}-{tag}{cp.label}-",
                ignore_eos=bool(self.args.ignore_eos),
            )
            for k, cp in enumerate(passes)
        ]

    def _warmup(self, cfg: ServerConfig, server: Any) -> None:
        from adaptive_spec.commands.bench.serve_client import client_argv, run_passes, write_dataset
        from adaptive_spec.commands.bench.serve_plan import ClientPass

        path = write_dataset(self.work / "datasets" / "warmup.jsonl", self.warmup_prompts, 8)
        cp = ClientPass("warmup", 0.0, tuple(range(len(self.warmup_prompts))))
        argv = client_argv(
            cp,
            base_url=server.url,
            served_name=self.settings.served_name,
            tokenizer=str(self.settings.model),
            dataset=path,
            max_tokens=8,
            seed=self.args.seed,
            request_id_prefix=f"{_slug(cfg.name)}-warmup-",
        )
        with self.console.status(f"{cfg.name}: {len(self.warmup_prompts)} warm-up requests"):
            res = run_passes(
                [argv], self.work / f"client-{_slug(cfg.name)}.log", self.args.pattern_timeout
            )
        if res[0].get("failed"):
            self.notes.append(f"{cfg.name}: {res[0]['failed']} warm-up requests failed")

    def _calibrate(self, cfg: ServerConfig, server: Any) -> None:
        from adaptive_spec.commands.bench.serve_server import ServerError

        pattern = parse_pattern("steady:inf")
        self.console.print(
            f"  calibrating: {self.plan.requests} requests at once on {cfg.name} (the saturation point)"
        )
        run = self.run_pattern(cfg, server, pattern, "calibration", record=False)
        sat = run.get("request_throughput") or 0.0
        if not sat > 0:
            raise ServerError(f"calibration failed on {cfg.name}: no request completed")
        rates = calibrated_rates(sat)
        self.calibration = {
            "config": cfg.name,
            "saturation_rps": sat,
            "rates": list(rates),
            "run": run,
        }
        patterns = self.plan.expand(rates)
        self.console.print(
            f"  saturation {sat:.2f} requests/s -> rates {', '.join(f'{r:g}' for r in rates)}; patterns "
            + ", ".join(p.name for p in patterns)
        )

    def run_pattern(
        self, cfg: ServerConfig, server: Any, pattern: Pattern, step: str, record: bool = True
    ) -> dict[str, Any]:
        """Run one pattern on a ready server; store and return its run."""
        from adaptive_spec.commands.bench.serve_client import merge_passes, run_passes, vllm_summary
        from adaptive_spec.commands.bench.serve_server import counters, delta, scrape
        from adaptive_spec.commands.bench.serve_summary import acceptance

        passes = pattern.passes(self.plan.requests)
        tag = "" if record else "cal-"
        argvs = self._argvs(cfg, server, pattern, passes, tag)
        client_log = self.work / f"client-{_slug(cfg.name)}.log"
        before = counters(scrape(server.url))
        t0 = time.monotonic()
        run: dict[str, Any] = {"config": cfg.name, "pattern": pattern.name, "kind": pattern.kind}
        with self.console.status(
            f"{cfg.name} / {pattern.name}: {self.plan.requests} requests ({len(passes)} client pass"
            f"{'es' if len(passes) > 1 else ''})"
        ):
            try:
                results = run_passes(argvs, client_log, self.args.pattern_timeout)
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
                run["checks"] = _checks(run, server_delta)
                if record:
                    self.texts.setdefault(cfg.name, {})[pattern.name] = merged["texts"]
                    raw = self.work / "raw" / f"{_slug(cfg.name)}-{_slug(pattern.name)}.json"
                    raw.parent.mkdir(parents=True, exist_ok=True)
                    raw.write_text(json.dumps(results, default=str), encoding="utf-8")
                    run["texts"] = merged["texts"]
        run["wall_s"] = time.monotonic() - t0
        if record:
            self.runs[cfg.name][pattern.name] = run
        self._report_line(cfg, pattern, run, step)
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

    def _report_line(
        self, cfg: ServerConfig, pattern: Pattern, run: dict[str, Any], step: str
    ) -> None:
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


def _checks(run: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
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


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


# -- main -------------------------------------------------------------------------------------------
