"""``adaptive-spec distill``: train a drafter for a target: an EAGLE-3 head or a draft model.

With ``--student eagle3`` it trains an EAGLE-3 head (Li et al. 2025): one decoder layer over the
target's hidden states after three of its layers, with a reduced draft vocabulary, trained with
training-time test on the target's greedy tokens (``adaptive_spec.commands.distill.eagle3_command``;
vLLM loads it as ``method: "eagle3"``). This is what the ``draft`` proposer runs by default.
``--init-from HEAD`` starts from a stored head (its weights and draft vocabulary) instead, e.g. to
fine-tune the shipped head on the target's own replies.

With ``--student layer-cut`` (the default) the draft is a layer cut of the target (:mod:`adaptive_spec.vllm.drafts`): ``n`` decoder layers initialised
from the target's first ``n``, trained, with the target's embedding, final norm and tied LM head frozen
and shared. Training minimises the forward KL divergence from the target's next-token distribution to
the draft's (Hinton et al. 2015; DistillSpec, Zhou et al., ICLR 2024), optionally plus cross-entropy on
the target's argmax, at the reply positions of chat-formatted prompts.

Data (``--generator``):

* ``vllm`` (default): the target's own replies from an in-process vLLM engine, which also records the
  target's top-K log-probabilities at every reply token (the draft must imitate what the target says;
  sequence-level KD, Kim & Rush 2016);
* ``hf``: the target's replies from transformers (slow on a CPU);
* ``none``: the data sets' reference replies, labelled by one teacher-forced forward pass of the target
  (its top-K at every position). On a busy CPU this is tens of times cheaper per token than
  generating, so the shipped head was trained this way (``docs/drafts.md``).

Teachers (``--teacher``): ``topk`` (the recorded top-K: no teacher pass during training; the KL between
the (K + 1)-bucket coarsenings, a lower bound of the full KL), ``online`` (the target's full
distribution each step) or ``cached`` (the target's final hidden states computed once; logits are one
product with the shared head).

With ``--lora NAME`` the base drafter is frozen and a LoRA adapter (Hu et al. 2022) on its linear layers
is trained on one domain's text instead (:mod:`adaptive_spec.vllm.lora_draft` runs it inside vLLM): on
a stored layer-cut draft (``--draft``), or with ``--student eagle3`` on a stored head (``--draft``,
default the shipped one) with the head's own loss, on the training sequences of ``--lora-domain``
(``adaptive_spec.commands.distill.eagle3_lora``). ``--features-from DIR`` reuses the cached data and
hidden states of the head's run, so an adapter needs no new target pass.

It runs on the CPU (``--device cuda`` where there is a GPU) with tqdm progress bars. Checkpoints
(trainable weights, optimiser, schedule, step, RNG state, history) are written atomically every
``--save-every`` steps and on Ctrl-C / SIGTERM; generated data and target labels are saved as they are
made. Rerunning the same command resumes where it stopped (``--steps`` may be raised to train on).
The final report gives, per category of held-out prompts, the draft's greedy agreement with the target
and the mean accepted length tau at k = 1..8 of greedy speculative decoding on the target's own greedy
replies, computed exactly from teacher-forced draft predictions: while the drafts match, the draft's
context is the target's, so a step starting at position j accepts the run of consecutive matches there.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import GENERATORS, TEACHERS, DistillConfig, check_resume
from .data import prepare_data, prepare_reference_data
from .evaluation import evaluate, format_report
from .loss import LOSSES
from .prompts import EXTRA_SOURCES, parse_sources
from .sequences import TokenSequence, usable
from .student import build_student
from .teacher import build_teacher_cache, load_target
from .training import train_draft


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "distill",
        help="train a draft model (or a LoRA adapter for one) by distillation from the target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a(
        "--target",
        default=None,
        help="target model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    a(
        "--data",
        default="chat,code,math,summarize",
        help="comma-separated prompt sources: workloads (code, math, chat, summarize, agent), "
        f"{', '.join(EXTRA_SOURCES)}, or JSONL files (default chat,code,math,summarize)",
    )
    a("--prompts", type=int, default=200, help="training prompts per source (default 200)")
    a(
        "--eval-prompts",
        type=int,
        default=8,
        help="held-out prompts per workload for the report (default 8)",
    )
    a(
        "--skip",
        type=int,
        default=48,
        help="training prompts of a workload start after its first SKIP (default 48)",
    )
    a(
        "--student",
        choices=("layer-cut", "eagle3"),
        default="layer-cut",
        help="layer-cut (default): a draft model of --layers target layers; eagle3: an EAGLE-3 head "
        "(one layer over three of the target's hidden states, reduced vocabulary), loaded by vLLM "
        "as method eagle3",
    )
    a(
        "--draft-vocab",
        type=int,
        default=8192,
        help="eagle3: rows of the head's LM head, the target's most frequent tokens (default 8192)",
    )
    a(
        "--ttt-steps",
        type=int,
        default=4,
        help="eagle3: draft passes unrolled in training (training-time test; default 4)",
    )
    a("--layers", type=int, default=2, help="decoder layers of the draft (default 2)")
    a(
        "--lora",
        default=None,
        metavar="NAME",
        help="train LoRA adapter NAME for --draft instead of a drafter (with --student eagle3: an "
        "adapter on the head, trained on --lora-domain's sequences)",
    )
    a(
        "--lora-domain",
        default=None,
        metavar="CATEGORY",
        help="eagle3 --lora: train on the sequences of this category only (chat, code, math, "
        "summarize, ...; default: the adapter's NAME)",
    )
    a(
        "--draft",
        default=None,
        help="what --lora adapts: a stored layer-cut draft (required for --student layer-cut) or a "
        "stored EAGLE-3 head (--student eagle3; default: the shipped head)",
    )
    a(
        "--features-from",
        default=None,
        metavar="DIR",
        help="eagle3: reuse the cached data and target hidden states of an earlier run's checkpoint "
        "directory DIR (same --data, --prompts, --skip, --eval-prompts, --seq-len and --generator), "
        "e.g. to train adapters on the data of the head's own run without another target pass; with "
        "--generator none the --data counts and --prompts may grow: only the new sequences are labelled",
    )
    a(
        "--init-from",
        default=None,
        metavar="HEAD_DIR",
        help="eagle3: start from this stored head (its weights and its draft vocabulary) instead of "
        "from the target's layers, e.g. to fine-tune the shipped head on the target's own replies "
        "(--generator vllm); the report then also gives that head's held-out acceptance",
    )
    a("--lora-rank", type=int, default=16, help="LoRA rank r (default 16)")
    a("--lora-alpha", type=float, default=32.0, help="LoRA alpha; scale = alpha / r (default 32)")
    a("--steps", type=int, default=300, help="optimiser steps (default 300)")
    a("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    a("--seq-len", type=int, default=512, help="tokens per sequence window (default 512)")
    a("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    a("--warmup", type=int, default=20, help="linear warm-up steps (default 20)")
    a("--loss", choices=LOSSES, default="kl", help="kl (default), ce, or kl+ce")
    a(
        "--teacher",
        choices=TEACHERS,
        default="topk",
        help="topk: the target's top-K logprobs recorded while generating (vLLM generator; no teacher "
        "pass in training; default); online: the target's full distribution, computed each step; "
        "cached: the target's hidden states computed once",
    )
    a("--topk", type=int, default=8, help="K of the top-K teacher (default 8)")
    a("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    a(
        "--generator",
        choices=GENERATORS,
        default="vllm",
        help="vllm (default): the target's replies from an in-process engine, with top-K logprobs; "
        "hf: its replies from transformers; none: the data sets' reference replies labelled by one "
        "target forward pass each (top-K teacher; by far the cheapest on a CPU)",
    )
    a("--max-new-tokens", type=int, default=256, help="target continuation length (default 256)")
    a(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="longer prompts are skipped (default 1024)",
    )
    a("--gen-batch-size", type=int, default=16, help="prompts generated together (default 16)")
    a("--gen-temperature", type=float, default=0.0, help="0: greedy continuations (default)")
    a(
        "--samples",
        type=int,
        default=1,
        help="continuations per training prompt (with --gen-temperature)",
    )
    a("--device", default="cpu", help="cpu (default) or cuda[:N]")
    a(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 is fastest on a busy machine)",
    )
    a("--no-autocast", action="store_true", help="train in float32 (default: bf16 autocast)")
    a("--seed", type=int, default=0)
    a("--save-every", type=int, default=50, help="checkpoint every N steps (default 50)")
    a("--checkpoint-dir", default=None, help="default: <cache>/distill/<run id>")
    a(
        "--out",
        required=True,
        help="output: a stored draft (draft.json) or, with --lora, an adapter",
    )
    a("--export", default=None, help="also write a loadable draft model directory here")
    a("--name", default=None, help="name recorded in the output (default: the --out folder name)")
    a("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main)


def _check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first invalid option."""
    positive = (
        "prompts",
        "layers",
        "steps",
        "batch_size",
        "seq_len",
        "max_new_tokens",
        "gen_batch_size",
        "samples",
        "lora_rank",
        "save_every",
        "max_prompt_tokens",
        "topk",
        "draft_vocab",
        "ttt_steps",
    )
    for names, low in ((positive, 1), (("eval_prompts", "skip", "warmup"), 0)):
        for name in names:
            v = getattr(args, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(
                    f"--{name.replace('_', '-')}={v!r} is invalid; allowed: an integer >= {low}"
                )
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads!r} is invalid; allowed: an integer >= 1")
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr!r} is invalid; allowed: > 0")
    if not args.lora_alpha > 0:
        raise ValueError(f"--lora-alpha={args.lora_alpha!r} is invalid; allowed: > 0")
    if not args.temperature > 0:
        raise ValueError(f"--temperature={args.temperature!r} is invalid; allowed: > 0")
    if args.gen_temperature < 0:
        raise ValueError(f"--gen-temperature={args.gen_temperature!r} is invalid; allowed: >= 0")
    if args.samples > 1 and args.gen_temperature == 0:
        raise ValueError(
            "--samples > 1 needs --gen-temperature > 0 (greedy continuations are identical)"
        )
    if args.teacher == "topk" and args.generator == "hf":
        raise ValueError(
            "--teacher topk needs --generator vllm or none (they record the top-K logprobs)"
        )
    if args.teacher == "topk" and args.temperature != 1.0:
        raise ValueError("--teacher topk supports --temperature 1 only")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise ValueError(f"--device={args.device!r} is invalid; allowed: cpu, cuda, cuda:N")
    if args.lora_domain is not None and not (args.student == "eagle3" and args.lora is not None):
        raise ValueError("--lora-domain needs --student eagle3 and --lora NAME")
    if args.features_from is not None:
        if args.student != "eagle3":
            raise ValueError("--features-from needs --student eagle3")
        if not Path(args.features_from).is_dir():
            raise ValueError(
                f"--features-from={args.features_from!r} is not a directory; give the checkpoint "
                "directory of an earlier eagle3 run"
            )
    if args.init_from is not None and (args.student != "eagle3" or args.lora is not None):
        raise ValueError(
            f"--init-from={args.init_from!r} starts an EAGLE-3 head from a stored one: it needs "
            "--student eagle3 and no --lora (an adapter's base head is --draft)"
        )
    if args.init_from is not None and not (Path(args.init_from) / "head.json").is_file():
        raise ValueError(
            f"--init-from={args.init_from!r} holds no head.json: give a stored EAGLE-3 head, the "
            "--out of an earlier distill --student eagle3 run"
        )
    if args.student == "eagle3" and args.generator == "hf":
        raise ValueError("--student eagle3 needs --generator vllm or none")
    if args.lora is not None:
        from adaptive_spec.vllm.lora_draft import check_adapter_name

        check_adapter_name(args.lora)


