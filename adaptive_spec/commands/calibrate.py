"""``adaptive-spec calibrate``: measure this machine's step-cost table, and optionally an acceptance prior.

1. Builds the engine (the embedded default unless ``--model``), attaches the controller with
   ``calibrate=True`` and writes the measured step-cost table (batch size x draft tokens verified;
   ``adaptive_spec.vllm.calibrate``) to ``--out`` and to the cache, where every later attach on this
   machine, model, dtype and thread count finds it.
2. With ``--prior``: runs the adaptive controller on prompts that the benchmarks and the main job never
   use (each category's items after the first ``PRIOR_SKIP``), greedy and at temperature 1.0, and
   writes its acceptance counts as a prior (``adaptive_spec.core.priors``): each context cell's mean with at
   most ``--prior-strength`` pseudo-observations.

With ``--head-prior`` it does neither, and instead learns the **drafter prior**: the acceptance by draft
position of the drafter (the shipped EAGLE-3 head, or ``--draft-model``), in an engine built with it,
on the same held-out prompts, greedy and at temperature 1.0. The controller there runs the proposers
none, n-gram, Jacobi and the drafter with epsilon-greedy exploration at epsilon 1 (every request-step
plays an arm drawn uniformly, so the drafter is tried at every k in every context), and only the
drafter's row is kept (arms drawn at random need no step-cost table).

``--ship`` writes the files into the package's data directory (``adaptive_spec/data/cost_tables`` and
``adaptive_spec/data/priors``), which is how the embedded default's files were made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from adaptive_spec.commands.run import _positive_int, add_engine_args, setup_logging
from adaptive_spec.core.paths import PACKAGE_DATA


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's step-cost table (and with --prior an acceptance prior)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="runs/calibrate", help="output directory (default runs/calibrate)"
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="measurements per (batch size, draft tokens) cell (default 5)",
    )
    p.add_argument(
        "--prompt-len",
        type=_positive_int,
        default=None,
        help="middle dummy prompt length in tokens (default 192, near the median context of a "
        "decode step on the mixed workload); a batch's prompts spread from a quarter to 4.5 times "
        "it, as real prompts do: a draft token's price grows with the context and with the spread",
    )
    p.add_argument(
        "--prior", action="store_true", help="also learn an acceptance prior on held-out prompts"
    )
    p.add_argument(
        "--prior-prompts",
        type=_positive_int,
        default=48,
        help="held-out mixed prompts for the prior (default 48)",
    )
    p.add_argument(
        "--prior-max-tokens",
        type=_positive_int,
        default=192,
        help="output tokens per prompt for the prior (default 192)",
    )
    p.add_argument(
        "--prior-strength",
        type=float,
        default=20.0,
        help="largest pseudo-observation count of a prior cell (default 20)",
    )
    p.add_argument(
        "--head-prior",
        action="store_true",
        help="instead of the table and the lookup prior, learn the drafter's acceptance prior (the "
        "shipped EAGLE-3 head, or --draft-model) in an engine with it, on the held-out prompts, with "
        "arms drawn at random; the drafter's arms (draft, lora:<name>) start from it",
    )
    p.add_argument(
        "--ship",
        action="store_true",
        help="write the table and the prior into the package data directory (for maintainers)",
    )
    add_engine_args(p)
    p.set_defaults(func=main, proposers="none,ngram,jacobi")


def main(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    if not (args.prior_strength > 0):
        print(
            f"adaptive-spec calibrate: error: --prior-strength={args.prior_strength} is invalid; "
            "allowed: a number > 0",
            file=sys.stderr,
        )
        return 2
    unused = [
        f"{flag}={value}"
        for flag, value, default in (
            ("--proposers", args.proposers, "none,ngram,jacobi"),
            ("--draft-model", None if args.head_prior else args.draft_model, None),
            ("--lora-adapter", args.lora_adapter or None, None),
        )
        if value != default
    ]
    if unused:
        print(
            f"adaptive-spec calibrate: error: {', '.join(unused)} is not supported: calibrate measures "
            "the engine without a drafter and learns the prior for the proposers none,ngram,jacobi; "
            "leave these flags out (--head-prior learns the drafter's prior: the shipped head, or "
            "--draft-model)",
            file=sys.stderr,
        )
        return 2
    if args.head_prior:
        if args.prior:
            print(
                "adaptive-spec calibrate: error: --prior with --head-prior is not supported: they "
                "need different engines; run calibrate --prior, then calibrate --head-prior",
                file=sys.stderr,
            )
            return 2
        from adaptive_spec.commands.calibrate_head import learn_head_prior

        return learn_head_prior(args)
    from rich.console import Console

    from adaptive_spec.commands.run import build_engine, encode_prompts
    from adaptive_spec.commands.workloads import PRIOR_SKIP, load_workload
    from adaptive_spec.core.cost_tables import save_cached_table
    from adaptive_spec.core.machine import key_slug
    from adaptive_spec.core.priors import prior_document
    from adaptive_spec.core.state import write_policy_state
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.engine import request_seed, sampling_params

    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proposers = ["none", "ngram", "jacobi"]
    args.draft_model = None
    console.print("building the engine...")
    llm = build_engine(args, proposers)
    t0 = time.perf_counter()
    spec = AdaptiveSpec(
        llm, proposers, policy="adaptive", policy_state=None, calibrate=False, prior=False
    )
    try:
        table = spec.calibrate(repeats=args.repeats, prompt_len=args.prompt_len)
    finally:
        spec.detach()
    calib_s = time.perf_counter() - t0
    key = table.key
    slug = key_slug(key)
    doc = json.dumps(table.to_dict(), indent=1)
    (out / f"cost_table-{slug}.json").write_text(doc)
    save_cached_table(table)
    console.print(
        f"step-cost table: {calib_s:.1f} s; at batch 4: {1e3 * table.predict(4, 0):.1f} ms without "
        f"drafts, +{1e3 * table.speculation_overhead(4):.2f} ms to speculate at all, "
        f"{1e3 * (table.predict(4, 16) - table.predict(4, 0)):.1f} ms more for 16 draft tokens"
    )
    if table.sampled is not None:
        console.print(
            f"sampled (temperature > 0): at batch 4, +{1e3 * table.speculation_overhead(4, True):.2f} "
            f"ms to speculate at all, "
            f"{1e3 * (table.predict(4, 16, sampled=1) - table.predict(4, 0, sampled=1)):.1f} ms more "
            "for 16 draft tokens"
        )
    written = [out / f"cost_table-{slug}.json"]
    if args.ship:
        ship = PACKAGE_DATA / "cost_tables" / f"{slug}.json"
        ship.parent.mkdir(parents=True, exist_ok=True)
        write_policy_state(doc, ship)
        written.append(ship)
    if args.prior:
        prompts = load_workload("mixed", args.prior_prompts, seed=args.seed, skip=PRIOR_SKIP)
        ids = encode_prompts(llm, prompts)
        spec = AdaptiveSpec(
            llm,
            proposers,
            policy="adaptive",
            policy_state=None,
            cost_table=table,
            prior=False,
            seed=args.seed,
        )
        try:
            for temp in (0.0, 1.0):
                console.print(f"prior: {len(ids)} held-out prompts at temperature {temp:g}")
                llm.generate(
                    [{"prompt_token_ids": t} for t in ids],
                    sampling_params(
                        temperature=temp,
                        max_tokens=args.prior_max_tokens,
                        seed=request_seed(args.seed),
                    ),
                    use_tqdm=True,
                )
        finally:
            spec.detach()
        acc = spec.policy.acceptance
        observed = float(acc.tri.sum())
        acc.set_prior_from_counts(args.prior_strength)
        info = {
            "prompts": [p.source_id for p in prompts],
            "skip": PRIOR_SKIP,
            "max_tokens": args.prior_max_tokens,
            "temperatures": [0.0, 1.0],
            "observations": round(observed, 1),
            "strength": args.prior_strength,
            "created": time.strftime("%Y-%m-%d"),
        }
        pdoc = json.dumps(prior_document(acc.state_dict(), key, info), indent=1)
        (out / f"prior-{slug}.json").write_text(pdoc)
        written.append(out / f"prior-{slug}.json")
        if args.ship:
            pship = PACKAGE_DATA / "priors" / f"{key['model']}-{key['dtype']}.json"
            pship.parent.mkdir(parents=True, exist_ok=True)
            write_policy_state(pdoc, pship)
            written.append(pship)
    console.print("written: " + ", ".join(str(p) for p in written))
    return 0
