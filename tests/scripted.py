"""Scripted proposers, policies and engine helpers for the correctness suite (``test_correctness_*``).

Speculative-decoding bugs hide in exact situations: a stop token as the third token of a fully accepted
draft, a request one token from its limit next to one drafting ``max_k``, a seeded request whose
batch-mates change arms every step. The pieces here put the engine in those situations on purpose:

* :class:`ScriptedPolicy`: the arm of every request at every step is a function of the request (its
  prompt), its output length and the step index, so a schedule can change proposer and k every step,
  or hold one request's schedule fixed while its batch-mates' change;
* :class:`OracleProposer`: drafts the reference (no-speculation) continuation with the first wrong token
  at a scripted position, so a step's accepted length is exactly what the test wants; it can ignore the
  request's remaining budget on purpose (an adversarial proposer);
* :class:`EmptyProposer`, :class:`RaisingProposer`: zero drafts, and a proposer bug;
* :func:`install_proposer`: puts one of these under an arm name of an attached ``AdaptiveSpec`` (test only);
* :func:`check_bookkeeping`: the per-request-step invariants of a trace (accepted = longest prefix of the
  draft equal to the target's argmax, emitted = accepted + 1 unless the request finished, positions chain);
* engine drivers: :func:`generate` (``LLM.generate``) and :func:`stream` (``LLMEngine.add_request`` /
  ``step`` with delta outputs, optional aborts), and :func:`make_near_draft`, a draft model that agrees
  with the tiny target most of the time (for the draft-model engine run in a subprocess).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView
from adaptive_spec.proposers.base import (
    EMPTY,
    ProposalRequest,
    Proposer,
    as_tokens,
    check_ks,
    clean_draft,
    draft_cap,
)

VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's tokenizer)
MAX_K = 4  # the ``tiny_llm`` fixture's num_speculative_tokens
MAX_TOKENS = 16  # output length of the shared reference runs


def core_prompts() -> list[list[int]]:
    """The prompts most engine tests share (so the no-speculation reference runs once per process).

    Three random prompts (greedy outputs that never repeat: n-gram finds nothing, Jacobi is rejected)
    and two made of repeated tokens, whose greedy outputs on the tiny model fall into loops at once (a
    run of one token; a period-3 cycle), so n-gram and Jacobi drafts get accepted too. Five requests
    with concurrency 4: one joins a running batch.
    """
    from tests.conftest import tiny_prompts

    return [*tiny_prompts(3, length=12, seed=11), [7] * 12, [100, 200] * 6]


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> Any:
    """Greedy ``SamplingParams``."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# A schedule maps (request key, output tokens so far, decision index, index in the batch) to an arm.
Schedule = Callable[[Hashable, int, int, int], Arm]


# -- schedules --------------------------------------------------------------------------------------
def fixed(arm: Arm | str) -> Schedule:
    """The same arm for every request and step."""
    a = Arm.parse(arm) if isinstance(arm, str) else arm

    def schedule(key: Hashable, n_out: int, step: int, index: int) -> Arm:
        return a

    return schedule


