"""From ``adaptive-spec bench serve``'s command line to what it runs: the resolved plan (:class:`Plan`),
the target model, the settings every server shares, and the prompts."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.commands.bench.resolve import csv_list, default_mt_bench, model_max_len
from adaptive_spec.commands.bench.serve_plan import (
    DEFAULT_CONFIGS,
    DEFAULT_RATES,
    PATTERN_HELP,
    PATTERN_KINDS,
    QUICK_CONFIGS,
    QUICK_RATES,
    Pattern,
    ServerConfig,
    expand_patterns,
    parse_pattern,
    parse_server_configs,
)
from adaptive_spec.commands.bench.serve_server import ServerSettings
from adaptive_spec.core.machine import default_dtype

#: --quick: settings for a CI-size smoke run on the tiny float32 model.
QUICK = {"requests": 6, "max_tokens": 32, "warmup": 1, "kv_cache_gib": 0.25, "max_num_seqs": 8}
FULL = {"requests": 32, "max_tokens": 128, "warmup": 2, "kv_cache_gib": 1.0, "max_num_seqs": 16}


def load_prompts(sources: list[str], n: int, *, seed: int, mt_bench: str | None) -> list[str]:
    """``n`` prompt texts interleaved round-robin from ``sources`` (fewer if the sources run out).

    Raises
    ------
    ValueError
        For an unknown source or an unreadable file.
    FileNotFoundError
        If a data package or the MT-Bench file is missing.
    """
    from adaptive_spec.commands.workloads import load_workload

    if not sources:
        raise ValueError("--workloads is empty; allowed: built-in names, mtbench, or JSONL paths")
    per = -(-n // len(sources))
    pools: list[list[str]] = []
    for src in sources:
        if src == "mtbench":
            if not mt_bench or not Path(mt_bench).is_file():
                raise FileNotFoundError(
                    f"--workloads mtbench needs --mt-bench=<question.jsonl> (not found: {mt_bench})"
                )
            src = mt_bench
        path = Path(src)
        if path.suffix == ".jsonl" and path.is_file() and _is_custom_format(path):
            pools.append(_read_custom(path, per))
        else:
            pools.append([p.text for p in load_workload(src, per, seed=seed)])
    out = [pool[i] for i in range(per) for pool in pools if i < len(pool)]
    return out[:n]


def _is_custom_format(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                return isinstance(rec, dict) and "prompt" in rec and "turns" not in rec
    return False


def _read_custom(path: Path, n: int) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{i}: not a JSON object with a 'prompt' field") from None
            if len(out) >= n:
                break
    return out


class Plan:
    """The resolved run: settings, configurations, pattern specs (expanded now, or after calibration).

    Raises
    ------
    ValueError
        For any invalid flag value, naming the flag.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        q = bool(args.quick)
        d = QUICK if q else FULL
        self.quick = q
        self.mode = "quick" if q else "full"
        self.requests = args.requests or d["requests"]
        self.max_tokens = args.max_tokens or d["max_tokens"]
        self.warmup = d["warmup"] if args.warmup is None else args.warmup
        self.max_num_seqs = args.max_num_seqs or d["max_num_seqs"]
        self.kv_cache_gib = args.kv_cache_gib or d["kv_cache_gib"]
        self.dtype = args.dtype or ("float32" if q else default_dtype())
        self.eager = bool(args.eager or q)
        self.max_k = args.max_k
        names = (
            csv_list(args.configs)
            if args.configs
            else list(QUICK_CONFIGS if q else DEFAULT_CONFIGS)
        )
        self.configs: list[ServerConfig] = parse_server_configs(names, self.max_k)
        self.warm_state = Path(args.warm_state).expanduser() if args.warm_state else None
        if any(c.warm for c in self.configs):
            if self.warm_state is None and not any(c.name == "adaptive" for c in self.configs):
                raise ValueError(
                    "--configs has adaptive-warm but neither 'adaptive' (whose saved state it loads) nor "
                    "--warm-state=<policy-state file>"
                )
            if self.warm_state is not None and not self.warm_state.is_file():
                raise ValueError(f"--warm-state={args.warm_state!r} is not a file")
        self.pattern_specs = csv_list(args.patterns)
        if not self.pattern_specs:
            raise ValueError(f"--patterns is empty; allowed: {PATTERN_HELP}")
        for spec in self.pattern_specs:
            if spec not in PATTERN_KINDS:
                parse_pattern(spec)  # fails early, naming the entry
        try:
            rates = [float(x) for x in csv_list(args.rates)] if args.rates else None
        except ValueError:
            raise ValueError(
                f"--rates={args.rates!r} is invalid; allowed: comma-separated rates > 0 (requests/s)"
            ) from None
        self.rates = tuple(rates) if rates else (QUICK_RATES if q else DEFAULT_RATES)
        self.calibrate = bool(args.calibrate)
        if not 0 < args.hot_share < 1:
            raise ValueError(f"--hot-share={args.hot_share:g} is invalid; allowed: 0 < share < 1")
        self.burstiness = args.burstiness
        self.hot_share = args.hot_share
        self.patterns: list[Pattern] | None = None
        self.expand(self.rates)  # validates the rates; redone after --calibrate
        if self.calibrate:
            self.patterns = None

    def expand(self, rates: tuple[float, ...]) -> list[Pattern]:
        self.rates = tuple(rates)
        self.patterns = expand_patterns(
            self.pattern_specs, self.rates, burstiness=self.burstiness, hot_share=self.hot_share
        )
        return self.patterns


