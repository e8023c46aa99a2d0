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

from dataclasses import dataclass

import torch

from ._common import INT_DTYPES, check_same_device, check_tensor, use_triton

DEFAULT_MAX_WINDOW = 2048
MAX_WINDOW_LIMIT = 1 << 16


@dataclass(slots=True)
class NgramMatch:
    """Result of :func:`ngram_match`.

    Attributes
    ----------
    draft_token_ids : torch.Tensor
        int64 [B, max_k]: draft tokens, padded with -1.
    num_draft_tokens : torch.Tensor
        int64 [B]: valid draft tokens per request.
    match_len : torch.Tensor
        int64 [B]: n of the matched suffix n-gram (0 when none), whatever the draft length.
    """

    draft_token_ids: torch.Tensor
    num_draft_tokens: torch.Tensor
    match_len: torch.Tensor


def check_ngram_config(min_n: int, max_n: int, max_window: int) -> None:
    """Validate the n-gram parameters.

    Raises
    ------
    ValueError
        ``min_n < 1``, ``max_n < min_n``, or ``max_window`` outside [2, 65536].
    """
    if not isinstance(min_n, int) or min_n < 1:
        raise ValueError(f"min_n={min_n!r}; expected an int >= 1")
    if not isinstance(max_n, int) or max_n < min_n:
        raise ValueError(f"max_n={max_n!r}; expected an int >= min_n={min_n}")
    if max_n > 64:
        raise ValueError(f"max_n={max_n}; expected <= 64")
    if not isinstance(max_window, int) or not 2 <= max_window <= MAX_WINDOW_LIMIT:
        raise ValueError(f"max_window={max_window!r}; expected an int in [2, {MAX_WINDOW_LIMIT}]")


def _prepare(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    ks: torch.Tensor | int,
    max_new_tokens: torch.Tensor | None,
    min_n: int,
    max_n: int,
    max_window: int,
    max_k: int | None,
) -> tuple[torch.Tensor, int]:
    """Validate and return (per-request draft cap int64 [B], max_k)."""
    check_ngram_config(min_n, max_n, max_window)
    check_tensor("token_ids", token_ids, ndim=2, dtypes=INT_DTYPES)
    check_tensor("num_tokens", num_tokens, ndim=1, dtypes=INT_DTYPES)
    b = token_ids.shape[0]
    if num_tokens.shape[0] != b:
        raise ValueError(f"num_tokens has {num_tokens.shape[0]} entries; expected {b}")
    dev = token_ids.device
    if isinstance(ks, int):
        if ks < 0:
            raise ValueError(f"ks={ks}; expected >= 0")
        ks_t = torch.full((b,), ks, dtype=torch.int64, device=dev)
    else:
        check_tensor("ks", ks, ndim=1, dtypes=INT_DTYPES)
        if ks.shape[0] != b:
            raise ValueError(f"ks has {ks.shape[0]} entries; expected {b}")
        ks_t = ks.to(torch.int64)
    if max_new_tokens is not None:
        check_tensor("max_new_tokens", max_new_tokens, ndim=1, dtypes=INT_DTYPES)
        if max_new_tokens.shape[0] != b:
            raise ValueError(f"max_new_tokens has {max_new_tokens.shape[0]} entries; expected {b}")
    check_same_device(
        token_ids=token_ids, num_tokens=num_tokens, ks=ks_t, max_new_tokens=max_new_tokens
    )
    if max_k is None:
        max_k = int(ks_t.max()) if b else 0
    if not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"max_k={max_k!r}; expected an int >= 0 or None")
    cap = ks_t.clamp(min=0, max=max_k)
    if max_new_tokens is not None:
        cap = torch.minimum(cap, max_new_tokens.to(torch.int64) - 1).clamp(min=0)
    return cap, max_k


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
    cap, max_k = _prepare(
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
