"""``adaptive-spec replay``: replay policies offline over a recorded (or synthetic) step trace.

Every policy sees the drafts each proposer would have offered at each request's current position
(n-gram drafts are recomputed when the trace does not store them; Jacobi drafts exist only where the
recorded run logged them), the accepted length follows from the known output, and each simulated
step is charged a cost profile's step time (by default one fitted to the trace's measured step times).
Prints goodput, mean accepted length, acceptance rate, arm mix and regret against the best static arm
in hindsight, the per-request best static arm and the oracle; writes plots and ``summary.json``.
With ``--replicas N`` (N >= 2) it splits the requests between N data-parallel replicas instead and
compares how fast they learn the acceptance with and without sharing a state file
(:mod:`adaptive_spec.commands.replay_replicas`). See ``docs/replay.md``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DEFAULT_POLICIES = "adaptive,static:ngram:4,oracle"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="replay policies offline over a step trace: goodput, arm mix, regret vs static arms and the oracle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace file (JSONL) written by `adaptive-spec run` or `record`")
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma-separated policies: adaptive, adaptive-ucb, adaptive-greedy, adaptive-eps, none, "
        "static:<proposer>:<k>, table:<proposer>:<start>-<end>=<k>;..., smartspec[:<proposer>], "
        "banditspec[:<proposer>], bandit:<learner> (a learner of adaptive_spec.bandits, e.g. "
        "bandit:ucb1), per-request-static, oracle, adaptive-hindsight (the controller "
        "started with the acceptance counts of the whole trace: what its context features allow) "
        "(a table policy's rows are separated "
        f"by ';' here). Default {DEFAULT_POLICIES}",
    )
    p.add_argument(
        "--profile",
        default="auto",
        help="cost profile: auto (default: the controller's measured step-cost table recorded in the "
        "trace, else fit), table (that table), fit (least squares on the trace's step times), cpu-smollm2, "
        "gpu-flat, gpu-tight, h200-llama8b (measured), linear:c0,c_batch,c_token[,c_draft_pass[,c_prefill_token]] or "
        "roofline:base_s,flat_tokens,per_token_s[,draft_ratio] (seconds)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="largest batch in the replay (default: the largest batch_size in the trace)",
    )
    p.add_argument("--out", default=None, help="output directory (default: <trace dir>/replay)")
    p.add_argument(
        "--no-prior",
        action="store_true",
        help="start the learning policies from the generic acceptance prior; by default they start "
        "from the shipped prior of the model the trace names, as the engine does when no saved "
        "state is loaded",
    )
    p.add_argument(
        "--calibration",
        action="store_true",
        help="also replay the adaptive controller recording its predicted acceptance of every judged "
        "draft position: predicted vs observed per proposer and position, a reliability table with "
        "the expected calibration error, and calibration.png",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the learning policies (default 0)")
    p.add_argument(
        "--ngram-min", type=int, default=2, help="n-gram min_n the engine used (default 2)"
    )
    p.add_argument(
        "--ngram-max", type=int, default=4, help="n-gram max_n the engine used (default 4)"
    )
    from adaptive_spec.commands.replay_replicas import add_arguments

    add_arguments(p)
    p.set_defaults(func=main)


def _split_policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [n.replace(";", ",") for n in names]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from adaptive_spec.commands.plots import (
        arm_mix,
        plot_arms,
        plot_goodput_by_category,
        plot_regret,
    )
    from adaptive_spec.sim.compare import compare_policies
    from adaptive_spec.sim.cost_profiles import get_profile
    from adaptive_spec.sim.trace_io import load_replay_trace

    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    path = Path(args.trace)
    if not path.exists():
        console.print(f"[red]error[/]: trace {path} does not exist")
        return 2
    try:
        wl = load_replay_trace(path, min_n=args.ngram_min, max_n=args.ngram_max)
        profile = get_profile(args.profile, wl.trace)
    except ValueError as e:
        console.print(f"[red]error[/]: {e}")
        return 2
    max_batch = args.max_batch if args.max_batch is not None else wl.max_batch
    if max_batch < 1:
        console.print(
            f"[red]error[/]: --max-batch={max_batch} is invalid; allowed: an integer >= 1"
        )
        return 2
    names = _split_policies(args.policies)
    from adaptive_spec.commands import replay_replicas
    from adaptive_spec.core.errors import ConfigError

    try:
        opts = replay_replicas.parse_replica_args(args, len(wl.requests))
    except ConfigError as e:
        console.print(f"[red]error[/]: {e}")
        return 2
    if wl.trace.truncated:
        console.print(
            f"[yellow]note[/]: the trace was cut off (line {wl.trace.truncated_at_line}) or has no end line; "
            "replaying its complete steps"
        )
    prior_key = None if args.no_prior else trace_prior_key(wl.trace)
    out = Path(args.out) if args.out else path.parent / "replay"
    if opts["replicas"] > 1:
        out.mkdir(parents=True, exist_ok=True)
        return replay_replicas.main(
            args,
            console,
            wl,
            profile,
            names=names,
            opts=opts,
            max_batch=max_batch,
            prior_key=prior_key,
            out=out,
        )
    try:
        cmp = compare_policies(
            wl.requests,
            names,
            profile,
            proposers=wl.proposers,
            max_k=wl.max_k,
            max_batch=max_batch,
            seed=args.seed,
            prior_key=prior_key,
        )
    except ValueError as e:
        console.print(f"[red]error[/]: {e}")
        return 2
    base = cmp.static["none"]
    table = Table(
        title=f"adaptive-spec replay: {path.name} ({len(wl.requests)} requests, "
        f"{sum(len(r) for r in wl.requests)} tokens, max batch {max_batch}, max k {wl.max_k})"
    )
    cols = (
        "policy",
        "tokens/s",
        "x none",
        "acc. len",
        "acc. rate",
        "arms (top 3)",
        "regret: best static",
        "per-req. static",
        "oracle",
    )
    for c in cols:
        left = c in ("policy", "arms (top 3)")
        table.add_column(c, justify="left" if left else "right", no_wrap=not left)

    def pct(x: float) -> str:
        return f"{100 * x:+.1f}%"

    for n, res in cmp.results.items():
        reg = cmp.regrets(n)
        table.add_row(
            n,
            f"{res.goodput:.1f}",
            f"{res.goodput / base:.2f}x" if base > 0 else "-",
            f"{res.mean_accepted_length:.2f}",
            f"{res.acceptance_rate:.2f}",
            arm_mix(dict(res.arm_counts), top=3),
            pct(reg["best-static"].gap),
            pct(reg["per-request-static"].gap),
            pct(reg["oracle"].gap),
        )
    table.add_section()

    def reference_row(name: str, goodput: float, *, ratio: bool = True, run: Any = None) -> None:
        """A row of a reference (no regret columns): goodput, its ratio to ``none`` and, for a
        replayed run, its accepted length and arms."""
        cells = [name, f"{goodput:.1f}", f"{goodput / base:.2f}x" if ratio else ""]
        cells += [f"{run.mean_accepted_length:.2f}", ""] if run is not None else ["", ""]
        cells.append(arm_mix(dict(run.arm_counts), top=3) if run is not None else "")
        table.add_row(*cells, *[""] * (len(cols) - len(cells)))

    bs = cmp.best_static
    reference_row(f"best static ({bs})", cmp.static[bs])
    reference_row(
        "per-request best static", cmp.per_request_static.goodput, run=cmp.per_request_static
    )
    reference_row("oracle", cmp.oracle.goodput, run=cmp.oracle)
    reference_row("oracle bound (no schedule)", cmp.bound.goodput)
    rec_policy = wl.trace.header.get("policy", "?")
    reference_row(f"recorded run ({rec_policy}, measured)", wl.recorded_goodput, ratio=False)
    desc = profile.describe()
    fit = desc.get("fit")
    notes = [f"cost profile: {desc['name']} ({desc['source']})"]
    from adaptive_spec.core.priors import shipped_prior

    shipped = prior_key is not None and shipped_prior(prior_key) is not None
    notes.append(
        "acceptance prior of the learning policies: "
        + (f"shipped ({prior_key['model']})" if shipped else "generic")
    )
    if fit:
        notes.append(
            f"fit on {fit['n_steps']} steps: R^2 {fit['r2']:.3f}, relative RMSE {fit['rel_rmse']:.3f}, "
            f"{fit['n_outliers']} outliers dropped"
            + (
                f", not identified (charged 0): {', '.join(fit['unidentified'])}"
                if fit["unidentified"]
                else ""
            )
        )
    notes.append(
        "draft coverage: " + ", ".join(f"{p} {100 * c:.0f}%" for p, c in wl.coverage.items())
    )
    if wl.ngram_check.get("compared"):
        c = wl.ngram_check
        notes.append(
            f"recomputed n-gram drafts equal the logged ones at {c['equal']}/{c['compared']} positions"
        )
    sampled = max((r.sampled_request_steps for r in cmp.results.values()), default=0)
    if sampled:
        notes.append(
            f"{sampled} request-steps have temperature > 0: scored by token equality (approximate, see docs/replay.md)"
        )
    notes.append("regret: 1 - goodput / comparator goodput (negative: the policy beat it)")
    table.caption = "\n".join(notes)
    console.print(table)

    out.mkdir(parents=True, exist_ok=True)
    calib = None
    if args.calibration:
        calib = replay_calibration(wl, profile, max_batch, args.seed, prior_key)
        print_calibration(console, calib)
        plot_calibration(calib, out / "calibration.png")
    plots = [plot_regret(cmp.results, cmp.oracle, out / "regret.png", comparator="oracle")]
    for n, res in cmp.results.items():
        plots.append(plot_arms(res, out / f"arms_{_safe(n)}.png"))
    plots.append(plot_goodput_by_category(cmp.results, out / "goodput_by_category.png"))
    summary = {
        "trace": str(path),
        "profile": desc,
        "acceptance_prior": "shipped" if shipped else "generic",
        "max_batch": max_batch,
        "max_k": wl.max_k,
        "recorded_goodput_tok_s": round(wl.recorded_goodput, 3),
        "coverage": wl.coverage,
        "ngram_check": wl.ngram_check,
        **cmp.as_dict(),
    }
    if calib is not None:
        summary["calibration"] = calib
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    console.print(f"plots: {', '.join(str(p) for p in plots)}\nsummary: {out / 'summary.json'}")
    return 0


def trace_prior_key(trace: Any) -> dict[str, Any] | None:
    """The recorded engine's prior key (model, dtype and its drafter, if any) from a trace's header,
    whose shipped acceptance priors the engine's controller started from; None for a trace without
    one (a synthetic trace)."""
    meta = trace.header.get("meta") or {}
    key = meta.get("prior_key") or meta.get("engine_key")
    return dict(key) if isinstance(key, dict) and "model" in key and "dtype" in key else None


def replay_calibration(
    wl: Any, profile: Any, max_batch: int, seed: int = 0, prior_key: Any = None
) -> dict[str, Any]:
    """Replay the adaptive controller over ``wl`` recording its predictions; returns
    :meth:`AdaptiveController.calibration <adaptive_spec.core.controller.AdaptiveController.calibration>`."""
    from adaptive_spec.sim.policies import build_policy
    from adaptive_spec.sim.replay import replay

    props = [p for p in wl.proposers if p != "none"]
    pol = build_policy(
        "adaptive",
        props,
        wl.max_k,
        requests=wl.requests,
        profile=profile,
        max_batch=max_batch,
        seed=seed,
        prior_key=prior_key,
    )
    pol.record_calibration = True
    replay(wl.requests, pol, profile, max_batch=max_batch, proposers=props)
    return pol.calibration()


def print_calibration(console: Any, calib: dict[str, Any]) -> None:
    from rich.table import Table

    for name, c in calib.items():
        t = Table(
            title=f"acceptance calibration: {name} ({c['n']} judged positions, ECE {c['ece']:.3f})"
        )
        for col in ("position", "n", "predicted", "observed"):
            t.add_column(col, justify="right")
        for row in c["by_position"]:
            t.add_row(
                str(row["position"]),
                str(row["n"]),
                f"{row['predicted']:.3f}",
                f"{row['observed']:.3f}",
            )
        console.print(t)


def plot_calibration(calib: dict[str, Any], path: Path) -> Path | None:
    """Reliability diagram: observed acceptance rate against predicted, one line per proposer."""
    if not calib:
        return None
    from adaptive_spec.commands.plots import _plt, save_figure

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    for name, c in calib.items():
        xs = [r["predicted"] for r in c["reliability"]]
        ys = [r["observed"] for r in c["reliability"]]
        ax.plot(xs, ys, "o-", label=f"{name} (ECE {c['ece']:.3f})")
    ax.set_xlabel("predicted conditional acceptance")
    ax.set_ylabel("observed acceptance rate")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Acceptance calibration (replay)")
    return save_figure(fig, path)
