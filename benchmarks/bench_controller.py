"""Micro-benchmark: the adaptive controller's hot path, microseconds per engine step.

Times ``decide`` + ``observe`` of :class:`adaptive_spec.core.controller.AdaptiveController` on synthetic
steps shaped like the embedded default's traffic (max k 8; an n-gram draft for 30 % of the requests,
suffix-like drafts for 60 %, Jacobi drafts for the requests whose argmax rows were recorded), at batch
sizes 1, 4, 16, 64 and 256. The views, drafts and outcomes are built before the clock starts; only
the two calls are timed. Prints the median and the 90th percentile over the timed steps (wall time;
``--cpu``: the thread's CPU time, which a busy machine disturbs less; ``--cold``: 128 MB are read
before each timed call, so that the caches are as cold as after an engine's forward pass).

    python benchmarks/bench_controller.py [--steps 400] [--batches 1,4,16,64,256] [--cold] [--json out.json]

The step driver around the policy (proposers, trace, metrics) is timed with ``--driver``: the same
steps through :class:`adaptive_spec.core.driver.StepDriver` with external drafts.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.driver import LiveRequest, StepDriver, VerifiedRequest
from adaptive_spec.core.protocol import RequestOutcome, RequestView, StepOutcome, StepView

K = 8
# --cpu: time.thread_time (CPU time of this thread: robust to a busy machine)
_clock = time.perf_counter
# --cold: an array the size of a forward pass's working set, read before each timed call
_evict: np.ndarray | None = None


def _cold() -> None:
    if _evict is not None:
        _evict.sum()


PROPOSERS = ["ngram", "jacobi"]
COVER = {"ngram": 0.3, "jacobi": 0.5}
ACCEPT = {"ngram": 0.7, "jacobi": 0.1}


def make_steps(batch: int, steps: int, seed: int = 0) -> list[tuple[list[RequestView], dict]]:
    """Pre-built views and the true continuations (the outcome of any decision follows from them)."""
    rng = np.random.default_rng(seed)
    pos = np.zeros(batch, dtype=np.int64)
    out = []
    for _ in range(steps):
        truth = rng.integers(0, 49_000, size=(batch, K + 1))
        views = []
        for i in range(batch):
            v = RequestView(f"r{i}", int(pos[i]), 100_000, 0.0)
            for p in PROPOSERS:
                if rng.random() < COVER[p]:
                    n = int(rng.integers(1, K + 1))
                    ok = np.cumprod(rng.random(n) < ACCEPT[p]) > 0
                    v.drafts[p] = np.where(ok, truth[i, :n], truth[i, :n] + 1).astype(np.int64)
                    v.match_lengths[p] = int(rng.integers(2, 5))
            views.append(v)
        out.append((views, {"truth": truth}))
        pos += 1  # positions advance by at least one; exact positions matter only for bookkeeping
    return out


def outcome_of(views: list[RequestView], arms, truth: np.ndarray) -> StepOutcome:
    outs = []
    verified = 0
    for i, (v, a) in enumerate(zip(views, arms, strict=True)):
        if a.k:
            d = v.drafts[a.proposer][: a.k]
            m = int(np.argmin(np.append(d == truth[i, : len(d)], False)))
            verified += len(d)
        else:
            m = 0
        outs.append(RequestOutcome(v.req_id, a, a.k, m, [int(t) for t in truth[i, : m + 1]]))
    return StepOutcome(outs, 0.02 + 0.001 * len(views) + 0.00035 * verified, len(views), verified)


def time_policy(batch: int, steps: int, warmup: int = 50) -> dict[str, float]:
    ctrl = AdaptiveController(PROPOSERS, K, seed=0)
    data = make_steps(batch, steps + warmup)
    pos = {f"r{i}": 0 for i in range(batch)}  # tokens committed so far, as the engine reports them
    times = []
    for t, (views, info) in enumerate(data):
        for v in views:
            v.num_output_tokens = pos[v.req_id]
        _cold()
        t0 = _clock()
        dec = ctrl.decide(StepView(views, batch_size=batch))
        t1 = _clock()
        outcome = outcome_of(views, dec.arms, info["truth"])
        _cold()
        t2 = _clock()
        ctrl.observe(outcome)
        t3 = _clock()
        for o in outcome.requests:
            pos[o.req_id] += len(o.emitted_token_ids)
        if t >= warmup:
            times.append((t1 - t0) + (t3 - t2))
    us = 1e6 * np.asarray(times)
    return {
        "batch": batch,
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
    }


def time_driver(batch: int, steps: int, warmup: int = 50) -> dict[str, float]:
    ctrl = AdaptiveController(PROPOSERS, K, seed=0)
    drv = StepDriver(ctrl, {}, max_k=K, vocab_size=49_152, external=PROPOSERS)
    for i in range(batch):
        drv.add_request(f"r{i}", list(range(32)))
    data = make_steps(batch, steps + warmup, seed=1)
    n_out = dict.fromkeys((f"r{i}" for i in range(batch)), 0)
    times = []
    for t, (views, info) in enumerate(data):
        ext = {p: {v.req_id: v.drafts[p] for v in views if p in v.drafts} for p in PROPOSERS}
        match = {
            p: {v.req_id: v.match_lengths[p] for v in views if p in v.drafts} for p in PROPOSERS
        }
        live = [LiveRequest(v.req_id, n_out[v.req_id], 100_000) for v in views]
        _cold()
        t0 = _clock()
        dec = drv.decide(live, batch_size=batch, external_drafts=ext, external_match=match)
        t1 = _clock()
        truth = info["truth"]
        verified = []
        for i, (d, _a) in enumerate(zip(dec.drafts, dec.arms, strict=True)):
            m = int(np.argmin(np.append(np.asarray(d) == truth[i, : len(d)], False))) if d else 0
            em = [int(x) for x in truth[i, : m + 1]]
            n_out[dec.req_ids[i]] += len(em)
            verified.append(VerifiedRequest(dec.req_ids[i], len(d), m, em))
        v_tot = sum(len(d) for d in dec.drafts)
        _cold()
        t2 = _clock()
        drv.observe(verified, step_time_s=0.02, batch_size=batch, num_verified_tokens=v_tot)
        t3 = _clock()
        if t >= warmup:
            times.append((t1 - t0) + (t3 - t2))
    us = 1e6 * np.asarray(times)
    return {
        "batch": batch,
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--steps", type=int, default=400, help="timed steps per batch size (default 400)"
    )
    ap.add_argument(
        "--batches", default="1,4,16,64,256", help="batch sizes (default 1,4,16,64,256)"
    )
    ap.add_argument(
        "--driver", action="store_true", help="also time the step driver around the policy"
    )
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="time with this thread's CPU time instead of wall time (for a machine that is busy)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="read 128 MB before each timed call, as an engine step's forward pass does: the caches "
        "are then cold, which is what the controller meets inside the engine",
    )
    args = ap.parse_args()
    global _clock, _evict
    if args.cpu:
        _clock = time.thread_time
    if args.cold:
        _evict = np.ones(16 << 20)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    rows = []
    print(
        f"{'batch':>6} {'decide+observe median (us)':>28} {'p90 (us)':>10}"
        + (f" {'driver median (us)':>20} {'p90 (us)':>10}" if args.driver else "")
    )
    for b in batches:
        r = time_policy(b, args.steps)
        if args.driver:
            d = time_driver(b, args.steps)
            r["driver_median_us"], r["driver_p90_us"] = d["median_us"], d["p90_us"]
        rows.append(r)
        line = f"{b:>6} {r['median_us']:>28.1f} {r['p90_us']:>10.1f}"
        if args.driver:
            line += f" {r['driver_median_us']:>20.1f} {r['driver_p90_us']:>10.1f}"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
