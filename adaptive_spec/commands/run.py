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
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from adaptive_spec.commands.generation import GenerationJob, encode_prompts, generate
from adaptive_spec.commands.workloads import WORKLOADS
from adaptive_spec.core.machine import dtype_arg

logger = logging.getLogger("adaptive_spec.commands.run")


def _temperature(text: str) -> float:
    """``--temperature``: a finite number >= 0 (argparse reports a refusal in one line, exit 2)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: a finite number >= 0; fix: e.g. --temperature 0 (greedy)"
        ) from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: a finite number >= 0; fix: e.g. --temperature 0 (greedy)"
        )
    return v


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} is invalid; allowed: an integer >= {low}")
    return v


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that build an engine."""
    p.add_argument(
        "--model",
        default=None,
        help="model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        type=dtype_arg,
        help="weights/activations dtype: auto (default: bfloat16 where the hardware runs it natively, "
        "a GPU or a CPU with AMX/AVX512-BF16; else float32, which is faster there), bfloat16, float32",
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
        help="comma-separated proposers the controller may choose: none, ngram, jacobi, suffix, draft (the "
        "engine's drafter: the shipped EAGLE-3 head unless --draft-model is given), lora:<name> (the "
        "drafter with LoRA adapter <name>: one the shipped head stores, or a --lora-adapter), lora "
        "(every adapter) (default none,ngram,jacobi)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="drafter directory for the draft/lora proposers: an EAGLE-3 head or a draft model (default: the shipped head for the "
        "embedded model, assembled into the cache on first use)",
    )
    p.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter for the drafter, trained with adaptive-spec distill --lora (repeatable; "
        "the shipped head's own adapters are used without this flag)",
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
        "--temperature",
        type=_temperature,
        default=0.0,
        help="sampling temperature, a finite number >= 0 (default 0: greedy)",
    )
    p.add_argument(
        "--policy",
        default="adaptive",
        help="adaptive (default), adaptive-ucb, adaptive-greedy, adaptive-eps, none, static:<proposer>:<k>, "
        "table:<proposer>:<start>-<end>=<k>,..., bandit:<learner> (a learner of adaptive_spec.bandits, "
        "e.g. bandit:ucb1; docs/bandits.md)",
    )
    p.add_argument(
        "--compare-static",
        action="store_true",
        help="also measure, on the same prompts after one untimed warm-up pass of all of them: speculation "
        "off in the same engine (k = 0), the controller's safe baseline (--baseline) and an engine built "
        "without speculative decoding (a second engine in this process, in the same rounds; --no-nospec "
        "skips it); repeats interleaved (--repeats), medians and paired ratios, greedy identity of every run",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=2,
        help="interleaved repeats of each configuration with --compare-static (default 2)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="the adaptive controller's safe baseline: none, static:<proposer>:<k> or "
        "table:<proposer>:<start>-<end>=<k>,... (default: the shipped n-gram batch-size table, "
        "adaptive_spec.core.baselines.DEFAULT_NGRAM_TABLE)",
    )
    p.add_argument(
        "--no-nospec",
        dest="nospec",
        action="store_false",
        help="with --compare-static, skip the engine built without speculative decoding (saves one engine build)",
    )
    p.add_argument(
        "--state",
        default=None,
        help="policy state file: loaded if present, saved at the end (default: a file in the cache "
        "directory keyed by model, dtype, machine, policy and proposers; see --no-state)",
    )
    p.add_argument(
        "--no-state",
        action="store_true",
        help="start from no learned state and keep none (the controller still uses the shipped priors "
        "and the measured step-cost table)",
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
    drafter when a draft proposer needs one and none was given (the EAGLE-3 head, and its stored
    adapters when a ``lora`` proposer is asked for: :func:`adaptive_spec.vllm.eagle3.default_drafter`),
    and return the proposers and the adapters (name -> directory).

    Raises
    ------
    ValueError
        For a malformed ``--lora-adapter``, ``lora`` with no adapter available, a ``lora:<name>`` with no
        such adapter, or a draft proposer with ``--model`` but no ``--draft-model``.
    """
    from adaptive_spec.vllm.lora_draft import check_adapter_name

    adapters: dict[str, Any] = {}
    for item in getattr(args, "lora_adapter", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-adapter={item!r} is invalid; expected NAME=DIR")
        check_adapter_name(name)
        if not Path(path).is_dir():
            raise ValueError(f"--lora-adapter={item!r}: {path!r} is not a directory")
        adapters[name] = Path(path)
    wants_lora = any(p == "lora" or p.startswith("lora:") for p in proposers)
    wants_draft = wants_lora or "draft" in proposers
    if wants_draft and not args.draft_model:
        if args.model:
            raise ValueError(
                f"--proposers={','.join(proposers)} with --model={args.model!r} needs --draft-model "
                "(the shipped head fits the embedded model only)"
            )
        from adaptive_spec.vllm.eagle3 import default_drafter

        args.draft_model, shipped = default_drafter(args.dtype, lora=wants_lora)
        adapters = {**shipped, **adapters}
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


_PROPOSER_FLAG_ALLOWED = "comma-separated none, ngram, jacobi, suffix, draft, lora, lora:<adapter>"


def check_proposers_flag(text: str) -> list[str]:
    """The proposers of ``--proposers`` (``lora`` is expanded later, by :func:`resolve_drafts`).

    Raises
    ------
    ConfigError
        For an empty list or an unknown name, naming the flag.
    """
    from adaptive_spec.core.arms import check_proposer_name
    from adaptive_spec.core.errors import invalid_value

    proposers = [p.strip() for p in text.split(",") if p.strip()]
    if not proposers:
        raise invalid_value(
            "--proposers",
            text,
            _PROPOSER_FLAG_ALLOWED,
            why="no proposer",
            fix="e.g. none,ngram,jacobi",
        )
    for p in proposers:
        if p == "lora":
            continue
        try:
            check_proposer_name(p)
        except ValueError:
            raise invalid_value(
                "--proposers",
                text,
                _PROPOSER_FLAG_ALLOWED,
                why=f"proposer {p!r} is not known",
                fix="remove or correct it",
            ) from None
    return proposers


def check_policy_flag(policy: str, proposers: list[str], max_k: int) -> None:
    """Check ``--policy`` against the resolved proposers and ``--max-k`` (before the engine is built).

    Raises
    ------
    ConfigError
        Naming the flag, the reason, the policy names and the fix.
    """
    from adaptive_spec.core.errors import invalid_value
    from adaptive_spec.core.policies import POLICY_NAMES, make_policy, policy_error_reason

    try:
        make_policy(policy, proposers, max_k)
    except ValueError as e:
        raise invalid_value(
            "--policy",
            policy,
            f"{', '.join(POLICY_NAMES)}, with k <= --max-k={max_k} and proposers in --proposers",
            why=policy_error_reason(e, policy),
            fix="e.g. --policy adaptive",
        ) from None


def load_prompts(args: argparse.Namespace) -> list[Any]:
    """The prompts of ``--workload`` (``--prompts`` of them).

    Raises
    ------
    ConfigError
        For an unknown workload, a missing, unreadable, malformed or empty JSONL file, or a data package
        that is not installed; the message names the flag.
    """
    from adaptive_spec.commands.workloads import WORKLOADS, load_workload
    from adaptive_spec.core.errors import invalid_value

    allowed = f"{', '.join(WORKLOADS)}, or a JSONL file in MT-Bench format (one record per line)"
    fix = "give a built-in name, or a path to a non-empty JSONL file with a 'turns' list per line"
    if args.workload not in WORKLOADS and not Path(args.workload).is_file():
        why = "not a built-in workload, and no such file"
        raise invalid_value("--workload", args.workload, allowed, why=why, fix=fix)
    try:
        return load_workload(args.workload, args.prompts, seed=args.seed)
    except (OSError, ValueError) as e:
        raise invalid_value("--workload", args.workload, allowed, why=str(e), fix=fix) from None


def check_paths(args: argparse.Namespace) -> None:
    """Check ``--model``, ``--draft-model``, ``--state`` and ``--out`` before the engine is built;
    removes stale temporary files of an interrupted state save.

    Raises
    ------
    ConfigError
        Naming the flag and the path.
    """
    from adaptive_spec.core.errors import invalid_value
    from adaptive_spec.core.state import check_writable_path, prepare_state_path

    for flag, value in (("--model", args.model), ("--draft-model", args.draft_model)):
        if value is not None and not Path(value).is_dir():
            raise invalid_value(
                flag,
                value,
                "a model directory (config.json and weights)",
                why="not a directory",
                fix=f"give an existing directory, or omit {flag} for the default",
            )
    if args.state:
        prepare_state_path(args.state, "--state")
    check_writable_path(Path(args.out) / "summary.json", "--out")


def check_args(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], list[Any]]:
    """Everything ``run`` can check before building the engine, in the order of the flags' cost:
    proposers, paths, workload, draft proposers, policy. Returns the proposers, the LoRA adapters and
    the prompts.

    Raises
    ------
    ValueError
        A :class:`~adaptive_spec.core.errors.ConfigError` (or a message of :func:`resolve_drafts`) naming the
        flag.
    """
    proposers = check_proposers_flag(args.proposers)
    check_paths(args)
    prompts = load_prompts(args)
    proposers, adapters = resolve_drafts(args, proposers)
    check_policy_flag(args.policy, proposers, args.max_k)
    if getattr(args, "baseline", None) is not None:
        from adaptive_spec.core.errors import invalid_value

        try:
            check_policy_flag(args.baseline, proposers, args.max_k)
            if args.baseline.startswith(("adaptive", "smartspec", "banditspec", "bandit:")):
                raise ValueError("a learning policy cannot be the baseline")
        except ValueError as e:
            raise invalid_value(
                "--baseline",
                args.baseline,
                "none, static:<proposer>:<k>, table:<proposer>:<start>-<end>=<k>,...",
                why=str(e).split(";")[0],
                fix="pass e.g. --baseline static:ngram:4",
            ) from None
    return proposers, adapters, prompts


def build_engine(
    args: argparse.Namespace, proposers: list[str], *, speculative: bool = True
) -> Any:
    """The main job's engine (n-gram speculation, or the draft model's with ``--draft-model``). With
    ``speculative=False``, the same engine without speculative decoding (model, dtype, concurrency and
    seed as the main one), which ``--compare-static`` runs beside it: vLLM 0.32's CPU build holds the
    two in one process only when this one is built second. Raises what vLLM raises."""
    from adaptive_spec.vllm.engine import build_llm

    method = ("draft_model" if args.draft_model else "ngram") if speculative else None
    return build_llm(
        args.model,
        dtype=args.dtype,
        max_k=args.max_k,
        concurrency=args.concurrency,
        method=method,
        draft_model=args.draft_model if speculative else None,
        seed=args.seed,
        # lora:<name> arms: the adapters run inside the drafter's compiled pass
        lora_sites=speculative and any(p.startswith("lora:") for p in proposers),
    )


def main(args: argparse.Namespace) -> int:
    """Run the main job. Returns 0, or 2 after one line on stderr naming a bad flag (with the traceback
    under ``--verbose``); the flags are checked before vLLM is imported or the engine built."""
    setup_logging(args.verbose)
    try:
        proposers, adapters, prompts = check_args(args)
    except (ValueError, FileNotFoundError) as e:
        if args.verbose:
            traceback.print_exc()
        print(f"adaptive-spec run: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from adaptive_spec.commands.plots import arm_mix, plot_arm_choices
    from adaptive_spec.core.trace import read_trace
    from adaptive_spec.vllm import AdaptiveSpec
    from adaptive_spec.vllm.engine import request_seed, sampling_params

    console = Console(width=None if sys.stdout.isatty() else 160)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]adaptive-spec run[/]: {len(prompts)} prompts ({args.workload}), max_tokens={args.max_tokens}, "
        f"concurrency={args.concurrency}, policy={args.policy}, proposers={','.join(proposers)}"
    )
    console.print(
        "building the engine (vLLM CPU build; the first build compiles the model, about a minute or two)..."
    )
    llm = build_engine(args, proposers)
    nospec_llm = None
    if args.compare_static and getattr(args, "nospec", True):
        console.print(
            "building the engine without speculative decoding (for --compare-static; --no-nospec skips it)..."
        )
        try:
            nospec_llm = build_engine(args, proposers, speculative=False)
        except Exception as e:  # measured in a worker process afterwards instead (unpaired)
            logger.warning(
                "the engine without speculative decoding could not be built beside the main one "
                "(%s: %s); it will run in its own process after the rounds",
                type(e).__name__,
                e,
            )
    token_ids = encode_prompts(llm, prompts)
    params = sampling_params(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=request_seed(args.seed)
    )
    greedy = args.temperature == 0
    # One untimed pass of every prompt with speculation off: it warms the engine and puts every prompt
    # in vLLM's prefix cache, so that no configuration pays a prefill the others skip. In compare
    # mode it is the greedy reference (logprobs) every run is checked against.
    console.print(
        "warm-up: every prompt once with speculation off (untimed, fills the prefix cache)"
    )
    ref_params = sampling_params(
        temperature=args.temperature,
        max_tokens=args.max_tokens if args.compare_static else 1,
        seed=request_seed(args.seed),
        logprobs=2 if args.compare_static and greedy else None,
    )
    with AdaptiveSpec(
        llm, proposers, policy="none", lora_adapters=adapters, policy_state=None, calibrate=False
    ):
        reference, _ = generate(llm, token_ids, ref_params)
    if nospec_llm is not None:
        # Its prefix cache warmed as the main engine's: a prefill pass is enough (the reference,
        # which every run is checked against, comes from the main engine's pass above).
        generate(nospec_llm, token_ids, sampling_params(temperature=0.0, max_tokens=1))

    state = None if args.no_state else (args.state or "auto")
    trace_path = out_dir / "trace.jsonl"
    results: dict[str, Any] = {}
    job = GenerationJob(
        llm,
        proposers,
        adapters,
        token_ids,
        params,
        categories={tuple(t): p.category for t, p in zip(token_ids, prompts, strict=True)},
        policy=args.policy,
        seed=args.seed,
        trace_path=trace_path,
        baseline=args.baseline,
    )
    if not args.compare_static:
        outs, wall, stats = job.run_adaptive(True, state)
    else:
        from adaptive_spec.commands.compare_static import compare_in_engine

        outs, wall, stats, results["comparison"] = compare_in_engine(
            console, job, args, reference, state, prompts, nospec_llm
        )
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
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
    if stats.get("cost_table_source"):
        table.caption += f" Step-cost table: {stats['cost_table_source']}."

    console.print(table)
    if args.compare_static:
        from adaptive_spec.commands.compare_static import print_comparison

        print_comparison(console, results, greedy)
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
