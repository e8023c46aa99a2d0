"""Measuring an engine's step-cost table with dummy steps, when the controller attaches.

:func:`calibrate` (called by :meth:`AdaptiveSpec.calibrate <adaptive_spec.vllm.attach.AdaptiveSpec.calibrate>`)
feeds the engine core batches of dummy requests (random prompts whose lengths spread from a quarter of
:data:`DEFAULT_PROMPT_LEN` tokens to 4.5 times it, :func:`prompt_lengths`; ``ignore_eos``) and, at every decode step, makes them verify a planned number of draft tokens: junk
drafts, which the target rejects, so each step commits one token per request and the plan stays on
schedule; they are spread evenly over the batch in even repeats and put on as few requests as
possible in odd ones (:func:`placement`). For each batch size ``B``
of the plan the draft tokens per step cycle through ``V = 0, 1, 2, 4, 8, ...`` up to ``B * max_k``,
``repeats`` times, interleaved (so a drift in machine speed spreads over every ``V``); each step is
timed exactly as in normal operation (from one ``update_from_output`` to the next), and the table is
built from the medians (:meth:`StepCostTable.from_samples`). Each batch size is measured twice, back to
back: with greedy requests, then with requests that sample (temperature 1), which gives the table's
sampled part (verification at temperature > 0 takes a softmax and draws recovered tokens over the
vocabulary). The requests are then aborted and the engine is exactly as before; nothing is learned by
the controller from them.

This is the approach of vLLM's DSpark adaptive verification (profiled tables at startup, forced
monotone). On the embedded default (2 CPU cores, concurrency 16, 30 repeats) it took about 2 min; skip
it with ``AdaptiveSpec(calibrate=False)`` or give a table (``cost_table=``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaptive_spec.core.cost_table import StepCostTable

logger = logging.getLogger(__name__)

CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Dummy prompt length (tokens). A draft token's verification attends over the whole context, so its
#: price grows with it (at batch 4 on 2 CPU cores: about 1.0 ms per draft token at 32 tokens of
#: context, 1.5 ms at 640); 192 is near the median context of a decode step on the built-in mixed
#: workload (prompts of 47-865 tokens, median 137, plus the tokens generated so far).
DEFAULT_PROMPT_LEN = 192
#: The dummy prompts of a batch spread log-uniformly over these multiples of the prompt length (the
#: built-in mixed workload's prompts span 47-865 tokens). A step that verifies draft tokens costs
#: more when the contexts of its batch differ in length: at batch 16 on 2 CPU cores, prompts of
#: equal length priced speculating at all at +0.0 ms (greedy) and +1.6 ms (sampled), prompts of
#: 48-864 tokens at +1.8 ms and +3.3 ms, and the engine measured about +4 and +5.8 ms on the mixed
#: workload, where the equal-length table had the controller draft where it did not pay.
PROMPT_SPREAD = (0.25, 4.5)


def prompt_lengths(batch_size: int, prompt_len: int, room: int) -> list[int]:
    """Dummy prompt lengths (tokens) of a batch of ``batch_size``: ``prompt_len`` times multiples
    spread log-uniformly over :data:`PROMPT_SPREAD` (just ``prompt_len`` for one request), each
    between 1 and ``room`` (what the engine's context leaves)."""
    lo, hi = PROMPT_SPREAD
    if batch_size == 1:
        mult = [1.0]
    else:
        mult = [lo * (hi / lo) ** (i / (batch_size - 1)) for i in range(batch_size)]
    return [max(1, min(round(prompt_len * m), room)) for m in mult]


def plan_tokens(batch_size: int, max_k: int) -> list[int]:
    """Draft tokens per step to measure at ``batch_size``: 0, 1, 2, 4, ... up to ``batch_size * max_k``
    (and that maximum itself)."""
    top = batch_size * max_k
    vs = [0]
    v = 1
    while v < top:
        vs.append(v)
        v *= 2
    vs.append(top)
    return vs


def plan_steps(batch_size: int, max_k: int, repeats: int) -> int:
    """Engine steps a batch of ``batch_size`` dummy requests is given: ``repeats`` times
    :func:`plan_tokens`, and 3 more (prefill and slack)."""
    return repeats * len(plan_tokens(batch_size, max_k)) + 3


def plan_batches(max_num_seqs: int, limit: int = 64) -> list[int]:
    """Batch sizes to measure: powers of two up to ``min(max_num_seqs, limit)``, plus that maximum."""
    top = max(1, min(max_num_seqs, limit))
    out = [b for b in CALIBRATION_BATCHES if b <= top]
    if top not in out:
        out.append(top)
    return out


def placement(v: int, n: int, max_k: int, *, concentrated: bool, start: int = 0) -> list[int]:
    """Draft tokens per request (``n`` requests, at most ``max_k`` each) that place ``v`` draft
    tokens in one calibration step: evenly (the first ``v mod n`` requests get one more), or
    ``concentrated`` on as few requests as possible (``max_k`` each, from request ``start mod n``
    on). ``v`` is capped at ``n * max_k``.

    The two placements bracket what a controller does (it drafts long on a few requests that match
    and short on many): a step verifying the same draft tokens over more requests costs more (on
    the embedded default in float32, 2-core AVX2 EPYC, 8 draft tokens at batch 4: +40-47 ms
    spread evenly, +33-37 ms on one request), so calibration alternates them, repeat by repeat,
    and each cell's median lies between.
    """
    if n <= 0:
        return []
    v = max(0, min(int(v), n * max_k))
    if not concentrated:
        base, extra = divmod(v, n)
        return [min(max_k, base + (1 if i < extra else 0)) for i in range(n)]
    ks = [0] * n
    for j in range(n):
        i = (start + j) % n
        ks[i] = min(max_k, v)
        v -= ks[i]
    return ks


@dataclass
class Calibration:
    """The plan and the samples of one calibration run (used by the AdaptiveSpec hooks)."""

    max_k: int
    vocab_size: int
    plan: list[int] = field(default_factory=list)  # V per decode step of the current batch
    step: int = 0
    batch_size: int = 0
    samples: list[tuple[int, int, int, float]] = field(default_factory=list)  # (B, V, prefill, s)
    req_ids: set[str] = field(default_factory=set)
    per_repeat: int = 0  # planned steps per repeat (len(plan_tokens(B, max_k)))

    def drafts(self, live: list[Any]) -> tuple[list[str], list[list[int]]]:
        """Junk drafts for the live calibration requests: the planned V placed by
        :func:`placement` (evenly in even repeats, on as few requests as possible in odd ones)."""
        live = [r for r in live if r.request_id in self.req_ids]
        if not live:
            return [], []
        i = self.step % len(self.plan) if self.plan else 0
        v = self.plan[i] if self.plan else 0
        self.step += 1
        repeat = i // self.per_repeat if self.per_repeat > 0 else 0
        ks = placement(v, len(live), self.max_k, concentrated=repeat % 2 == 1, start=self.step)
        ids, out = [], []
        for k, r in zip(ks, live, strict=True):
            last = int(r.all_token_ids[-1]) if r.num_tokens else 0
            # Tokens the target will not predict: a fixed offset from the last one.
            out.append([(last + 7919 * (j + 1)) % self.vocab_size for j in range(k)])
            ids.append(r.request_id)
        return ids, out

    def record(self, batch_size: int, verified: int, prefill: int, step_time_s: float) -> None:
        if np.isfinite(step_time_s) and step_time_s > 0:
            self.samples.append((batch_size, verified, prefill, step_time_s))


def _request(rid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0) -> Any:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    sp = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=sp,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def calibrate(
    spec: Any,
    *,
    batch_sizes: list[int] | None = None,
    repeats: int = 5,
    prompt_len: int | None = None,
    seed: int = 0,
    key: dict[str, Any] | None = None,
    sampled: bool = True,
) -> StepCostTable:
    """Measure ``spec``'s engine step-cost table (see the module docstring).

    Parameters
    ----------
    spec : AdaptiveSpec
        Attached, with an idle engine (no request running or waiting).
    batch_sizes : list of int, optional
        Default :func:`plan_batches` of the engine's ``max_num_seqs``.
    repeats : int >= 1
        Measurements per (B, V) cell.
    prompt_len : int >= 1, optional
        Dummy prompt length (tokens). Default :data:`DEFAULT_PROMPT_LEN`, shortened where the
        engine's ``max_model_len`` leaves no room for it and the planned steps.
    sampled : bool
        Also measure the table's sampled part (every batch size again at temperature 1; about
        doubles the time). Without it, the greedy table stands in for sampled steps.

    Raises
    ------
    RuntimeError
        If the engine has requests (calibrate before serving).
    ValueError
        For a bad parameter.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    if prompt_len is not None and (
        isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1
    ):
        raise ValueError(f"prompt_len={prompt_len!r} is invalid; allowed: an integer >= 1")
    core = spec.core
    sched = core.scheduler
    if sched.get_num_unfinished_requests() > 0:
        raise RuntimeError(
            "the engine has requests: calibrate the step-cost table before serving (or pass "
            "calibrate=False / cost_table=...)"
        )
    max_seqs = int(core.vllm_config.scheduler_config.max_num_seqs)
    if batch_sizes is None:
        batch_sizes = plan_batches(max_seqs)
    bad = [b for b in batch_sizes if not isinstance(b, int) or not 1 <= b <= max_seqs]
    if bad:
        raise ValueError(
            f"batch_sizes={batch_sizes!r} is invalid; allowed: integers in 1..{max_seqs}"
        )
    # Room for a prompt, every planned step's token and one step's draft tokens.
    steps = max(plan_steps(b, spec.max_k, repeats) for b in batch_sizes)
    room = max(1, int(getattr(spec, "max_model_len", 1 << 30)) - steps - spec.max_k - 1)
    if prompt_len is None:
        prompt_len = min(DEFAULT_PROMPT_LEN, room)
    rng = np.random.default_rng(seed)
    cal = Calibration(spec.max_k, spec.vocab_size)
    t0 = time.perf_counter()
    temperatures = (0.0, 1.0) if sampled else (0.0,)
    by_temp: dict[float, list[tuple[int, int, int, float]]] = {t: [] for t in temperatures}
    # vLLM's admission limit (``max_num_active_seqs``) may hold RUNNING below ``max_num_seqs``: a
    # batch of B dummy requests would then run as a smaller one and the table would price every
    # larger batch as that one. Lifted while measuring, restored after.
    limit = getattr(sched, "max_num_active_reqs", None)
    with spec.hooks.calibrating(cal):
        try:
            if limit is not None:
                sched.max_num_active_reqs = max(int(limit), max_seqs)
            for B in batch_sizes:
                for temp in temperatures:  # back to back, so that drift barely separates the two
                    cal.samples = by_temp[temp]
                    _measure_batch(
                        core,
                        sched,
                        cal,
                        rng,
                        spec,
                        B,
                        repeats,
                        prompt_lengths(B, prompt_len, room),
                        temp,
                    )
        finally:
            if limit is not None:
                sched.max_num_active_reqs = limit
    seen = {int(b) for b, _, p, _ in by_temp[0.0] if p == 0}
    missing = [b for b in batch_sizes if b not in seen]
    if missing:
        logger.warning(
            "adaptive-spec: calibration measured no decode step at batch sizes %s (the engine ran "
            "fewer requests at once); the table extends its largest measured batch to them",
            missing,
        )
    table = _table_from(by_temp[0.0], key, "calibrated")
    if sampled:
        part = _table_from(by_temp[1.0], key, "calibrated")
        # Sampling never makes a step cheaper: where noise says so, the greedy cell stands (the
        # maximum of two monotone tables is monotone).
        part.seconds = np.maximum(part.seconds, table.seconds)
        table = dataclasses.replace(table, sampled=part)  # validated again on construction
    n_dec = int(sum(1 for x in by_temp[0.0] if x[2] == 0))
    logger.info(
        "adaptive-spec: step-cost table calibrated in %.1f s (%d steps, batch sizes %s)",
        time.perf_counter() - t0,
        n_dec * len(temperatures),
        batch_sizes,
    )
    return table


def _measure_batch(
    core: Any,
    sched: Any,
    cal: Calibration,
    rng: np.random.Generator,
    spec: Any,
    B: int,
    repeats: int,
    lengths: list[int],
    temperature: float,
) -> None:
    """Run ``B`` dummy requests (prompts of ``lengths`` tokens) through the plan of ``B`` (samples
    go to ``cal.samples``), then abort what is left of them."""
    vs = plan_tokens(B, spec.max_k)
    cal.plan = [v for _ in range(repeats) for v in vs]
    cal.per_repeat = len(vs)
    cal.step = 0
    cal.batch_size = B
    steps = plan_steps(B, spec.max_k, repeats)
    ids = [f"adaptive-spec-calibration-{uuid.uuid4().hex[:12]}" for _ in range(B)]
    cal.req_ids = set(ids)
    for rid, n in zip(ids, lengths, strict=True):
        prompt = [int(t) for t in rng.integers(100, spec.vocab_size - 100, size=n)]
        req = core.preprocess_add_request(_request(rid, prompt, steps, temperature))
        core.add_request(*req) if isinstance(req, tuple) else core.add_request(req)
    guard = 0
    while sched.has_requests() and cal.step < len(cal.plan) and guard < 10 * steps:
        _, executed = core.step()
        core.post_step(executed)
        guard += 1
    live = [r for r in ids if r in sched.requests]
    if live:
        core.abort_requests(live)
    while sched.has_requests() and guard < 12 * steps:  # let the aborts through
        _, executed = core.step()
        core.post_step(executed)
        guard += 1


def _table_from(
    samples: list[tuple[int, int, int, float]], key: dict[str, Any] | None, source: str
) -> StepCostTable:
    """The table of one calibration pass: decode steps' medians, and the prefill price."""
    arr = np.array(samples, dtype=float).reshape(-1, 4)
    dec = arr[arr[:, 2] == 0]
    if dec.shape[0] == 0:
        raise RuntimeError("calibration measured no decode step")
    table = StepCostTable.from_samples(
        dec[:, 0], dec[:, 1], dec[:, 3], key=dict(key or {}), source=source
    )
    pre = arr[arr[:, 2] > 0]
    if pre.shape[0]:
        extra = [(t - float(table.predict(b, v))) / p for b, v, p, t in pre]
        table.prefill_s_per_token = max(float(np.median(extra)), 0.0)
    return table
