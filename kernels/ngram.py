"""Batched n-gram match (prompt lookup) over token histories.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` proposer): the
draft is what followed an earlier occurrence of the context's last n tokens. For each request:

1. Only the last ``max_window`` tokens ``h`` are searched (bounded work: a 50k-token context
   costs the same as a ``max_window``-token one). The result equals the unbounded search run on
   ``h`` alone.
2. For each earlier end position e (0 <= e < len(h) - 1, so at least one token follows), the
   match length m[e] is the number of consecutive tokens, up to ``max_n``, with
   ``h[e - j] == h[len(h) - 1 - j]``.
3. The matched n is the largest m[e] (so n runs from ``max_n`` down); if it is below ``min_n``
   there is no match. Among the occurrences of that n-gram the most recent (largest e) wins.
4. The draft is the continuation ``h[e+1], h[e+2], ...`` copied with overlap (LZ77 style): with
   period D = len(h) - 1 - e, draft token t is ``h[e + 1 + (t mod D)]``, so a run of one token
   repeated yields a full draft instead of one token.
5. The draft length is ``min(ks[i], max_new_tokens[i] - 1, max_k)`` (>= 0), 0 without a match:
   never beyond the request's remaining token budget (the target's own token is the +1).

``ngram_match_reference`` is the PyTorch reference; ``_ngram_triton.py`` holds the Triton kernel
(one program per request, the window in one block); ``ngram_match`` dispatches.
"""

from __future__ import annotations

import torch

from ._checks import (
    DEFAULT_MAX_WINDOW,
    MAX_WINDOW_LIMIT,
    NgramMatch,
    check_ngram_config,
    prepare_ngram_match,
)
from ._common import use_triton

__all__ = [
    "DEFAULT_MAX_WINDOW",
    "MAX_WINDOW_LIMIT",
    "NgramMatch",
    "check_ngram_config",
    "ngram_match",
    "ngram_match_reference",
]


def ngram_match_reference(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    ks: torch.Tensor | int,
    *,
    min_n: int = 2,
    max_n: int = 4,
    max_window: int = DEFAULT_MAX_WINDOW,
    max_k: int | None = None,
    max_new_tokens: torch.Tensor | None = None,
) -> NgramMatch:
    """PyTorch reference of :func:`ngram_match` (same arguments, same result)."""
    cap, max_k = prepare_ngram_match(
        token_ids, num_tokens, ks, max_new_tokens, min_n, max_n, max_window, max_k
    )
    dev = token_ids.device
    b, lmax = token_ids.shape
    length = num_tokens.to(torch.int64).clamp(min=0, max=lmax)
    lw = length.clamp(max=max_window)
    base = length - lw
    w = min(max_window, lmax)
    pos = torch.arange(w, device=dev)
    gidx = (base[:, None] + pos[None, :]).clamp(max=max(lmax - 1, 0))
    h = torch.gather(token_ids.to(torch.int64), 1, gidx) if w else gidx
    e_ok = pos[None, :] < (lw[:, None] - 1)
    run = e_ok
    m = torch.zeros((b, w), dtype=torch.int64, device=dev)
    for j in range(max_n):
        idx = pos - j
        sidx = lw - 1 - j
        a = h[:, idx.clamp(min=0)] if w else h
        sfx = torch.gather(h, 1, sidx.clamp(min=0)[:, None]) if w else h[:, :1]
        cond = run & (idx >= 0)[None, :] & (sidx >= 0)[:, None] & (a == sfx)
        m += cond.to(torch.int64)
        run = cond
    best = m.max(dim=1).values if w else torch.zeros(b, dtype=torch.int64, device=dev)
    n = torch.where(best >= min_n, best, torch.zeros_like(best))
    hit = (m >= n[:, None]) & (n[:, None] > 0) & e_ok
    e_star = (
        torch.where(hit, pos[None, :], torch.full_like(m, -1)).max(dim=1).values if w else n - 1
    )
    num = torch.where(n > 0, cap, torch.zeros_like(cap))
    out = torch.full((b, max_k), -1, dtype=torch.int64, device=dev)
    if max_k and w:
        period = (lw - 1 - e_star).clamp(min=1)
        t = torch.arange(max_k, device=dev)
        src = (e_star.clamp(min=0)[:, None] + 1 + t[None, :] % period[:, None]).clamp(max=w - 1)
        vals = torch.gather(h, 1, src)
        out = torch.where(t[None, :] < num[:, None], vals, out)
    return NgramMatch(out, num, n)


def ngram_match(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    ks: torch.Tensor | int,
    *,
    min_n: int = 2,
    max_n: int = 4,
    max_window: int = DEFAULT_MAX_WINDOW,
    max_k: int | None = None,
    max_new_tokens: torch.Tensor | None = None,
    backend: str = "auto",
) -> NgramMatch:
    """Batched prompt lookup: longest suffix n-gram match and its continuation per request.

    See the module docstring for the exact rule (window, longest n, most recent occurrence,
    overlapping copy, budget cap).

    Parameters
    ----------
    token_ids : torch.Tensor
        int32/int64 [B, L_max]: token histories (prompt + output), left-aligned, any padding.
    num_tokens : torch.Tensor
        int32/int64 [B]: history length per request (clamped to [0, L_max]).
    ks : torch.Tensor or int
        Draft length wanted per request (int64 [B]) or for all.
    min_n, max_n : int
        Suffix n-gram sizes tried, 1 <= min_n <= max_n <= 64.
    max_window : int
        Only the last ``max_window`` tokens are searched (2..65536); work per request is
        O(max_window * max_n).
    max_k : int or None
        Output width; None = max(ks) (a host synchronisation on CUDA).
    max_new_tokens : torch.Tensor or None
        int [B]: tokens each request may still emit; drafts are cut to ``max_new_tokens - 1``.
    backend : {"auto", "torch", "triton"}
        "auto": Triton on CUDA tensors, else the PyTorch reference.

    Returns
    -------
    NgramMatch
        Drafts [B, max_k] (-1 padded), draft counts [B], matched n [B].

    Raises
    ------
    TypeError, ValueError
        A malformed argument (the message names it).

    Examples
    --------
    >>> import torch
    >>> toks = torch.tensor([[5, 6, 7, 8, 5, 6]])
    >>> r = ngram_match(toks, torch.tensor([6]), 3)
    >>> r.draft_token_ids.tolist(), r.match_len.tolist()
    ([[7, 8, 5]], [2])
    """
    if use_triton(backend, [token_ids, num_tokens]):
        from ._ngram_triton import ngram_match_triton

        return ngram_match_triton(
            token_ids,
            num_tokens,
            ks,
            min_n=min_n,
            max_n=max_n,
            max_window=max_window,
            max_k=max_k,
            max_new_tokens=max_new_tokens,
        )
    return ngram_match_reference(
        token_ids,
        num_tokens,
        ks,
        min_n=min_n,
        max_n=max_n,
        max_window=max_window,
        max_k=max_k,
        max_new_tokens=max_new_tokens,
    )
