"""Counterfactual drafts: what every proposer would have offered at every output position.

Under greedy decoding the output sequence does not depend on the arms chosen, so for a
deterministic proposer the accepted length of any ``(proposer, k)`` at any position is computable
after the fact:

* **n-gram** (prompt lookup, stateless): rerun :class:`adaptive_spec.proposers.NgramProposer` on the
  prefix ``prompt + output[:n]`` for every ``n`` (:func:`ngram_counterfactual`); the result equals the
  drafts the engine logged (``cf_drafts``) at the positions it decided at, which :func:`check_logged`
  verifies.
* **suffix** (stateful: its global index holds every request's text seen so far): replay the recorded
  steps in order, each decision point's batch (the rows that carry ``cf_drafts``) proposed together
  with each request's prefix ``prompt + output[:n]``, finished requests released after their last step
  (:func:`suffix_counterfactual`); this rebuilds the engine's index exactly, so the drafts equal the
  logged ones, but only at the positions the recorded run decided at (others stay unknown, as for
  Jacobi).
* **Jacobi** (stateful: its iterate comes from the previous verification): only the drafts the
  recorded run logged are known, at the positions it decided at (:func:`logged_only`). A replay that
  reaches another position sees no Jacobi draft there (documented limit, ``docs/replay.md``).
* **draft model**: one teacher-forced pass of the draft model over ``prompt + output`` gives its
  argmax at every position given the true prefix; while its greedy draft agrees with the output, its
  autoregressive inputs *are* the true prefix, so the draft from position ``n`` agrees exactly for the
  run of agreeing argmaxes starting at ``n`` and then differs (:func:`draft_model_counterfactual`).
  Tokens after the first disagreement are not the model's autoregressive draft (they are the
  teacher-forced argmaxes) but never change an accepted length.

Temperature > 0: the emitted tokens are one sample; equality with the draft is not the acceptance
event of rejection sampling. The expected accepted length of a draft needs the target's probability
of each draft token (:func:`expected_accepted_length`); version 1 traces do not log probabilities, so
the replay scores sampled requests by equality and counts them (see ``docs/replay.md``).

:func:`write_counterfactuals` stores the tables in a trace as ``"counterfactual"`` lines (ignored by
:func:`adaptive_spec.core.trace.read_trace`); :func:`read_counterfactuals` loads them back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_spec.core.trace import Trace

from .requests import Counterfactuals, DraftTable, logged_drafts, matched_length, outputs_from_trace

CF_TYPE = "counterfactual"
SOURCES = ("rerun", "logged", "teacher-forced", "synthetic")


def ngram_counterfactual(
    prompt_token_ids: np.ndarray,
    output_token_ids: np.ndarray,
    max_k: int,
    *,
    max_tokens: int | None = None,
    min_n: int = 2,
    max_n: int = 4,
    window: int = 2048,
    vocab_size: int | None = None,
    proposer: Any = None,
) -> tuple[DraftTable, np.ndarray]:
    """Rerun the n-gram proposer at every output position.

    Parameters
    ----------
    prompt_token_ids, output_token_ids : numpy.ndarray of int64, shapes [P] and [L]
        The request's prompt and final output.
    max_k : int
        Longest draft (the engine's ``num_speculative_tokens``).
    max_tokens : int, optional
        The request's output budget (drafts are capped at ``max_tokens - n - 1`` as in the engine);
        default: no cap beyond ``max_k``.
    min_n, max_n, window : int
        Prompt-lookup parameters; must equal the engine's (``AdaptiveSpec(ngram_min=2, ngram_max=4)``).
    vocab_size : int, optional
        Draft ids must be below it (default: one above the largest id seen).
    proposer : object, optional
        A proposer with the :class:`adaptive_spec.proposers.Proposer` interface to use instead of a new
        ``NgramProposer(min_n, max_n, max_k, window)``.

    Returns
    -------
    (DraftTable, numpy.ndarray of int64, shape [L])
        The int64 draft at each position ``n`` (empty when the lookup finds no match) and the
        controller's match feature there
        (:func:`adaptive_spec.proposers.base.controller_feature`, as the step driver computes it; 0 when
        the draft is empty).
    """
    from adaptive_spec.proposers import NgramProposer, ProposalRequest
    from adaptive_spec.proposers.base import controller_feature

    prop = proposer or NgramProposer(min_n=min_n, max_n=max_n, max_k=max_k, window=window)
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    out = np.asarray(output_token_ids, dtype=np.int64)
    seq = np.concatenate([prompt, out])
    L = out.shape[0]
    vocab = int(vocab_size) if vocab_size is not None else int(seq.max(initial=0)) + 1
    budget = max_tokens if max_tokens is not None else L + max_k + 1
    table: DraftTable = []
    reqs = [
        ProposalRequest(
            req_id="cf",
            token_ids=seq[: prompt.shape[0] + n],
            max_new_tokens=int(budget - n),
            vocab_size=vocab,
        )
        for n in range(L)
    ]
    drafts = prop.propose(reqs, [max_k] * L)
    feats = np.zeros(L, dtype=np.int64)
    for n, (r, d) in enumerate(zip(reqs, drafts, strict=True)):
        table.append(np.asarray(d, dtype=np.int64))
        feats[n] = controller_feature(prop, r) if len(d) else 0
    return table, feats


def suffix_counterfactual(
    trace: Trace,
    *,
    options: Mapping[str, Any] | None = None,
    tenant_of: Any = None,
) -> Counterfactuals:
    """Recompute the suffix proposer's drafts of a recorded run, at the positions it decided at.

    The proposer's global index depends on every request's text seen so far, so the trace is replayed
    in its own order: for each step, the requests whose row has ``cf_drafts`` were decided together
    after the previous step (their history then was ``prompt + output[:num_output_before]``); they are
    proposed as one batch, then the step's finished requests are released, as in
    :class:`adaptive_spec.vllm.AdaptiveSpec`.

    Parameters
    ----------
    trace : Trace
        A trace recorded with the ``suffix`` proposer (its header's ``meta.suffix`` holds the proposer's
        :meth:`~adaptive_spec.proposers.SuffixProposer.config`).
    options : mapping, optional
        SuffixProposer parameters overriding the header's (``max_k`` is the header's ``max_k``): replay
        another configuration of the proposer on the same traffic.
    tenant_of : mapping or callable, optional
        Request id -> tenant, for ``scope="tenant"`` (the trace does not record tenants).

    Returns
    -------
    Counterfactuals
        ``tables[req_id]["suffix"]`` (int64 drafts at decided positions, None elsewhere),
        ``features[req_id]["suffix"]`` (the ``match_length`` feature there, 0 elsewhere), source
        ``rerun``.

    Raises
    ------
    ValueError
        When the header has no valid ``max_k``, or for invalid proposer options (``scope="tenant"``
        without ``tenant_of``).
    """
    from adaptive_spec.proposers import ProposalRequest, SuffixProposer
    from adaptive_spec.proposers.base import controller_feature

    max_k = trace.header.get("max_k")
    if not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"trace header max_k={max_k!r}; expected an integer >= 1")
    opts = dict((trace.header.get("meta") or {}).get("suffix") or {})
    opts.update(options or {})
    opts["max_k"] = max_k
    if tenant_of is not None:
        opts["tenant_of"] = tenant_of
    prop = SuffixProposer(**opts)
    outs = outputs_from_trace(trace)
    prompts = {
        rid: np.asarray(meta.get("prompt_token_ids") or [], dtype=np.int64)
        for rid, meta in trace.requests.items()
    }
    vocab = 1 + max(
        [int(o.max(initial=0)) for o in outs.values()]
        + [int(p.max(initial=0)) for p in prompts.values()]
    )
    cf = Counterfactuals(sources={"suffix": "rerun"})
    for rid, out in outs.items():
        if out.size:
            cf.tables[rid] = {"suffix": [None] * int(out.size)}
            cf.features[rid] = {"suffix": np.zeros(int(out.size), dtype=np.int64)}
    for s in trace.steps:
        rows = [
            r
            for r in s.get("requests", [])
            if r.get("cf_drafts") is not None
            and isinstance(r.get("num_output_before"), int)
            and r["req_id"] in cf.tables
        ]
        batch = []
        for r in rows:
            rid, n = r["req_id"], r["num_output_before"]
            out = outs[rid]
            mt = trace.requests.get(rid, {}).get("max_tokens")
            budget = (mt if isinstance(mt, int) and mt >= out.size else out.size + max_k + 1) - n
            toks = np.concatenate([prompts.get(rid, np.zeros(0, dtype=np.int64)), out[:n]])
            batch.append(ProposalRequest(rid, toks, int(budget), vocab))
        if batch:
            drafts = prop.propose(batch, [max_k] * len(batch))
            for r, req, d in zip(rows, batch, drafts, strict=True):
                rid, n = r["req_id"], r["num_output_before"]
                if n < len(cf.tables[rid]["suffix"]):
                    cf.tables[rid]["suffix"][n] = np.asarray(d, dtype=np.int64)
                    cf.features[rid]["suffix"][n] = controller_feature(prop, req) if len(d) else 0
        for r in s.get("requests", []):
            if r.get("finished"):
                prop.release(r["req_id"])
    return cf


def logged_only(trace: Trace, proposer: str) -> dict[str, DraftTable]:
    """The drafts ``proposer`` offered where the recorded run decided (None elsewhere).

    Returns ``{req_id: DraftTable}``; requests where the proposer never appears are absent.
    """
    outs = outputs_from_trace(trace)
    return {
        rid: per[proposer] for rid, per in logged_drafts(trace, outs).items() if proposer in per
    }


ArgmaxFn = Callable[[np.ndarray], np.ndarray]


def torch_causal_lm(model: Any, device: str = "cpu") -> ArgmaxFn:
    """Wrap a PyTorch causal LM (``model(input_ids).logits`` as in Hugging Face transformers, or a
    module returning logits directly) as ``f(token_ids int64 [T]) -> argmax int64 [T]``."""
    import torch

    def f(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)[None, :]
            out = model(x)
            logits = getattr(out, "logits", out)
            return logits[0].argmax(dim=-1).cpu().numpy().astype(np.int64)

    return f


def draft_model_counterfactual(
    argmax_fn: ArgmaxFn,
    prompt_token_ids: np.ndarray,
    output_token_ids: np.ndarray,
    max_k: int,
    *,
    max_tokens: int | None = None,
) -> DraftTable:
    """Greedy draft-model drafts at every output position from one teacher-forced pass.

    Parameters
    ----------
    argmax_fn : callable
        ``f(token_ids int64 [T]) -> int64 [T]``: the draft model's argmax next token at every position
        of ``token_ids`` (or ``[T, V]`` logits, reduced here). :func:`torch_causal_lm` wraps a torch model.
    prompt_token_ids, output_token_ids : numpy.ndarray of int64, shapes [P >= 1] and [L]
    max_k : int
        Draft length.
    max_tokens : int, optional
        Output budget (drafts capped at ``max_tokens - n - 1``).

    Returns
    -------
    DraftTable
        Length L. At position n the draft's first ``r + 1`` tokens are exact (r = the run of positions
        from n where the draft model's argmax equals the output, the next one its first disagreeing
        token); later tokens are teacher-forced argmaxes (see the module docstring).

    Raises
    ------
    ValueError
        For an empty prompt or an ``argmax_fn`` result of the wrong shape.
    """
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    out = np.asarray(output_token_ids, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("prompt_token_ids is empty; the draft model needs >= 1 prompt token")
    seq = np.concatenate([prompt, out])
    am = np.asarray(argmax_fn(seq))
    if am.ndim == 2:
        am = am.argmax(axis=-1)
    if am.shape != (seq.shape[0],):
        raise ValueError(
            f"argmax_fn returned shape {am.shape}; expected ({seq.shape[0]},) or [T, V]"
        )
    am = am.astype(np.int64)
    P, L = prompt.shape[0], out.shape[0]
    pred = am[P - 1 : P - 1 + L + 1]  # pred[j] = draft argmax for output position j (j = 0..L)
    budget = max_tokens if max_tokens is not None else L + max_k + 1
    table: DraftTable = []
    for n in range(L):
        cap = max(0, min(max_k, budget - n - 1))
        d = pred[n : n + cap].copy()
        if d.shape[0] < cap:  # past the end of the output: repeat the last prediction
            d = np.concatenate([d, np.full(cap - d.shape[0], pred[-1], dtype=np.int64)])
        table.append(d)
    return table


def expected_accepted_length(accept_probs: np.ndarray) -> float:
    """Expected accepted draft tokens under rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    Parameters
    ----------
    accept_probs : numpy.ndarray of float, shape [k]
        Per-position acceptance probability ``min(1, p(x_j) / q(x_j))`` of each draft token given the
        previous ones were accepted (for a deterministic proposer, ``q = 1`` and this is the target's
        probability ``p(x_j)`` of the draft token).

    Returns
    -------
    float
        ``sum_j prod_{i <= j} accept_probs[i]``; the expected tokens emitted is this plus one.

    Raises
    ------
    ValueError
        When a probability is outside [0, 1].
    """
    a = np.asarray(accept_probs, dtype=float).reshape(-1)
    if a.size and (not np.isfinite(a).all() or a.min() < 0 or a.max() > 1):
        raise ValueError("accept_probs must lie in [0, 1]")
    return float(np.cumprod(a).sum()) if a.size else 0.0


def acceptance_probs(target_probs: np.ndarray, draft_probs: np.ndarray | None = None) -> np.ndarray:
    """``min(1, p / q)`` per draft position; ``q = 1`` (deterministic proposer) when ``draft_probs`` is None.

    Parameters
    ----------
    target_probs : numpy.ndarray of float, shape [k]
        The target's probability of each draft token.
    draft_probs : numpy.ndarray of float, shape [k], optional
        The proposer's probability of each draft token (> 0).
    """
    p = np.asarray(target_probs, dtype=float)
    if draft_probs is None:
        return np.clip(p, 0.0, 1.0)
    q = np.asarray(draft_probs, dtype=float)
    if q.shape != p.shape or (q <= 0).any():
        raise ValueError("draft_probs must have the shape of target_probs and be > 0")
    return np.minimum(1.0, p / q)


def build_counterfactuals(
    trace: Trace,
    *,
    ngram: bool = True,
    min_n: int = 2,
    max_n: int = 4,
    window: int = 2048,
    draft_argmax: ArgmaxFn | None = None,
    draft_name: str = "draft",
) -> Counterfactuals:
    """Counterfactual draft tables for every request of a trace.

    Parameters
    ----------
    trace : Trace
    ngram : bool
        Rerun the n-gram proposer (at every position) when the header lists ``ngram``.
    min_n, max_n, window : int
        The n-gram parameters the engine used.
    draft_argmax : callable, optional
        A draft model's teacher-forced argmax (:func:`torch_causal_lm`): adds ``draft_name`` tables.
    draft_name : str
        Proposer name of the draft model (``draft`` or ``lora:<adapter>``).

    Returns
    -------
    Counterfactuals
        Sources ``rerun`` (n-gram) and ``teacher-forced`` (draft model).

    Raises
    ------
    ValueError
        When the trace header has no valid ``max_k``.
    """
    max_k = trace.header.get("max_k")
    if not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"trace header max_k={max_k!r}; expected an integer >= 1")
    outs = outputs_from_trace(trace)
    vocab = 1 + max(
        [int(o.max(initial=0)) for o in outs.values()]
        + [max(r.get("prompt_token_ids") or [0]) for r in trace.requests.values()]
    )
    cf = Counterfactuals()
    do_ngram = ngram and "ngram" in (trace.header.get("proposers") or ["ngram"])
    for rid, out in outs.items():
        if out.size == 0:
            continue
        meta = trace.requests.get(rid, {})
        prompt = np.asarray(meta.get("prompt_token_ids") or [], dtype=np.int64)
        mt = meta.get("max_tokens")
        mt = mt if isinstance(mt, int) and mt >= out.size else None
        per = cf.tables.setdefault(rid, {})
        if do_ngram:
            tab, feats = ngram_counterfactual(
                prompt,
                out,
                max_k,
                max_tokens=mt,
                min_n=min_n,
                max_n=max_n,
                window=window,
                vocab_size=vocab,
            )
            per["ngram"] = tab
            cf.features.setdefault(rid, {})["ngram"] = feats
            cf.sources["ngram"] = "rerun"
        if draft_argmax is not None and prompt.size:
            per[draft_name] = draft_model_counterfactual(
                draft_argmax, prompt, out, max_k, max_tokens=mt
            )
            cf.sources[draft_name] = "teacher-forced"
    return cf


def check_logged(trace: Trace, cf: Counterfactuals, proposer: str) -> dict[str, int]:
    """Compare recomputed drafts with the ones the run logged (``cf_drafts``).

    Returns ``{"compared": n, "equal": n, "same_accepted": n}``: positions where both exist, where the
    drafts are identical, and where they give the same accepted length against the output.
    """
    outs = outputs_from_trace(trace)
    logged = logged_drafts(trace, outs)
    res = {"compared": 0, "equal": 0, "same_accepted": 0}
    for rid, per in logged.items():
        lt = per.get(proposer)
        ct = cf.tables.get(rid, {}).get(proposer)
        if lt is None or ct is None:
            continue
        out = outs[rid]
        for n, (a, b) in enumerate(zip(lt, ct, strict=True)):
            if a is None or b is None:
                continue
            res["compared"] += 1
            res["equal"] += int(a.shape == b.shape and bool((a == b).all()))
            res["same_accepted"] += int(matched_length(a, out[n:]) == matched_length(b, out[n:]))
    return res


def _table_json(table: DraftTable) -> list[list[int] | None]:
    return [None if d is None else [int(t) for t in d] for d in table]


def counterfactual_lines(cf: Counterfactuals) -> Iterable[dict[str, Any]]:
    """The ``"counterfactual"`` trace records of ``cf`` (one per request and proposer)."""
    for rid, per in cf.tables.items():
        for p, tab in per.items():
            rec: dict[str, Any] = {
                "type": CF_TYPE,
                "req_id": rid,
                "proposer": p,
                "source": cf.sources.get(p, "rerun"),
                "drafts": _table_json(tab),
            }
            feats = cf.features.get(rid, {}).get(p)
            if feats is not None:
                rec["match_lengths"] = [int(v) for v in feats]
            yield rec


def write_counterfactuals(
    trace_path: str | Path, out_path: str | Path, cf: Counterfactuals
) -> Path:
    """Copy a trace to ``out_path`` with ``"counterfactual"`` lines appended before its ``end`` line.

    Existing counterfactual lines for the same (request, proposer) are replaced; ``out_path`` may be
    ``trace_path`` (written atomically). The header gains ``"counterfactuals": {proposer: source}``.
    Returns ``out_path``.

    Raises
    ------
    ValueError
        When ``trace_path`` is not a readable trace (see :func:`adaptive_spec.core.trace.read_trace`).
    """
    from adaptive_spec.core.trace import read_trace

    read_trace(trace_path)  # validates schema and version
    trace_path, out_path = Path(trace_path), Path(out_path)
    lines = trace_path.read_text(encoding="utf-8").split("\n")
    header = json.loads(lines[0])
    header["counterfactuals"] = {**(header.get("counterfactuals") or {}), **cf.sources}
    body, end = [], None
    replace = {(rid, p) for rid, per in cf.tables.items() for p in per}
    for line in lines[1:]:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a cut last line: dropped
        if rec.get("type") == "end":
            end = line
            continue
        if rec.get("type") == CF_TYPE and (rec.get("req_id"), rec.get("proposer")) in replace:
            continue
        body.append(line)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for line in body:
            f.write(line + "\n")
        for rec in counterfactual_lines(cf):
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if end is not None:
            f.write(end + "\n")
    shutil.move(tmp, out_path)
    return out_path


def read_counterfactuals(path: str | Path) -> Counterfactuals:
    """Load the ``"counterfactual"`` lines of a trace. A cut last line is ignored (as by
    :func:`adaptive_spec.core.trace.read_trace`)."""
    cf = Counterfactuals()
    with Path(path).open("r", encoding="utf-8") as f:
        for line in f:
            if CF_TYPE not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("type") != CF_TYPE:
                continue
            tab = [None if d is None else np.asarray(d, dtype=np.int64) for d in rec["drafts"]]
            cf.tables.setdefault(rec["req_id"], {})[rec["proposer"]] = tab
            if rec.get("match_lengths") is not None:
                cf.features.setdefault(rec["req_id"], {})[rec["proposer"]] = np.asarray(
                    rec["match_lengths"], dtype=np.int64
                )
            cf.sources[rec["proposer"]] = rec.get("source", "rerun")
    return cf
