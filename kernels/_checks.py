"""Argument checks and result types shared by each kernel's PyTorch reference and its Triton twin.

The public modules (:mod:`~adaptive_spec.kernels.jacobi`, :mod:`~adaptive_spec.kernels.lora`,
:mod:`~adaptive_spec.kernels.ngram`, :mod:`~adaptive_spec.kernels.rejection`) re-export the result
types; the ``_*_triton.py`` modules import from here, never from their public twin.

Each ``check_*`` / ``prepare_*`` function raises TypeError for an argument that is not a tensor and
ValueError for a wrong rank, dtype, shape, value or device, naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import FLOAT_DTYPES, INT_DTYPES, check_same_device, check_tensor


# Jacobi decoding and lookahead (jacobi.py) --------------------------------------------------------
@dataclass(slots=True)
class JacobiStep:
    """Result of :func:`~adaptive_spec.kernels.jacobi.jacobi_step`.

    Attributes
    ----------
    accepted : torch.Tensor
        int64 [B]: accepted prefix length a (0..len).
    emitted : torch.Tensor
        int64 [B, K + 1]: z_0..z_a, padded with -1.
    num_emitted : torch.Tensor
        int64 [B]: a + 1.
    next_iterate : torch.Tensor
        int64 [B, K]: z_{a+1}..z_len, padded with -1.
    next_len : torch.Tensor
        int64 [B]: len - a.
    """

    accepted: torch.Tensor
    emitted: torch.Tensor
    num_emitted: torch.Tensor
    next_iterate: torch.Tensor
    next_len: torch.Tensor


def check_jacobi_step(
    iterate: torch.Tensor, iterate_len: torch.Tensor, predictions: torch.Tensor
) -> tuple[int, int]:
    """Validate the arguments of :func:`~adaptive_spec.kernels.jacobi.jacobi_step`; returns (B, K)."""
    check_tensor("iterate", iterate, ndim=2, dtypes=INT_DTYPES)
    check_tensor("iterate_len", iterate_len, ndim=1, dtypes=INT_DTYPES)
    check_tensor("predictions", predictions, ndim=2, dtypes=INT_DTYPES)
    b, k = iterate.shape
    if iterate_len.shape[0] != b:
        raise ValueError(f"iterate_len has {iterate_len.shape[0]} entries; expected {b}")
    if tuple(predictions.shape) != (b, k + 1):
        raise ValueError(
            f"predictions has shape {tuple(predictions.shape)}; expected ({b}, {k + 1})"
        )
    check_same_device(iterate=iterate, iterate_len=iterate_len, predictions=predictions)
    return b, k


def check_lookahead_ngrams(
    trajectory: torch.Tensor, predictions: torch.Tensor
) -> tuple[int, int, int]:
    """Validate the arguments of :func:`~adaptive_spec.kernels.jacobi.lookahead_ngrams`; returns
    (B, N, W).
    """
    check_tensor("trajectory", trajectory, ndim=3, dtypes=INT_DTYPES)
    check_tensor("predictions", predictions, ndim=2, dtypes=INT_DTYPES)
    b, levels, w = trajectory.shape
    if levels < 1:
        raise ValueError(f"trajectory has {levels} levels; need N - 1 >= 1")
    if tuple(predictions.shape) != (b, w):
        raise ValueError(f"predictions has shape {tuple(predictions.shape)}; expected ({b}, {w})")
    check_same_device(trajectory=trajectory, predictions=predictions)
    return b, levels + 1, w


def check_pool_update(pool: torch.Tensor, pool_ptr: torch.Tensor, ngrams: torch.Tensor) -> None:
    """Validate the arguments of :func:`~adaptive_spec.kernels.jacobi.lookahead_pool_update`."""
    check_tensor("pool", pool, ndim=3, dtypes=(torch.int64,))
    check_tensor("pool_ptr", pool_ptr, ndim=1, dtypes=(torch.int64,))
    check_tensor("ngrams", ngrams, ndim=3, dtypes=INT_DTYPES)
    b, c, n = pool.shape
    if c < 1 or n < 2:
        raise ValueError(f"pool has shape {tuple(pool.shape)}; need capacity >= 1 and N >= 2")
    if pool_ptr.shape[0] != b:
        raise ValueError(f"pool_ptr has {pool_ptr.shape[0]} entries; expected {b}")
    if ngrams.shape[0] != b or ngrams.shape[2] != n:
        raise ValueError(f"ngrams has shape {tuple(ngrams.shape)}; expected ({b}, M, {n})")
    check_same_device(pool=pool, pool_ptr=pool_ptr, ngrams=ngrams)


# Batched multi-LoRA (lora.py) ---------------------------------------------------------------------
def check_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    scale: float | torch.Tensor,
) -> torch.Tensor:
    """Validate the arguments of :func:`~adaptive_spec.kernels.lora.lora_bgmv` (adapter indices too,
    off CUDA); returns the per-adapter scale, float32 [L] on the tensors' device.
    """
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("lora_a", lora_a, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("indices", indices, ndim=1, dtypes=INT_DTYPES)
    t, d_in = x.shape
    n_ad, a_in, rank = lora_a.shape
    if a_in != d_in:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}; expected (L, {d_in}, r)")
    if tuple(lora_b.shape[:2]) != (n_ad, rank):
        raise ValueError(
            f"lora_b has shape {tuple(lora_b.shape)}; expected ({n_ad}, {rank}, d_out)"
        )
    if tuple(y.shape) != (t, lora_b.shape[2]):
        raise ValueError(f"y has shape {tuple(y.shape)}; expected ({t}, {lora_b.shape[2]})")
    if indices.shape[0] != t:
        raise ValueError(f"indices has {indices.shape[0]} entries; expected {t}")
    dev = check_same_device(y=y, x=x, lora_a=lora_a, lora_b=lora_b, indices=indices)
    if isinstance(scale, torch.Tensor):
        check_tensor("scale", scale, ndim=1, dtypes=FLOAT_DTYPES)
        if scale.shape[0] != n_ad:
            raise ValueError(
                f"scale has {scale.shape[0]} entries; expected {n_ad} (one per adapter)"
            )
        scale_t = scale.to(device=dev, dtype=torch.float32)
    else:
        scale_t = torch.full((n_ad,), float(scale), dtype=torch.float32, device=dev)
    if not y.is_cuda and indices.numel():
        bad = (indices >= n_ad) | (indices < -1)
        if bool(bad.any()):
            raise ValueError(
                f"indices contains {indices[bad][:5].tolist()}; allowed: -1 (no adapter) or "
                f"0..{n_ad - 1}"
            )
    return scale_t


# n-gram match (ngram.py) --------------------------------------------------------------------------
DEFAULT_MAX_WINDOW = 2048
MAX_WINDOW_LIMIT = 1 << 16


@dataclass(slots=True)
class NgramMatch:
    """Result of :func:`~adaptive_spec.kernels.ngram.ngram_match`.

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


