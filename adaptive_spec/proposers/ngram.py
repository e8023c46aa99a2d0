"""N-gram (prompt lookup) proposer: drafts what followed the context's last n-gram earlier."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..kernels import check_ngram_config, ngram_match
from ._fastpath import ngram_draft, ngram_next_agrees, warm_up_ngram
from .base import (
    EMPTY,
    ProposalRequest,
    Proposer,
    as_int,
    as_tokens,
    check_ks,
    check_max_k,
    clean_draft,
    draft_cap,
)

BACKENDS = ("numpy", "auto", "torch", "triton")
_INT64_MAX = int(np.iinfo(np.int64).max)


def _length(token_ids: object) -> int:
    """Length of a request's history as the proposer reads it (garbage counts as empty)."""
    return (
        int(as_tokens(token_ids).shape[0])
        if not isinstance(token_ids, np.ndarray)
        else token_ids.size
    )


def _lookup_ready(toks: object) -> bool:
    """Whether a history is what the compiled lookup takes as is: a 1-D C-contiguous int64 array."""
    return (
        type(toks) is np.ndarray
        and toks.ndim == 1
        and toks.dtype == np.int64
        and toks.flags.c_contiguous
    )


def _history(request: ProposalRequest) -> np.ndarray:
    """The request's history as the compiled lookups take it (int64, 1-D, C-contiguous)."""
    toks = request.token_ids
    return toks if _lookup_ready(toks) else np.ascontiguousarray(as_tokens(toks))


class NgramProposer(Proposer):
    """Prompt-lookup proposer (Saxena 2023; vLLM's ``ngram`` method), stateless.

    For each request: the longest suffix n-gram of ``token_ids`` (n from ``max_n`` down to
    ``min_n``) found earlier within the last ``window`` tokens, most recent occurrence first,
    and the tokens that followed it (copied with overlap, so a repeated token gives a full
    draft); exactly :func:`adaptive_spec.kernels.ngram_match`.

    Parameters
    ----------
    min_n, max_n : int
        Suffix n-gram sizes, 1 <= min_n <= max_n <= 64.
    max_k : int
        Longest draft, 0..128.
    window : int
        Tokens searched (2..65536): bounded work per request, O(window * max_n).
    backend : {"numpy", "auto", "torch", "triton"}
        "numpy" (default): the CPU fast path, one request at a time (equal to the kernel's
        reference, proven in the tests). Otherwise the batched kernel on ``device`` with that
        backend.
    device : str or torch.device
        Where the batched kernel runs (ignored for "numpy").

    Raises
    ------
    ValueError
        Invalid configuration (the message names the parameter, its value and the allowed range).

    Examples
    --------
    >>> import numpy as np
    >>> p = NgramProposer(min_n=2, max_n=3, max_k=4)
    >>> r = ProposalRequest("a", np.array([5, 6, 7, 8, 5, 6]), max_new_tokens=10, vocab_size=10)
    >>> p.propose([r], [4])[0].tolist(), p.match_length(r)
    ([7, 8, 5, 6], 2)
    """

    name = "ngram"

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        max_k: int = 8,
        window: int = 2048,
        backend: str = "numpy",
        device: str | torch.device = "cpu",
    ) -> None:
        check_ngram_config(min_n, max_n, window)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_k = check_max_k(max_k)
        self.window = window
        self.backend = backend
        self.device = torch.device(device)
        if backend == "numpy":
            warm_up_ngram()  # its compiled lookup, loaded before the first step
        # Matched lengths of the last ``propose`` call, by request object: the step driver asks for
        # each request's match feature right after drafting, and the lookup found it already.
        self._matched: dict[int, tuple[ProposalRequest, int, int]] = {}

    def _one(self, request: ProposalRequest, cap: int, vocab: int) -> tuple[np.ndarray, int]:
        vocab = min(max(vocab, 0), _INT64_MAX)
        return ngram_draft(_history(request), cap, self.min_n, self.max_n, self.window, vocab)

    def propose(self, requests: Sequence[ProposalRequest], ks: Sequence[int]) -> list[np.ndarray]:
        """Prompt-lookup drafts per request (see :meth:`Proposer.propose`)."""
        kl = check_ks(requests, ks)
        self._matched = {}
        if self.backend == "numpy":
            out = []
            matched = self._matched
            max_k, min_n, max_n, window = self.max_k, self.min_n, self.max_n, self.window
            for r, k in zip(requests, kl, strict=True):
                toks, vocab, budget = r.token_ids, r.vocab_size, r.max_new_tokens
                if (
                    type(budget) is int
                    and type(vocab) is int
                    and 0 <= vocab <= _INT64_MAX
                    and _lookup_ready(toks)
                ):  # the step driver's requests: straight to the compiled lookup
                    c = min(k, max_k, budget - 1)
                    if c <= 0:
                        out.append(EMPTY)
                        continue
                    d, n = ngram_draft(toks, c, min_n, max_n, window, vocab)
                    matched[id(r)] = (r, toks.size, n)
                else:
                    c = draft_cap(r, k, max_k)
                    if c <= 0:
                        out.append(EMPTY)
                        continue
                    d, n = self._one(r, c, as_int(vocab))
                    matched[id(r)] = (r, _length(toks), n)
                out.append(d)
            return out
        caps = [draft_cap(r, k, self.max_k) for r, k in zip(requests, kl, strict=True)]
        vocab = [as_int(r.vocab_size) for r in requests]
        raw = self._batched(requests, caps)
        return [clean_draft(d, c, v) for d, c, v in zip(raw, caps, vocab, strict=True)]

    def _batched(self, requests: Sequence[ProposalRequest], caps: list[int]) -> list[np.ndarray]:
        if not requests:
            return []
        toks = [as_tokens(r.token_ids)[-self.window :] for r in requests]
        lmax = max(1, max(t.shape[0] for t in toks))
        padded = np.zeros((len(toks), lmax), dtype=np.int64)
        for i, t in enumerate(toks):
            padded[i, : t.shape[0]] = t
        dev = self.device
        res = ngram_match(
            torch.from_numpy(padded).to(dev),
            torch.tensor([t.shape[0] for t in toks], dtype=torch.int64, device=dev),
            torch.tensor(caps, dtype=torch.int64, device=dev),
            min_n=self.min_n,
            max_n=self.max_n,
            max_window=self.window,
            max_k=max(caps),
            backend=self.backend,
        )
        d = res.draft_token_ids.cpu().numpy()
        nd = res.num_draft_tokens.cpu().numpy()
        return [d[i, : nd[i]] for i in range(len(toks))]

    def match_length(self, request: ProposalRequest) -> int:
        """Suffix n-gram length matched now (0 if none); the last ``propose`` call's lookup when it
        drafted for this very request object with the same history length (the step driver builds
        new requests every step and asks right after drafting)."""
        hit = self._matched.get(id(request))
        if hit is not None and hit[0] is request and hit[1] == _length(request.token_ids):
            return hit[2]
        return self._one(request, 0, 1)[1]

    def match_feature(self, request: ProposalRequest) -> int:
        """The controller's context feature: the matched suffix length (:meth:`match_length`) when
        every occurrence of that suffix in the window was followed by the same token, else 0 (its
        own acceptance cell: a suffix whose occurrences disagree on what comes next is a weaker
        bet, :func:`~adaptive_spec.proposers._fastpath.ngram_next_agrees`). 0 without a match."""
        n = self.match_length(request)
        if n <= 0:
            return 0
        return n if ngram_next_agrees(_history(request), n, self.window) else 0
