"""``adaptive-spec run``: the main job.

Builds the embedded default engine (SmolLM2-135M-Instruct, bf16, vLLM's CPU build, n-gram method with
k up to 8), attaches :class:`~adaptive_spec.AdaptiveSpec`, generates for a mixed workload of real prompts
and prints a per-category table; writes the step trace, a PNG of the arm choices over time and a JSON
summary into ``--out``. With ``--compare-static`` the same prompts also run with speculation off in the
same engine, and the goodput ratio and greedy identity are reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from adaptive_spec.workloads import WORKLOADS

logger = logging.getLogger("adaptive_spec.run")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is invalid; allowed: an integer >= 1")
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that build an engine."""
    p.add_argument(
        "--model",
        default=None,
        help="model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="weights/activations dtype",
    )
    p.add_argument(
        "--max-k",
        type=_positive_int,
        default=8,
        help="num_speculative_tokens: the largest k (default 8)",
    )
    p.add_argument(
        "--concurrency",
        type=_positive_int,
        default=4,
        help="requests decoded together (max_num_seqs; default 4)",
    )
    p.add_argument(
        "--proposers",
        default="none,ngram,jacobi",
        help="comma-separated proposers the controller may choose: none, ngram, jacobi, suffix, draft (the draft "
        "model), lora:<name> (the draft model with LoRA adapter <name>), lora (every available adapter) "
        "(default none,ngram,jacobi; draft and lora load the shipped distilled draft unless --draft-model "
        "is given)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft model directory for the draft/lora proposers (default: the shipped draft for the "
        "embedded model, assembled into the cache on first use)",
    )
    p.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter for the draft (repeatable; adds to the shipped draft's adapters code, math, "
        "chat when the shipped draft is used)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the engine and the policy (default 0)"
    )
    p.add_argument("--verbose", action="store_true", help="show vLLM's own INFO logs")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run the main job: adaptive speculation on real prompts, per-category table, trace and plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        default="mixed",
        help=f"built-in workload ({', '.join(WORKLOADS)}) or a JSONL file in MT-Bench format (default mixed)",
    )
    p.add_argument(
        "--prompts", type=_positive_int, default=32, help="number of prompts (default 32)"
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=256,
        help="output tokens per prompt (default 256)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    p.add_argument(
        "--policy",
        default="adaptive",
        help="adaptive (default), adaptive-ucb, adaptive-greedy, adaptive-eps, none, static:<proposer>:<k>, "
        "table:<proposer>:<start>-<end>=<k>,...",
    )
    p.add_argument(
        "--compare-static",
        action="store_true",
        help="also run with speculation off and print the goodput ratio",
    )
    p.add_argument(
        "--state", default=None, help="policy state file: loaded if present, saved at the end"
    )
    p.add_argument(
        "--out",
        default="runs/latest",
        help="output directory for trace.jsonl, arms.png, summary.json",
    )
    add_engine_args(p)
    p.set_defaults(func=main)