def target_model(args: argparse.Namespace) -> Path:
    """The target model directory: ``--model``, else the tiny test model under ``--quick``, else the
    embedded model for ``--dtype``.

    Raises
    ------
    ValueError
        When ``--model`` is not a model directory.
    """
    if args.model:
        path = Path(args.model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model={args.model!r} is not a model directory (no config.json)")
        return path
    if args.quick:
        from adaptive_spec.vllm.tiny_model import tiny_model_path

        return tiny_model_path()
    from adaptive_spec.vllm.models import default_model_path

    return default_model_path(args.dtype or default_dtype())


def resolve_drafter(plan: Plan, args: argparse.Namespace) -> tuple[Path | None, str]:
    """The drafter of the configurations with ``draft`` / ``lora:<adapter>`` arms and vLLM's method for
    it: ``--draft-model``, else the shipped EAGLE-3 head for the embedded model (assembled into the
    cache on first use); (None, "eagle3") when no configuration needs one. Expands ``adaptive+lora``'s
    adapters in ``plan.configs`` (those stored with the shipped head).

    Raises
    ------
    ValueError
        For a drafter configuration with ``--model`` or ``--quick`` and no ``--draft-model``, a
        ``--draft-model`` that is not a directory, or a LoRA adapter the drafter does not have.
    """
    if not any(c.drafter for c in plan.configs):
        return None, "eagle3"
    from adaptive_spec.vllm.eagle3 import default_head_path, draft_method, drafter_adapters

    names = ",".join(c.name for c in plan.configs if c.drafter)
    if args.draft_model:
        drafter = Path(args.draft_model).expanduser()
        if not drafter.is_dir():
            raise ValueError(f"--draft-model={args.draft_model!r} is not a directory")
    elif args.model or plan.quick:
        raise ValueError(
            f"--configs {names} needs a drafter: give --draft-model DIR (the shipped head fits the "
            "embedded model only)"
        )
    else:
        drafter = default_head_path(plan.dtype)
    adapters = sorted(drafter_adapters(drafter))
    plan.configs = [c.with_adapters(adapters) for c in plan.configs]
    for c in plan.configs:
        missing = [p for p in c.proposers or () if p.startswith("lora:") and p[5:] not in adapters]
        if missing:
            raise ValueError(
                f"--configs entry {c.name!r}: the drafter has no adapter {missing[0][5:]!r}; it has "
                f"{', '.join(adapters) or 'none'}"
            )
    return drafter, draft_method(drafter)


def server_settings(plan: Plan, args: argparse.Namespace) -> ServerSettings:
    """What every configuration's server shares, from the plan and the command line (with
    :func:`resolve_drafter`, which expands ``adaptive+lora``'s adapters in ``plan.configs``).

    Raises
    ------
    ValueError
        When ``--model`` is not a model directory, or as :func:`resolve_drafter`.
    """
    model = target_model(args)
    drafter, method = resolve_drafter(plan, args)
    return ServerSettings(
        model=model,
        served_name="tiny" if plan.quick and not args.model else "smollm2",
        dtype=plan.dtype,
        max_model_len=model_max_len(model, args.max_model_len),
        max_num_seqs=plan.max_num_seqs,
        kv_cache_bytes=int(plan.kv_cache_gib * (1 << 30)),
        enforce_eager=plan.eager,
        prefix_caching=bool(args.prefix_caching),
        max_k=plan.max_k,
        seed=args.seed,
        extra_args=tuple(args.server_arg),
        multiprocessing=bool(getattr(args, "multiprocessing", False)),
        drafter=drafter,
        drafter_method=method,
    )


@dataclass(frozen=True, slots=True)
class RunPrompts:
    """The prompt texts of a run: ``measured`` (every pattern sends all of them) and ``warmup`` (sent
    once to each server before its first pattern)."""

    measured: list[str]
    warmup: list[str]


def run_prompts(plan: Plan, args: argparse.Namespace, notes: list[str]) -> RunPrompts:
    """Load ``plan.requests + plan.warmup`` prompts from ``--workloads``; when the workloads give fewer,
    ``plan.requests`` is lowered to what is left after the warm-up, with a note.

    Raises
    ------
    ValueError
        For an unknown source, or no prompts left after the warm-up ones.
    FileNotFoundError
        If a data package or the MT-Bench file is missing.
    """
    need = plan.requests + plan.warmup
    prompts = load_prompts(
        csv_list(args.workloads),
        need,
        seed=args.seed,
        mt_bench=args.mt_bench or default_mt_bench(),
    )
    if len(prompts) < need:
        if len(prompts) <= plan.warmup:
            raise ValueError(
                f"--workloads={args.workloads!r} gave {len(prompts)} prompts; need more than "
                f"--warmup={plan.warmup}"
            )
        notes.append(
            f"the workloads gave {len(prompts)} prompts: {len(prompts) - plan.warmup} requests per "
            f"pattern instead of {plan.requests}"
        )
        plan.requests = len(prompts) - plan.warmup
    return RunPrompts(
        prompts[: plan.requests], prompts[plan.requests : plan.requests + plan.warmup]
    )