def _config(args: argparse.Namespace, target_dir: Path, draft_dir: Path | None) -> DistillConfig:
    return DistillConfig(
        target=str(target_dir),
        data=[s.strip() for s in args.data.split(",") if s.strip()],
        prompts=args.prompts,
        eval_prompts=args.eval_prompts,
        skip=args.skip,
        layers=args.layers,
        lora=args.lora,
        lora_domain=args.lora_domain,
        draft=str(draft_dir) if draft_dir is not None else None,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        loss=args.loss,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        gen_batch_size=args.gen_batch_size,
        gen_temperature=args.gen_temperature,
        samples=args.samples,
        teacher=args.teacher,
        generator=args.generator,
        topk=args.topk,
        seed=args.seed,
        device=args.device,
        autocast=not args.no_autocast,
        save_every=args.save_every,
        student=args.student,
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        init_from=str(Path(args.init_from).resolve()) if args.init_from else None,
    )


def _target_and_data(
    cfg: DistillConfig, ckpt_dir: Path, *, progress: bool
) -> tuple[Any, Any, list[TokenSequence]]:
    """The target, its tokenizer and the run's sequences (``cfg.generator``): with vLLM the data first,
    so that the engine is gone before the target loads in transformers."""
    target_dir = Path(cfg.target)
    if cfg.generator == "vllm":
        seqs = prepare_data(cfg, ckpt_dir, progress=progress)
        target, tok = load_target(target_dir, cfg.device)
    elif cfg.generator == "none":
        target, tok = load_target(target_dir, cfg.device)
        seqs = prepare_reference_data(
            cfg, target, tok, ckpt_dir.parent / "labels", progress=progress
        )
    else:
        target, tok = load_target(target_dir, cfg.device)
        seqs = prepare_data(cfg, ckpt_dir, progress=progress, target=target, tok=tok)
    return target, tok, seqs