def every_step(proposers: Sequence[str], ks: Sequence[int] = (4, 1, 0, 2)) -> Schedule:
    """An arm that changes every step: k runs through ``ks`` and the proposer through ``proposers`` at a
    different period, so over ``len(ks) * len(proposers)`` steps every (proposer, k) pair occurs and
    consecutive steps differ in k (and mostly in proposer). Batch-mates are offset by their index."""
    props = list(proposers)
    if not props or not ks:
        raise ValueError("every_step needs at least one proposer and one k")

    def schedule(key: Hashable, n_out: int, step: int, index: int) -> Arm:
        t = step + index
        k = int(ks[t % len(ks)])
        p = props[(t // len(ks) + t) % len(props)]
        return NO_SPEC if k == 0 else Arm(p, k)

    return schedule


def by_output_length(arms: Sequence[Arm]) -> Schedule:
    """An arm that depends only on the request's own output length (for seeded requests: the schedule
    does not depend on batch-mates or step numbering)."""

    def schedule(key: Hashable, n_out: int, step: int, index: int) -> Arm:
        return arms[n_out % len(arms)]

    return schedule


def per_request(table: dict[Hashable, Schedule], default: Schedule) -> Schedule:
    """A schedule per request key (prompt), ``default`` for the others."""

    def schedule(key: Hashable, n_out: int, step: int, index: int) -> Arm:
        return table.get(key, default)(key, n_out, step, index)

    return schedule


# -- policies ---------------------------------------------------------------------------------------
@dataclass
class PolicyLog:
    """What a :class:`ScriptedPolicy` or :class:`RecordingPolicy` saw and did."""

    views: list[StepView] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    outcomes: list[StepOutcome] = field(default_factory=list)
    released: list[str] = field(default_factory=list)


class ScriptedPolicy(SpecPolicy):
    """Arms from a :data:`Schedule`; the arm is played as chosen (no cut to the drafts or the budget:
    AdaptiveSpec and vLLM must cope with a k larger than what is available).

    Parameters
    ----------
    proposers : list of str
        Enabled proposers.
    max_k : int
        The engine's ``num_speculative_tokens``.
    schedule : Schedule
        ``schedule(key, n_out, step, index) -> Arm``; ``key`` is the request's prompt (a tuple of token
        ids) once :meth:`bind` was called, else its request id.
    """

    name = "scripted"

    def __init__(self, proposers: list[str], max_k: int, schedule: Schedule) -> None:
        super().__init__(proposers, max_k)
        self.schedule = schedule
        self.key_of: Callable[[str], Hashable] = lambda rid: rid
        self.log = PolicyLog()
        self.step = 0
        self._live: set[str] = set()

    def bind(self, spec: Any) -> ScriptedPolicy:
        """Key requests by their prompt token ids (read from ``spec``'s scheduler)."""

        def key_of(rid: str) -> Hashable:
            r = spec.scheduler.requests.get(rid)
            return tuple(r.prompt_token_ids) if r is not None else rid

        self.key_of = key_of
        return self

    def decide(self, view: StepView) -> Decision:
        arms = [
            self.schedule(self.key_of(r.req_id), r.num_output_tokens, self.step, i)
            for i, r in enumerate(view.requests)
        ]
        self.step += 1
        self._live.update(r.req_id for r in view.requests)
        d = Decision(arms, [1.0] * len(arms), [[] for _ in arms])
        self.log.views.append(view)
        self.log.decisions.append(d)
        return d

    def observe(self, outcome: StepOutcome) -> None:
        self.log.outcomes.append(outcome)

    def release(self, req_id: str) -> None:
        self.log.released.append(req_id)
        self._live.discard(req_id)

    def num_tracked_requests(self) -> int:
        return len(self._live)


class RecordingPolicy(SpecPolicy):
    """Wraps a policy and records every view, decision, outcome and release (delegates everything)."""

    def __init__(self, inner: SpecPolicy) -> None:
        super().__init__(list(inner.proposers), inner.max_k)
        self.inner = inner
        self.name = inner.name
        self.log = PolicyLog()

    def decide(self, view: StepView) -> Decision:
        d = self.inner.decide(view)
        self.log.views.append(view)
        self.log.decisions.append(d)
        return d

    def observe(self, outcome: StepOutcome) -> None:
        self.log.outcomes.append(outcome)
        self.inner.observe(outcome)

    def release(self, req_id: str) -> None:
        self.log.released.append(req_id)
        self.inner.release(req_id)

    def num_tracked_requests(self) -> int:
        return self.inner.num_tracked_requests()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class FaultyPolicy(SpecPolicy):
    """Plays ``arm`` but fails in ``where`` (``decide``, ``observe``, ``release`` or ``malformed``: a
    decision of the wrong length) every ``every``-th call."""

    name = "faulty"

    def __init__(
        self, proposers: list[str], max_k: int, where: str, arm: Arm, every: int = 2
    ) -> None:
        super().__init__(proposers, max_k)
        if where not in ("decide", "observe", "release", "malformed"):
            raise ValueError(f"where={where!r}; allowed: decide, observe, release, malformed")
        self.where, self.arm, self.every = where, arm, every
        self.calls = {"decide": 0, "observe": 0, "release": 0}

    def _tick(self, verb: str) -> bool:
        self.calls[verb] += 1
        return self.calls[verb] % self.every == 0

    def decide(self, view: StepView) -> Decision:
        n = len(view.requests)
        fail = self._tick("decide")
        if fail and self.where == "decide":
            raise RuntimeError("scripted policy bug in decide")
        if fail and self.where == "malformed":
            n = n + 1  # one arm too many
        return Decision([self.arm] * n, [None] * n, [[] for _ in range(n)])

    def observe(self, outcome: StepOutcome) -> None:
        if self._tick("observe") and self.where == "observe":
            raise RuntimeError("scripted policy bug in observe")

    def release(self, req_id: str) -> None:
        if self._tick("release") and self.where == "release":
            raise RuntimeError("scripted policy bug in release")


# -- proposers --------------------------------------------------------------------------------------
class OracleProposer(Proposer):
    """Drafts the reference continuation of each request, with its first wrong token where told.

    Parameters
    ----------
    references : dict
        ``{prompt token ids (tuple): reference output token ids}`` (the no-speculation output, long
        enough to cover the run).
    correct : callable, optional
        ``correct(key, n_out) -> int``: how many leading draft tokens are right at this step (the
        token after them is replaced by a wrong one). Default: all of them.
    ignore_budget : bool
        Draft ``k`` tokens even past the request's remaining budget (``max_new_tokens - 1``): an
        adversarial proposer, to check that the engine cuts at ``max_tokens`` and the model length.
    empty_for : set, optional
        Prompt keys for which it offers nothing (zero drafts).
    max_k : int
        Longest draft.

    Requests whose history left the reference (or whose prompt is unknown) get zero drafts.
    """

    name = "oracle"

    def __init__(
        self,
        references: dict[tuple[int, ...], Sequence[int]],
        correct: Callable[[Hashable, int], int] | None = None,
        *,
        ignore_budget: bool = False,
        empty_for: set[tuple[int, ...]] | None = None,
        max_k: int = 4,
    ) -> None:
        self.references = {tuple(k): list(v) for k, v in references.items()}
        self.correct = correct
        self.ignore_budget = ignore_budget
        self.empty_for = set(empty_for or ())
        self.max_k = max_k
        self.calls = 0
        self.offered = 0  # draft tokens handed out

    def _lookup(self, toks: np.ndarray) -> tuple[tuple[int, ...], list[int], int] | None:
        best = None
        for prompt, ref in self.references.items():
            n = len(prompt)
            longer = best is None or n > len(best[0])
            if longer and toks.shape[0] >= n and tuple(int(t) for t in toks[:n]) == prompt:
                best = (prompt, ref, n)
        if best is None:
            return None
        prompt, ref, n = best
        out = toks[n:]
        if out.shape[0] > len(ref) or any(int(a) != b for a, b in zip(out, ref, strict=False)):
            return None
        return prompt, ref, out.shape[0]

    def _draft(self, r: ProposalRequest, k: int, corrupt: bool = True) -> np.ndarray:
        toks = as_tokens(r.token_ids)
        found = self._lookup(toks)
        if found is None:
            return EMPTY
        prompt, ref, n_out = found
        if prompt in self.empty_for:
            return EMPTY
        cap = min(k, self.max_k) if self.ignore_budget else draft_cap(r, k, self.max_k)
        d = np.asarray(ref[n_out : n_out + max(cap, 0)], dtype=np.int64)
        if corrupt and self.correct is not None:
            c = int(self.correct(prompt, n_out))
            if 0 <= c < d.shape[0]:
                d = d.copy()
                d[c] = (d[c] + 1) % VOCAB  # a valid id that is not the reference token
        return d

    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        kl = check_ks(requests, ks)
        self.calls += 1
        out = [
            clean_draft(self._draft(r, k), self.max_k, VOCAB)
            for r, k in zip(requests, kl, strict=True)
        ]
        self.offered += sum(len(d) for d in out)
        return out

    def match_length(self, request: ProposalRequest) -> int:
        return int(self._draft(request, self.max_k, corrupt=False).shape[0])


def cycling_correct(pattern: Sequence[int]) -> Callable[[Hashable, int], int]:
    """``correct`` for :class:`OracleProposer`: per request, successive steps get ``pattern[0]``,
    ``pattern[1]``, ... right tokens (cycling; a value >= k means the whole draft is right)."""
    counters: dict[Hashable, int] = {}

    def correct(key: Hashable, n_out: int) -> int:
        i = counters.get(key, 0)
        counters[key] = i + 1
        return int(pattern[i % len(pattern)])

    return correct


class EmptyProposer(Proposer):
    """Never drafts (every request gets zero draft tokens)."""

    name = "empty"

    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        check_ks(requests, ks)
        return [EMPTY for _ in requests]

    def match_length(self, request: ProposalRequest) -> int:
        return 0


class RaisingProposer(Proposer):
    """A proposer bug: ``propose`` raises every ``every``-th call (drafts the reference otherwise)."""

    name = "raising"

    def __init__(self, inner: Proposer, every: int = 2) -> None:
        self.inner, self.every, self.calls = inner, every, 0

    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("scripted proposer bug")
        return self.inner.propose(requests, ks)

    def match_length(self, request: ProposalRequest) -> int:
        return self.inner.match_length(request)


def install_proposer(spec: Any, name: str, proposer: Proposer) -> None:
    """Put ``proposer`` under the arm name ``name`` of an attached ``AdaptiveSpec`` (test only: the arm
    keeps its name, the drafts come from ``proposer``)."""
    if name not in spec.proposer_names or name in ("none", "draft"):
        raise ValueError(f"name={name!r} must be an enabled cheap proposer of this AdaptiveSpec")
    spec.proposers[name] = proposer


# -- trace invariants -------------------------------------------------------------------------------
@dataclass
class BookkeepingSummary:
    request_steps: int = 0
    drafted_steps: int = 0
    accepted_tokens: int = 0
    full_accepts: int = 0
    rejections: int = 0


def check_bookkeeping(trace: Any, outputs: dict[tuple[int, ...], list[int]]) -> BookkeepingSummary:
    """Assert the per-request-step invariants of a trace (greedy decoding, no logits processors).

    For every request-step: ``0 <= accepted <= drafted``; the verified draft is the first ``drafted``
    tokens of the chosen proposer's offer (``cf_drafts``); ``accepted`` is the longest prefix where the
    draft equals the target's argmax (the first draft token checked too), cut to the tokens emitted when
    the request finished inside the chunk (committed counts); the emitted tokens are the target's argmax
    at positions ``0..accepted`` (cut where the request finished); ``emitted = accepted + 1`` unless the
    request finished; ``num_output_before`` chains from the previous step; and the emitted
    tokens of each request, concatenated, are its final output (``outputs``, keyed by prompt).
    """
    s = BookkeepingSummary()
    pos: dict[str, int] = {}
    emitted_by: dict[str, list[int]] = {}
    finished: set[str] = set()
    for st in trace.steps:
        for r in st["requests"]:
            rid = r["req_id"]
            where = f"step {st['step']} request {rid}"
            assert rid not in finished, f"{where}: scheduled after it finished"
            assert r["num_output_before"] == pos.get(rid, 0), (
                f"{where}: starts at output position {r['num_output_before']}, "
                f"expected {pos.get(rid, 0)}"
            )
            d, a, e = r["drafted"], r["accepted"], r["emitted"]
            ids = r["emitted_token_ids"]
            assert 0 <= a <= d, f"{where}: accepted={a} drafted={d}"
            assert len(ids) == e, f"{where}: emitted={e} but {len(ids)} ids"
            assert e <= a + 1, f"{where}: emitted={e} > accepted + 1 = {a + 1}"
            if not r["finished"]:
                assert e == a + 1, f"{where}: emitted={e}, accepted={a}, not finished"
            s.request_steps += 1
            if d > 0:
                s.drafted_steps += 1
                proposer, _, k = r["arm"].rpartition(":")
                assert int(k) >= d, f"{where}: drafted {d} > k of arm {r['arm']}"
                offered = (r["cf_drafts"] or {}).get(proposer)
                assert offered is not None and len(offered) >= d, (
                    f"{where}: arm {r['arm']} but the proposer offered {offered}"
                )
                draft = offered[:d]
                tam = r["target_argmax"]
                assert tam is not None and len(tam) == d + 1, (
                    f"{where}: target_argmax {tam} for {d} drafts"
                )
                m = 0
                while m < d and draft[m] == tam[m]:
                    m += 1
                # Committed counts: a stop or length limit inside the chunk cuts accepted to emitted.
                want = min(m, e) if r["finished"] else m
                assert a == want, f"{where}: accepted={a}, longest prefix draft == argmax is {m}"
                assert ids == tam[: m + 1][:e], (
                    f"{where}: emitted {ids}, target argmax {tam}, accepted {a}"
                )
                s.accepted_tokens += a
                s.full_accepts += a == d
                s.rejections += a < d
            pos[rid] = pos.get(rid, 0) + e
            emitted_by.setdefault(rid, []).extend(ids)
            if r["finished"]:
                finished.add(rid)
    for rid, ids in emitted_by.items():
        prompt = tuple(trace.requests[rid]["prompt_token_ids"])
        if prompt in outputs:
            assert ids == outputs[prompt], f"request {rid}: trace tokens {ids} != output"
    return s


# -- engine drivers ---------------------------------------------------------------------------------
def generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
    """``llm.generate`` on token-id prompts; returns each request's first ``CompletionOutput``.
    ``params`` is one ``SamplingParams`` or one per prompt."""
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@dataclass
class Streamed:
    """One request driven by :func:`stream`: its deltas and final state."""

    deltas: list[list[int]] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    outputs_after_finish: int = 0
    num_cached_tokens: int | None = None
    aborted: bool = False


def stream(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    params: Any,
    *,
    abort_after: dict[int, int] | None = None,
    max_steps: int = 10_000,
) -> list[Streamed]:
    """Drive ``llm.llm_engine`` step by step with delta outputs (what a streaming server sends).

    ``params`` is one ``SamplingParams`` or one per prompt (``output_kind`` is set to DELTA on copies).
    ``abort_after={i: n}`` aborts request ``i`` once it has streamed ``n`` tokens.
    """
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    plist = params if isinstance(params, list | tuple) else [params] * len(prompts)
    res = [Streamed() for _ in prompts]
    ids = [f"corr-{id(res)}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    for rid, p, sp in zip(ids, prompts, plist, strict=True):
        sp = sp.clone()
        sp.output_kind = RequestOutputKind.DELTA
        engine.add_request(rid, {"prompt_token_ids": list(p)}, sp)
    abort_after = dict(abort_after or {})
    done: set[int] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            i = index[out.request_id]
            s = res[i]
            if i in done:
                s.outputs_after_finish += 1
            c = out.outputs[0]
            s.deltas.append(list(c.token_ids))
            s.token_ids.extend(c.token_ids)
            s.text += c.text
            if c.logprobs:
                s.logprobs.extend(c.logprobs)
            if out.num_cached_tokens is not None:
                s.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
                done.add(i)
        for i, n in list(abort_after.items()):
            if len(res[i].token_ids) >= n and i not in done:
                engine.abort_request([ids[i]])
                res[i].aborted = True
                done.add(i)
                del abort_after[i]
    else:
        raise RuntimeError(f"stream: requests still unfinished after {max_steps} steps")
    return res


# -- draft model ------------------------------------------------------------------------------------
def make_near_draft(target_dir: Path, out: Path, *, noise: float = 0.006, seed: int = 1) -> Path:
    """A draft model for the tiny target: the target's weights plus Gaussian noise of standard deviation
    ``noise`` on the transformer layers (embedding and head unchanged), so the draft agrees with the
    target on most tokens but not all (both accept and reject paths occur): on the tiny model, greedy
    next-token agreement along the target's outputs was 0.78 at noise 0.005, 0.5 at 0.01, 0.22 at 0.02.
    Cached in ``out`` (put the noise in its name)."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir, tmp)
    weights = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if ".layers." in name and w.dim() == 2:
            weights[name] = w + noise * torch.randn(w.shape, generator=g, dtype=w.dtype)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


_REFERENCE_CACHE: dict[tuple[Any, ...], list[Any]] = {}


def reference(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
    """No-speculation outputs (every request k = 0 through AdaptiveSpec's ``none`` policy), memoised per
    process on (prompts, params) so that the test files of one session share them."""
    from adaptive_spec.vllm import AdaptiveSpec

    plist = params if isinstance(params, list | tuple) else [params]
    key = (tuple(tuple(p) for p in prompts), tuple(repr(p) for p in plist))
    if key not in _REFERENCE_CACHE:
        with AdaptiveSpec(llm, ["none"], policy="none"):
            _REFERENCE_CACHE[key] = generate(llm, prompts, params)
    return _REFERENCE_CACHE[key]


def references_for(
    prompts: Sequence[Sequence[int]], outs: Sequence[Any]
) -> dict[tuple[int, ...], list[int]]:
    """``{prompt: output token ids}`` for :class:`OracleProposer` and :func:`check_bookkeeping`."""
    return {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