def prepare_ngram_match(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    ks: torch.Tensor | int,
    max_new_tokens: torch.Tensor | None,
    min_n: int,
    max_n: int,
    max_window: int,
    max_k: int | None,
) -> tuple[torch.Tensor, int]:
    """Validate the arguments of :func:`~adaptive_spec.kernels.ngram.ngram_match`; returns the
    per-request draft cap (int64 [B]) and max_k.
    """
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


# Verification (rejection.py) ----------------------------------------------------------------------
@dataclass(slots=True)
class VerifyOutput:
    """Result of one verification step.

    Attributes
    ----------
    output_token_ids : torch.Tensor
        int64 [B, max_k + 1]: per request the accepted draft tokens then one emitted target
        token (correction or bonus), padded with -1.
    num_emitted : torch.Tensor
        int64 [B]: tokens emitted per request (= num_accepted + 1).
    num_accepted : torch.Tensor
        int64 [B]: accepted draft tokens per request (0..k_i).
    target_argmax : torch.Tensor
        int64 [T + B]: the target's argmax (of logits / T; of the logits for greedy requests) at
        every row, i.e. every draft position plus the bonus position, in the logits' row order.
    """

    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor
    num_accepted: torch.Tensor
    target_argmax: torch.Tensor


def check_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor | None,
    max_k: int | None,
    validate: bool | None,
) -> int:
    """Validate the arguments of :func:`~adaptive_spec.kernels.rejection.verify`: shapes and dtypes
    always, values when ``validate`` (default: on CPU); returns max_k.
    """
    check_tensor("target_logits", target_logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=INT_DTYPES)
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INT_DTYPES)
    check_same_device(
        target_logits=target_logits,
        draft_token_ids=draft_token_ids,
        cu_num_draft_tokens=cu_num_draft_tokens,
        draft_probs=draft_probs,
        temperature=temperature,
        seeds=seeds,
    )
    n_rows, vocab = target_logits.shape
    n_draft = draft_token_ids.shape[0]
    b = cu_num_draft_tokens.shape[0]
    if vocab < 1:
        raise ValueError(f"target_logits has vocabulary size {vocab}; need >= 1")
    if n_rows != n_draft + b:
        raise ValueError(
            f"target_logits has {n_rows} rows; expected len(draft_token_ids) + batch = "
            f"{n_draft} + {b} = {n_draft + b} (k_i + 1 rows per request)"
        )
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(draft_probs.shape) != (n_draft, vocab):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}; expected ({n_draft}, {vocab})"
            )
    if temperature is not None:
        check_tensor("temperature", temperature, ndim=1, dtypes=FLOAT_DTYPES)
        if temperature.shape[0] != b:
            raise ValueError(f"temperature has {temperature.shape[0]} entries; expected {b}")
        if seeds is None:
            raise ValueError("seeds is None; stochastic verification (temperature given) needs it")
    if seeds is not None:
        check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,))
        if seeds.shape[0] != b:
            raise ValueError(f"seeds has {seeds.shape[0]} entries; expected {b}")
    if max_k is not None and (not isinstance(max_k, int) or max_k < 0):
        raise ValueError(f"max_k={max_k!r}; expected an int >= 0 or None")
    if validate is None:
        validate = not target_logits.is_cuda
    if validate and b > 0:
        cu = cu_num_draft_tokens.to(torch.int64)
        counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
        if bool((counts < 0).any()):
            raise ValueError(f"cu_num_draft_tokens={cu.tolist()} must be non-decreasing and >= 0")
        if int(cu[-1]) != n_draft:
            raise ValueError(
                f"cu_num_draft_tokens[-1]={int(cu[-1])} must equal len(draft_token_ids)={n_draft}"
            )
        if temperature is not None and not bool(
            ((temperature >= 0) & torch.isfinite(temperature)).all()
        ):
            raise ValueError(
                f"temperature={temperature.tolist()} must be finite and >= 0 (0 = greedy)"
            )
    if max_k is None:
        if b == 0:
            return 0
        cu = cu_num_draft_tokens.to(torch.int64)
        counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
        return int(counts.max())
    return max_k
