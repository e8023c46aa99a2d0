"""Speed of the bandit policies: microseconds per choose + update of a batch of requests.

One *step* is what the controller does per engine step: choose an arm for each of ``--batch``
requests (``pull_batch``) and learn their outcomes (``update_batch``; ``update_full`` with every
arm's reward for Hedge). Contextual policies get ``--dim`` features per request. Each
configuration is timed over many steps, interleaved with the others, and the median is reported
(the machine is shared and noisy). river's policies with the same rule, and vowpalwabbit's
``--cb_explore_adf`` if ``import vowpalwabbit`` works, are timed on the same batches one request
at a time (their API is per request).

Usage::

    .venv/bin/python benchmarks/bench_bandits.py            # markdown table on stdout
    .venv/bin/python benchmarks/bench_bandits.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from adaptive_spec.bandits import LogisticThompson, available_policies, make_policy

RIVER_EQUIVALENT = {
    "ucb1": "UCB(delta=1)",
    "epsilon-greedy": "EpsilonGreedy(epsilon=0.1)",
    "thompson-beta": "ThompsonSampling(Beta(1, 1))",
    "exp3": "Exp3(gamma=0.1)",
    "linucb": "LinUCBDisjoint(alpha=1)",
}


def _river_policy(name: str, seed: int) -> Any:
    from river import bandit, proba

    return {
        "ucb1": lambda: bandit.UCB(delta=1, seed=seed),
        "epsilon-greedy": lambda: bandit.EpsilonGreedy(epsilon=0.1, seed=seed),
        "thompson-beta": lambda: bandit.ThompsonSampling(reward_obj=proba.Beta(1, 1), seed=seed),
        "exp3": lambda: bandit.Exp3(gamma=0.1, seed=seed),
        "linucb": lambda: bandit.LinUCBDisjoint(alpha=1.0, seed=seed),
    }[name]()


class Problem:
    """A random contextual Bernoulli problem: P(reward = 1 | x, a) = sigmoid(x . w_a)."""

    def __init__(self, n_arms: int, dim: int, batch: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.w = self.rng.normal(scale=0.5, size=(n_arms, dim))
        self.n_arms, self.dim, self.batch = n_arms, dim, batch

    def contexts(self) -> np.ndarray:
        X = self.rng.normal(size=(self.batch, self.dim))
        X[:, 0] = 1.0
        return X

    def rewards(self, X: np.ndarray) -> np.ndarray:
        """Binary reward of every (request, arm), float64 ``[batch, n_arms]``."""
        p = 1.0 / (1.0 + np.exp(-(X @ self.w.T)))
        return (self.rng.random(p.shape) < p).astype(np.float64)


def ours_step(name: str, n_arms: int, dim: int, batch: int, seed: int) -> Callable[[], float]:
    """Return a closure timing one step of our policy (decide, then learn)."""
    kwargs: dict[str, Any] = {"seed": seed}
    policy = make_policy(
        name, list(range(n_arms)), **({**kwargs, "dim": dim} if _ctx(name) else kwargs)
    )
    prob = Problem(n_arms, dim, batch, seed)
    rows = np.arange(batch)

    def step() -> float:
        X = prob.contexts()
        R = prob.rewards(X)
        ctx = X if policy.contextual else None
        t0 = time.perf_counter_ns()
        idx = policy.pull_batch_indices(ctx, n=None if policy.contextual else batch)
        t1 = time.perf_counter_ns()
        if policy.full_information_only:
            policy.update_full(R, ctx)
        else:
            policy.update_batch(idx.tolist(), R[rows, idx], ctx)
        t2 = time.perf_counter_ns()
        step.decide.append((t1 - t0) / 1e3)  # type: ignore[attr-defined]
        return (t2 - t0) / 1e3

    step.decide = []  # type: ignore[attr-defined]
    return step


def _ctx(name: str) -> bool:
    from adaptive_spec.bandits import POLICIES

    return POLICIES[name].contextual


def logistic_model_step(dim: int, batch: int, seed: int) -> Callable[[], float]:
    """One LogisticThompson acceptance model: Thompson draw for the batch, then learn_batch."""
    model = LogisticThompson(dim, seed=seed)
    prob = Problem(1, dim, batch, seed)

    def step() -> float:
        X = prob.contexts()
        y = prob.rewards(X)[:, 0]
        t0 = time.perf_counter_ns()
        model.sample_proba(X)
        t1 = time.perf_counter_ns()
        model.learn_batch(X, y)
        t2 = time.perf_counter_ns()
        step.decide.append((t1 - t0) / 1e3)  # type: ignore[attr-defined]
        return (t2 - t0) / 1e3

    step.decide = []  # type: ignore[attr-defined]
    return step


def river_step(name: str, n_arms: int, dim: int, batch: int, seed: int) -> Callable[[], float]:
    """river's policy on the same kind of batch, one pull + update per request."""
    policy = _river_policy(name, seed)
    prob = Problem(n_arms, dim, batch, seed)
    arms = list(range(n_arms))
    contextual = name == "linucb"
    keys = [f"x{i}" for i in range(dim)]

    def step() -> float:
        X = prob.contexts()
        R = prob.rewards(X)
        dicts = [dict(zip(keys, row.tolist(), strict=True)) for row in X] if contextual else None
        t0 = time.perf_counter_ns()
        decide = 0
        for j in range(batch):
            s = time.perf_counter_ns()
            arm = policy.pull(arms, context=dicts[j]) if contextual else policy.pull(arms)
            decide += time.perf_counter_ns() - s
            if contextual:
                policy.update(arm, dicts[j], float(R[j, arm]))
            else:
                policy.update(arm, float(R[j, arm]))
        t2 = time.perf_counter_ns()
        step.decide.append(decide / 1e3)  # type: ignore[attr-defined]
        return (t2 - t0) / 1e3

    step.decide = []  # type: ignore[attr-defined]
    return step


