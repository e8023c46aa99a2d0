"""``adaptive-spec replay TRACE --replicas N``: data-parallel replicas sharing what they learn.

The trace's requests are dealt round-robin by arrival between N replicas, each with its own adaptive
controller; sharing replicas merge their learning through the state file the serve replicas share
(:func:`adaptive_spec.core.state.sync_policy_state`, in a temporary directory). Compared: one server
over all requests, N replicas sharing, N replicas alone (:func:`adaptive_spec.sim.replicas.replica_study`).
Printed: the learned acceptance's error against the single server's after all requests, as a function
of the requests each replica has completed, the requests per replica after which every replica stays
within ``--tolerance`` ("reach"), and the learned acceptance per proposer and position at the end.
Written: ``replicas.json`` and ``replicas.png`` in the output directory.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from adaptive_spec.core.errors import ConfigError, invalid_value

DEFAULT_TOLERANCE = 0.02
#: Policies with a learned acceptance model (what the replicas share).
LEARNING_POLICIES = ("adaptive", "adaptive-ucb", "adaptive-greedy", "adaptive-eps")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--replicas`` family of flags of ``adaptive-spec replay``."""
    from adaptive_spec.sim.replicas import DEFAULT_SYNC_EVERY_S

    g = p.add_argument_group(
        "data-parallel replicas (--replicas N >= 2)",
        "Split the trace's requests round-robin (by arrival) between N replicas, each with its own "
        "controller, and compare how fast they learn the acceptance with and without sharing a "
        "state file (the merge of `vllm serve --data-parallel-size N` replicas sharing ADAPTIVE_SPEC_STATE: "
        "adaptive_spec.core.state.sync_policy_state) "
        "against one server replaying every request.",
    )
    g.add_argument(
        "--replicas",
        default=None,
        metavar="N",
        help="number of data-parallel replicas (an integer from 1 to the number of requests; "
        "default 1: the usual replay). N >= 2 replays the learning policies of --policies "
        f"({', '.join(LEARNING_POLICIES)}) as 1 server, N replicas sharing, N replicas alone, and "
        "prints the learned acceptance's error against the single server's after all requests",
    )
    g.add_argument(
        "--sync-every",
        default=None,
        metavar="R",
        help="sharing replicas merge after every R requests each completes (an integer >= 1), "
        "and whenever one has no request left running; excludes --sync-every-s",
    )
    g.add_argument(
        "--sync-every-s",
        default=None,
        metavar="S",
        help="sharing replicas merge when S simulated seconds of their clock have passed since their "
        f"previous merge, and whenever idle (a number > 0; default {DEFAULT_SYNC_EVERY_S:g}, the "
        "serve runtime's default save interval, used unless --sync-every is given)",
    )
    g.add_argument(
        "--tolerance",
        default=None,
        metavar="T",
        help="a configuration reaches the single server's learned acceptance after n requests per "
        "replica when every replica's error (mean absolute difference over proposers and positions, "
        "weighted by the single server's judged draft positions) stays <= T from n on (a number in "
        f"(0, 1); default {DEFAULT_TOLERANCE}). The output also shows the order floor: how far "
        "one server over the same requests in the reverse order ends from it; a T below that asks "
        "more than the trace can tell",
    )


def _int(name: str, text: str, lo: int, hi: int | None, allowed: str, fix: str) -> int:
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise invalid_value(name, text, allowed, fix=fix) from None
    if v < lo or (hi is not None and v > hi):
        raise invalid_value(name, text, allowed, fix=fix)
    return v


