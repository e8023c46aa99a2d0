"""Requests as the replay simulator sees them: the final output sequence plus counterfactual drafts.

Under greedy decoding the emitted sequence does not depend on which proposer drafted or on k, so a
request is fully described offline by its prompt, its final output tokens, and, for every proposer
and every output position ``n``, the draft that proposer would offer after ``n`` committed output
tokens. The accepted length of any arm ``(proposer, k)`` at position ``n`` is then the longest common
prefix of that draft's first ``k`` tokens with ``output[n:]``.

:func:`requests_from_trace` rebuilds these from a trace (outputs from the per-step
``emitted_token_ids``, logged drafts from ``cf_drafts``); the :class:`Counterfactuals` tables that
:mod:`adaptive_spec.sim.counterfactual` computes fill in the positions a trace did not log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptive_spec.core.arms import check_proposer_name
from adaptive_spec.core.trace import Trace

DraftTable = list[np.ndarray | None]
"""Per output position ``n`` (``0..L-1``): the int64 draft offered there, or None when unknown."""


def _as_ids(x: object, name: str) -> np.ndarray:
    arr = np.asarray(x if x is not None else [], dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} has a negative token id ({int(arr.min())}); allowed: ids >= 0")
    return arr


@dataclass(slots=True)
class ReplayRequest:
    """One request for offline replay.

    Parameters
    ----------
    req_id : str
        Request id (unique within a workload).
    prompt_token_ids : numpy.ndarray of int64, shape [P]
        Prompt tokens.
    output_token_ids : numpy.ndarray of int64, shape [L]
        The committed output (after EOS/stop/length truncation), L >= 1.
    max_tokens : int
        The request's output budget (>= L); ``RequestView.max_new_tokens`` is ``max_tokens - n``.
    temperature : float
        Sampling temperature (> 0: counterfactuals by equality are approximate, see ``docs/replay.md``).
    category : str or None
        Workload category for per-category statistics.
    arrival_s : float
        Simulated arrival time in seconds (0: present from the start, closed loop).
    drafts : dict of str to DraftTable
        Per proposer, the draft offered at each output position (length L; None = unknown there).
    match_features : dict of str to numpy.ndarray of int64, shape [L]
        Per proposer, the controller's ``match_length`` feature at each position (the n-gram suffix
        length); absent: for logged Jacobi drafts the draft's length (0 for the initial guess, the last
        committed token repeated), 0 otherwise.
    prefill_tokens : int or None
        Prompt tokens the engine computed for this request (0..P): fewer than the prompt when its
        prefix cache held the rest, as after ``adaptive-spec run``'s warm-up pass. None: the whole
        prompt (:attr:`prefill_len`).

    Raises
    ------
    ValueError
        For an empty output, negative ids, ``max_tokens < L``, an unknown proposer name, or a draft
        table whose length is not L.
    """

    req_id: str
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    max_tokens: int
    temperature: float = 0.0
    category: str | None = None
    arrival_s: float = 0.0
    drafts: dict[str, DraftTable] = field(default_factory=dict)
    match_features: dict[str, np.ndarray] = field(default_factory=dict)
    prefill_tokens: int | None = None
    _match: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = _as_ids(self.prompt_token_ids, "prompt_token_ids")
        self.output_token_ids = _as_ids(self.output_token_ids, "output_token_ids")
        if self.output_token_ids.size == 0:
            raise ValueError(
                f"request {self.req_id!r}: output_token_ids is empty; allowed: >= 1 token"
            )
        if not isinstance(self.max_tokens, int | np.integer) or self.max_tokens < len(self):
            raise ValueError(
                f"request {self.req_id!r}: max_tokens={self.max_tokens!r} is invalid; allowed: an integer "
                f">= the output length {len(self)}"
            )
        self.max_tokens = int(self.max_tokens)
        if not np.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(
                f"arrival_s={self.arrival_s!r} is invalid; allowed: a finite number >= 0"
            )
        if self.prefill_tokens is not None:
            n_prompt = int(self.prompt_token_ids.shape[0])
            if (
                not isinstance(self.prefill_tokens, int | np.integer)
                or not 0 <= self.prefill_tokens <= n_prompt
            ):
                raise ValueError(
                    f"request {self.req_id!r}: prefill_tokens={self.prefill_tokens!r} is invalid; "
                    f"allowed: an integer from 0 to the prompt length {n_prompt}, or None (the whole prompt)"
                )
            self.prefill_tokens = int(self.prefill_tokens)
        for p in list(self.drafts):
            self.set_drafts(p, self.drafts[p])

    @property
    def prefill_len(self) -> int:
        """Prompt tokens a replay charges as this request's prefill (``prefill_tokens``, else the
        whole prompt)."""
        if self.prefill_tokens is None:
            return int(self.prompt_token_ids.shape[0])
        return self.prefill_tokens

    def __len__(self) -> int:
        return int(self.output_token_ids.shape[0])

    def set_drafts(self, proposer: str, table: DraftTable) -> None:
        """Set (or replace) the draft table of ``proposer``.

        Raises
        ------
        ValueError
            For an unknown proposer name or a table whose length is not the output length.
        """
        check_proposer_name(proposer)
        if proposer == "none":
            raise ValueError(
                "proposer='none' offers no drafts; allowed: ngram, jacobi, suffix, draft, lora:<name>"
            )
        if len(table) != len(self):
            raise ValueError(
                f"request {self.req_id!r}: drafts[{proposer!r}] has {len(table)} positions; expected {len(self)}"
            )
        clean: DraftTable = [
            None if d is None else _as_ids(d, f"drafts[{proposer!r}]") for d in table
        ]
        self.drafts[proposer] = clean
        out = self.output_token_ids
        m = np.full(len(self), -1, dtype=np.int64)
        for n, d in enumerate(clean):
            if d is not None:
                m[n] = matched_length(d, out[n:])
        self._match[proposer] = m

    def draft(self, proposer: str, n: int) -> np.ndarray | None:
        """The draft ``proposer`` offers after ``n`` output tokens (None when unknown)."""
        t = self.drafts.get(proposer)
        return None if t is None or n >= len(t) else t[n]

    def match_length(self, proposer: str, n: int) -> int:
        """Accepted length of ``proposer``'s full draft at position ``n`` (-1 when unknown)."""
        m = self._match.get(proposer)
        return -1 if m is None or n >= len(m) else int(m[n])

    def match_feature(self, proposer: str, n: int) -> int:
        """The ``match_length`` feature a live engine would report for ``proposer`` at position ``n``."""
        f = self.match_features.get(proposer)
        if f is not None and n < len(f):
            return int(f[n])
        d = self.draft(proposer, n)
        if d is None or proposer != "jacobi" or d.size == 0:
            return 0
        # JacobiProposer.match_length counts its candidate but not the initial guess (the last
        # committed token repeated).
        last = self.output_token_ids[n - 1] if n > 0 else None
        return 0 if last is not None and bool((d == last).all()) else int(d.size)

    def coverage(self, proposer: str) -> float:
        """Share of decision positions ``1..L-1`` where ``proposer``'s draft is known."""
        m = self._match.get(proposer)
        if m is None or len(self) <= 1:
            return 0.0
        return float((m[1:] >= 0).mean())


