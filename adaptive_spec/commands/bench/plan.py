"""What ``adaptive-spec bench`` runs: configuration names, cells, the full and quick grids, and the tuned
vLLM batch-size table.

A **configuration** is one way of decoding, named as follows:

=========================== ======== ========= ===========================================================
name                        kind     engine    what runs
=========================== ======== ========= ===========================================================
``none``                    baseline main      every request k = 0 (``AdaptiveSpec`` policy ``none``)
``nospec``                  nospec   nospec    an engine built without speculative decoding, nothing
                                               attached: what an operator runs without adaptive-spec
``static:<p>:<k>``          static   main      one fixed arm, p in ngram, jacobi, suffix (``draft``: draft engine)
``smartspec:<p>``           peer     main      SmartSpec's goodput rule over k for proposer p (Liu et al.
                                               2024), :class:`adaptive_spec.core.peers.SmartSpecPolicy`
``banditspec:<p>``          peer     main      BanditSpec's UCBSpec over k per step (Hou et al. 2025),
                                               :class:`adaptive_spec.core.peers.BanditSpecPolicy`
``table:<p>:<s>-<e>=<k>,..`` peer    main      vLLM's batch-size table emulated in this framework
``bandit:<learner>``        peer     main      a learner of ``adaptive_spec.bandits`` over every arm (p, k)
                                               of none, ngram and jacobi, per request
                                               (:class:`adaptive_spec.core.bandit_policy.BanditPolicy`)
``adaptive``                adaptive main      the adaptive controller, default policy, no prior state
``adaptive+suffix``         adaptive main      the controller with the suffix proposer as well
``adaptive-ngram``          adaptive main      the controller with n-gram lookup only (none, ngram)
``adaptive-warm``           adaptive main      the same, warm-started from a state saved by an adaptive run
                                               on held-out prompts of the same workload
``adaptive-ucb`` (-greedy,  adaptive main      the controller with another exploration mode
-eps)
``adaptive+draft``          adaptive draft     the controller with the draft model as a fourth proposer
``adaptive+lora``           adaptive draft     the controller with the drafter and each of its LoRA
                                               adapters (``lora:<name>`` arms; the shipped head's)
``static:lora:<name>:<k>``  static   draft     the drafter with LoRA adapter ``name``, fixed k
``vllm-ngram``              vllm     main      vLLM's own n-gram speculation, k = max_k, nothing attached
``vllm-dynamic``            vllm     dynamic   vLLM's own dynamic speculation
                                               (``num_speculative_tokens_per_batch_size``) in its own
                                               engine, table tuned from this workload's static n-gram runs
``hf-greedy``, ``hf-pld``   hf       hf        Hugging Face transformers: plain greedy, and prompt-lookup
                                               assisted generation (concurrency 1, greedy only)
=========================== ======== ========= ===========================================================

A **cell** is one workload at one concurrency and temperature, with a prompt count, an output length and
its configurations. Each engine kind runs in its own process (vLLM is fragile with several engines in
one process, ``docs/benchmarks.md``); inside a process every configuration of a cell runs on the same prompts, repeats
interleaved.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.commands.workloads import CATEGORIES, WORKLOADS
from adaptive_spec.core.arms import drafts_with_drafter

KINDS = ("baseline", "nospec", "static", "peer", "adaptive", "vllm", "hf")
ENGINES = ("main", "nospec", "dynamic", "draft", "hf")
STATIC_PROPOSERS = ("ngram", "jacobi", "suffix", "draft")
_LORA = re.compile(r"^lora:[A-Za-z0-9_.\-]+$")
STATIC_KS = (1, 2, 4, 8)
MAX_K = 16
ADAPTIVE_NAMES = ("adaptive", "adaptive-ucb", "adaptive-greedy", "adaptive-eps")
MT_BENCH_DEFAULT = Path("/work/shared/data/mt_bench/question.jsonl")
MT_BENCH = "mtbench"

CONFIG_HELP = (
    "none, nospec, static:<ngram|jacobi|suffix|draft|lora:<name>>:<k>, smartspec:<p>, banditspec:<p>, "
    "table:<p>:<s>-<e>=<k>,..., bandit:<learner>, adaptive, adaptive+suffix, adaptive-ngram, adaptive-warm, adaptive-ucb, adaptive-greedy, adaptive-eps, "
    "adaptive+draft, adaptive+lora, vllm-ngram, "
    "vllm-dynamic, hf-greedy, hf-pld"
)


@dataclass(frozen=True, slots=True)
class ConfigInfo:
    """A parsed configuration name: its ``kind`` (one of :data:`KINDS`), the ``engine`` process it runs
    in (one of :data:`ENGINES`), the proposer it uses (``None`` when several or none) and ``k``."""

    name: str
    kind: str
    engine: str
    proposer: str | None = None
    k: int | None = None


def parse_k(text: str, max_k: int, where: str, *, hint: str = "") -> int:
    """The k of a configuration name: an integer in ``1..max_k``.

    Raises
    ------
    ValueError
        ``<where>: k=... is invalid`` (not an integer) or ``... is out of range`` (followed by
        ``hint``).
    """
    try:
        k = int(text)
    except ValueError:
        raise ValueError(
            f"{where}: k={text!r} is invalid; allowed: an integer in 1..{max_k}"
        ) from None
    if not 1 <= k <= max_k:
        raise ValueError(f"{where}: k={k} is out of range; allowed: 1..{max_k}{hint}")
    return k


def parse_static_arm(
    rest: str,
    max_k: int,
    where: str,
    proposers: tuple[str, ...],
    *,
    lora: bool = False,
    hint: str = "",
) -> tuple[str, int]:
    """The proposer and k of a static arm's name after ``static:`` (``<proposer>:<k>``).

    Parameters
    ----------
    rest : str
        E.g. ``ngram:4`` or ``lora:code:2``.
    max_k : int
        The largest k allowed.
    where : str
        What the errors name (the configuration).
    proposers : tuple of str
        The proposers allowed.
    lora : bool
        Also allow ``lora:<adapter>``.
    hint : str
        Appended to the error for a k out of range.

    Raises
    ------
    ValueError
        For a proposer not allowed or a k outside ``1..max_k`` (:func:`parse_k`).
    """
    prop, _, k_text = rest.rpartition(":")
    if prop not in proposers and not (lora and _LORA.match(prop)):
        raise ValueError(
            f"{where}: proposer {prop!r} is invalid; allowed: {', '.join(proposers)}"
            + (", lora:<name>" if lora else "")
        )
    return prop, parse_k(k_text, max_k, where, hint=hint)


def parse_config(name: str, max_k: int = MAX_K) -> ConfigInfo:
    """Parse a configuration name (see the module docstring).

    Parameters
    ----------
    name : str
    max_k : int
        The engines' ``num_speculative_tokens``: the largest k a static arm may use (default 16, the
        most :func:`adaptive_spec.vllm.engine.build_llm` accepts; the CLI passes ``--max-k``).

    Raises
    ------
    ValueError
        Naming the configuration and what is allowed, for an unknown name, proposer or k.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"config={name!r} is invalid; allowed: {CONFIG_HELP}")
    if name == "none":
        return ConfigInfo(name, "baseline", "main")
    if name == "nospec":
        return ConfigInfo(name, "nospec", "nospec")
    if name in ADAPTIVE_NAMES or name in ("adaptive-warm", "adaptive+suffix", "adaptive-ngram"):
        return ConfigInfo(name, "adaptive", "main")
    if name in ("adaptive+draft", "adaptive+lora"):
        return ConfigInfo(name, "adaptive", "draft")
    if name == "vllm-ngram":
        return ConfigInfo(name, "vllm", "main", "ngram", max_k)
    if name == "vllm-dynamic":
        return ConfigInfo(name, "vllm", "dynamic", "ngram")
    if name in ("hf-greedy", "hf-pld"):
        return ConfigInfo(name, "hf", "hf", None if name == "hf-greedy" else "ngram")
    head, _, rest = name.partition(":")
    if head == "static":
        prop, k = parse_static_arm(rest, max_k, f"config={name!r}", STATIC_PROPOSERS, lora=True)
        engine = "draft" if drafts_with_drafter(prop) else "main"
        return ConfigInfo(name, "static", engine, prop, k)
    if head in ("smartspec", "banditspec"):
        if rest not in STATIC_PROPOSERS:
            raise ValueError(
                f"config={name!r}: proposer {rest!r} is invalid; allowed: {', '.join(STATIC_PROPOSERS)}"
            )
        return ConfigInfo(name, "peer", "draft" if rest == "draft" else "main", rest)
    if head == "bandit":
        from adaptive_spec.core.bandit_policy import learner_name

        try:
            learner_name(rest)
        except ValueError as e:
            raise ValueError(f"config={name!r}: {e}") from None
        return ConfigInfo(name, "peer", "main")
    if head == "table":
        prop, _, spec = rest.partition(":")
        if prop not in ("ngram", "jacobi") or not spec:
            raise ValueError(
                f"config={name!r} is invalid; expected e.g. 'table:ngram:1-2=8,3-8=4,9-16=2'"
            )
        return ConfigInfo(name, "peer", "main", prop)
    raise ValueError(f"config={name!r} is not known; allowed: {CONFIG_HELP}")