def setup_logging(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


def resolve_drafts(
    args: argparse.Namespace, proposers: list[str]
) -> tuple[list[str], dict[str, Any]]:
    """Expand ``lora`` into ``lora:<name>`` per available adapter, set ``args.draft_model`` to the shipped
    draft when a draft proposer needs one and none was given, and return the proposers and the adapters
    (name -> directory).

    Raises
    ------
    ValueError
        For a malformed ``--lora-adapter``, ``lora`` with no adapter available, a ``lora:<name>`` with no
        such adapter, or a draft proposer with ``--model`` but no ``--draft-model``.
    """
    from adaptive_spec.lora_draft import check_adapter_name

    adapters: dict[str, Any] = {}
    for item in getattr(args, "lora_adapter", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-adapter={item!r} is invalid; expected NAME=DIR")
        check_adapter_name(name)
        if not Path(path).is_dir():
            raise ValueError(f"--lora-adapter={item!r}: {path!r} is not a directory")
        adapters[name] = Path(path)
    wants_draft = any(p == "draft" or p == "lora" or p.startswith("lora:") for p in proposers)
    if wants_draft and not args.draft_model:
        if args.model:
            raise ValueError(
                f"--proposers={','.join(proposers)} with --model={args.model!r} needs --draft-model "
                "(the shipped draft fits the embedded model only)"
            )
        from adaptive_spec.drafts import default_draft_path, shipped_adapters

        args.draft_model = str(default_draft_path(args.dtype))
        adapters = {**shipped_adapters(), **adapters}
    out: list[str] = []
    for p in proposers:
        if p == "lora":
            if not adapters:
                raise ValueError(
                    "--proposers includes 'lora' but no LoRA adapter is available: give --lora-adapter NAME=DIR"
                )
            out += [f"lora:{n}" for n in adapters]
        else:
            out.append(p)
    for p in out:
        if p.startswith("lora:") and p.removeprefix("lora:") not in adapters:
            raise ValueError(
                f"proposer {p!r} has no adapter; available: {', '.join(sorted(adapters)) or 'none'}"
            )
    return list(dict.fromkeys(out)), adapters


def build_engine(args: argparse.Namespace, proposers: list[str]) -> Any:
    from adaptive_spec.engine import build_llm

    method = "draft_model" if args.draft_model else "ngram"
    return build_llm(
        args.model,
        dtype=args.dtype,
        max_k=args.max_k,
        concurrency=args.concurrency,
        method=method,
        draft_model=args.draft_model,
        seed=args.seed,
    )


def encode_prompts(llm: Any, prompts: list[Any]) -> list[list[int]]:
    """Apply the model's chat template to each prompt and return token ids."""
    tok = llm.get_tokenizer()
    out = []
    for p in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def generate(llm: Any, token_ids: list[list[int]], params: Any) -> tuple[list[Any], float]:
    """Generate for all prompts (with vLLM's progress bar); returns outputs and wall time (s)."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params, use_tqdm=True)
    return outs, time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    from rich.console import Console
    from rich.table import Table
    from vllm import SamplingParams

    from adaptive_spec.identity import compare_greedy
    from adaptive_spec.plots import arm_mix, plot_arm_choices
    from adaptive_spec.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.workloads import load_workload

    console = Console(width=None if sys.stdout.isatty() else 160)
    proposers = [p.strip() for p in args.proposers.split(",") if p.strip()]
    try:
        proposers, adapters = resolve_drafts(args, proposers)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]adaptive-spec run: error:[/] {e}")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_workload(args.workload, args.prompts, seed=args.seed)
    console.print(
        f"[bold]adaptive-spec run[/]: {len(prompts)} prompts ({args.workload}), max_tokens={args.max_tokens}, "
        f"concurrency={args.concurrency}, policy={args.policy}, proposers={','.join(proposers)}"
    )
    console.print(
        "building the engine (vLLM CPU build; the first build compiles the model, about a minute or two)..."
    )
    llm = build_engine(args, proposers)
    token_ids = encode_prompts(llm, prompts)
    cats = {tuple(t): p.category for t, p in zip(token_ids, prompts, strict=True)}

    def category_of(ids: Any) -> str | None:
        return cats.get(tuple(ids))

    want_logprobs = 2 if args.compare_static and args.temperature == 0 else None
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        logprobs=want_logprobs,
    )
    # Warm-up (not measured): the first steps of a new engine run slower.
    warm = AdaptiveSpec(llm, proposers, policy="none", lora_adapters=adapters)
    llm.generate(
        [{"prompt_token_ids": token_ids[0]}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )
    warm.detach()

    results: dict[str, Any] = {}
    baseline_outs = None
    if args.compare_static:
        console.print("[bold]1/2[/] speculation off (same engine, every request k = 0)")
        base = AdaptiveSpec(
            llm, proposers, policy="none", category_of=category_of, lora_adapters=adapters
        )
        baseline_outs, wall = generate(llm, token_ids, params)
        base.detach()
        n_tok = sum(len(o.outputs[0].token_ids) for o in baseline_outs)
        results["no_speculation"] = {
            "wall_s": wall,
            "output_tokens": n_tok,
            "goodput_tok_s": n_tok / wall,
            "stats": base.stats(),
        }
        console.print("[bold]2/2[/] adaptive")
    trace_path = out_dir / "trace.jsonl"
    spec = AdaptiveSpec(
        llm,
        proposers,
        policy=args.policy,
        trace=trace_path,
        policy_state=args.state,
        category_of=category_of,
        seed=args.seed,
        lora_adapters=adapters,
    )
    outs, wall = generate(llm, token_ids, params)
    spec.detach()
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = spec.stats()
    results["adaptive"] = {
        "wall_s": wall,
        "output_tokens": n_tok,
        "goodput_tok_s": n_tok / wall,
        "stats": stats,
    }

    table = Table(
        title=f"adaptive-spec run: {args.workload}, policy {args.policy}, concurrency {args.concurrency}"
    )
    for col in (
        "category",
        "request-steps",
        "output tokens",
        "tokens/s",
        "mean accepted length",
        "acceptance rate",
        "arms chosen",
    ):
        table.add_column(col, justify="right" if col not in ("category", "arms chosen") else "left")
    for cat, s in stats["by_category"].items():
        mix = stats["arm_mix_by_category"].get(cat, {})
        table.add_row(
            cat,
            str(s["request_steps"]),
            str(s["emitted"]),
            f"{s['goodput_tok_s']:.1f}",
            f"{s['mean_accepted_length']:.2f}",
            f"{s['acceptance_rate']:.2f}",
            arm_mix(mix, top=3),
        )
    table.caption = (
        f"all: {n_tok} tokens in {wall:.1f} s = {n_tok / wall:.1f} tokens/s; controller overhead "
        f"{100 * stats['controller_overhead']:.1f}% of step time; faults {stats['faults']}. "
        "tokens/s per category charges each request-step an equal share of its step's time."
    )
    console.print(table)
    if baseline_outs is not None:
        b = results["no_speculation"]
        ratio = results["adaptive"]["goodput_tok_s"] / b["goodput_tok_s"]
        results["goodput_ratio"] = ratio
        console.print(
            f"[bold]goodput[/]: adaptive {results['adaptive']['goodput_tok_s']:.1f} tokens/s vs no speculation "
            f"{b['goodput_tok_s']:.1f} tokens/s: [bold]{ratio:.2f}x[/]"
        )
        if args.temperature == 0:
            ident = compare_greedy(baseline_outs, outs)
            results["greedy_identity"] = ident
            console.print(
                f"greedy identity: {ident['identical']}/{ident['total']} identical, {ident['near_tie']} differ at a "
                f"near-tie (top-2 margin <= {ident['tolerance']}), {ident['violations']} violations"
            )
    trace = read_trace(trace_path)
    plot = plot_arm_choices(
        trace.steps, out_dir / "arms.png", title=f"Arm choices: {args.workload}, {args.policy}"
    )
    summary = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "results": results,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    console.print(f"trace: {trace_path}  plot: {plot}  summary: {out_dir / 'summary.json'}")
    return 0
