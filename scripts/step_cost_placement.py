"""Measure whether a step's verification cost depends on where its draft tokens go, or only on their total.

    python scripts/step_cost_placement.py --batch 4 --repeats 40

Runs ``--batch`` dummy requests (random prompts of ``--prompt-len`` tokens, ``ignore_eos``) in the
embedded default engine and, at every decode step, gives them junk draft tokens (which the target
rejects, so every step commits one token per request) in one of several placements: ``1,1,1,1`` (one
draft token on each of four requests) against ``4,0,0,0`` (four on one), and so on. The placements
are shuffled within each repeat, so drift in machine speed spreads over all of them. Each step is
timed as the controller times it (from one ``update_from_output`` to the next). Prints, per
placement, the median step time, its difference from the step without drafts and the interquartile
range; then a least squares fit of step time on [1, V] per quarter of the run (the context grows by
one token per step). Nothing is learned by a controller.

Used for the step-cost measurements behind the shipped tables (``docs/results.md``).
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import numpy as np

from adaptive_spec.commands.run import _positive_int, add_engine_args, build_engine
from adaptive_spec.vllm import AdaptiveSpec
from adaptive_spec.vllm import calibrate as cal_mod

DEFAULT_PLACEMENTS = "0;1;1,1;1,1,1,1;4;2,2;3,1;2,2,2,2;4,4;8;4,4,4,4"


class PlacedDrafts(cal_mod.Calibration):
    """Junk drafts placed per request as planned (one tuple of k per step), and samples tagged with
    the placement the timed step verified."""

    def drafts(self, live: list[Any]) -> tuple[list[str], list[list[int]]]:
        live = [r for r in live if r.request_id in self.req_ids]
        if not live:
            return [], []
        placement = self.plan[self.step % len(self.plan)]
        self.current = placement
        self.step += 1
        ids, out = [], []
        for i, r in enumerate(live):
            k = placement[i] if i < len(placement) else 0
            last = int(r.all_token_ids[-1]) if r.num_tokens else 0
            out.append([(last + 7919 * (j + 1)) % self.vocab_size for j in range(k)])
            ids.append(r.request_id)
        return ids, out

    def record(self, batch_size: int, verified: int, prefill: int, step_time_s: float) -> None:
        placement = getattr(self, "current", None)
        if prefill == 0 and placement is not None and sum(placement) == verified:
            self.samples.append((placement, step_time_s))


def _placements(text: str, batch: int) -> list[tuple[int, ...]]:
    out = []
    for part in text.split(";"):
        ks = tuple(int(x) for x in part.split(",") if x.strip())
        if len(ks) > batch or any(k < 0 for k in ks):
            raise SystemExit(
                f"--placements: {part!r} is invalid; allowed: at most --batch={batch} "
                "non-negative integers separated by ','"
            )
        out.append(ks + (0,) * (batch - len(ks)))
    if (0,) * batch not in out:
        out.insert(0, (0,) * batch)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--batch", type=_positive_int, default=4, help="dummy requests decoded together"
    )
    ap.add_argument(
        "--repeats", type=_positive_int, default=40, help="steps per placement (default 40)"
    )
    ap.add_argument(
        "--prompt-len", type=_positive_int, default=32, help="dummy prompt tokens (default 32)"
    )
    ap.add_argument(
        "--placements",
        default=DEFAULT_PLACEMENTS,
        help="draft tokens per request, placements separated by ';' (default %(default)s; "
        "no drafts is always added)",
    )
    add_engine_args(ap)
    args = ap.parse_args()
    args.concurrency = max(args.concurrency, args.batch)
    args.draft_model = None
    plans = _placements(args.placements, args.batch)
    if max(max(p) for p in plans) > args.max_k:
        raise SystemExit(f"--placements: a k above --max-k={args.max_k}; raise --max-k")
    llm = build_engine(args, ["none", "ngram"])
    spec = AdaptiveSpec(
        llm, ["none", "ngram"], policy="adaptive", policy_state=None, calibrate=False, prior=False
    )
    rng = np.random.default_rng(args.seed)
    cal = PlacedDrafts(spec.max_k, spec.vocab_size)
    for _ in range(args.repeats):
        order = list(plans)
        rng.shuffle(order)
        cal.plan += order
    core, sched = spec.core, spec.core.scheduler
    ids = [f"adaptive-spec-calibration-{uuid.uuid4().hex[:12]}" for _ in range(args.batch)]
    cal.req_ids = set(ids)
    spec.hooks.calibration = cal
    try:
        for rid in ids:
            prompt = [
                int(t) for t in rng.integers(100, spec.vocab_size - 100, size=args.prompt_len)
            ]
            req = core.preprocess_add_request(cal_mod._request(rid, prompt, len(cal.plan) + 3))
            core.add_request(*req) if isinstance(req, tuple) else core.add_request(req)
        t0 = time.perf_counter()
        while sched.has_requests() and cal.step < len(cal.plan):
            _, executed = core.step()
            core.post_step(executed)
        wall = time.perf_counter() - t0
    finally:
        spec.hooks.calibration = None
        spec.detach()
    by: dict[tuple[int, ...], list[float]] = {}
    for placement, s in cal.samples:
        by.setdefault(placement, []).append(1e3 * s)
    base = float(np.median(by[(0,) * args.batch]))
    print(
        f"batch {args.batch}, prompts of {args.prompt_len} tokens, {len(cal.samples)} decode steps "
        f"in {wall:.1f} s"
    )
    print(f"{'placement':>16} {'V':>3} {'n':>4} {'median ms':>10} {'+ms':>7} {'IQR ms':>14}")
    for p in plans:
        x = by.get(p, [])
        if not x:
            continue
        q1, q3 = np.percentile(x, [25, 75])
        med = float(np.median(x))
        label = ",".join(map(str, p))
        print(
            f"{label:>16} {sum(p):>3} {len(x):>4} {med:>10.2f} {med - base:>+7.2f} {q1:>6.2f}-{q3:<6.2f}"
        )
    n = len(cal.samples)
    for q in range(4):
        part = cal.samples[q * n // 4 : (q + 1) * n // 4]
        X = np.array([[1.0, sum(p)] for p, _ in part])
        y = np.array([1e3 * s for _, s in part])
        c0, c1 = np.linalg.lstsq(X, y, rcond=None)[0]
        print(f"quarter {q + 1}: {c0:.2f} ms + {c1:.2f} ms per draft token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
