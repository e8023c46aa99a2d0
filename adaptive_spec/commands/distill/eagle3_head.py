"""The EAGLE-3 draft head in PyTorch, for training: its forward pass over the target's hidden states and
the training-time test (TTT) unroll.

The head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") reads the target's residual stream after three of its layers (low, middle, high),
fuses them with one linear layer ``fc`` (3 x hidden -> hidden), and runs one Llama decoder layer whose
attention takes the concatenation of the normed token embedding and the normed fused state
(2 x hidden inputs). Its LM head covers a reduced draft vocabulary; ``d2t[i]`` is the offset from draft
id ``i`` to its target id. The module's state-dict names are the EAGLE-3 checkpoint layout that vLLM 0.32
loads as ``method: "eagle3"`` (``vllm/model_executor/models/llama_eagle3.py``): ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``. The token embedding is the target's,
frozen, and never stored.

Alignment (vLLM's): at position ``t`` the first pass reads the target's fused state of token ``t`` and
the embedding of token ``t + 1`` and predicts token ``t + 2``. Each further draft pass at position
``t + j`` reads the head's own pre-norm output at ``t + j - 1`` (no ``fc``) and the previous draft token.
Training-time test unrolls the same: step ``j`` feeds step ``j - 1``'s outputs shifted by one position,
and its attention sees step-0 keys up to ``t - j`` plus one key of each step ``1..j`` on the diagonal,
exactly the draft passes' KV cache at inference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """The head's dimensions (the target's, except ``draft_vocab``).

    Attributes
    ----------
    hidden : int
        Hidden size of the target and the head.
    heads, kv_heads, head_dim : int
        Attention heads, key/value heads (grouped-query attention) and their width.
    intermediate : int
        MLP width.
    draft_vocab : int
        Rows of the head's LM head.
    n_aux : int
        Target layers fused by ``fc`` (3 for EAGLE-3).
    rms_eps : float
    rope_theta : float
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    n_aux: int = 3
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def of_target(cls, config: Any, draft_vocab: int) -> HeadShape:
        """The shape of a head for a transformers Llama ``config``."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = int(config.num_attention_heads)
        return cls(
            hidden=int(config.hidden_size),
            heads=heads,
            kv_heads=int(config.num_key_value_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate=int(config.intermediate_size),
            draft_vocab=int(draft_vocab),
            rms_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm in float32, as Llama's (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class _Attention(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.hidden_norm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = _MLP(s)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021), the rotate-half form of Llama: x [B, H, T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` moved ``n`` places later along ``dim`` (zeros enter at the front)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - n)), dim=dim)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head (see the module docstring).

    Parameters
    ----------
    shape : HeadShape
    embed : torch.Tensor
        [vocab, hidden]: the target's token embedding (frozen, not a parameter of the head).
    d2t : torch.Tensor
        int64 [draft_vocab]: target id minus draft id, per draft id.
    """

    def __init__(self, shape: HeadShape, embed: torch.Tensor, d2t: torch.Tensor) -> None:
        super().__init__()
        s = self.shape = shape
        self.fc = nn.Linear(s.n_aux * s.hidden, s.hidden, bias=False)
        self.midlayer = _MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = nn.Linear(s.hidden, s.draft_vocab, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64).clone())
        self.embed = embed.detach()
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @classmethod
    def from_target(cls, target: Any, draft_ids: torch.Tensor) -> Eagle3Head:
        """A head for a transformers Llama ``target`` over the draft vocabulary ``draft_ids`` (int64
        target ids, ascending): its LM head is the target's output embedding restricted to those rows,
        frozen (shared with the target, so never stored), and its final norm starts as the target's."""
        ids = draft_ids.to(torch.int64)
        head = cls(
            HeadShape.of_target(target.config, len(ids)),
            target.model.embed_tokens.weight.detach().float(),
            ids - torch.arange(len(ids)),
        )
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[ids].float())
            head.norm.weight.copy_(target.model.norm.weight.float())
        head.lm_head.weight.requires_grad_(False)
        return head

    def draft_ids(self) -> torch.Tensor:
        """int64 [draft_vocab]: the target id of each draft id (ascending)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors a stored head holds, by their EAGLE-3 names: not the embedding and not the LM
        head, which are the target's (its output embedding's draft-vocabulary rows)."""
        skip = ("inv_freq", "lm_head.weight")
        return {k: v for k, v in self.state_dict().items() if k not in skip}

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # [B, 1, T, D]
        return ang.cos(), ang.sin()

    def unroll(
        self,
        feats: torch.Tensor,
        next_ids: torch.Tensor,
        steps: int,
        *,
        pad: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: the head's final normed states of ``steps`` unrolled draft passes.

        Parameters
        ----------
        feats : torch.Tensor
            [B, T, n_aux * hidden]: the target's residual stream after its three chosen layers, per
            position (vLLM's auxiliary hidden states; transformers' ``hidden_states[i]``).
        next_ids : torch.Tensor
            int64 [B, T]: the token after each position (what the draft pass at ``t`` embeds).
        steps : int >= 1
            Draft passes to unroll.
        pad : torch.Tensor, optional
            bool [B, T]: padding positions (never attended to).

        Returns
        -------
        list of torch.Tensor
            ``steps`` tensors [B, T, hidden]: entry ``j`` at position ``t`` predicts token ``t + 2`` for
            a chain whose first ``j`` drafts (at ``t - j + 1 .. t``) were accepted; positions ``t < j``
            are meaningless.
        """
        s = self.shape
        B, T, _ = feats.shape
        pos = torch.arange(T, device=feats.device).expand(B, T)
        cos, sin = self._rope_tables(pos)
        emb = self.midlayer.input_layernorm(F.embedding(next_ids, self.embed).to(feats.dtype))
        hidden = self.fc(feats)
        scale = 1.0 / math.sqrt(s.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool, device=feats.device).tril()
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        pre = hidden
        rep = s.heads // s.kv_heads
        for j in range(steps):
            if j > 0:
                hidden = _shift(
                    pre, 1, dim=1
                )  # the previous pass's pre-norm output, one position on
            residual = hidden
            x = torch.cat((emb, self.midlayer.hidden_norm(hidden)), dim=-1)
            a = self.midlayer.self_attn
            q = a.q_proj(x).view(B, T, s.heads, s.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            keys.append((k, v))
            # step-0 keys at positions <= t - j
            k0, v0 = keys[0]
            sc0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
            allow = _shift(causal, j, dim=0) if j > 0 else causal
            if pad is not None:
                allow = allow[None] & ~pad[:, None, :]
                allow = allow[:, None]
            sc0 = sc0.masked_fill(~allow, float("-inf"))
            # one key of each later step on the diagonal: step i at position t - (j - i)
            diag = []
            for i in range(1, j + 1):
                ki = _shift(keys[i][0], j - i, dim=2)
                d = (q * ki).sum(-1, keepdim=True) * scale
                if j - i > 0:
                    ok = torch.arange(T, device=feats.device) >= (j - i)
                    d = d.masked_fill(~ok[None, None, :, None], float("-inf"))
                diag.append(d)
            logits = torch.cat([sc0, *diag], dim=-1) if diag else sc0
            # a padded row may have nothing to attend to: its NaN weights become zeros (never used)
            w = torch.nan_to_num(torch.softmax(logits.float(), dim=-1), nan=0.0).to(q.dtype)
            o = w[..., :T] @ v0
            for n, i in enumerate(range(1, j + 1)):
                o = o + w[..., T + n : T + n + 1] * _shift(keys[i][1], j - i, dim=2)
            o = a.o_proj(o.transpose(1, 2).reshape(B, T, s.heads * s.head_dim))
            residual = residual + o
            h = self.midlayer.mlp(self.midlayer.post_attention_layernorm(residual))
            pre = residual + h
            outs.append(self.norm(pre))
        return outs

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of final normed states."""
        return self.lm_head(normed)
