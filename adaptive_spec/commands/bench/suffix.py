"""Micro-benchmark of the suffix proposer: cost per request per step, and draft coverage.

``python -m adaptive_spec.commands.bench.suffix [--workload mixed] [--trace run/trace.jsonl]``

1. **Cost.** Real token streams (a trace's prompts and outputs, or the workload's prompts tokenized by
   the embedded model's tokenizer when its converted copy is cached, else their UTF-8 bytes) are
   decoded in a closed loop at concurrency 1, 4 and 16: each request starts from its prompt (the first
   half of a prompt-only stream) and gains 1-3 tokens per step, like a speculative engine; at every step
   the proposer drafts for the whole batch (``propose`` plus ``match_length`` per request, as
   :class:`~adaptive_spec.vllm.AdaptiveSpec` calls it). Reported: microseconds per request per step
   (CPU time of this process, the minimum and the median over interleaved repeats; the median of the
   wall time), and the wall time of a request's first step (indexing its prompt). On a shared machine
   the CPU-time minimum is the steadiest estimate of the cost itself. The n-gram proposer runs the same loop as a yardstick, and
   ArcticInference's ``SuffixDecodingCache`` too when ``arctic_inference`` is importable.
2. **Coverage** (with ``--trace``): the share of the recorded run's decision points (request-steps that
   decided) where each proposer offers a non-empty draft: suffix replayed in the trace's order
   (:func:`adaptive_spec.sim.counterfactual.suffix_counterfactual`), n-gram recomputed at the same
   positions; plus, for every output position with requests taken one after another in the trace's
   order, the same share and the mean accepted length of the full draft against the recorded output
   (greedy: the longest common prefix), for suffix, suffix with ``local="always"``, and n-gram.

Times are of this machine at that moment: compare the rows of one table, not absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.proposers.base import ProposalRequest
from adaptive_spec.proposers.ngram import NgramProposer
from adaptive_spec.proposers.suffix import SuffixProposer

VOCAB = 1 << 20  # larger than any tokenizer's: no draft is cut by the vocabulary


def _tokenizer() -> Callable[[str], list[int]]:
    try:
        from tokenizers import Tokenizer

        from adaptive_spec.core.paths import cache_dir

        files = sorted(cache_dir().glob("*/tokenizer.json"))
        if files:
            tok = Tokenizer.from_file(str(files[0]))
            return lambda text: tok.encode(text).ids
    except Exception:
        pass
    return lambda text: list(text.encode("utf-8"))


def workload_streams(name: str, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, continuation) int64 pairs: the first half of each tokenized prompt, then the rest."""
    from adaptive_spec.commands.workloads import load_workload

    enc = _tokenizer()
    out = []
    for p in load_workload(name, n):
        ids = np.asarray(enc(p.text), dtype=np.int64)
        if ids.size >= 4:
            half = ids.size // 2
            out.append((ids[:half], ids[half:]))
    return out


def trace_streams(path: str | Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, output) int64 pairs of a recorded trace, in the order requests appeared."""
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.sim.requests import outputs_from_trace

    trace = read_trace(path)
    outs = outputs_from_trace(trace)
    res = []
    for rid, meta in trace.requests.items():
        out = outs.get(rid)
        if out is not None and out.size:
            res.append((np.asarray(meta.get("prompt_token_ids") or [], dtype=np.int64), out))
    return res


class _Arctic:
    """ArcticInference's ``SuffixDecodingCache`` behind the same per-step calls (for comparison)."""

    def __init__(self, max_k: int, depth: int = 24) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10_000)
        self.max_k, self.depth = max_k, depth
        self.seen: dict[str, int] = {}

    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        out = []
        for r, k in zip(requests, ks, strict=True):
            toks = r.token_ids
            n = self.seen.get(r.req_id)
            if n is None:
                self.cache.start_request(r.req_id, toks.tolist())
            elif n < toks.shape[0]:
                self.cache.add_active_response(r.req_id, toks[n:].tolist())
            self.seen[r.req_id] = int(toks.shape[0])
            d = self.cache.speculate(r.req_id, toks[-self.depth :].tolist(), max_spec_tokens=k)
            out.append(np.asarray(d.token_ids, dtype=np.int64))
        return out

    def match_length(self, request: ProposalRequest) -> int:
        return 0

    def release(self, req_id: str) -> None:
        if self.seen.pop(req_id, None) is not None:
            self.cache.stop_request(req_id)


