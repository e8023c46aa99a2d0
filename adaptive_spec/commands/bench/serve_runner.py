"""The servers of ``adaptive-spec bench serve``: :class:`Runner` starts one server per configuration
(optionally the next one early), waits until it is ready and its plugin active, has every load pattern
sent to it (:class:`~adaptive_spec.commands.bench.serve_passes.ClientPasses`), and stops it, recording
each server and each run."""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.serve_passes import ClientPasses, slug
from adaptive_spec.commands.bench.serve_plan import (
    Pattern,
    ServerConfig,
    calibrated_rates,
    parse_pattern,
)
from adaptive_spec.commands.bench.serve_resolve import Plan, run_prompts, server_settings


class Runner:
    """Runs the plan: one server per configuration, one client call per pattern (see the module
    docstring). Results accumulate in :attr:`runs` (``{config: {pattern: run}}``)."""

    def __init__(self, plan: Plan, args: argparse.Namespace, console: Any) -> None:
        self.plan = plan
        self.args = args
        self.console = console
        self.out = Path(args.out)
        self.work = self.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.settings = server_settings(plan, args)
        self.runs: dict[str, dict[str, dict[str, Any]]] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.texts: dict[str, dict[str, dict[int, str | None]]] = {}
        self.notes: list[str] = []
        self.calibration: dict[str, Any] | None = None
        self.tables: dict[str, Any] = {}
        self._prestarted: dict[str, tuple[Any, dict[str, Any], Path | None]] = {}
        self._client_ready = threading.Event()
        self._client_error: BaseException | None = None
        self.passes: ClientPasses | None = None

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

    def prepare_prompts(self) -> None:
        """Load the prompts (:func:`~adaptive_spec.commands.bench.serve_resolve.run_prompts`).

        Raises
        ------
        ValueError, FileNotFoundError
            As :func:`~adaptive_spec.commands.bench.serve_resolve.run_prompts`.
        """
        prompts = run_prompts(self.plan, self.args, self.notes)
        self.passes = ClientPasses(
            self.plan, self.settings, self.args, self.work, self.console, prompts, self.notes
        )

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
        log = self.work / f"server-{slug(cfg.name)}.log"
        info: dict[str, Any] = {
            "command": cmd,
            "env": {k: v for k, v in env.items() if k.startswith(("ADAPTIVE_SPEC", "VLLM_"))},
            "speculative_config": self.settings.speculative_config(cfg),
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
                self._client().warmup(cfg, server)
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

    def _calibrate(self, cfg: ServerConfig, server: Any) -> None:
        from adaptive_spec.commands.bench.serve_server import ServerError

        pattern = parse_pattern("steady:inf")
        self.console.print(
            f"  calibrating: {self.plan.requests} requests at once on {cfg.name} (the saturation point)"
        )
        run = self._client().run_pattern(cfg, server, pattern, "calibration", record=False)
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

    def _client(self) -> ClientPasses:
        if self.passes is None:
            raise RuntimeError("prepare_prompts() has not run")
        return self.passes

    def run_pattern(
        self, cfg: ServerConfig, server: Any, pattern: Pattern, step: str
    ) -> dict[str, Any]:
        """Run one pattern on a ready server; store and return its run (its texts in :attr:`texts`)."""
        run = self._client().run_pattern(cfg, server, pattern, step)
        if "texts" in run:
            self.texts.setdefault(cfg.name, {})[pattern.name] = run["texts"]
        self.runs[cfg.name][pattern.name] = run
        return run
