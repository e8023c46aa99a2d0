"""From ``adaptive-spec bench``'s command line to what it runs: the draft model and its LoRA adapters, the
cells with the overrides applied, the repeats, each cell's prompts, and the plan's printout.

Also the small resolutions ``adaptive-spec bench serve`` shares: comma-separated flag values, the default
MT-Bench file, and a model's usable context length.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.commands.bench.plan import (
    MT_BENCH,
    MT_BENCH_DEFAULT,
    Cell,
    check_cell,
    custom_plan,
    estimate_minutes,
    full_plan,
    parse_config,
    quick_plan,
)


def csv_list(text: str | None) -> list[str]:
    """The non-empty, stripped items of a comma-separated flag value."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def default_mt_bench() -> str | None:
    """The shared MT-Bench ``question.jsonl`` (:data:`~adaptive_spec.commands.bench.plan.MT_BENCH_DEFAULT`)
    when it is present, else None."""
    return str(MT_BENCH_DEFAULT) if MT_BENCH_DEFAULT.is_file() else None


def model_max_len(model: str | Path | None, cap: int = 4096) -> int:
    """The context length (tokens) to build an engine with: ``cap``, lowered to the model's
    ``max_position_embeddings`` (a small test model has 2048). ``cap`` when ``model`` is None or its
    ``config.json`` is unreadable or has no positive length."""
    if not model:
        return cap
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return cap
    n = cfg.get("max_position_embeddings")
    return min(cap, int(n)) if isinstance(n, int | float) and n > 0 else cap


@dataclass(slots=True)
class BenchPlan:
    """What an ``adaptive-spec bench`` run does.

    Attributes
    ----------
    mode : str
        ``quick``, ``full`` or ``custom``.
    cells : list of Cell
        The cells to run, in order (MT-Bench cells without their file dropped).
    repeats : int >= 1
        Interleaved repeats per cell.
    confirm : int >= 0
        Confirmation rounds per cell after the repeats.
    draft_path : str or None
        The draft model directory; None when the draft arms are off.
    lora_adapters : dict
        LoRA adapters of the draft: name -> directory.
    ignore_eos : dict
        Cell id -> whether its requests decode to ``max_tokens`` past EOS (:func:`ignores_eos`).
    notes : list of str
        What the plan left out and why, for the report.
    """

    mode: str
    cells: list[Cell]
    repeats: int
    confirm: int
    draft_path: str | None
    lora_adapters: dict[str, str]
    ignore_eos: dict[str, bool]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CellPrompts:
    """A cell's prompts (:class:`adaptive_spec.commands.workloads.Prompt`): the ``evaluated`` ones, the
    held-out ``training`` ones (for ``adaptive-warm``; else empty) and a ``note`` when the workload had
    fewer than asked."""

    evaluated: list[Any]
    training: list[Any]
    note: str | None = None