def decode_loop(
    proposer: Any,
    streams: Sequence[tuple[np.ndarray, np.ndarray]],
    concurrency: int,
    *,
    max_k: int = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Closed-loop decode of ``streams`` at ``concurrency``; returns times and coverage.

    Returns
    -------
    dict
        ``wall_us`` / ``cpu_us``: per request per step (first steps excluded); ``first_ms``: mean wall
        time of a request's first step (its prompt is indexed) per request; ``coverage``: share of
        request-steps with a non-empty draft; ``steps``: request-steps timed.
    """
    rng = np.random.default_rng(seed)
    todo = list(range(len(streams)))
    live: dict[int, int] = {}  # stream index -> output tokens so far
    fresh: set[int] = set()
    wall = cpu = first = 0.0
    steps = drafted = firsts = 0
    while todo or live:
        while todo and len(live) < concurrency:
            i = todo.pop(0)
            live[i] = 0
            fresh.add(i)
        order = list(live)
        reqs = [
            ProposalRequest(
                f"s{i}",
                np.concatenate([streams[i][0], streams[i][1][: live[i]]]),
                int(streams[i][1].size - live[i] + 1),
                VOCAB,
            )
            for i in order
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        out = proposer.propose(reqs, [max_k] * len(reqs))
        for r, d in zip(reqs, out, strict=True):
            if len(d):
                proposer.match_length(r)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        n_first = sum(i in fresh for i in order)
        if n_first == len(order):
            first += dt
            firsts += n_first
        else:  # a mixed step: charge the first steps at the mean of this call
            share = len(order) - n_first
            wall += dt * share / len(order)
            cpu += dc * share / len(order)
            steps += share
            first += dt * n_first / len(order)
            firsts += n_first
        drafted += sum(len(d) > 0 for i, d in zip(order, out, strict=True) if i not in fresh)
        fresh.clear()
        for i in order:
            live[i] += int(rng.integers(1, 4))
            if live[i] >= streams[i][1].size:
                proposer.release(f"s{i}")
                del live[i]
    return {
        "wall_us": 1e6 * wall / max(steps, 1),
        "cpu_us": 1e6 * cpu / max(steps, 1),
        "first_ms": 1e3 * first / max(firsts, 1),
        "coverage": drafted / max(steps, 1),
        "steps": float(steps),
    }


def cost_table(
    streams: Sequence[tuple[np.ndarray, np.ndarray]],
    concurrencies: Sequence[int] = (1, 4, 16),
    repeats: int = 3,
    max_k: int = 8,
    arctic: bool = True,
) -> list[dict[str, Any]]:
    """Median cost per configuration and concurrency over ``repeats`` interleaved rounds."""
    makers: dict[str, Callable[[], Any]] = {
        "suffix": lambda: SuffixProposer(max_k=max_k),
        "suffix local='always'": lambda: SuffixProposer(max_k=max_k, local="always"),
        "ngram (prompt lookup)": lambda: NgramProposer(max_k=max_k),
    }
    if arctic:
        try:
            import arctic_inference.suffix_decoding  # noqa: F401

            makers["arctic SuffixDecodingCache"] = lambda: _Arctic(max_k)
        except ImportError:
            pass
    rows = []
    for c in concurrencies:
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in makers}
        names = list(makers)
        for rep in range(repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                runs[name].append(decode_loop(makers[name](), streams, c, max_k=max_k, seed=rep))
        for name in names:
            rs = runs[name]
            row = {
                key: statistics.median(r[key] for r in rs)
                for key in ("wall_us", "cpu_us", "first_ms", "coverage", "steps")
            }
            row["cpu_min_us"] = min(r["cpu_us"] for r in rs)
            rows.append({"config": name, "concurrency": c, **row})
    return rows


def coverage_on_trace(path: str | Path, max_k: int | None = None) -> dict[str, float]:
    """Draft coverage of suffix vs n-gram on a recorded trace (see the module docstring)."""
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.sim.counterfactual import ngram_counterfactual, suffix_counterfactual
    from adaptive_spec.sim.requests import matched_length, outputs_from_trace

    trace = read_trace(path)
    k = max_k or int(trace.header["max_k"])
    sfx = suffix_counterfactual(trace).tables
    outs = outputs_from_trace(trace)
    ngr = {}
    for rid in sfx:
        prompt = trace.requests.get(rid, {}).get("prompt_token_ids") or []
        ngr[rid] = ngram_counterfactual(
            np.asarray(prompt, dtype=np.int64), outs[rid], k, vocab_size=VOCAB
        )[0]
    decided = [
        (rid, n) for rid, per in sfx.items() for n, d in enumerate(per["suffix"]) if d is not None
    ]
    res = {
        "decisions": float(len(decided)),
        "suffix_at_decisions": float(np.mean([len(sfx[r]["suffix"][n]) > 0 for r, n in decided])),
        "ngram_at_decisions": float(np.mean([len(ngr[r][n]) > 0 for r, n in decided])),
    }
    # every output position, requests one after another in the trace's order
    props = {
        "suffix": SuffixProposer(max_k=k),
        "suffix_local_always": SuffixProposer(max_k=k, local="always"),
        "ngram": NgramProposer(max_k=k),
    }
    hits = dict.fromkeys(props, 0)
    accepted = dict.fromkeys(props, 0)
    total = 0
    for i, (prompt, out) in enumerate(trace_streams(path)):
        for n in range(1, out.size):
            r = ProposalRequest(f"t{i}", np.concatenate([prompt, out[:n]]), out.size - n + 1, VOCAB)
            for name, p in props.items():
                d = p.propose([r], [k])[0]
                hits[name] += len(d) > 0
                accepted[name] += matched_length(d, out[n:])
            total += 1
        for p in props.values():
            p.release(f"t{i}")
    res["positions"] = float(total)
    for name in props:
        res[f"{name}_every_position"] = hits[name] / max(total, 1)
        res[f"{name}_accepted_per_position"] = accepted[name] / max(total, 1)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload", default="mixed", help="workload for the cost table (default mixed)"
    )
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the workload (default 64)")
    ap.add_argument(
        "--trace", help="a recorded trace: its streams for the cost table, and coverage"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument(
        "--no-arctic", action="store_true", help="skip ArcticInference even if installed"
    )
    args = ap.parse_args(argv)
    streams = (
        trace_streams(args.trace) if args.trace else workload_streams(args.workload, args.prompts)
    )
    src = args.trace or f"{args.workload} x {args.prompts}"
    print(
        f"streams: {src}: {len(streams)} requests, {sum(p.size + o.size for p, o in streams)} tokens"
    )
    print(
        "| proposer | c | us/request/step, CPU min | CPU median | wall median "
        "| first step, ms/request | steps with a draft |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in cost_table(streams, repeats=args.repeats, max_k=args.max_k, arctic=not args.no_arctic):
        print(
            f"| {r['config']} | {r['concurrency']} | {r['cpu_min_us']:.1f} | {r['cpu_us']:.1f} | "
            f"{r['wall_us']:.1f} | {r['first_ms']:.2f} | {r['coverage']:.2f} |"
        )
    if args.trace:
        cov = coverage_on_trace(args.trace, args.max_k)
        print(f"\ncoverage on {args.trace}:")
        for key, v in cov.items():
            print(
                f"  {key}: {int(v)}" if key in ("decisions", "positions") else f"  {key}: {v:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
