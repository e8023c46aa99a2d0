"""``adaptive-spec distill --student eagle3``: train an EAGLE-3 head for the target.

From data to stored head: the sequences (the target's own replies from vLLM, or reference replies
with ``--generator none``), one target pass for the fused-layer hidden states and greedy tokens
(:mod:`.eagle3_data`, cached), the draft vocabulary, the head (its LM head and final norm initialised
from the target's tied embedding and final norm over the draft vocabulary; or, with ``--init-from``, a
stored head with its own draft vocabulary, whose held-out acceptance is then reported before training
too), training-time-test training
(:mod:`.eagle3_train`, resumable) and the held-out report: acceptance by draft position and mean
accepted length at k = 1..4 per category. The head is stored with :func:`adaptive_spec.vllm.eagle3.save_head`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .config import DistillConfig
from .prompts import TextPair, format_prompt, load_reference_pairs, parse_sources
from .sequences import TokenSequence, usable

K_MAX = 4


def reference_sequences(
    tok: Any, sources: list[str], n: int, *, skip: int, seq_len: int
) -> list[TokenSequence]:
    """Training sequences from the data sets' reference replies, chat-formatted, cut to their last
    ``seq_len`` tokens (the target labels them in the feature pass)."""
    out = []
    for source, count in parse_sources(sources, n):
        pairs: list[TextPair] = load_reference_pairs(source, count, skip=skip)[:count]
        for p in pairs:
            prompt = format_prompt(tok, p.prompt)
            reply = tok(p.reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            toks = (prompt + reply)[-seq_len:]
            plen = max(len(prompt) - (len(prompt) + len(reply) - len(toks)), 1)
            out.append(TokenSequence(np.asarray(toks, dtype=np.int32), plen, p.category, "train"))
    return out


def format_head_report(rows: dict[str, Any]) -> str:
    """A plain-text table: per category, acceptance by draft position and tau at k = 1..4."""
    head = (
        f"{'category':<12}"
        + "".join(f"{'pos ' + str(i):>8}" for i in range(1, K_MAX + 1))
        + "".join(f"{'tau@' + str(k):>8}" for k in range(1, K_MAX + 1))
    )
    lines = [head, "-" * len(head)]
    for cat in sorted(rows, key=lambda c: (c == "all", c)):
        st = rows[cat]
        lines.append(
            f"{cat:<12}"
            + "".join(f"{x:>8.3f}" for x in st.by_position)
            + "".join(f"{st.tau[k]:>8.3f}" for k in range(1, K_MAX + 1))
        )
    return "\n".join(lines)


def head_settings(cfg: DistillConfig, autocast: bool) -> Any:
    """The :class:`~.eagle3_train.HeadTraining` of a run (``autocast``: bf16 autocast applies)."""
    from .eagle3_train import HeadTraining

    return HeadTraining(
        steps=cfg.steps, batch_size=cfg.batch_size, ttt_steps=cfg.ttt_steps, lr=cfg.lr,
        warmup=cfg.warmup, weight_decay=cfg.weight_decay, save_every=cfg.save_every,
        seed=cfg.seed, autocast=autocast,
    )  # fmt: skip


def curve_record(curve: list[Any]) -> list[Any]:
    """At most about 50 points of a training history ``(step, loss, agreement per pass)``, rounded,
    for the stored record."""
    stride = max(1, len(curve) // 50)
    return [[s, round(loss, 4), [round(a, 4) for a in ag]] for s, loss, ag in curve[::stride]]


def run_eagle3(
    cfg: DistillConfig,
    ckpt_dir: Path,
    *,
    out: str,
    name: str,
    progress: bool,
) -> int:
    """Train and store an EAGLE-3 head (see the module docstring); returns the exit status."""
    import torch

    from adaptive_spec.core.machine import native_bf16
    from adaptive_spec.vllm.drafts import tensor_sha256
    from adaptive_spec.vllm.eagle3 import save_head

    from .data import prepare_data
    from .eagle3_data import aux_layers, build_features, draft_vocabulary, target_to_draft
    from .eagle3_head import Eagle3Head
    from .eagle3_train import evaluate_head, train_head
    from .teacher import load_target

    target_dir = Path(cfg.target)
    # bf16 only where the CPU runs it natively (AMX / AVX-512 BF16); elsewhere it is emulated and
    # several times slower than float32
    bf16 = cfg.device != "cpu" or native_bf16()
    dtype = "bfloat16" if bf16 else "float32"
    if cfg.generator == "vllm":
        seqs = prepare_data(cfg, ckpt_dir, progress=progress)
        target, tok = load_target(target_dir, cfg.device, dtype)
        train = usable(seqs, "train")
    else:
        target, tok = load_target(target_dir, cfg.device, dtype)
        seqs = prepare_data(
            cfg, ckpt_dir, progress=progress, target=target, tok=tok, held_only=True
        )
        train = reference_sequences(tok, cfg.data, cfg.prompts, skip=cfg.skip, seq_len=cfg.seq_len)
    held = usable(seqs, "eval")
    every = train + held
    feats = build_features(
        target,
        every,
        seq_len=cfg.seq_len,
        device=cfg.device,
        path=ckpt_dir / "features.pt",
        progress=progress,
    )
    train_idx = list(range(len(train)))
    held_idx = list(range(len(train), len(every)))
    vocab = int(target.config.vocab_size)
    cats = [every[i].category for i in held_idx]
    if cfg.lora is not None:
        return train_adapter(
            cfg, ckpt_dir, target, feats, [s.category for s in train], held_idx, cats,
            out=out, progress=progress, autocast=cfg.autocast and bf16,
        )  # fmt: skip
    reply_labels = np.concatenate(
        [feats.sequence(i)[1][feats.sequence(i)[3] + 1 :].numpy() for i in train_idx]
    )
    settings = head_settings(cfg, cfg.autocast and bf16)
    init: dict[str, Any] = {}
    if cfg.init_from is not None:
        from .eagle3_lora import load_stored_head

        try:
            head, spec = load_stored_head(target, cfg.init_from)
        except (ValueError, FileNotFoundError) as e:
            print(f"adaptive-spec distill: error: --init-from: {e}")
            return 2
        draft_ids = head.draft_ids().numpy()
        coverage = float(np.isin(reply_labels, draft_ids).mean())
        init = {"name": spec.name, "weights_sha256": spec.weights_sha256}
    else:
        draft_ids, coverage = draft_vocabulary(reply_labels, vocab, cfg.draft_vocab)
        head = Eagle3Head.from_target(target, torch.as_tensor(draft_ids))
    t2d = torch.as_tensor(target_to_draft(draft_ids, vocab))
    print(
        f"data: {len(train)} training sequences ({len(feats.labels)} tokens with the held-out), "
        f"draft vocabulary {len(draft_ids)} tokens covering {coverage:.1%} of the target's reply tokens"
        + (f"; starting from head {init['name']!r}" if init else "")
    )
    eval_kw = {"k_max": K_MAX, "autocast": settings.autocast}
    before = evaluate_head(head, feats, held_idx, cats, t2d, **eval_kw) if init and held_idx else {}
    try:
        result = train_head(head, feats, train_idx, t2d, settings, ckpt_dir, progress=progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted: checkpoint kept in {ckpt_dir}; rerun the same command to resume")
        return 130
    report = evaluate_head(head, feats, held_idx, cats, t2d, **eval_kw) if held_idx else {}
    curve = result.pop("history")
    training = {
        "data": cfg.data,
        "prompts": cfg.prompts,
        "generator": cfg.generator,
        "train_sequences": len(train),
        "train_tokens": int(sum(len(s.tokens) for s in train)),
        "draft_vocab_coverage": round(coverage, 4),
        **{k: v for k, v in settings.__dict__.items()},
        "seq_len": cfg.seq_len,
        **{k: result[k] for k in ("steps_done", "seconds", "loss", "agree")},
        "curve": curve_record(curve),
        **({"init_from": init} if init else {}),
    }
    measured = {"held_out": {c: st.as_dict() for c, st in report.items()}}
    if before:
        measured["held_out_init"] = {c: st.as_dict() for c, st in before.items()}
    save_head(
        head.head_state_dict(),
        out,
        name=name,
        base_model=target_dir.name,
        aux_layers=aux_layers(int(target.config.num_hidden_layers)),
        embed_sha256=tensor_sha256(target.model.embed_tokens.weight),
        lm_head_sha256=tensor_sha256(target.lm_head.weight),
        training=training,
        measured=measured,
    )
    from adaptive_spec.commands.plots import plot_head_training

    plot = plot_head_training(curve, ckpt_dir / "training.png")
    (ckpt_dir / "report.json").write_text(
        json.dumps({c: st.as_dict() for c, st in report.items()}, indent=1)
    )
    if before:
        print(f"\nheld out, head {init['name']!r} before training:")
        print(format_head_report(before))
    print("\nheld out, trained:" if before else "")
    print(format_head_report(report))
    print(f"\nwrote {out}; training curve: {plot}")
    return 0


def format_adapter_report(base: dict[str, Any], adapted: dict[str, Any], domain: str) -> str:
    """A plain-text table: per held-out category, acceptance at draft position 1 and tau@4 of the base
    head and with the adapter, and the difference at position 1 in points."""
    head = f"{'category':<12}{'base pos 1':>12}{'adapter':>10}{'points':>8}{'base tau@4':>12}{'adapter':>10}"
    lines = [head, "-" * len(head)]
    for cat in sorted(adapted, key=lambda c: (c == "all", c != domain, c)):
        b, a = base[cat], adapted[cat]
        lines.append(
            f"{cat + (' *' if cat == domain else ''):<12}{b.by_position[0]:>12.3f}"
            f"{a.by_position[0]:>10.3f}{100 * (a.by_position[0] - b.by_position[0]):>+8.1f}"
            f"{b.tau[K_MAX]:>12.3f}{a.tau[K_MAX]:>10.3f}"
        )
    return "\n".join(lines) + f"\n(* the adapter's domain, {domain!r})"


def train_adapter(
    cfg: DistillConfig,
    ckpt_dir: Path,
    target: Any,
    feats: Any,
    train_categories: list[str],
    held_idx: list[int],
    held_categories: list[str],
    *,
    out: str,
    progress: bool,
    autocast: bool,
) -> int:
    """Train LoRA adapter ``cfg.lora`` on the stored head ``cfg.draft`` (:mod:`.eagle3_lora`) with the
    training sequences of ``cfg.lora_domain`` (default: the adapter's name), store it in ``out``
    (:func:`adaptive_spec.vllm.lora_adapter.save_lora_adapter`) and print the held-out acceptance of the
    base head and the adapted head per category (``autocast``: bf16 autocast applies). Returns the exit
    status."""
    import torch

    from adaptive_spec.vllm.lora_adapter import LoraAdapter, save_lora_adapter

    from .eagle3_data import target_to_draft
    from .eagle3_lora import add_head_lora, domain_indices, head_lora_weights, load_stored_head
    from .eagle3_train import evaluate_head, train_head

    domain = cfg.lora_domain or cfg.lora
    try:
        idx = domain_indices(train_categories, domain)
        head, spec = load_stored_head(target, cfg.draft)
    except (ValueError, FileNotFoundError) as e:
        print(f"adaptive-spec distill: error: {e}")
        return 2
    vocab = int(target.config.vocab_size)
    draft_ids = head.draft_ids().numpy()
    t2d = torch.as_tensor(target_to_draft(draft_ids, vocab))
    print(
        f"adapter {cfg.lora!r} on head {spec.name!r}: {len(idx)} training sequences of {domain!r}, "
        f"rank {cfg.lora_rank}, alpha {cfg.lora_alpha}"
    )
    kw = {"k_max": K_MAX, "autocast": autocast}
    base = evaluate_head(head, feats, held_idx, held_categories, t2d, **kw) if held_idx else {}
    add_head_lora(head, cfg.lora_rank, cfg.lora_alpha, cfg.lora_modules, seed=cfg.seed)
    settings = head_settings(cfg, autocast)
    try:
        result = train_head(head, feats, idx, t2d, settings, ckpt_dir, progress=progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted: checkpoint kept in {ckpt_dir}; rerun the same command to resume")
        return 130
    report = evaluate_head(head, feats, held_idx, held_categories, t2d, **kw) if held_idx else {}
    curve = result.pop("history")
    training = {
        "data": cfg.data,
        "domain": domain,
        "train_sequences": len(idx),
        **{k: v for k, v in settings.__dict__.items()},
        "seq_len": cfg.seq_len,
        "modules": list(cfg.lora_modules),
        **{k: result[k] for k in ("steps_done", "seconds", "loss", "agree")},
        "curve": curve_record(curve),
    }
    save_lora_adapter(
        LoraAdapter(
            name=cfg.lora,
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            weights=head_lora_weights(head),
            base_draft={"name": spec.name, "weights_sha256": spec.weights_sha256},
            training=training,
            measured={
                "held_out": {c: st.as_dict() for c, st in report.items()},
                "held_out_base_head": {c: st.as_dict() for c, st in base.items()},
            },
        ),
        out,
    )
    if report:
        print()
        print(format_adapter_report(base, report, domain))
    print(f"\nwrote adapter {cfg.lora!r} to {out}")
    return 0
