"""``adaptive-spec record``: add counterfactual drafts to a trace, or record a synthetic trace.

* ``adaptive-spec record TRACE [--out OUT]``: recompute the n-gram proposer's draft at every output
  position of every request (and, with ``--draft-model DIR``, a draft model's greedy drafts from one
  teacher-forced pass per request) and store them in the trace as ``"counterfactual"`` lines, so that
  ``adaptive-spec replay`` can score any (proposer, k) at any position. Prints how often the
  recomputed n-gram drafts equal the ones the engine logged.
* ``adaptive-spec record --synthetic WORKLOAD --out OUT``: simulate a policy over a synthetic
  workload (known acceptance processes; no vLLM) and write the run as a trace.

See ``docs/replay.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    from adaptive_spec.sim.synthetic import WORKLOAD_NAMES

    p = sub.add_parser(
        "record",
        help="add counterfactual drafts to a trace (for replay), or record a synthetic trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "trace", nargs="?", default=None, help="trace to complete (omit with --synthetic)"
    )
    p.add_argument("--out", default=None, help="output trace (default: overwrite TRACE)")
    p.add_argument(
        "--ngram-min", type=int, default=2, help="n-gram min_n the engine used (default 2)"
    )
    p.add_argument(
        "--ngram-max", type=int, default=4, help="n-gram max_n the engine used (default 4)"
    )
    p.add_argument(
        "--draft-model", default=None, help="draft model directory (transformers format)"
    )
    p.add_argument(
        "--draft-name", default="draft", help="proposer name of the draft model (default draft)"
    )
    p.add_argument(
        "--synthetic",
        default=None,
        choices=WORKLOAD_NAMES,
        help="record a synthetic workload instead of completing a trace",
    )
    p.add_argument(
        "--policy",
        default="static:ngram:4",
        help="policy of the synthetic run (default static:ngram:4)",
    )
    p.add_argument(
        "--profile",
        default="cpu-smollm2",
        help="cost profile of the synthetic run (default cpu-smollm2)",
    )
    p.add_argument(
        "--max-batch", type=int, default=4, help="batch of the synthetic run (default 4)"
    )
    p.add_argument(
        "--max-k", type=int, default=8, help="largest k of the synthetic run (default 8)"
    )
    p.add_argument(
        "--scale", type=int, default=1, help="multiplies the synthetic workload's requests"
    )
    p.add_argument(
        "--noise", type=float, default=0.03, help="log-normal step-time noise (default 0.03)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.set_defaults(func=main)


def _synthetic(args: argparse.Namespace, console: Any) -> int:
    from adaptive_spec.sim.cost_profiles import get_profile
    from adaptive_spec.sim.policies import build_policy
    from adaptive_spec.sim.synthetic import make_requests, named_workload, record_trace

    if not args.out:
        console.print("[red]error[/]: --synthetic needs --out PATH")
        return 2
    wl = named_workload(args.synthetic, scale=args.scale, seed=args.seed)
    reqs = make_requests(wl.specs, args.max_k, seed=args.seed)
    profile = get_profile(args.profile)
    props = sorted({p for r in reqs for p in r.drafts})
    policy = build_policy(
        args.policy,
        props,
        args.max_k,
        requests=reqs,
        profile=profile,
        max_batch=args.max_batch,
        seed=args.seed,
    )
    path, res = record_trace(
        args.out,
        reqs,
        policy,
        profile,
        max_batch=args.max_batch,
        step_time_noise=args.noise,
        seed=args.seed,
        meta={"workload": args.synthetic},
    )
    console.print(
        f"synthetic trace {path}: {len(reqs)} requests, {res.tokens} tokens, {res.steps} steps, "
        f"policy {policy.name}, goodput {res.goodput:.1f} tokens/s ({profile.name})"
    )
    return 0


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.sim.counterfactual import (
        build_counterfactuals,
        check_logged,
        write_counterfactuals,
    )

    console = Console()
    try:
        if args.synthetic:
            return _synthetic(args, console)
        if not args.trace:
            console.print(
                "[red]error[/]: give a TRACE to complete, or --synthetic WORKLOAD --out PATH"
            )
            return 2
        path = Path(args.trace)
        if not path.exists():
            console.print(f"[red]error[/]: trace {path} does not exist")
            return 2
        trace = read_trace(path)
        draft_fn = None
        if args.draft_model:
            import torch
            from transformers import AutoModelForCausalLM

            from adaptive_spec.sim.counterfactual import torch_causal_lm

            model = AutoModelForCausalLM.from_pretrained(
                args.draft_model, torch_dtype=torch.float32
            )
            model.eval()
            draft_fn = torch_causal_lm(model)
        cf = build_counterfactuals(
            trace,
            min_n=args.ngram_min,
            max_n=args.ngram_max,
            draft_argmax=draft_fn,
            draft_name=args.draft_name,
        )
        out = Path(args.out) if args.out else path
        write_counterfactuals(path, out, cf)
    except ValueError as e:
        console.print(f"[red]error[/]: {e}")
        return 2
    n_req = len(cf.tables)
    n_pos = sum(len(t) for per in cf.tables.values() for t in per.values())
    console.print(
        f"wrote {out}: counterfactual drafts for {n_req} requests ({n_pos} request-positions, proposers "
        f"{', '.join(f'{p} ({s})' for p, s in cf.sources.items()) or 'none'})"
    )
    chk = check_logged(trace, cf, "ngram")
    if chk["compared"]:
        console.print(
            f"n-gram check: recomputed drafts equal the logged ones at {chk['equal']}/{chk['compared']} positions "
            f"(same accepted length at {chk['same_accepted']})"
        )
    return 0
