"""Where the controller's time goes inside the engine: microseconds per engine step of each hook.

Builds the embedded default engine (compiled, as a user runs it), decodes the mixed workload at one
concurrency, untraced, with the adaptive controller and with a static n-gram arm in turn (interleaved,
``--repeats`` times, greedy and sampled), and prints, per run, the step time, the controller overhead
that ``AdaptiveSpec.stats()`` reports and the wall time spent per engine step in each hook and in the
functions they call (cumulative: ``driver.decide`` contains ``ctrl.decide`` and the proposers,
``ctrl.observe`` contains ``cost.update``, which contains ``cost.refresh``):

* ``_assign_drafts``: after a step, the next decision (``driver.decide``: the proposers' drafts,
  ``ctrl.decide``, cutting drafts to k);
* ``_post_update``: after the scheduler's update, the outcome (``driver.observe``: metrics,
  ``ctrl.observe``: learning, the cost model, the safety rule's counterfactual);
* ``_pre_update``: before the scheduler's update (which requests ran, what was verified);
* ``_record_argmax``: the target's argmax rows for Jacobi.

    python scripts/hook_profile.py [--concurrency 16] [--prompts 32] [--max-tokens 64] [--repeats 2]

The wrappers cost about a microsecond per call. Run it on a quiet machine (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

from adaptive_spec.commands.run import _positive_int

TIMED = (
    ("adaptive_spec.core.driver", "StepDriver", "decide", "driver.decide"),
    ("adaptive_spec.core.driver", "StepDriver", "observe", "driver.observe"),
    ("adaptive_spec.core.controller", "AdaptiveController", "decide", "ctrl.decide"),
    ("adaptive_spec.core.controller", "AdaptiveController", "observe", "ctrl.observe"),
    ("adaptive_spec.core.cost_model", "StepCostModel", "update", "cost.update"),
    ("adaptive_spec.core.cost_model", "StepCostModel", "refresh", "cost.refresh"),
    ("adaptive_spec.proposers.ngram", "NgramProposer", "propose", "ngram.propose"),
    ("adaptive_spec.proposers.jacobi", "JacobiProposer", "propose", "jacobi.propose"),
    ("adaptive_spec.vllm.hooks", "StepHooks", "_pre_update", "_pre_update"),
    ("adaptive_spec.vllm.hooks", "StepHooks", "_post_update", "_post_update"),
    ("adaptive_spec.vllm.hooks", "StepHooks", "_assign_drafts", "_assign_drafts"),
    ("adaptive_spec.vllm.hooks", "StepHooks", "_record_argmax", "_record_argmax"),
)


def instrument(totals: dict[str, list[float]]) -> None:
    """Wrap each function of :data:`TIMED` so that its calls and wall time add up in ``totals``."""
    import importlib

    for module, cls_name, name, label in TIMED:
        cls = getattr(importlib.import_module(module), cls_name)
        orig = getattr(cls, name)

        def timed(*a: Any, _orig=orig, _label=label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                s = totals[_label]
                s[0] += 1
                s[1] += time.perf_counter() - t0

        setattr(cls, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--concurrency", type=_positive_int, default=16, help="max_num_seqs (default 16)"
    )
    ap.add_argument(
        "--prompts", type=_positive_int, default=32, help="mixed-workload prompts (default 32)"
    )
    ap.add_argument(
        "--max-tokens", type=_positive_int, default=64, help="output tokens each (default 64)"
    )
    ap.add_argument(
        "--repeats", type=_positive_int, default=2, help="runs of each policy (default 2)"
    )
    ap.add_argument(
        "--static",
        default="static:ngram:2",
        help="the static arm to compare with (default static:ngram:2)",
    )
    args = ap.parse_args()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    instrument(totals)
    from vllm import SamplingParams

    from adaptive_spec.commands.compare_static import static_proposers
    from adaptive_spec.commands.workloads import chat_token_ids, load_workload
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.engine import build_llm

    llm = build_llm(None, max_k=8, concurrency=args.concurrency, method="ngram")
    prompts = load_workload("mixed", args.prompts, seed=0)
    batch = [
        {"prompt_token_ids": t}
        for t in chat_token_ids(llm.get_tokenizer(), [p.text for p in prompts])
    ]
    every = ["none", "ngram", "jacobi"]
    with AdaptiveSpec(llm, ["none"], policy="none", calibrate=False):  # prefix cache, warm-up
        llm.generate(batch, SamplingParams(max_tokens=1), use_tqdm=False)
    print(f"c={args.concurrency}, {args.prompts} prompts x {args.max_tokens} tokens, untraced")
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=0)
        for rep in range(args.repeats):
            for policy in ("adaptive", args.static):
                props = every if policy == "adaptive" else static_proposers(policy, every)
                totals.clear()
                # No saved state is loaded or written (each adaptive run starts from the shipped prior).
                spec = AdaptiveSpec(llm, props, policy=policy, policy_state=None)
                try:
                    llm.generate(batch, params, use_tqdm=False)
                finally:
                    spec.detach()
                st = spec.stats()
                n = max(st["steps"], 1)
                parts = ", ".join(f"{k} {1e6 * s / n:.0f}" for k, (_, s) in sorted(totals.items()))
                print(
                    f"T={temperature:g} {policy} #{rep + 1}: {n} steps of "
                    f"{1e3 * st['step_time_s'] / n:.1f} ms, controller overhead "
                    f"{100 * st['controller_overhead']:.2f} %\n    us per step: {parts}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
