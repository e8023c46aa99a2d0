"""Jacobi decoding step and the n-gram pool of lookahead decoding.

Jacobi decoding (Santilli et al. 2023, "Accelerating Transformer Inference for Translation via
Parallel Decoding", ACL) treats the next K tokens as unknowns: guess them (the *iterate*), run
the target once over the guess, and take the target's greedy predictions as the next guess.
With ``iterate`` y_0..y_{K-1} for absolute positions P..P+K-1 and ``predictions``
z_0..z_K (z_j = target argmax for position P + j given the context and y_0..y_{j-1}):

* the accepted prefix is a = the number of leading j with y_j == z_j;
* the step emits z_0..z_a (a + 1 tokens; z_a is the correction or bonus token);
* the next iterate is z_{a+1}..z_K, already aligned with the new positions P + a + 1.. .

Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", ICML) keeps the last N - 1 iterates (the *trajectory*) and harvests
n-grams along diagonals: each token of iterate t + 1 was predicted right after the token one
position earlier in iterate t. On a grid where column c is absolute position base + c,
``trajectory[r]`` the r-th oldest iterate and ``predictions`` the newest target predictions, the
n-gram starting at column s is

    (trajectory[0][s], trajectory[1][s + 1], ..., trajectory[N-2][s + N-2], predictions[s + N-1])

and is valid when none of its tokens is unknown (-1). A per-request pool of capacity C stores
distinct n-grams in a ring (the oldest is evicted); a lookup keyed on the last committed token
returns the continuation (the other N - 1 tokens) of the most recently inserted n-gram whose
first token is that key.

Each function has a PyTorch reference; ``jacobi_step``, ``lookahead_ngrams`` and
``lookahead_pool_update`` also have Triton kernels (``_jacobi_triton.py``) behind a dispatcher.
"""

from __future__ import annotations

import torch

from ._checks import JacobiStep, check_jacobi_step, check_lookahead_ngrams, check_pool_update
from ._common import use_triton


def jacobi_step_reference(
    iterate: torch.Tensor, iterate_len: torch.Tensor, predictions: torch.Tensor
) -> JacobiStep:
    """PyTorch reference of :func:`jacobi_step`."""
    _, k = check_jacobi_step(iterate, iterate_len, predictions)
    dev = iterate.device
    ln = iterate_len.to(torch.int64).clamp(min=0, max=k)
    y = iterate.to(torch.int64)
    z = predictions.to(torch.int64)
    j = torch.arange(k, device=dev)
    mismatch = (y != z[:, :k]) | (j[None, :] >= ln[:, None])
    a = torch.where(mismatch, j[None, :], torch.full_like(y, k)).min(dim=1).values if k else ln
    a = torch.minimum(a, ln)
    j1 = torch.arange(k + 1, device=dev)
    emitted = torch.where(j1[None, :] <= a[:, None], z, torch.full_like(z, -1))
    src = (a[:, None] + 1 + j[None, :]).clamp(max=k)
    nxt_len = ln - a
    nxt = torch.where(
        j[None, :] < nxt_len[:, None], torch.gather(z, 1, src), torch.full_like(y, -1)
    )
    return JacobiStep(a, emitted, a + 1, nxt, nxt_len)


def jacobi_step(
    iterate: torch.Tensor,
    iterate_len: torch.Tensor,
    predictions: torch.Tensor,
    *,
    backend: str = "auto",
) -> JacobiStep:
    """One greedy Jacobi iteration per request (Santilli et al. 2023).

    Parameters
    ----------
    iterate : torch.Tensor
        int32/int64 [B, K]: the guessed tokens y, left-aligned, any padding.
    iterate_len : torch.Tensor
        int32/int64 [B]: valid iterate length per request (clamped to [0, K]).
    predictions : torch.Tensor
        int32/int64 [B, K + 1]: target argmax z_j after the context and y_0..y_{j-1}; entries
        past ``iterate_len + 1`` are ignored.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    JacobiStep
        Accepted prefix, emitted tokens, next iterate.

    Examples
    --------
    >>> import torch
    >>> r = jacobi_step(torch.tensor([[4, 5, 9]]), torch.tensor([3]), torch.tensor([[4, 5, 6, 7]]))
    >>> r.accepted.tolist(), r.emitted.tolist(), r.next_iterate.tolist()
    ([2], [[4, 5, 6, -1]], [[7, -1, -1]])
    """
    if use_triton(backend, [iterate, iterate_len, predictions]):
        from ._jacobi_triton import jacobi_step_triton

        return jacobi_step_triton(iterate, iterate_len, predictions)
    return jacobi_step_reference(iterate, iterate_len, predictions)


