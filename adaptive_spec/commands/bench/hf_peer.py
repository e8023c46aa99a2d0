"""The outside peer: Hugging Face transformers' own prompt-lookup assisted generation, at concurrency 1.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding", the n-gram proposer that vLLM's ``ngram``
method also implements) ships in transformers as assisted generation with a
``PromptLookupCandidateGenerator``: ``model.generate(..., prompt_lookup_num_tokens=k)`` drafts up to ``k``
tokens by matching the last ``max_matching_ngram_size`` tokens against the context, and verifies them in
one forward pass of the target. Assisted generation runs one sequence at a time, so this peer is
measured at concurrency 1 only, greedy only, against plain HF greedy decoding of the same model (its own
baseline, in the same process).

Greedy identity follows :mod:`adaptive_spec.commands.identity`: at the first divergent position the plain greedy
run's top-2 logprob margin (computed by one teacher-forced forward pass over the prompt and the greedy
output, only for the prompts that diverge) decides between a near-tie and a violation.

Run as a worker process by ``adaptive-spec bench``: ``python -m adaptive_spec.commands.bench.hf_peer SPEC.json OUT.json``
where the spec names the model, prompts and configurations (see :func:`run_hf_group`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.jsonio import worker_main, write_json
from adaptive_spec.commands.bench.plan import rotated

HF_CONFIGS = ("hf-greedy", "hf-pld")


@dataclass(slots=True)
class _Logprob:
    logprob: float


@dataclass(slots=True)
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob] | None] | None = None


@dataclass(slots=True)
class HFOutput:
    """One prompt's result, shaped like a vLLM ``RequestOutput`` for
    :func:`adaptive_spec.commands.identity.compare_greedy` (``outputs[0].token_ids``, ``outputs[0].logprobs``)."""

    outputs: list[_Completion] = field(default_factory=list)


def load_hf_model(model_dir: str | Path, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a safetensors directory, in eval mode on the CPU.

    Parameters
    ----------
    model_dir : path
        A directory ``transformers`` loads (e.g. :func:`adaptive_spec.vllm.models.default_model_path`).
    dtype : {"bfloat16", "float32"}

    Returns
    -------
    (model, tokenizer)

    Raises
    ------
    ValueError
        For another dtype.
    FileNotFoundError
        If ``model_dir`` does not exist.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r} is invalid; allowed: bfloat16, float32")
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_dir={str(path)!r} is not a directory")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model, tok


def hf_generate(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
) -> list[int]:
    """Greedy generation of one sequence; with ``prompt_lookup_num_tokens`` HF's prompt-lookup assisted
    generation drafts that many tokens per step.

    Parameters
    ----------
    model : transformers causal LM
    prompt_ids : sequence of int, length >= 1
    max_new_tokens : int >= 1
    prompt_lookup_num_tokens : int >= 1, optional
        Draft tokens per step (HF's ``num_output_tokens``); None: plain greedy decoding.
    max_matching_ngram_size : int >= 1, optional
        Longest n-gram matched against the context (HF's default 2 when None).

    Returns
    -------
    list of int
        The generated token ids (the EOS token included when generation stopped on it).

    Raises
    ------
    ValueError
        For an empty prompt or a count below 1.
    """
    import torch

    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; allowed: at least one token id")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid; allowed: an integer >= 1")
    for name, v in (
        ("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
        ("max_matching_ngram_size", max_matching_ngram_size),
    ):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} is invalid; allowed: None or an integer >= 1")
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if prompt_lookup_num_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        if max_matching_ngram_size is not None:
            kwargs["max_matching_ngram_size"] = max_matching_ngram_size
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **kwargs,
        )
    return [int(t) for t in out[0, ids.shape[1] :].tolist()]


def top2_logprobs_at(
    model: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], position: int
) -> dict[int, _Logprob]:
    """The two most likely tokens and their logprobs at output ``position``, from one teacher-forced
    forward pass over ``prompt_ids + output_ids[:position]``.

    Raises
    ------
    ValueError
        If ``position`` is outside ``0..len(output_ids)``.
    """
    import torch

    if not 0 <= position <= len(output_ids):
        raise ValueError(f"position={position} is invalid; allowed: 0..{len(output_ids)}")
    ids = torch.tensor([list(prompt_ids) + list(output_ids[:position])], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    vals, idx = torch.topk(lp, 2)
    return {int(i): _Logprob(float(v)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)}


def greedy_identity(
    model: Any,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    candidate: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """:func:`adaptive_spec.commands.identity.compare_greedy` of ``candidate`` against the plain greedy
    ``reference``, with the reference's top-2 logprobs computed at each first divergence.

    Raises
    ------
    ValueError
        If the three lists differ in length.
    """
    from adaptive_spec.commands.identity import compare_greedy, first_divergence

    if not len(prompts) == len(reference) == len(candidate):
        raise ValueError(
            f"prompts ({len(prompts)}), reference ({len(reference)}) and candidate ({len(candidate)}) "
            "must have the same length"
        )
    ref_out, cand_out = [], []
    for p, r, c in zip(prompts, reference, candidate, strict=True):
        pos = first_divergence(r, c)
        lps: list[dict[int, _Logprob] | None] | None = None
        if pos is not None and pos < len(r):
            lps = [None] * len(r)
            lps[pos] = top2_logprobs_at(model, p, r, pos)
        ref_out.append(HFOutput([_Completion(list(r), lps)]))
        cand_out.append(HFOutput([_Completion(list(c))]))
    return compare_greedy(ref_out, cand_out)


def _run_config(
    model: Any, name: str, prompts: list[list[int]], max_tokens: int, pld_tokens: int, ngram: int
) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = [
        hf_generate(
            model,
            p,
            max_tokens,
            prompt_lookup_num_tokens=pld_tokens if name == "hf-pld" else None,
            max_matching_ngram_size=ngram if name == "hf-pld" else None,
        )
        for p in prompts
    ]
    return outs, time.perf_counter() - t0


def run_hf_group(spec: dict[str, Any], out_path: str | Path | None = None) -> dict[str, Any]:
    """Run the HF peer's cells: for each cell and repeat, every configuration in turn (rotated each
    repeat), each over all the cell's prompts one at a time.

    Parameters
    ----------
    spec : dict
        ``model`` (directory), ``dtype``, ``repeats`` (>= 1), ``pld_tokens`` (draft tokens per step, HF's
        ``prompt_lookup_num_tokens``), ``max_matching_ngram_size``, and ``cells``: a list of dicts with
        ``id``, ``texts`` (user messages; the chat template is applied here), ``max_tokens`` and ``configs``
        (a subset of ``hf-greedy``, ``hf-pld``; ``hf-greedy`` is required: it is the baseline).
    out_path : path, optional
        Where the results JSON is (re)written after every cell.

    Returns
    -------
    dict
        ``{"engine": "hf", "cells": {id: {"configs": {name: {"runs": [...]}}}}, "environment": {...}}``;
        each run has ``repeat``, ``wall_s``, ``output_tokens``, ``goodput_tok_s`` and, for ``hf-pld``,
        ``identity`` and ``valid``.

    Raises
    ------
    ValueError
        For an unknown configuration or a cell without ``hf-greedy``.
    """
    import torch

    from adaptive_spec.commands.workloads import chat_token_ids

    repeats = int(spec["repeats"])
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    for cell in spec["cells"]:
        bad = [c for c in cell["configs"] if c not in HF_CONFIGS]
        if bad:
            raise ValueError(f"configs {bad} are not HF peer configurations; allowed: {HF_CONFIGS}")
        if "hf-greedy" not in cell["configs"]:
            raise ValueError(f"cell {cell['id']}: 'hf-greedy' (the HF baseline) is required")
    t_load = time.perf_counter()
    model, tok = load_hf_model(spec["model"], spec.get("dtype", "bfloat16"))
    result: dict[str, Any] = {
        "engine": "hf",
        "load_s": time.perf_counter() - t_load,
        "environment": {
            "torch_threads": torch.get_num_threads(),
            "transformers_prompt_lookup_num_tokens": int(spec["pld_tokens"]),
            "max_matching_ngram_size": spec.get("max_matching_ngram_size"),
        },
        "cells": {},
    }
    encoded = {cell["id"]: chat_token_ids(tok, cell["texts"]) for cell in spec["cells"]}
    # Warm-up (not measured).
    first = encoded[spec["cells"][0]["id"]][0] if spec["cells"] else None
    if first:
        hf_generate(model, first, 8)
        hf_generate(model, first, 8, prompt_lookup_num_tokens=int(spec["pld_tokens"]))
    for cell in spec["cells"]:
        prompts = encoded[cell["id"]]
        configs = list(cell["configs"])
        res: dict[str, Any] = {"configs": {c: {"engine": "hf", "runs": []} for c in configs}}
        result["cells"][cell["id"]] = res
        for r in range(repeats):
            outs: dict[str, list[list[int]]] = {}
            for name in rotated(configs, r):
                o, wall = _run_config(
                    model,
                    name,
                    prompts,
                    int(cell["max_tokens"]),
                    int(spec["pld_tokens"]),
                    spec.get("max_matching_ngram_size") or 2,
                )
                outs[name] = o
                n = sum(len(x) for x in o)
                res["configs"][name]["runs"].append(
                    {"repeat": r, "wall_s": wall, "output_tokens": n, "goodput_tok_s": n / wall}
                )
                print(
                    f"[hf] {cell['id']} repeat {r + 1}/{repeats} {name}: {n / wall:.1f} tokens/s ({wall:.1f} s)",
                    flush=True,
                )
            if "hf-pld" in outs:
                ident = greedy_identity(model, prompts, outs["hf-greedy"], outs["hf-pld"])
                ident["details"] = ident["details"][:10]
                run = res["configs"]["hf-pld"]["runs"][-1]
                run["identity"] = ident
                run["valid"] = ident["violations"] == 0
        if out_path is not None:
            write_json(out_path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m adaptive_spec.commands.bench.hf_peer SPEC.json OUT.json``."""
    return worker_main("adaptive_spec.commands.bench.hf_peer", run_hf_group, argv)


if __name__ == "__main__":
    sys.exit(main())