def _float(name: str, text: str, ok: Any, allowed: str, fix: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise invalid_value(name, text, allowed, fix=fix) from None
    if not (math.isfinite(v) and ok(v)):
        raise invalid_value(name, text, allowed, fix=fix)
    return v


def parse_replica_args(args: argparse.Namespace, n_requests: int) -> dict[str, Any]:
    """Check the ``--replicas`` flags against a trace of ``n_requests`` requests.

    Returns
    -------
    dict
        ``replicas`` (int), ``sync_every`` (int or None), ``sync_every_s`` (float or None),
        ``tolerance`` (float).

    Raises
    ------
    ConfigError
        Naming the flag, the value, what is allowed and the fix.
    """
    from adaptive_spec.sim.replicas import DEFAULT_SYNC_EVERY_S

    n = 1
    if args.replicas is not None:
        n = _int(
            "--replicas",
            args.replicas,
            1,
            n_requests,
            f"an integer from 1 to the trace's number of requests ({n_requests})",
            "pass e.g. --replicas 2 (each replica needs at least one request)",
        )
    extra = [
        f
        for f, v in (
            ("--sync-every", args.sync_every),
            ("--sync-every-s", args.sync_every_s),
            ("--tolerance", args.tolerance),
        )
        if v is not None
    ]
    if n == 1:
        if extra:
            raise invalid_value(
                "--replicas",
                args.replicas or "1",
                "an integer >= 2 with " + ", ".join(extra),
                why=f"{', '.join(extra)} apply only to a replay split between replicas",
                fix=f"add --replicas 2, or drop {', '.join(extra)}",
            )
        return {"replicas": 1, "sync_every": None, "sync_every_s": None, "tolerance": None}
    if args.sync_every is not None and args.sync_every_s is not None:
        raise invalid_value(
            "--sync-every-s",
            args.sync_every_s,
            "either --sync-every (requests) or --sync-every-s (simulated seconds), not both",
            fix="drop one of them",
        )
    if getattr(args, "calibration", False):
        raise invalid_value(
            "--replicas",
            args.replicas,
            "1 with --calibration",
            why="--calibration reports the usual replay only",
            fix="drop --calibration, or run it without --replicas",
        )
    sync_every = None
    sync_every_s: float | None = DEFAULT_SYNC_EVERY_S
    if args.sync_every is not None:
        sync_every = _int(
            "--sync-every",
            args.sync_every,
            1,
            None,
            "an integer >= 1 (requests each replica completes between merges)",
            "pass e.g. --sync-every 1",
        )
        sync_every_s = None
    elif args.sync_every_s is not None:
        sync_every_s = _float(
            "--sync-every-s",
            args.sync_every_s,
            lambda v: v > 0,
            "a finite number of simulated seconds > 0",
            f"pass e.g. --sync-every-s {DEFAULT_SYNC_EVERY_S:g}",
        )
    tolerance = DEFAULT_TOLERANCE
    if args.tolerance is not None:
        tolerance = _float(
            "--tolerance",
            args.tolerance,
            lambda v: 0 < v < 1,
            "a number strictly between 0 and 1 (an absolute acceptance-probability error)",
            f"pass e.g. --tolerance {DEFAULT_TOLERANCE}",
        )
    return {
        "replicas": n,
        "sync_every": sync_every,
        "sync_every_s": sync_every_s,
        "tolerance": tolerance,
    }


def learning_policies(names: list[str]) -> list[str]:
    """The policies of ``names`` that the replica study replays. Raises ConfigError when none."""
    keep = [n for n in names if n in LEARNING_POLICIES]
    if not keep:
        raise invalid_value(
            "--policies",
            ",".join(names),
            f"with --replicas >= 2, at least one of {', '.join(LEARNING_POLICIES)}",
            why="the replicas share a learned acceptance model, which these policies do not have",
            fix="pass e.g. --policies adaptive",
        )
    return keep


def main(
    args: argparse.Namespace,
    console: Any,
    wl: Any,
    profile: Any,
    *,
    names: list[str],
    opts: dict[str, Any],
    max_batch: int,
    prior_key: dict[str, Any] | None,
    out: Path,
) -> int:
    """Run and print the replica study for every learning policy of ``names``; write
    ``replicas.json`` (and ``replicas.png``, ``replicas_<policy>.png`` for further policies) in
    ``out``. Returns the exit status."""
    from adaptive_spec.sim.policies import build_policy
    from adaptive_spec.sim.replicas import replica_study

    try:
        policies = learning_policies(names)
    except ConfigError as e:
        console.print(f"[red]error[/]: {e}")
        return 2
    skipped = [n for n in names if n not in policies]
    if skipped:
        console.print(
            f"[yellow]note[/]: with --replicas, only policies with a learned acceptance are "
            f"replayed; skipped: {', '.join(skipped)}"
        )
    from adaptive_spec.core.priors import shipped_prior

    props = [p for p in wl.proposers if p != "none"]
    shipped = prior_key is not None and shipped_prior(prior_key) is not None
    summary: dict[str, Any] = {
        "trace": str(args.trace),
        "requests": len(wl.requests),
        "replicas": opts["replicas"],
        "sync_every_requests": opts["sync_every"],
        "sync_every_s": opts["sync_every_s"],
        "max_batch": max_batch,
        "profile": profile.describe(),
        "acceptance_prior": f"shipped ({prior_key['model']})" if shipped else "generic",
        "policies": {},
    }
    plots = []
    for i, name in enumerate(policies):

        def make(seed_offset: int, name: str = name) -> Any:
            return build_policy(
                name,
                props,
                wl.max_k,
                requests=wl.requests,
                profile=profile,
                max_batch=max_batch,
                seed=args.seed + seed_offset,
                prior_key=prior_key,
            )

        study = replica_study(
            wl.requests,
            make,
            profile,
            n_replicas=opts["replicas"],
            max_batch=max_batch,
            tolerance=opts["tolerance"],
            sync_every=opts["sync_every"],
            sync_every_s=opts["sync_every_s"],
            proposers=props,
        )
        print_study(console, study, name, Path(args.trace).name, opts, len(wl.requests))
        summary["policies"][name] = study.as_dict()
        png = out / ("replicas.png" if i == 0 else f"replicas_{name}.png")
        plots.append(plot_study(study, png, name))
    (out / "replicas.json").write_text(json.dumps(summary, indent=1, default=str))
    console.print(f"plots: {', '.join(str(p) for p in plots)}\nsummary: {out / 'replicas.json'}")
    return 0


def _sync_text(opts: dict[str, Any]) -> str:
    if opts["sync_every"] is not None:
        r = opts["sync_every"]
        return f"merge every {r} request{'s' if r != 1 else ''} per replica and when idle"
    return f"merge every {opts['sync_every_s']:g} simulated s and when idle"


def _checkpoints(m: int) -> list[int]:
    """0, 1, 2, 4, ... and m: the request counts the error table shows."""
    pts = [0]
    x = 1
    while x < m:
        pts.append(x)
        x *= 2
    return [*pts, m] if m > 0 else pts


def print_study(
    console: Any, study: Any, policy: str, trace: str, opts: dict[str, Any], n_requests: int
) -> None:
    """The study's tables: reach and final error per configuration; error by requests per replica;
    learned acceptance per proposer and position at the end."""
    from rich.table import Table

    n = opts["replicas"]
    tol = study.tolerance
    single_reach = study.reach(study.single)
    t = Table(
        title=f"data-parallel replicas: {trace} ({n_requests} requests, policy {policy}; "
        f"{_sync_text(opts)})"
    )
    for c in (
        "configuration",
        "requests each",
        f"reach (err <= {tol:g})",
        "vs 1 server",
        "gap at N·n",
        "final error",
        "merges / pulls",
        "acc. rate",
        "tokens/s",
    ):
        t.add_column(c, justify="left" if c == "configuration" else "right", no_wrap=True)
    for name, run in study.runs().items():
        r = study.reach(run)
        ratio = (
            f"{r / single_reach:.2f}x"
            if r is not None and single_reach
            else ("-" if r is not None else "")
        )
        finals = [e[-1] for e in study.errors(run)]
        t.add_row(
            name,
            "/".join(str(len(tabs) - 1) for tabs in run.tables)
            if len({len(x) for x in run.tables}) > 1
            else str(len(run.tables[0]) - 1),
            "not reached" if r is None else str(r),
            ratio,
            f"{study.gap(run):+.3f}",
            " / ".join(f"{e:.3f}" for e in finals),
            f"{sum(run.syncs)} / {sum(run.pulls)}" if run.sharing else "-",
            f"{run.acceptance_rate:.3f}",
            f"{run.goodput:.1f}",
        )
    shared_reach = study.reach(study.shared)
    goal = math.ceil(single_reach / n) if single_reach is not None else None
    if single_reach is None:  # (the single server's final error is 0: not expected)
        verdict = "not decided: the single server itself does not stay within the tolerance"
    elif single_reach == 0:
        verdict = (
            "not decided: the single server starts within the tolerance (its prior already is "
            "that close to what it learns), so there is nothing to reach; pass a smaller "
            "--tolerance or --no-prior"
        )
    elif shared_reach is None:
        verdict = (
            f"goal not met: the {n} sharing replicas do not stay within the tolerance by the end of "
            f"their shares; the single server does after {single_reach} requests"
        )
    else:
        verdict = (
            f"{n} sharing replicas reach it after {shared_reach} requests each, the single server "
            f"after {single_reach}: goal (<= ceil({single_reach}/{n}) = {goal}) "
            + ("met" if shared_reach <= goal else "not met")
        )
    verdict += (
        f"\nlearning curves: the {n} sharing replicas' error after n requests each is "
        f"{study.gap(study.shared):+.3f} on average from the single server's after {n}·n "
        f"(replicas alone: {study.gap(study.alone):+.3f})"
    )
    floor = study.order_floor
    if tol < floor:
        verdict += (
            f"\n(the tolerance is below the order floor {floor:.3f}: one server over the same "
            "requests in the reverse order ends that far from the single server; a --tolerance "
            "at or above it asks only what the trace can tell)"
        )
    t.caption = (
        "error: mean absolute difference, over proposers and positions weighted by the single "
        "server's judged draft positions, between a replica's learned acceptance (posterior means "
        "averaged over context cells) and the single server's after all requests; reach: requests "
        "per replica after which every replica stays within the tolerance; gap at N·n: the worst "
        "replica's error after n requests minus the single server's after N·n (N replicas), averaged "
        "over n (about 0: as fast as one server in total requests). Round-robin split by "
        f"arrival; tokens/s: all replicas' tokens over the simulated time until the last finished. "
        f"Order floor (the reverse-order server's final error): {floor:.3f}.\n"
        f"verdict: {verdict}"
    )
    console.print(t)
    m = min(len(x) for run in study.runs().values() for x in run.tables) - 1
    pts = _checkpoints(m)
    e = Table(title="worst replica's error after n requests per replica")
    e.add_column("configuration", no_wrap=True)
    for x in pts:
        e.add_column(f"n={x}", justify="right")
    for name, run in study.runs().items():
        w = study.worst(run)
        e.add_row(name, *(f"{w[x]:.3f}" for x in pts))
    console.print(e)
    a = Table(
        title="learned acceptance at the end per proposer and position (mean over replicas; "
        "conditional on the earlier positions accepted)"
    )
    a.add_column("proposer", no_wrap=True)
    a.add_column("configuration", no_wrap=True)
    k = study.reference.shape[1]
    for j in range(k):
        a.add_column(str(j + 1), justify="right")
    for p, prop in enumerate(study.proposers):
        if not study.weights[p].any():
            continue
        for name, run in study.runs().items():
            vals = study.final_learned(run)[p]
            a.add_row(prop, name, *("-" if math.isnan(v) else f"{v:.3f}" for v in vals))
        a.add_row(prop, "judged positions (1 server)", *(str(int(x)) for x in study.weights[p]))
        a.add_section()
    console.print(a)


def plot_study(study: Any, path: Path, policy: str) -> Path:
    """Error against the single server's final learned acceptance vs requests per replica: one
    server, the sharing replicas' and the lone replicas' worst replica, and the tolerance."""
    from adaptive_spec.commands.plots import _plt, save_figure

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, run in study.runs().items():
        w = study.worst(run)
        ax.plot(range(len(w)), w, marker="." if len(w) < 80 else None, label=name)
    ax.axhline(study.tolerance, color="gray", ls="--", lw=1, label=f"tolerance {study.tolerance:g}")
    ax.set_xlabel("requests completed per replica")
    ax.set_ylabel("error vs single server's final (worst replica)")
    ax.set_title(f"Learned acceptance, data-parallel replicas ({policy})")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