def main(args: argparse.Namespace) -> int:
    """Run ``adaptive-spec distill`` (see the module docstring); returns the exit status."""
    import torch

    from adaptive_spec.vllm.models import cache_dir, default_model_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_args(args)
    except ValueError as e:
        print(f"adaptive-spec distill: error: {e}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.target:
        target_dir = Path(args.target)
    elif args.student == "eagle3":  # the head reads the target's hidden states in the serving dtype
        from adaptive_spec.core.machine import resolve_dtype

        target_dir = default_model_path(resolve_dtype("auto"))
    else:
        target_dir = default_model_path("bfloat16")
    draft_dir = None
    if args.lora is not None and args.student == "eagle3":
        from adaptive_spec.vllm.eagle3 import shipped_head_dir

        draft_dir = Path(args.draft) if args.draft else shipped_head_dir()
    elif args.lora is not None:
        if not args.draft:
            print(
                "adaptive-spec distill: error: --lora needs --draft DIR, the layer-cut draft it adapts "
                "(none is shipped; train one with --student layer-cut --out DIR)"
            )
            return 2
        draft_dir = Path(args.draft)
    cfg = _config(args, target_dir, draft_dir)
    ckpt_dir = (
        Path(args.checkpoint_dir) if args.checkpoint_dir else cache_dir() / "distill" / cfg.run_id()
    )
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    try:
        check_resume(ckpt_dir, cfg)
    except ValueError as e:
        print(f"adaptive-spec distill: error: {e}")
        return 2
    if args.features_from is not None:
        try:
            reuse_features(Path(args.features_from), ckpt_dir, cfg)
        except ValueError as e:
            print(f"adaptive-spec distill: error: {e}")
            return 2
    (ckpt_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    print(f"checkpoints: {ckpt_dir} (rerun the same command to resume)")
    progress = not args.no_progress
    if cfg.student == "eagle3":
        from .eagle3_command import run_eagle3

        return run_eagle3(
            cfg, ckpt_dir, out=args.out, name=args.name or Path(args.out).name, progress=progress
        )
    try:
        target, tok, seqs = _target_and_data(cfg, ckpt_dir, progress=progress)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        train = usable(seqs, "train")
        held = usable(seqs, "eval")
        n_tok = sum(len(s.tokens) - s.prompt_len for s in train)
        print(
            f"data: {len(train)} training and {len(held)} held-out sequences, {n_tok} training tokens"
        )
        student = build_student(
            cfg, target, target_dir=target_dir, draft_dir=draft_dir, export=args.export
        )
        kw = {"device": cfg.device, "pad_id": pad_id, "autocast": cfg.autocast}
        baseline = evaluate(student.model, held, **kw) if held else {}
        params = student.trainable()
        cache = build_teacher_cache(target, train, cfg, pad_id) if cfg.teacher == "cached" else None
        result = train_draft(
            student.model,
            params,
            target,
            train,
            cfg,
            ckpt_dir,
            pad_id=pad_id,
            teacher_cache=cache,
            progress=progress,
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted: checkpoint kept in {ckpt_dir}; rerun the same command to resume")
        return 130
    report = evaluate(student.model, held, **kw) if held else {}
    measured = {
        "held_out": {c: st.as_dict() for c, st in report.items()},
        f"held_out_{student.baseline_name}": {c: st.as_dict() for c, st in baseline.items()},
    }
    training = {k: v for k, v in asdict(cfg).items() if k not in ("target", "draft")}
    training.update({k: result[k] for k in ("steps_done", "seconds", "loss", "agree")})
    training["train_sequences"], training["train_tokens"] = len(train), n_tok
    student.save(
        args.out, name=args.name or Path(args.out).name, training=training, measured=measured
    )
    print()
    print(format_report({student.baseline_name: baseline, "trained": report}))
    print(f"\nwrote {args.out}" + (f" and {args.export}" if args.export else ""))
    return 0


# The settings a run's cached data and target hidden states depend on.
_FEATURE_SETTINGS = (
    "target", "data", "prompts", "eval_prompts", "skip", "seq_len", "generator", "max_new_tokens",
    "max_prompt_tokens", "gen_temperature", "samples",
)  # fmt: skip
_FEATURE_FILES = ("data.npz", "features.pt")


def reuse_features(src: Path, ckpt_dir: Path, cfg: DistillConfig) -> None:
    """Link (or copy) an earlier eagle3 run's cached data and hidden states from ``src`` into
    ``ckpt_dir``, where absent. With reference replies (``--generator none``) on both sides, the
    sources' counts (``--data``, ``--prompts``) may differ: the target then labels only the training
    sequences the earlier run did not have (:func:`.eagle3_data.build_features` reuses by content).

    Raises
    ------
    ValueError
        If ``src`` holds no such cache, or was written with other data settings (named).
    """
    import os
    import shutil

    try:
        old = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(
            f"--features-from={str(src)!r} has no readable config.json: not a distill checkpoint directory"
        ) from None
    new = asdict(cfg)
    diff = [k for k in _FEATURE_SETTINGS if old.get(k) != new[k]]
    names = [[n for n, _ in parse_sources(d, 1)] for d in (old.get("data") or [], new["data"])]
    if old.get("generator") == new["generator"] == "none" and names[0] == names[1]:
        # With reference replies the cache holds the held-out replies of the same sources, and the
        # training sequences are labelled by content: the common ones are reused, new ones labelled.
        diff = [k for k in diff if k not in ("data", "prompts")]
    if diff:
        raise ValueError(
            f"--features-from={str(src)!r} was written with other data settings ("
            + ", ".join(f"{k}: {old.get(k)!r} there, {new[k]!r} here" for k in diff)
            + "): use the same flags as that run"
        )
    for name in _FEATURE_FILES:
        if not (src / name).is_file():
            raise ValueError(
                f"--features-from={str(src)!r} lacks {name}: that run did not finish its data"
            )
        dst = ckpt_dir / name
        if dst.exists() or src.resolve() == ckpt_dir.resolve():
            continue
        try:
            os.link(src / name, dst)
        except OSError:
            shutil.copy2(src / name, dst)