@dataclass(slots=True)
class Counterfactuals:
    """Counterfactual draft tables of a workload.

    Attributes
    ----------
    tables : dict
        ``{req_id: {proposer: DraftTable}}``.
    features : dict
        ``{req_id: {proposer: int64 [L]}}``: the ``match_length`` feature per position, where known.
    sources : dict
        ``{proposer: source}``, source in ``rerun``, ``logged``, ``teacher-forced``, ``synthetic``.
    """

    tables: dict[str, dict[str, DraftTable]] = field(default_factory=dict)
    features: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def merge(self, other: Counterfactuals) -> Counterfactuals:
        """Entries of ``other`` replace this one's (per request and proposer); returns self."""
        for rid, per in other.tables.items():
            self.tables.setdefault(rid, {}).update(per)
        for rid, per in other.features.items():
            self.features.setdefault(rid, {}).update(per)
        self.sources.update(other.sources)
        return self


def matched_length(draft: np.ndarray, target: np.ndarray) -> int:
    """Longest common prefix of ``draft`` and ``target`` (both int64 1-D): the accepted length of the
    draft under greedy verification when ``target`` holds the tokens the target emits."""
    n = min(draft.shape[0], target.shape[0])
    if n == 0:
        return 0
    neq = np.flatnonzero(draft[:n] != target[:n])
    return int(neq[0]) if neq.size else n


def outputs_from_trace(trace: Trace) -> dict[str, np.ndarray]:
    """Each request's committed output, concatenated from the step lines' ``emitted_token_ids``.

    Raises
    ------
    ValueError
        When a step row's ``num_output_before`` disagrees with the tokens seen so far (a trace with
        missing steps).
    """
    out: dict[str, list[int]] = {}
    for s in trace.steps:
        for r in s.get("requests", []):
            rid = r["req_id"]
            toks = out.setdefault(rid, [])
            before = r.get("num_output_before")
            if before is not None and before != len(toks):
                raise ValueError(
                    f"trace step {s.get('step')}: request {rid!r} has num_output_before={before} but "
                    f"{len(toks)} tokens were emitted before; the trace misses steps"
                )
            toks.extend(int(t) for t in r.get("emitted_token_ids") or [])
    return {rid: np.asarray(t, dtype=np.int64) for rid, t in out.items()}


