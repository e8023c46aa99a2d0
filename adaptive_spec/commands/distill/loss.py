"""The distillation loss: forward KL from the target's next-token distribution to the draft's (Hinton et
al. 2015; DistillSpec, Zhou et al., ICLR 2024), cross-entropy on the target's argmax, or their sum."""

from __future__ import annotations

from typing import Any

LOSSES = ("kl", "ce", "kl+ce")


def distill_loss(
    student_h: Any,
    teacher_h: Any,
    head_w: Any,
    targets: Any,
    *,
    loss: str = "kl",
    temperature: float = 1.0,
    chunk: int = 4096,
    teacher_topk: tuple[Any, Any] | None = None,
) -> tuple[Any, dict[str, float]]:
    """Distillation loss over N selected positions, computed in chunks of the vocabulary products.

    Parameters
    ----------
    student_h : torch.Tensor
        float [N, H]: the draft's final normed hidden states at the positions.
    teacher_h : torch.Tensor or None
        float [N, H]: the target's, or None when ``teacher_topk`` gives the teacher.
    head_w : torch.Tensor
        [V, H]: the shared LM head.
    targets : torch.Tensor
        int64 [N]: the next tokens of the text.
    loss : {"kl", "ce", "kl+ce"}
        ``kl``: KL(p_target || p_draft) at ``temperature`` (scaled by T^2, Hinton et al. 2015);
        ``ce``: cross-entropy on the target's argmax (the teacher's top-1, or ``targets`` when no
        teacher is given); ``kl+ce``: their sum.
    teacher_topk : (ids, logprobs), optional
        int64 [N, K] and float [N, K]: a sparse teacher (its K most likely tokens). The KL is then taken
        between the (K + 1)-bucket coarsenings of both distributions (each top-K token, and the rest),
        a lower bound of the full KL that needs no teacher forward pass; ``temperature`` must be 1.

    Returns
    -------
    loss : torch.Tensor
        Scalar, mean over positions.
    stats : dict
        ``agree``: fraction of positions where the draft's argmax is the target's argmax (the
        target's argmax is ``targets`` for greedy continuations when only ``teacher_topk`` is given:
        its top-1).

    Raises
    ------
    ValueError
        For an unknown ``loss``, no teacher for a KL loss, or ``temperature != 1`` with ``teacher_topk``.
    """
    import torch
    import torch.nn.functional as F

    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is invalid; allowed: {', '.join(LOSSES)}")
    if "kl" in loss and teacher_h is None and teacher_topk is None:
        raise ValueError("a KL loss needs teacher_h or teacher_topk")
    if teacher_topk is not None and teacher_h is None and temperature != 1.0:
        raise ValueError(f"temperature={temperature}: a top-K teacher supports temperature 1 only")
    n = student_h.shape[0]
    total = student_h.new_zeros((), dtype=torch.float32)
    agree = 0
    for s in range(0, n, chunk):
        sh = student_h[s : s + chunk]
        s_logits = (sh @ head_w.to(sh.dtype).T).float()
        part = s_logits.new_zeros(())
        if teacher_h is not None:
            th = teacher_h[s : s + chunk]
            with torch.no_grad():
                t_logits = (th @ head_w.to(th.dtype).T).float()
                t_top = t_logits.argmax(-1)
            if loss in ("kl", "kl+ce"):
                t_logp = F.log_softmax(t_logits / temperature, dim=-1)
                s_logp = F.log_softmax(s_logits / temperature, dim=-1)
                part = part + (t_logp.exp() * (t_logp - s_logp)).sum() * temperature**2
        else:
            t_top = (
                teacher_topk[0][s : s + chunk, 0]
                if teacher_topk is not None
                else targets[s : s + chunk]
            )
            if loss in ("kl", "kl+ce"):
                ids = teacher_topk[0][s : s + chunk]
                t_lp = teacher_topk[1][s : s + chunk].float()
                s_lp = F.log_softmax(s_logits, dim=-1).gather(1, ids)
                t_rest = (1 - t_lp.exp().sum(-1)).clamp_min(1e-6)
                s_rest = (1 - s_lp.exp().sum(-1)).clamp_min(1e-6)
                kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1) + t_rest * (t_rest.log() - s_rest.log())
                part = part + kl.sum()
        agree += int((s_logits.detach().argmax(-1) == t_top).sum())
        if loss in ("ce", "kl+ce"):
            # Greedy acceptance asks for the target's argmax: the teacher's top-1 when there is a
            # teacher, else the given next tokens (the target's greedy text).
            hard = (
                t_top
                if (teacher_h is not None or teacher_topk is not None)
                else targets[s : s + chunk]
            )
            part = part + F.cross_entropy(s_logits, hard, reduction="sum")
        total = total + part
    return total / max(n, 1), {"agree": agree / max(n, 1)}
