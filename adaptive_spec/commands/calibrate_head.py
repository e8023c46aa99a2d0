"""``adaptive-spec calibrate --head-prior``: learn a drafter's acceptance prior in an engine with it.

The lookup prior (``calibrate --prior``) is learned in an engine without a drafter, so it holds
nothing for the ``draft`` arm, and a controller without a prior for it starts from the generic one
(:data:`adaptive_spec.core.acceptance.PRIOR_FIRST`) and can take long to find out that the head pays. This
builds the engine with the drafter (the shipped EAGLE-3 head unless ``--draft-model``), runs the
held-out prompts (:data:`adaptive_spec.commands.workloads.PRIOR_SKIP`) greedy and at temperature 1.0
under an adaptive controller over none, n-gram, Jacobi and the drafter with epsilon-greedy exploration
at epsilon 1 (each request-step plays an arm drawn uniformly from those its offered drafts allow, so
the drafter is tried at every k, in every context), and keeps the drafter's row of its counts as a
drafter prior (:mod:`adaptive_spec.core.priors`), keyed on the model, dtype and the drafter's
directory name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_spec.core.paths import PACKAGE_DATA

#: Every request-step explores: the prior needs the drafter at every k, not the best arm.
EPSILON = 1.0


@dataclass
class DrafterPrior:
    """A learned drafter prior.

    Attributes
    ----------
    state : dict
        Acceptance state (:meth:`~adaptive_spec.core.acceptance.AcceptanceModel.state_dict`) with the one
        row ``draft``, its counts turned into the prior.
    key : dict
        The engine's prior key (:func:`adaptive_spec.core.priors.prior_key`), naming the drafter.
    observed : float
        Discounted observations of the drafter's draft tokens, all positions.
    first : float
        Acceptance of the drafter's first draft token over the run (both temperatures).
    seconds : float
        Wall time of the generation (s).
    """

    state: dict[str, Any]
    key: dict[str, Any]
    observed: float
    first: float
    seconds: float


def learn_drafter_prior(
    llm: Any,
    prompt_ids: list[list[int]],
    *,
    max_tokens: int,
    strength: float,
    seed: int = 0,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    progress: bool = True,
) -> DrafterPrior:
    """Run ``prompt_ids`` on ``llm`` (an engine with a drafter) at each temperature under the
    exploring controller (see the module docstring) and return the drafter's prior.

    Raises
    ------
    ValueError
        If ``llm`` has no drafter (a method of :data:`adaptive_spec.vllm.checks.DRAFT_METHODS`).
    """
    from adaptive_spec.core.controller import AdaptiveController
    from adaptive_spec.core.priors import DRAFTER_ROW, select_rows
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.checks import DRAFT_METHODS
    from adaptive_spec.vllm.engine import request_seed, sampling_params

    proposers = ["none", "ngram", "jacobi", DRAFTER_ROW]
    spec_config = llm.llm_engine.vllm_config.speculative_config
    method = getattr(spec_config, "method", None)
    if method not in DRAFT_METHODS:
        raise ValueError(
            f"the engine has no drafter (speculative method {method!r}); build it with a method "
            f"among {', '.join(DRAFT_METHODS)}"
        )
    policy = AdaptiveController(
        proposers,
        int(spec_config.num_speculative_tokens),
        exploration="eps-greedy",
        epsilon=EPSILON,
        seed=seed,
    )
    spec = AdaptiveSpec(llm, proposers, policy=policy, calibrate=False, prior=False, seed=seed)
    key = spec.prior_key
    t0 = time.perf_counter()
    try:
        for temp in temperatures:
            llm.generate(
                [{"prompt_token_ids": t} for t in prompt_ids],
                sampling_params(temperature=temp, max_tokens=max_tokens, seed=request_seed(seed)),
                use_tqdm=progress,
            )
    finally:
        spec.detach()
    acc = policy.acceptance
    row = acc.proposers.index(DRAFTER_ROW)
    observed = float(acc.tri[row].sum())
    first = float(acc.acc[row, ..., 0].sum() / max(acc.tri[row, ..., 0].sum(), 1e-9))
    acc.set_prior_from_counts(strength)
    state = select_rows(acc.state_dict(), {DRAFTER_ROW: DRAFTER_ROW})
    return DrafterPrior(state, key, observed, first, time.perf_counter() - t0)


def learn_head_prior(args: argparse.Namespace) -> int:
    """``calibrate --head-prior``: learn the drafter prior (see the module docstring) and write it
    (and with ``--ship`` into the package); returns the exit status (2 after one line on stderr for a
    drafter that cannot be had)."""
    from rich.console import Console

    from adaptive_spec.commands.run import build_engine, encode_prompts, resolve_drafts
    from adaptive_spec.commands.workloads import PRIOR_SKIP, load_workload
    from adaptive_spec.core.machine import key_slug
    from adaptive_spec.core.priors import DRAFTER_FIELD, DRAFTER_ROW, prior_document
    from adaptive_spec.core.state import write_policy_state

    console = Console()
    try:
        proposers, _ = resolve_drafts(args, ["none", "ngram", "jacobi", DRAFTER_ROW])
    except (ValueError, FileNotFoundError) as e:
        print(f"adaptive-spec calibrate: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"building the engine with the drafter {args.draft_model} ...")
    llm = build_engine(args, proposers)
    prompts = load_workload("mixed", args.prior_prompts, seed=args.seed, skip=PRIOR_SKIP)
    console.print(
        f"drafter prior: {len(prompts)} held-out prompts, {args.prior_max_tokens} tokens each, "
        "greedy and at temperature 1"
    )
    try:
        got = learn_drafter_prior(
            llm,
            encode_prompts(llm, prompts),
            max_tokens=args.prior_max_tokens,
            strength=args.prior_strength,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"adaptive-spec calibrate: error: {e}", file=sys.stderr)
        return 2
    key = got.key
    info = {
        "prompts": [p.source_id for p in prompts],
        "skip": PRIOR_SKIP,
        "max_tokens": args.prior_max_tokens,
        "temperatures": [0.0, 1.0],
        "exploration": f"eps-greedy, epsilon {EPSILON:g}",
        "observations": round(got.observed, 1),
        "first_position_acceptance": round(got.first, 4),
        "strength": args.prior_strength,
        "seconds": round(got.seconds, 1),
        "created": time.strftime("%Y-%m-%d"),
    }
    doc = json.dumps(prior_document(got.state, key, info), indent=1)
    written = [out / f"prior-{key_slug(key)}-{key[DRAFTER_FIELD]}.json"]
    write_policy_state(doc, written[0])
    if args.ship:
        ship = PACKAGE_DATA / "priors" / f"{key['model']}-{key['dtype']}-{key[DRAFTER_FIELD]}.json"
        write_policy_state(doc, ship)
        written.append(ship)
    console.print(
        f"drafter prior: {got.observed:.0f} discounted observations of the drafter's draft tokens "
        f"in {got.seconds:.0f} s; acceptance at position 1 {got.first:.3f} (both temperatures)"
    )
    console.print("written: " + ", ".join(str(p) for p in written))
    return 0