def logged_drafts(trace: Trace, outputs: dict[str, np.ndarray]) -> dict[str, dict[str, DraftTable]]:
    """Drafts the recorded run logged (``cf_drafts``), placed at the position they were offered.

    Returns ``{req_id: {proposer: DraftTable}}``; positions the run never decided at are None.
    """
    res: dict[str, dict[str, DraftTable]] = {}
    for s in trace.steps:
        for r in s.get("requests", []):
            cf = r.get("cf_drafts")
            rid = r["req_id"]
            n = r.get("num_output_before")
            if not cf or n is None or rid not in outputs:
                continue
            L = len(outputs[rid])
            if n >= L:
                continue
            per = res.setdefault(rid, {})
            for p, d in cf.items():
                if p == "none":
                    continue
                tab = per.setdefault(p, [None] * L)
                tab[n] = np.asarray(d, dtype=np.int64)
    return res


def requests_from_trace(
    trace: Trace,
    counterfactuals: Counterfactuals | None = None,
    *,
    use_logged: bool = True,
) -> list[ReplayRequest]:
    """Rebuild the replay requests of a trace, in the order they first appeared.

    Parameters
    ----------
    trace : Trace
        A loaded trace (:func:`adaptive_spec.core.trace.read_trace`).
    counterfactuals : Counterfactuals, optional
        From :func:`adaptive_spec.sim.counterfactual.build_counterfactuals` or
        :func:`~adaptive_spec.sim.counterfactual.read_counterfactuals`; for a proposer present there,
        its table replaces the logged drafts, except at positions where it is None.
    use_logged : bool
        Use the trace's ``cf_drafts`` for proposers (or positions) the counterfactuals do not cover.

    Returns
    -------
    list of ReplayRequest
        Requests with at least one output token; ``max_tokens`` is the logged budget (or the output
        length when the budget was not logged or is smaller).
    """
    outputs = outputs_from_trace(trace)
    logged = logged_drafts(trace, outputs) if use_logged else {}
    computed = computed_prefill(trace)
    order = list(trace.requests) + [rid for rid in outputs if rid not in trace.requests]
    reqs = []
    for rid in order:
        out = outputs.get(rid)
        if out is None or out.size == 0:
            continue
        meta = trace.requests.get(rid, {})
        L = int(out.size)
        max_tokens = meta.get("max_tokens")
        max_tokens = L if not isinstance(max_tokens, int) or max_tokens < L else max_tokens
        tables: dict[str, DraftTable] = dict(logged.get(rid, {}))
        feats: dict[str, np.ndarray] = {}
        if counterfactuals is not None:
            for p, tab in counterfactuals.tables.get(rid, {}).items():
                if len(tab) != L:
                    raise ValueError(
                        f"counterfactual drafts of {rid!r}/{p!r} have {len(tab)} positions; the output has {L}"
                    )
                base = tables.get(p, [None] * L)
                tables[p] = [c if c is not None else b for c, b in zip(tab, base, strict=True)]
            feats = dict(counterfactuals.features.get(rid, {}))
        reqs.append(
            ReplayRequest(
                req_id=rid,
                prompt_token_ids=np.asarray(meta.get("prompt_token_ids") or [], dtype=np.int64),
                output_token_ids=out,
                max_tokens=max_tokens,
                temperature=float(meta.get("temperature") or 0.0),
                category=meta.get("category"),
                drafts=tables,
                match_features=feats,
                prefill_tokens=computed.get(rid),
            )
        )
    return reqs


def computed_prefill(trace: Trace) -> dict[str, int]:
    """Prompt tokens the engine computed per request, from the steps' ``num_prefill_tokens`` (which
    leave out what the prefix cache held): each step's count, plus that of earlier steps that
    finished no prefill (chunks), is shared among the requests emitting their first token there in
    proportion to their prompt lengths, capped at each prompt's length. Empty when the steps do not
    log ``num_prefill_tokens`` (a replay then charges whole prompts). Returns request id -> tokens."""
    out: dict[str, int] = {}
    pending = 0
    for s in trace.steps:
        n = s.get("num_prefill_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return {}
        pending += n
        new = [
            r["req_id"]
            for r in s.get("requests", [])
            if r.get("num_output_before") == 0 and r.get("req_id") not in out
        ]
        if not new:
            continue
        lens = [len(trace.requests.get(rid, {}).get("prompt_token_ids") or []) for rid in new]
        total = sum(lens)
        left = pending
        for i, (rid, plen) in enumerate(zip(new, lens, strict=True)):
            share = left if i == len(new) - 1 else (pending * plen // total if total else 0)
            out[rid] = min(plen, max(0, share))
            left -= share
        pending = 0
    return out


def recorded_goodput(trace: Trace) -> tuple[int, float]:
    """``(tokens, seconds)`` of a trace: committed tokens over the summed positive step times."""
    tokens = 0
    secs = 0.0
    for s in trace.steps:
        t = s.get("step_time_s")
        if isinstance(t, int | float) and np.isfinite(t) and t > 0:
            secs += float(t)
        tokens += sum(int(r.get("emitted", 0)) for r in s.get("requests", []))
    return tokens, secs


def max_batch_size(trace: Trace) -> int:
    """Largest ``batch_size`` of any step (1 for a trace without steps)."""
    return max([int(s.get("batch_size") or 0) for s in trace.steps] + [1])
