"""Counter-based random numbers (Philox-4x32-10) shared by the PyTorch references and Triton.

Philox-4x32-10 is the counter-based generator of Salmon et al. 2011 ("Parallel random
numbers: as easy as 1, 2, 3", SC'11). A random word depends only on a 64-bit key (the
request's seed) and a 128-bit counter (what the number is for), never on the order of the
calls or on the other requests of a batch: this is what makes verification per-request
reproducible and batch-invariant. This module is the PyTorch version (uint32 arithmetic
emulated in int64); ``_philox_triton.py`` is the bit-identical Triton version.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
N_ROUNDS = 10
#: Multiplier turning an odd integer below 2**24 into a float32 strictly inside (0, 1).
TWO_POW_M24 = 2.0**-24

# Counter word c2 ("purpose") values used by verification.
PURPOSE_ACCEPT = 0
PURPOSE_SAMPLE = 1
#: The sampling noise of one vocabulary chunk of 4 * NOISE_SUB entries comes from NOISE_SUB
#: Philox calls (4 words each): entry v = chunk * 4 * NOISE_SUB + lane * NOISE_SUB + t uses word
#: ``lane`` of the call with counter c0 = chunk * NOISE_SUB + t.
NOISE_SUB = 1024


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for a uint32 constant ``a`` and uint32 values ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t_hi = a_hi * b  # < 2**48
    t_lo = a_lo * b  # < 2**48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & MASK32
    return hi, lo


def philox4x32(
    seed: torch.Tensor,
    c0: torch.Tensor,
    c1: torch.Tensor | int = 0,
    c2: torch.Tensor | int = 0,
    c3: torch.Tensor | int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 (Salmon et al. 2011) on broadcastable int64 tensors.

    Parameters
    ----------
    seed : torch.Tensor
        int64 key, any shape broadcastable with the counters; its low and high 32 bits are the
        two key words.
    c0, c1, c2, c3 : torch.Tensor or int
        Counter words, values in [0, 2**32).

    Returns
    -------
    tuple of 4 torch.Tensor
        int64 tensors with values in [0, 2**32), the four output words.
    """
    seed = seed.to(torch.int64)
    k0 = seed & MASK32
    k1 = (seed >> 32) & MASK32
    zero = torch.zeros_like(seed)
    c0 = (zero + c0) & MASK32
    c1 = (zero + c1) & MASK32
    c2 = (zero + c2) & MASK32
    c3 = (zero + c3) & MASK32
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + KEY_A) & MASK32
        k1 = (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 words (in int64) to float32 uniforms strictly inside (0, 1).

    ``u = (2 * (x >> 9) + 1) * 2**-24``: 2**23 equally spaced values, exact in float32, never 0
    or 1 (so ``-log(u)`` is finite and positive).
    """
    return ((x >> 9) * 2 + 1).to(torch.float32) * TWO_POW_M24


def accept_uniforms(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniforms of the acceptance tests: word 0 of counter ``(0, position, PURPOSE_ACCEPT, 0)``.

    Parameters
    ----------
    seed : torch.Tensor
        int64 per-request seed, broadcastable with ``position``.
    position : torch.Tensor
        int64 draft position within the request (0-based).

    Returns
    -------
    torch.Tensor
        float32 uniforms in (0, 1), broadcast shape.
    """
    w0, _, _, _ = philox4x32(seed, 0, position, PURPOSE_ACCEPT, 0)
    return to_uniform(w0)


def sample_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exponential(1) noise ``E = -log(u)`` over the vocabulary for one row per request.

    Parameters
    ----------
    seed : torch.Tensor
        int64 [B] per-request seeds.
    position : torch.Tensor
        int64 [B] row position within the request (the rejected position or k for the bonus).
    vocab_size : int
        V.

    Returns
    -------
    torch.Tensor
        float32 [B, V] noise; entry v uses the counter layout described at ``NOISE_SUB``.
    """
    if vocab_size <= NOISE_SUB:  # one chunk, lane 0 only: entry v uses word 0 of counter v
        t = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
        w0, _, _, _ = philox4x32(seed[:, None], t[None, :], position[:, None], PURPOSE_SAMPLE, 0)
        return -torch.log(to_uniform(w0))
    chunk = 4 * NOISE_SUB
    n_chunks = -(-vocab_size // chunk)
    t = torch.arange(n_chunks * NOISE_SUB, device=seed.device, dtype=torch.int64)
    words = philox4x32(seed[:, None], t[None, :], position[:, None], PURPOSE_SAMPLE, 0)
    # words[lane][b, chunk * NOISE_SUB + t] -> entry chunk * 4 * NOISE_SUB + lane * NOISE_SUB + t
    stacked = torch.stack(words, dim=1)  # [B, 4, n_chunks * NOISE_SUB]
    b = seed.shape[0]
    stacked = stacked.view(b, 4, n_chunks, NOISE_SUB).permute(0, 2, 1, 3).reshape(b, -1)
    u = to_uniform(stacked[:, :vocab_size])
    return -torch.log(u)