def lookahead_ngrams_reference(trajectory: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`lookahead_ngrams`."""
    b, n, w = check_lookahead_ngrams(trajectory, predictions)
    m = max(w - n + 1, 0)
    dev = trajectory.device
    s = torch.arange(m, device=dev)
    cols = [trajectory[:, r, s + r].to(torch.int64) for r in range(n - 1)]
    cols.append(predictions[:, s + n - 1].to(torch.int64))
    grams = (
        torch.stack(cols, dim=-1) if m else torch.zeros((b, 0, n), dtype=torch.int64, device=dev)
    )
    valid = (grams >= 0).all(dim=-1, keepdim=True)
    return torch.where(valid, grams, torch.full_like(grams, -1))


def lookahead_ngrams(
    trajectory: torch.Tensor, predictions: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Harvest lookahead-decoding n-grams along the trajectory's diagonals (Fu et al. 2024).

    Parameters
    ----------
    trajectory : torch.Tensor
        int32/int64 [B, N - 1, W]: the last N - 1 iterates, oldest first, on a shared grid of
        absolute positions (column c = position base + c); -1 = unknown.
    predictions : torch.Tensor
        int32/int64 [B, W]: the newest target predictions on the same grid; -1 = unknown.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    torch.Tensor
        int64 [B, max(W - N + 1, 0), N]: n-gram s is (trajectory[0][s], ...,
        trajectory[N-2][s+N-2], predictions[s+N-1]); an n-gram with an unknown token is all -1.
    """
    if use_triton(backend, [trajectory, predictions]):
        from ._jacobi_triton import lookahead_ngrams_triton

        return lookahead_ngrams_triton(trajectory, predictions)
    return lookahead_ngrams_reference(trajectory, predictions)


def lookahead_pool_update_reference(
    pool: torch.Tensor, pool_ptr: torch.Tensor, ngrams: torch.Tensor
) -> None:
    """PyTorch reference of :func:`lookahead_pool_update` (in place)."""
    check_pool_update(pool, pool_ptr, ngrams)
    b, c, _ = pool.shape
    rows = torch.arange(b, device=pool.device)
    g = ngrams.to(torch.int64)
    for m in range(g.shape[1]):
        ng = g[:, m, :]
        valid = (ng >= 0).all(dim=-1)
        dup = (pool == ng[:, None, :]).all(dim=-1).any(dim=-1)
        write = valid & ~dup
        slot = pool_ptr % c
        pool[rows[write], slot[write]] = ng[write]
        pool_ptr += write.to(torch.int64)


def lookahead_pool_update(
    pool: torch.Tensor,
    pool_ptr: torch.Tensor,
    ngrams: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Insert n-grams into per-request ring pools, skipping duplicates (in place).

    For each request, the n-grams are processed in order: one with an unknown (-1) token or
    already present in the pool is skipped; otherwise it is written at slot
    ``pool_ptr % C`` (evicting the oldest) and ``pool_ptr`` grows by one.

    Parameters
    ----------
    pool : torch.Tensor
        int64 [B, C, N]: the pools, -1 rows empty; modified in place.
    pool_ptr : torch.Tensor
        int64 [B]: insertions so far per request; modified in place.
    ngrams : torch.Tensor
        int32/int64 [B, M, N]: candidates, e.g. from :func:`lookahead_ngrams`.
    backend : {"auto", "torch", "triton"}
    """
    if use_triton(backend, [pool, pool_ptr, ngrams]):
        from ._jacobi_triton import lookahead_pool_update_triton

        lookahead_pool_update_triton(pool, pool_ptr, ngrams)
        return
    lookahead_pool_update_reference(pool, pool_ptr, ngrams)


def lookahead_pool_lookup(
    pool: torch.Tensor, pool_ptr: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Most recent pool n-gram starting with each request's key token (PyTorch only).

    Parameters
    ----------
    pool : torch.Tensor
        int64 [B, C, N].
    pool_ptr : torch.Tensor
        int64 [B]: insertions so far (slot of the most recent insertion: (pool_ptr - 1) % C).
    keys : torch.Tensor
        int [B]: the key token (e.g. the last committed token); negative = no lookup.

    Returns
    -------
    continuation : torch.Tensor
        int64 [B, N - 1]: the matched n-gram's tokens after the key, -1 where none.
    found : torch.Tensor
        bool [B].
    """
    b, c, _ = pool.shape
    keys = keys.to(torch.int64)
    slots = torch.arange(c, device=pool.device)
    age = (pool_ptr[:, None] - 1 - slots[None, :]) % c
    match = (pool[:, :, 0] == keys[:, None]) & (keys[:, None] >= 0) & (pool[:, :, 0] >= 0)
    age = torch.where(match, age, torch.full_like(age, c))
    best = age.min(dim=1)
    found = best.values < c
    slot = (pool_ptr - 1 - best.values) % c
    cont = pool[torch.arange(b, device=pool.device), slot, 1:]
    cont = torch.where(found[:, None], cont, torch.full_like(cont, -1))
    return cont, found