def _draft_path(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The draft model directory to use, or None and why."""
    if args.draft == "off" or (args.draft == "auto" and args.quick and not args.draft_model):
        return None, "draft arms off"
    if args.draft_model:
        if not Path(args.draft_model).is_dir():
            raise ValueError(f"--draft-model={args.draft_model!r} is not a directory")
        return args.draft_model, None
    try:
        from adaptive_spec.core.machine import resolve_dtype
        from adaptive_spec.vllm.eagle3 import default_drafter

        path, _ = default_drafter(resolve_dtype(getattr(args, "dtype", "auto") or "auto"))
    except Exception as e:  # a missing module or draft is not an error: the draft arms are optional
        if args.draft == "on":
            raise ValueError(f"--draft on, but no draft model is available ({e})") from None
        return None, f"no draft model ({type(e).__name__}: {e})"
    if path is None or not Path(path).is_dir():
        if args.draft == "on":
            raise ValueError(
                "--draft on, but adaptive_spec.vllm.eagle3.default_drafter() found none"
            )
        return None, "no draft model found"
    return str(path), None


def _lora_adapters(args: argparse.Namespace, draft_path: str | None) -> dict[str, str]:
    """LoRA adapters of the drafter (name -> directory): those stored with the shipped EAGLE-3 head
    (:func:`adaptive_spec.vllm.eagle3.head_adapters`) when the drafter is the shipped head."""
    if draft_path is None or args.draft_model:
        return {}
    from adaptive_spec.vllm.eagle3 import head_adapters, shipped_head_dir

    try:
        return {n: str(p) for n, p in head_adapters(shipped_head_dir()).items()}
    except FileNotFoundError:
        return {}


def build_plan(args: argparse.Namespace, draft: bool) -> tuple[list[Cell], str]:
    """Cells to run and the mode (``quick``, ``full`` or ``custom``), with the overrides applied.

    Raises
    ------
    ValueError
        For a bad override or configuration.
    """
    custom = any(
        getattr(args, a) is not None
        for a in ("workloads", "concurrency", "temperatures", "configs")
    )
    if custom:
        mode = "custom"
        try:
            conc = [int(x) for x in csv_list(args.concurrency or "4")]
            temps = [float(x) for x in csv_list(args.temperatures or "0")]
        except ValueError:
            raise ValueError(
                f"--concurrency={args.concurrency!r} / --temperatures={args.temperatures!r} are invalid; "
                "allowed: comma-separated numbers"
            ) from None
        cells = custom_plan(
            csv_list(args.workloads or "mixed"),
            conc,
            temps,
            csv_list(args.configs or "none,static:ngram:4,adaptive"),
            args.prompts,
            args.max_tokens or 64,
            args.max_k,
        )
    elif args.quick:
        mode = "quick"
        cells = quick_plan(max_tokens=args.max_tokens or 48)
    else:
        mode = "full"
        cells = full_plan(
            mt_bench=Path(args.mt_bench) if args.mt_bench else None,
            draft=draft,
            max_tokens=args.max_tokens or 128,
        )
    out = []
    for c in cells:
        if args.prompts is not None or args.max_tokens is not None:
            c = Cell(
                c.workload,
                c.concurrency,
                c.temperature,
                args.prompts or c.prompts,
                args.max_tokens or c.max_tokens,
                c.configs,
            )
        if not draft:
            kept = tuple(x for x in c.configs if parse_config(x, args.max_k).engine != "draft")
            c = Cell(c.workload, c.concurrency, c.temperature, c.prompts, c.max_tokens, kept)
        check_cell(c, args.max_k)
        out.append(c)
    return out, mode


def ignores_eos(cell: Cell, mode: str) -> bool:
    """Whether ``cell``'s requests decode to ``max_tokens`` past EOS under ``--ignore-eos mode``:
    ``sampled`` for cells at temperature > 0, ``off`` never."""
    return mode == "sampled" and not cell.greedy


def resolve_plan(args: argparse.Namespace) -> BenchPlan:
    """The plan of ``adaptive-spec bench`` from its parsed arguments.

    Raises
    ------
    ValueError
        For a bad override or configuration, a missing draft model under ``--draft on``, or a LoRA
        adapter the draft does not have.
    """
    notes: list[str] = []
    draft_path, why = _draft_path(args)
    if why:
        notes.append(why)
    lora_adapters = _lora_adapters(args, draft_path)
    cells, mode = build_plan(args, draft_path is not None)
    wanted = {
        info.proposer.removeprefix("lora:")
        for c in cells
        for info in (parse_config(p, args.max_k) for p in c.configs)
        if info.proposer and info.proposer.startswith("lora:")
    }
    missing = sorted(wanted - set(lora_adapters))
    if missing:
        raise ValueError(
            f"--configs uses LoRA adapters {', '.join(missing)}, which the draft does not have "
            f"(available: {', '.join(sorted(lora_adapters)) or 'none'})"
        )
    kept = []
    for c in cells:
        if c.workload == MT_BENCH and not (args.mt_bench and Path(args.mt_bench).is_file()):
            notes.append(f"{c.id} skipped: MT-Bench file not found ({args.mt_bench})")
            continue
        kept.append(c)
    return BenchPlan(
        mode=mode,
        cells=kept,
        repeats=args.repeats or (2 if mode == "quick" else 3),
        confirm=args.confirm if args.confirm is not None else (0 if mode == "quick" else 3),
        draft_path=draft_path,
        lora_adapters=lora_adapters,
        ignore_eos={c.id: ignores_eos(c, args.ignore_eos) for c in kept},
        notes=notes,
    )


def print_plan(console: Any, plan: BenchPlan, args: argparse.Namespace) -> None:
    """Print the plan: the cells with their configurations, and the estimated duration."""
    console.print(
        f"[bold]adaptive-spec bench[/] ({plan.mode}): {len(plan.cells)} cells, {plan.repeats} "
        f"interleaved repeats + {plan.confirm} confirmation rounds, "
        f"engines compiled={'no (enforce_eager)' if args.eager else 'yes (torch.compile)'}"
    )
    for c in plan.cells:
        console.print(
            f"  {c.id}: {c.prompts} prompts x {c.max_tokens} tokens"
            + (" (EOS ignored)" if plan.ignore_eos[c.id] else "")
            + f": {', '.join(c.configs)}"
        )
    est = estimate_minutes(
        plan.cells,
        plan.repeats,
        eager=args.eager,
        confirm=plan.confirm,
        trace_evaluated=args.trace_evaluated,
    )
    console.print(
        f"estimated duration on 2 quiet cores: about {est:.0f} min (nominal rates; a loaded machine is slower)"
    )


def load_texts(cell: Cell, mt_bench: str | None, seed: int) -> CellPrompts:
    """A cell's prompts: the evaluated ones and, only for ``adaptive-warm``, held-out training prompts
    (the workload's next ``prompts`` items after the evaluated ones).

    Raises
    ------
    FileNotFoundError
        For the ``mtbench`` workload without its file.
    """
    from adaptive_spec.commands.workloads import load_workload

    name = cell.workload
    if name == MT_BENCH:
        if not mt_bench or not Path(mt_bench).is_file():
            raise FileNotFoundError(
                f"the mtbench workload needs --mt-bench (not found: {mt_bench})"
            )
        name = mt_bench
    warm = "adaptive-warm" in cell.configs
    items = load_workload(name, cell.prompts * (2 if warm else 1), seed=seed)
    if len(items) < cell.prompts:
        note = f"the workload has only {len(items)} prompts (asked {cell.prompts})"
        return CellPrompts(items, [], note)
    return CellPrompts(items[: cell.prompts], items[cell.prompts :])
