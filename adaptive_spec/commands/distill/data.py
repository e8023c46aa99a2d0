"""Training data: prompts -> the target's replies (``--generator``), cached in the checkpoint directory
and resumable per batch.

* ``vllm``: the target's replies from an in-process vLLM engine
  (:func:`adaptive_spec.vllm.engine.build_llm`), with its top-K log-probabilities at every reply token;
* ``hf``: the target's replies from transformers;
* ``none``: the data sets' reference replies labelled by the target
  (:func:`~adaptive_spec.commands.distill.teacher.label_with_target`), and held-out sequences of the
  target's own greedy replies for the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import DistillConfig
from .prompts import (
    TEXT_SOURCES,
    TextPrompt,
    format_prompt,
    load_prompts,
    load_reference_pairs,
    parse_sources,
)
from .sequences import TokenSequence, in_batches, load_sequences, save_sequences
from .teacher import label_with_target


def _encode(
    tokenizer: Any, batch: Sequence[TextPrompt], max_prompt_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """The chat-formatted token ids of each prompt, and the indices of those short enough to generate."""
    encoded = [format_prompt(tokenizer, p.text) for p in batch]
    return encoded, [i for i, e in enumerate(encoded) if len(e) <= max_prompt_tokens]


def _in_prompt_order(
    seqs: Sequence[TokenSequence | None], batch: Sequence[TextPrompt]
) -> list[TokenSequence]:
    """One sequence per prompt: skipped prompts keep their place as empty sequences, so resume indices
    stay aligned."""
    return [
        s if s is not None else TokenSequence(np.zeros(0, dtype=np.int32), 0, p.category, p.split)
        for s, p in zip(seqs, batch, strict=True)
    ]


def generate_continuations(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[TextPrompt],
    *,
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
    device: str,
    temperature: float = 0.0,
    seed: int = 0,
    done: list[TokenSequence] | None = None,
    on_batch: Callable[[list[TokenSequence]], None] | None = None,
    progress: bool = True,
) -> list[TokenSequence]:
    """The target's continuations of ``prompts`` (greedy, or sampled at ``temperature``), batched with left
    padding; prompts longer than ``max_prompt_tokens`` are skipped.

    Parameters
    ----------
    target : transformers.PreTrainedModel
    done : list of TokenSequence, optional
        Sequences already generated for the first ``len(done)`` prompts (resume).
    on_batch : callable, optional
        ``f(sequences_so_far)`` after every batch (checkpointing).

    Returns
    -------
    list of TokenSequence
        One per prompt, in prompt order (an empty one for a skipped prompt).
    """
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    gen = torch.Generator(device=device).manual_seed(seed + len(done or []))

    def make(_start: int, batch: list[TextPrompt]) -> list[TokenSequence]:
        encoded, keep = _encode(tokenizer, batch, max_prompt_tokens)
        seqs: list[TokenSequence | None] = [None] * len(batch)
        if keep:
            width = max(len(encoded[i]) for i in keep)
            ids = torch.full((len(keep), width), pad, dtype=torch.long)
            mask = torch.zeros((len(keep), width), dtype=torch.long)
            for row, i in enumerate(keep):
                e = encoded[i]
                ids[row, width - len(e) :] = torch.tensor(e)
                mask[row, width - len(e) :] = 1
            kwargs: dict[str, Any] = {"do_sample": temperature > 0}
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            with torch.no_grad():
                res = target.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad,
                    eos_token_id=eos,
                    **kwargs,
                ).cpu()
            for row, i in enumerate(keep):
                cont = res[row, width:].tolist()
                if eos in cont:
                    cont = cont[: cont.index(eos) + 1]
                e = encoded[i]
                seqs[i] = TokenSequence(
                    np.asarray(e + cont, dtype=np.int32), len(e), batch[i].category, batch[i].split
                )
        return _in_prompt_order(seqs, batch)

    return in_batches(
        prompts,
        make,
        batch_size=batch_size,
        desc="target continuations",
        done=done,
        on_batch=on_batch,
        progress=progress,
    )


def generate_with_vllm(
    llm: Any,
    prompts: Sequence[TextPrompt],
    *,
    max_new_tokens: int,
    max_prompt_tokens: int,
    temperature: float = 0.0,
    topk: int = 8,
    seed: int = 0,
    chunk: int = 64,
    done: list[TokenSequence] | None = None,
    on_batch: Callable[[list[TokenSequence]], None] | None = None,
    progress: bool = True,
) -> list[TokenSequence]:
    """The target's continuations of ``prompts`` from an in-process vLLM engine, with its ``topk`` most
    likely tokens and their log-probabilities at every continuation position (vLLM's raw logprobs,
    i.e. at temperature 1 whatever the sampling temperature), for the sparse-teacher loss.

    Parameters
    ----------
    llm : vllm.LLM
        Serving the target (e.g. :func:`adaptive_spec.vllm.engine.build_llm`); its speculation, if any, does
        not change which tokens are emitted.
    chunk : int
        Prompts per ``llm.generate`` call; ``on_batch(sequences_so_far)`` runs after each.
    done : list of TokenSequence, optional
        Already generated sequences for the first prompts (resume).

    Returns
    -------
    list of TokenSequence
        One per prompt, in order; prompts longer than ``max_prompt_tokens`` give an empty sequence.
    """
    from adaptive_spec.vllm.engine import request_seed, sampling_params

    tok = llm.get_tokenizer()

    def make(c0: int, batch: list[TextPrompt]) -> list[TokenSequence]:
        encoded, keep = _encode(tok, batch, max_prompt_tokens)
        params = [
            sampling_params(
                temperature=temperature,
                max_tokens=max_new_tokens,
                logprobs=topk,
                seed=request_seed(seed * 1_000_003 + c0 + i) if temperature > 0 else None,
            )
            for i in keep
        ]
        res = (
            llm.generate([{"prompt_token_ids": encoded[i]} for i in keep], params, use_tqdm=False)
            if keep
            else []
        )
        seqs: list[TokenSequence | None] = [None] * len(batch)
        for i, r in zip(keep, res, strict=True):
            o = r.outputs[0]
            cont = list(o.token_ids)
            ids = np.zeros((len(cont), topk), dtype=np.int32)
            lps = np.full((len(cont), topk), -30.0, dtype=np.float16)
            for j, d in enumerate(o.logprobs or []):
                ranked = sorted(d.items(), key=lambda kv: kv[1].rank)[:topk]
                for m, (t, lp) in enumerate(ranked):
                    ids[j, m] = t
                    lps[j, m] = max(float(lp.logprob), -30.0)
            seqs[i] = TokenSequence(
                np.asarray(encoded[i] + cont, dtype=np.int32),
                len(encoded[i]),
                batch[i].category,
                batch[i].split,
                ids,
                lps,
            )
        return _in_prompt_order(seqs, batch)

    return in_batches(
        prompts,
        make,
        batch_size=chunk,
        desc="target continuations",
        done=done,
        on_batch=on_batch,
        progress=progress,
    )


def prepare_data(
    cfg: DistillConfig,
    ckpt_dir: Path | None,
    *,
    progress: bool = True,
    target: Any = None,
    tok: Any = None,
    held_only: bool = False,
    in_process: bool = False,
) -> list[TokenSequence]:
    """Prompts -> target continuations (held-out prompts greedy, training prompts at
    ``cfg.gen_temperature``, ``cfg.samples`` each; with ``held_only`` the held-out ones alone, from
    vLLM), cached in ``ckpt_dir/data.npz`` and resumable per batch from ``data.partial.npz``.

    With ``cfg.generator == "vllm"`` a vLLM engine serves the target (n-gram speculation, which changes
    no emitted token, speeds it up). With a ``ckpt_dir`` (and not ``in_process``) it runs in a spawned
    process of its own: vLLM's CPU backend leaves its thread binding and worker threads in the process
    that ran it, where they made the target's next pass (the feature labelling) 2.6x slower. With
    ``"hf"`` the transformers ``target`` and ``tok`` generate.

    Raises
    ------
    RuntimeError
        If the generating process fails (its exit code named; a rerun resumes from the partial file).
    """
    final = ckpt_dir / "data.npz" if ckpt_dir is not None else None
    partial = ckpt_dir / "data.partial.npz" if ckpt_dir is not None else None
    if final is not None and final.exists():
        return load_sequences(final)
    if (cfg.generator == "vllm" or held_only) and final is not None and not in_process:
        import multiprocessing

        proc = multiprocessing.get_context("spawn").Process(
            target=_prepare_in_child, args=(cfg, ckpt_dir, progress, held_only)
        )
        proc.start()
        proc.join()
        if proc.exitcode != 0 or not final.exists():
            raise RuntimeError(
                f"generating the target's replies failed in its own process (exit code "
                f"{proc.exitcode}; its error is printed above); rerun the same command to resume "
                f"from {partial}"
            )
        return load_sequences(final)
    prompts = load_prompts(
        cfg.data, cfg.prompts, eval_n=cfg.eval_prompts, skip=cfg.skip, seed=cfg.seed
    )
    held = [p for p in prompts if p.split == "eval"]
    train = [p for p in prompts if p.split == "train" for _ in range(cfg.samples)]
    if held_only:
        train = []
    done = load_sequences(partial) if partial is not None and partial.exists() else []
    parts: list[list[TokenSequence]] = [
        done[: len(held)],
        done[len(held) :] if len(done) > len(held) else [],
    ]

    def saver(idx: int) -> Callable[[list[TokenSequence]], None]:
        def on_batch(seqs: list[TokenSequence]) -> None:
            parts[idx] = seqs
            if partial is not None:
                save_sequences(parts[0] + parts[1], partial)

        return on_batch

    common: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "progress": progress,
    }
    if cfg.generator == "vllm" or held_only:
        from adaptive_spec.vllm.engine import build_llm

        llm = build_llm(
            cfg.target,
            # an EAGLE-3 head reads the target's hidden states in the serving dtype ("auto"), so its
            # training replies come from that dtype too; the layer-cut pipeline's target is bf16
            dtype="auto" if cfg.student == "eagle3" else "bfloat16",
            max_k=4,
            concurrency=cfg.gen_batch_size,
            max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 8,
            enforce_eager=True,
            enable_prefix_caching=True,
        )
        for idx, (ps, temp) in enumerate(((held, 0.0), (train, cfg.gen_temperature))):
            parts[idx] = generate_with_vllm(
                llm,
                ps,
                temperature=temp,
                topk=cfg.topk,
                seed=cfg.seed + idx,
                chunk=4 * cfg.gen_batch_size,
                done=parts[idx],
                on_batch=saver(idx),
                **common,
            )
        del llm
    else:
        for idx, (ps, temp) in enumerate(((held, 0.0), (train, cfg.gen_temperature))):
            parts[idx] = generate_continuations(
                target,
                tok,
                ps,
                temperature=temp,
                seed=cfg.seed + idx,
                batch_size=cfg.gen_batch_size,
                device=cfg.device,
                done=parts[idx],
                on_batch=saver(idx),
                **common,
            )
    seqs = parts[0] + parts[1]
    if final is not None:
        save_sequences(seqs, final)
        if partial is not None and partial.exists():
            partial.unlink()
    return seqs


def _prepare_in_child(
    cfg: DistillConfig, ckpt_dir: Path, progress: bool, held_only: bool
) -> None:  # the spawned process of :func:`prepare_data`
    prepare_data(cfg, ckpt_dir, progress=progress, held_only=held_only, in_process=True)


def prepare_reference_data(
    cfg: DistillConfig, target: Any, tok: Any, labels_dir: Path, *, progress: bool = True
) -> list[TokenSequence]:
    """Training sequences from reference texts labelled by the target (``--generator none``) and
    held-out sequences of the target's own greedy replies (for exact accepted lengths).

    Labels are cached per source in ``labels_dir`` (keyed by source, skip, K, window and target) and
    extended when more are asked for, so runs that share sources (a draft and its adapters) label each
    text once. Held-out prompts are the first ``cfg.eval_prompts`` of each workload source.
    """
    from adaptive_spec.vllm.drafts import tensor_sha256

    labels_dir.mkdir(parents=True, exist_ok=True)
    tkey = tensor_sha256(target.model.embed_tokens.weight)[:8]
    train: list[TokenSequence] = []
    held: list[TokenSequence] = []
    for source, n in parse_sources(cfg.data, cfg.prompts):
        if source not in TEXT_SOURCES:
            raise ValueError(
                f"data source {source!r}: --generator none needs one of {', '.join(TEXT_SOURCES)}"
            )
        path = labels_dir / f"{source}-skip{cfg.skip}-k{cfg.topk}-L{cfg.seq_len}-{tkey}.npz"
        have = load_sequences(path) if path.exists() else []
        if len(have) < n:
            pairs = load_reference_pairs(source, n, skip=cfg.skip)
            if len(pairs) > len(have):

                def save(seqs: list[TokenSequence], path: Path = path) -> None:
                    save_sequences(seqs, path)

                have = label_with_target(
                    target,
                    tok,
                    pairs,
                    topk=cfg.topk,
                    seq_len=cfg.seq_len,
                    batch_size=cfg.batch_size,
                    device=cfg.device,
                    autocast=cfg.autocast,
                    done=have,
                    on_batch=save,
                    progress=progress,
                )
        train += have[:n]
        if cfg.eval_prompts and source in ("chat", "code", "math", "summarize"):
            epath = (
                labels_dir / f"eval-{source}-n{cfg.eval_prompts}-t{cfg.max_new_tokens}-{tkey}.npz"
            )
            if epath.exists():
                held += load_sequences(epath)
                continue
            from adaptive_spec.commands.workloads import load_workload

            ps = [
                TextPrompt(p.category, p.text, "eval")
                for p in load_workload(source, cfg.eval_prompts)
            ]
            seqs = generate_continuations(
                target,
                tok,
                ps,
                max_new_tokens=cfg.max_new_tokens,
                max_prompt_tokens=cfg.max_prompt_tokens,
                batch_size=cfg.gen_batch_size,
                device=cfg.device,
                progress=progress,
            )
            save_sequences(seqs, epath)
            held += seqs
    return held + train