def vw_step(n_arms: int, dim: int, batch: int, seed: int) -> Callable[[], float] | None:
    """vowpalwabbit ``--cb_explore_adf`` (epsilon 0.1), one predict + learn per request."""
    try:
        import vowpalwabbit
    except ImportError:
        return None
    vw = vowpalwabbit.Workspace(f"--cb_explore_adf --epsilon 0.1 --quiet --random_seed {seed}")
    prob = Problem(n_arms, dim, batch, seed)
    rng = np.random.default_rng(seed)
    actions = [f"|a a{k}" for k in range(n_arms)]

    def step() -> float:
        X = prob.contexts()
        R = prob.rewards(X)
        shared = ["shared |s " + " ".join(f"x{i}:{v:.6f}" for i, v in enumerate(row)) for row in X]
        t0 = time.perf_counter_ns()
        decide = 0
        for j in range(batch):
            s = time.perf_counter_ns()
            pmf = np.asarray(vw.predict([shared[j], *actions]), dtype=np.float64)
            arm = int(rng.choice(n_arms, p=pmf / pmf.sum()))
            decide += time.perf_counter_ns() - s
            labelled = [
                (f"0:{-R[j, arm]}:{pmf[arm]} " if k == arm else "") + a
                for k, a in enumerate(actions)
            ]
            vw.learn([shared[j], *labelled])
        t2 = time.perf_counter_ns()
        step.decide.append(decide / 1e3)  # type: ignore[attr-defined]
        return (t2 - t0) / 1e3

    step.decide = []  # type: ignore[attr-defined]
    return step


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs: list[tuple[str, str, int, Callable[[], float], int]] = []
    for k in args.arms:
        for name in available_policies():
            configs.append(
                ("ours", name, k, ours_step(name, k, args.dim, args.batch, 0), args.repeats)
            )
            if name in RIVER_EQUIVALENT and not args.no_river:
                reps = max(3, args.repeats // (20 if name == "linucb" else 4))
                configs.append(
                    ("river", name, k, river_step(name, k, args.dim, args.batch, 0), reps)
                )
        vw = vw_step(k, args.dim, args.batch, 0)
        if vw is not None:
            configs.append(("vowpalwabbit", "cb_explore_adf", k, vw, max(3, args.repeats // 4)))
    configs.append(
        (
            "ours",
            "LogisticThompson (1 model)",
            1,
            logistic_model_step(args.dim, args.batch, 0),
            args.repeats,
        )
    )
    for _, _, _, fn, _ in configs:  # warm-up
        for _ in range(3):
            fn()
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    max_reps = max(c[4] for c in configs)
    for r in range(max_reps):  # interleaved repeats
        for i, (_, _, _, fn, reps) in enumerate(configs):
            if r < reps:
                times[i].append(fn())
    rows = []
    for i, (lib, name, k, fn, _) in enumerate(configs):
        rows.append(
            {
                "library": lib,
                "policy": name,
                "arms": k,
                "step_us": statistics.median(times[i]),
                "decide_us": statistics.median(fn.decide[3:]),  # type: ignore[attr-defined]
                "repeats": len(times[i]),
            }
        )
    return rows


def to_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    ours = {(r["policy"], r["arms"]): r for r in rows if r["library"] == "ours"}
    lines = [
        f"Batch of {args.batch} requests, context dim {args.dim}; median microseconds per step "
        "(decide = pull_batch, step = decide + update_batch) and per request.",
        "",
        "| policy | arms | decide µs / batch | step µs / batch | step µs / request | river step µs / batch | river ÷ ours |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    river = {(r["policy"], r["arms"]): r for r in rows if r["library"] == "river"}
    for (name, k), r in ours.items():
        rv = river.get((name, k))
        rv_s = f"{rv['step_us']:,.0f} ({RIVER_EQUIVALENT[name]})" if rv else "-"
        ratio = f"{rv['step_us'] / r['step_us']:,.0f}x" if rv else "-"
        lines.append(
            f"| {name} | {k} | {r['decide_us']:,.0f} | {r['step_us']:,.0f} | "
            f"{r['step_us'] / args.batch:,.1f} | {rv_s} | {ratio} |"
        )
    vw = [r for r in rows if r["library"] == "vowpalwabbit"]
    lines.append("")
    if vw:
        for r in vw:
            lines.append(
                f"vowpalwabbit --cb_explore_adf, {r['arms']} arms: decide {r['decide_us']:,.0f} µs, "
                f"step {r['step_us']:,.0f} µs per batch ({r['step_us'] / args.batch:,.1f} µs per request)."
            )
    else:
        lines.append("vowpalwabbit: not measured (`import vowpalwabbit` failed).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="30 repeats")
    parser.add_argument("--no-river", action="store_true")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 30
    rows = run(args)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    print(to_markdown(rows, args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