@dataclass(frozen=True, slots=True)
class Cell:
    """One benchmark cell.

    Attributes
    ----------
    workload : str
        A built-in workload name (:data:`adaptive_spec.commands.workloads.WORKLOADS`), ``"mtbench"`` or a JSONL path.
    concurrency : int >= 1
        Requests decoded together.
    temperature : float >= 0
        0 is greedy (checked for greedy identity).
    prompts : int >= 1
    max_tokens : int >= 1
        Output tokens per prompt (generation also stops at EOS).
    configs : tuple of str
        Configuration names; ``none`` is always run (it is every ratio's denominator).
    """

    workload: str
    concurrency: int
    temperature: float
    prompts: int
    max_tokens: int
    configs: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(
                f"concurrency={self.concurrency!r} is invalid; allowed: an integer >= 1"
            )
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature <= 2):
            raise ValueError(f"temperature={self.temperature!r} is invalid; allowed: 0..2")
        if not isinstance(self.prompts, int) or self.prompts < 1:
            raise ValueError(f"prompts={self.prompts!r} is invalid; allowed: an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid; allowed: an integer >= 1")

    @property
    def label(self) -> str:
        """The workload's short name (a JSONL path gives its file stem)."""
        if self.workload in WORKLOADS or self.workload == MT_BENCH:
            return self.workload
        return Path(self.workload).stem

    @property
    def id(self) -> str:
        return f"{self.label}/c{self.concurrency}/t{self.temperature:g}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def static_arms(proposers: tuple[str, ...] = ("ngram", "jacobi"), ks=STATIC_KS) -> tuple[str, ...]:
    """``static:<p>:<k>`` for every proposer and k, proposer-major."""
    return tuple(f"static:{p}:{k}" for p in proposers for k in ks)


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` rotated left by ``r``: the order of round ``r``, so that every configuration of a
    cell runs at each position in turn (interleaved repeats)."""
    r %= len(names)
    return names[r:] + names[:r]


def check_cell(cell: Cell, max_k: int = 8) -> None:
    """Check a cell's configurations can run.

    Raises
    ------
    ValueError
        For an unknown configuration, HF configurations outside concurrency 1 / greedy, or a duplicate.
    """
    if len(set(cell.configs)) != len(cell.configs):
        raise ValueError(f"cell {cell.id}: configs {list(cell.configs)} contain duplicates")
    for c in cell.configs:
        info = parse_config(c, max_k)
        if info.engine == "hf" and (cell.concurrency != 1 or not cell.greedy):
            raise ValueError(
                f"cell {cell.id}: {c} runs at concurrency 1 and temperature 0 only (HF assisted "
                "generation decodes one sequence, greedy)"
            )


def _with_none(configs: tuple[str, ...]) -> tuple[str, ...]:
    return configs if "none" in configs else ("none", *configs)


def full_plan(
    *, mt_bench: Path | None = None, draft: bool = False, max_tokens: int = 128
) -> list[Cell]:
    """The full grid (about 40-60 minutes on 2 quiet cores; the design is in ``docs/benchmarks.md``).

    * every mixed cell also runs ``nospec``, an engine built without speculative decoding;
    * mixed, c=4, greedy, 12 prompts (goal C): every static arm, both peers, vLLM's own n-gram and its
      tuned dynamic table, adaptive cold and warm (and, when a draft exists, the draft engine's static
      arms and the controller with the draft and with the draft plus its LoRA adapters);
    * each category alone (HumanEval, GSM8K, ShareGPT, ACLSum, agent traces, MT-Bench), c=4, greedy,
      8 prompts of at most 96 tokens (goal A): every static n-gram/Jacobi arm and adaptive;
    * mixed, c=16, greedy, 32 prompts: the static n-gram arms (they tune the vLLM table's large-batch
      row), the vLLM table, adaptive;
    * mixed, c=16, temperature 1.0, 32 prompts (goals B and D): the static n-gram arms, Jacobi at 2,
      adaptive;
    * mixed, c=1, greedy, 4 prompts: the static n-gram arms (the table's small-batch row), adaptive, and
      the HF peer (plain greedy and prompt lookup).
    """
    all_static = static_arms()
    ngram = static_arms(("ngram",))
    peers = ("smartspec:ngram", "banditspec:ngram")
    goal1 = (
        "none",
        "nospec",
        *all_static,
        *peers,
        "vllm-ngram",
        "vllm-dynamic",
        "adaptive",
        "adaptive-warm",
    )
    if draft:
        goal1 = (*goal1, *static_arms(("draft",)), "adaptive+draft", "adaptive+lora")
    cells = [Cell("mixed", 4, 0.0, 12, max_tokens, goal1)]
    categories = [*CATEGORIES]
    if mt_bench is not None:
        categories.append(MT_BENCH)
    per_category = min(max_tokens, 96)
    for cat in categories:
        cells.append(Cell(cat, 4, 0.0, 8, per_category, ("none", *all_static, "adaptive")))
    cells += [
        Cell(
            "mixed", 16, 0.0, 32, max_tokens, ("none", "nospec", *ngram, "vllm-dynamic", "adaptive")
        ),
        Cell(
            "mixed",
            16,
            1.0,
            32,
            max_tokens,
            ("none", "nospec", *ngram, "static:jacobi:2", "adaptive"),
        ),
        Cell(
            "mixed",
            1,
            0.0,
            4,
            max_tokens,
            ("none", "nospec", *ngram, "adaptive", "hf-greedy", "hf-pld"),
        ),
    ]
    return cells


def quick_plan(*, max_tokens: int = 48) -> list[Cell]:
    """A reduced grid for ``--quick`` (under 15 minutes here): every kind of configuration runs once per
    repeat on a few prompts with short outputs, so the harness is checked end to end; the numbers are
    indicative only."""
    return [
        Cell(
            "mixed",
            4,
            0.0,
            8,
            max_tokens,
            (
                "none",
                "static:ngram:2",
                "static:ngram:8",
                "static:jacobi:2",
                "static:jacobi:8",
                "smartspec:ngram",
                "banditspec:ngram",
                "vllm-dynamic",
                "adaptive",
                "adaptive-warm",
            ),
        ),
        Cell(
            "code", 4, 0.0, 4, max_tokens, ("none", "static:ngram:4", "static:jacobi:4", "adaptive")
        ),
        Cell("mixed", 16, 1.0, 16, max_tokens, ("none", "nospec", "static:ngram:2", "adaptive")),
        Cell("mixed", 1, 0.0, 2, max_tokens, ("none", "static:ngram:8", "hf-greedy", "hf-pld")),
    ]


# Nominal no-speculation goodput on 2 quiet cores (measured earlier here: 35 tokens/s at concurrency 1, 105 at 4;
# 16 extrapolated), HF transformers' greedy decode, and engine build times: for --dry-run estimates only.
NOMINAL_TOK_S = {1: 35.0, 4: 105.0, 16: 200.0}
NOMINAL_HF_TOK_S = 25.0
NOMINAL_BUILD_S = {"compiled": 90.0, "eager": 20.0}


def estimate_minutes(
    cells: list[Cell],
    repeats: int,
    *,
    eager: bool = False,
    confirm: int = 0,
    trace_evaluated: bool = False,
) -> float:
    """A rough duration of a plan on 2 quiet cores, in minutes: every generation pass (timed runs,
    references, training passes, ``confirm`` rounds of three configurations in cells that run the
    adaptive controller, and with ``trace_evaluated`` one traced adaptive pass in those cells) at
    the nominal no-speculation rate, plus engine builds."""
    passes_s = 0.0
    engines = set()
    for c in cells:
        tokens = c.prompts * c.max_tokens
        rate = (
            NOMINAL_TOK_S.get(c.concurrency)
            or NOMINAL_TOK_S[min(NOMINAL_TOK_S, key=lambda k: abs(k - c.concurrency))]
        )
        for name in c.configs:
            info = parse_config(name)
            engines.add(info.engine if info.engine != "dynamic" else f"dynamic:{c.label}")
            r = NOMINAL_HF_TOK_S if info.engine == "hf" else rate
            passes_s += repeats * tokens / r
        extra = 1 + ("adaptive-warm" in c.configs)
        extra += sum(
            1
            for e in ("dynamic", "draft", "nospec")
            if any(parse_config(x).engine == e for x in c.configs)
        )
        passes_s += extra * tokens / rate
        if "adaptive" in c.configs:
            passes_s += (3 * confirm + trace_evaluated) * tokens / rate
    build = NOMINAL_BUILD_S["eager" if eager else "compiled"]
    builds = sum(build if e != "hf" else 15.0 for e in engines)
    return (passes_s + builds) / 60.0


def custom_plan(
    workloads: list[str],
    concurrencies: list[int],
    temperatures: list[float],
    configs: list[str],
    prompts: int | None,
    max_tokens: int,
    max_k: int = 8,
) -> list[Cell]:
    """The cartesian product of workloads, concurrencies and temperatures, each with ``configs``
    (HF configurations are kept only in concurrency-1 greedy cells). ``prompts=None`` gives each
    cell ``max(8, 2 * concurrency)`` prompts, as the full grid does, so that its batch fills: with
    fewer prompts than its concurrency a cell never runs at it.

    Raises
    ------
    ValueError
        For an empty list or an unknown configuration.
    """
    for name, v in (
        ("workloads", workloads),
        ("concurrency", concurrencies),
        ("temperatures", temperatures),
        ("configs", configs),
    ):
        if not v:
            raise ValueError(f"{name}=[] is invalid; allowed: a non-empty list")
    for c in configs:
        parse_config(c, max_k)
    cells = []
    for w in workloads:
        for c in concurrencies:
            for t in temperatures:
                keep = tuple(
                    x
                    for x in _with_none(tuple(configs))
                    if parse_config(x, max_k).engine != "hf" or (c == 1 and t == 0)
                )
                n = prompts if prompts is not None else max(8, 2 * c)
                cells.append(Cell(w, c, float(t), n, max_tokens, keep))
    return cells


def tune_table(best_k: dict[int, int], max_batch: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` table from the best static k measured at a few
    concurrencies, as a user would tune it: each measured concurrency owns the batch sizes closer to it
    (on a log scale) than to its neighbours.

    Parameters
    ----------
    best_k : dict
        ``{concurrency: best k}`` (k = 0 when no static arm beat no speculation).
    max_batch : int >= 1
        The engine's ``max_num_seqs``: the last row ends there.

    Returns
    -------
    list of [start, end, k]
        Contiguous rows covering ``1..max_batch``, starting at 1.

    Raises
    ------
    ValueError
        If ``best_k`` is empty or has a concurrency < 1 or a k < 0.

    Examples
    --------
    >>> tune_table({1: 8, 4: 4, 16: 2}, 16)
    [[1, 2, 8], [3, 8, 4], [9, 16, 2]]
    """
    if not best_k:
        raise ValueError("best_k={} is invalid; allowed: at least one measured concurrency")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")
    for c, k in best_k.items():
        if not isinstance(c, int) or c < 1 or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"best_k entry {c!r}: {k!r} is invalid; allowed: concurrency >= 1 -> k >= 0"
            )
    conc = sorted(c for c in best_k if c <= max_batch) or [min(best_k)]
    rows = []
    start = 1
    for i, c in enumerate(conc):
        # The boundary with the next measured concurrency: their geometric mean.
        nxt = math.floor(math.sqrt(c * conc[i + 1])) if i + 1 < len(conc) else max_batch
        end = min(max(start, nxt), max_batch)
        if end < start:
            continue
        rows.append([start, end, int(best_k[c])])
        start = end + 1
        if start > max_batch:
            break
    return rows
