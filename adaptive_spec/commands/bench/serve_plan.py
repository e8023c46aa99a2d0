"""What ``adaptive-spec bench serve`` runs: server configurations, load patterns and the default plans.

A **server configuration** is one way of starting vLLM's OpenAI-compatible server:

============================== ========== =================================================================
name                           kind       server
============================== ========== =================================================================
``none``                       baseline   no ``--speculative-config``, no plugin: what an operator runs
                                          without speculation
``static:<p>:<k>``             static     the plugin (``ADAPTIVE_SPEC=1``) with ``ADAPTIVE_SPEC_POLICY=
                                          static:<p>:<k>``, p in ngram, jacobi; engine n-gram, max_k;
                                          p = draft or lora:<adapter>: the drafter's engine (below)
``vllm-ngram[:<k>]``           static     vLLM's own n-gram speculation with k (default max_k), no plugin
``vllm-dynamic[:<table>]``     table      vLLM's n-gram with ``num_speculative_tokens_per_batch_size``:
                                          the table given (``1-2=8,3-8=4,9-16=2``) or, bare, tuned from
                                          this run's static n-gram results (as ``adaptive-spec bench``)
``adaptive`` (``-ucb``,        adaptive   the plugin with that policy, cold: a fresh policy-state file
``-greedy``, ``-eps``)                    (``ADAPTIVE_SPEC_STATE``), saved by the server
``adaptive-warm``              adaptive   the plugin's default policy, loading the state that ``adaptive``
                                          saved in this run (or ``--warm-state FILE``)
``adaptive+draft``             adaptive   the plugin's default policy over none, n-gram, Jacobi and the
                                          drafter (``draft``), on the drafter's engine
``adaptive+lora``              adaptive   the same with every LoRA adapter of the drafter as well
                                          (``lora:<adapter>``; the ``uni`` executor)
============================== ========== =================================================================

The **drafter's engine** (``draft`` and ``lora:<adapter>`` arms) is started with ``--speculative-config
'{"method": "eagle3", "model": <drafter>, ...}'`` (``draft_model`` for a drafter that is not an EAGLE-3
head): the shipped EAGLE-3 head for the embedded model, or ``--draft-model``; its LoRA adapters are the
ones stored with the shipped head.

A **load pattern** is one pass of vLLM's serving-benchmark client (``vllm.benchmarks.serve``):

========================== =========================================================================
spec                       arrivals
========================== =========================================================================
``steady:<rate>``          Poisson arrivals at ``rate`` requests/s (``inf``: all at once)
``ramp:<start>-<end>``     ``--ramp-up-strategy linear`` from ``start`` to ``end`` requests/s (integers,
                           ``start`` >= 1: vLLM's client takes integer rates and refuses 0)
``burst:<rate>:<b>``       gamma arrivals, ``--burstiness b`` (b < 1 is burstier than Poisson)
``mixtemp:<rate>:<share>`` Poisson at ``rate``; a ``share`` of the requests at temperature 1.0, sent by
                           a second client pass running concurrently (vLLM's custom dataset has no
                           per-request temperature), each pass at its share of the rate
========================== =========================================================================

Bare kinds (``steady``, ``ramp``, ``burst``, ``mixtemp``) expand from the request rates (``--rates`` or
``--calibrate``): see :func:`expand_patterns`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from adaptive_spec.commands.bench.plan import parse_k, parse_static_arm
from adaptive_spec.core.arms import drafts_with_drafter

KINDS = ("baseline", "static", "table", "adaptive")
STATIC_PROPOSERS = ("ngram", "jacobi", "draft")
ADAPTIVE_POLICIES = ("adaptive", "adaptive-ucb", "adaptive-greedy", "adaptive-eps")
#: Adaptive configurations with the engine's drafter: their proposers (``lora``: every adapter).
DRAFTER_ADAPTIVE = {
    "adaptive+draft": ("none", "ngram", "jacobi", "draft"),
    "adaptive+lora": ("none", "ngram", "jacobi", "draft", "lora"),
}
PATTERN_KINDS = ("steady", "ramp", "burst", "mixtemp")
DEFAULT_RATES = (0.5, 2.0, 8.0)
QUICK_RATES = (2.0, 8.0)
DEFAULT_CONFIGS = (
    "none",
    "static:ngram:2",
    "static:ngram:4",
    "static:ngram:8",
    "vllm-ngram:8",
    "vllm-dynamic",
    "adaptive",
    "adaptive-warm",
)
# The tiny random model's text never repeats an n-gram of its prompt, so n-gram arms draft nothing there;
# Jacobi drafts at every step, so the smoke run's greedy comparison checks real verification.
QUICK_CONFIGS = ("none", "static:jacobi:2")
DEFAULT_BURSTINESS = 0.25
DEFAULT_HOT_SHARE = 0.25
HOT_TEMPERATURE = 1.0
#: Rates for ``--calibrate``, as multiples of the measured saturation throughput (requests/s).
CALIBRATE_FACTORS = (0.25, 1.0, 4.0)

CONFIG_HELP = (
    "none, static:<ngram|jacobi|draft|lora:<adapter>>:<k>, vllm-ngram[:<k>], "
    "vllm-dynamic[:<s>-<e>=<k>,...], "
    + ", ".join(ADAPTIVE_POLICIES)
    + ", adaptive-warm, "
    + ", ".join(DRAFTER_ADAPTIVE)
)
PATTERN_HELP = (
    "steady:<rate>, ramp:<start>-<end>, burst:<rate>:<burstiness>, mixtemp:<rate>:<share>, "
    "or a bare kind (steady, ramp, burst, mixtemp) expanded from the rates"
)
_TABLE_ROW = re.compile(r"^(\d+)-(\d+)=(\d+)$")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One server configuration (see the module docstring).

    Attributes
    ----------
    name : str
        As given on the command line.
    kind : str
        One of :data:`KINDS`.
    plugin : bool
        Whether the adaptive-spec plugin is switched on (``ADAPTIVE_SPEC=1``).
    policy : str or None
        ``ADAPTIVE_SPEC_POLICY`` (plugin configurations only).
    proposers : tuple of str or None
        ``ADAPTIVE_SPEC_PROPOSERS`` (plugin configurations only; None: the plugin's default).
    k : int or None
        vLLM's ``num_speculative_tokens`` for ``vllm-ngram``; the static arm's k for ``static``.
    table : tuple of (start, end, k) or None
        ``vllm-dynamic``'s table; None for a bare ``vllm-dynamic`` (tuned in the run).
    warm : bool
        Loads a saved policy state (``adaptive-warm``).
    drafter : bool
        Runs on the drafter's engine (its proposers include ``draft`` / ``lora:<adapter>``).
    """

    name: str
    kind: str
    plugin: bool = False
    policy: str | None = None
    proposers: tuple[str, ...] | None = None
    k: int | None = None
    table: tuple[tuple[int, int, int], ...] | None = None
    warm: bool = False
    drafter: bool = False

    @property
    def lora(self) -> bool:
        """Whether an arm drafts with a LoRA adapter (the server needs the ``uni`` executor)."""
        return any(p == "lora" or p.startswith("lora:") for p in self.proposers or ())

    @property
    def speculative(self) -> bool:
        """Whether the server is started with ``--speculative-config``."""
        return self.kind != "baseline"

    @property
    def order(self) -> int:
        """Run order: baseline, static arms, the table (tuned from the static arms), cold adaptive,
        warm adaptive (needs the state the cold run saved)."""
        if self.warm:
            return 4
        return {"baseline": 0, "static": 1, "table": 2, "adaptive": 3}[self.kind]

    def speculative_config(
        self, max_k: int, drafter: str | None = None, method: str = "eagle3"
    ) -> dict[str, object] | None:
        """The ``--speculative-config`` JSON object (None for ``none``).

        Plugin configurations run the engine's n-gram method with ``num_speculative_tokens = max_k``
        (the largest k an arm may use), or with a drafter the drafter's ``method`` (``eagle3`` or
        ``draft_model``) and model directory ``drafter``; vLLM's own configurations use their k or
        table.

        Raises
        ------
        ValueError
            For a configuration with a drafter and no ``drafter`` directory.
        """
        if not self.speculative:
            return None
        if self.drafter:
            if not drafter:
                raise ValueError(f"{self.name}: needs a drafter directory (--draft-model)")
            return {"method": method, "model": str(drafter), "num_speculative_tokens": max_k}
        spec: dict[str, object] = {
            "method": "ngram",
            "num_speculative_tokens": max_k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
        if self.kind == "static" and not self.plugin:
            spec["num_speculative_tokens"] = int(self.k or max_k)
        if self.kind == "table":
            if self.table is None:
                raise ValueError(f"{self.name}: the table is not tuned yet")
            spec["num_speculative_tokens"] = max(max_k, *(r[2] for r in self.table))
            spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.table]
        return spec

    def with_table(self, table: list[list[int]] | tuple[tuple[int, int, int], ...]) -> ServerConfig:
        """A copy with ``table`` set (``vllm-dynamic``)."""
        rows = tuple((int(a), int(b), int(c)) for a, b, c in table)
        return replace(self, table=rows)

    def with_adapters(self, adapters: list[str]) -> ServerConfig:
        """A copy whose ``lora`` proposer is expanded into ``lora:<adapter>`` for each of ``adapters``.

        Raises
        ------
        ValueError
            For a configuration with ``lora`` and no adapter.
        """
        if "lora" not in (self.proposers or ()):
            return self
        if not adapters:
            raise ValueError(
                f"--configs entry {self.name!r} needs LoRA adapters and the drafter has none; "
                "train them (adaptive-spec distill --student eagle3 --lora NAME) or leave it out"
            )
        props: list[str] = []
        for p in self.proposers or ():
            props += [f"lora:{a}" for a in adapters] if p == "lora" else [p]
        return replace(self, proposers=tuple(props))


def parse_table(text: str, *, where: str = "vllm-dynamic") -> tuple[tuple[int, int, int], ...]:
    """Parse ``1-2=8,3-8=4,9-16=2`` into ``((1, 2, 8), (3, 8, 4), (9, 16, 2))``.

    Raises
    ------
    ValueError
        For a malformed row, a first row not starting at 1, or overlapping/unsorted rows.
    """
    rows = []
    for part in text.split(","):
        m = _TABLE_ROW.match(part.strip())
        if not m:
            raise ValueError(
                f"{where}: table row {part!r} is invalid; allowed: <start>-<end>=<k>, e.g. "
                "'vllm-dynamic:1-2=8,3-8=4,9-16=2'"
            )
        rows.append(tuple(int(g) for g in m.groups()))
    prev = 0
    for a, b, _k in rows:
        if a != prev + 1 or b < a:
            raise ValueError(
                f"{where}: table rows must be contiguous and start at 1 (got {text!r}); "
                "e.g. 1-2=8,3-8=4,9-16=2"
            )
        prev = b
    return tuple(rows)  # type: ignore[return-value]


def parse_server_config(name: str, max_k: int = 8) -> ServerConfig:
    """Parse a server-configuration name (see the module docstring).

    Raises
    ------
    ValueError
        Naming the configuration and what is allowed, for an unknown name, proposer or k.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"--configs entry {name!r} is invalid; allowed: {CONFIG_HELP}")
    if name == "none":
        return ServerConfig(name, "baseline")
    if name in ADAPTIVE_POLICIES:
        return ServerConfig(name, "adaptive", plugin=True, policy=name)
    if name == "adaptive-warm":
        return ServerConfig(name, "adaptive", plugin=True, policy="adaptive", warm=True)
    if name in DRAFTER_ADAPTIVE:
        return ServerConfig(
            name, "adaptive", plugin=True, policy="adaptive", proposers=DRAFTER_ADAPTIVE[name],
            drafter=True,
        )  # fmt: skip
    head, _, rest = name.partition(":")
    where, hint = f"--configs entry {name!r}", " (raise --max-k for more)"
    if head == "static":
        prop, k = parse_static_arm(rest, max_k, where, STATIC_PROPOSERS, lora=True, hint=hint)
        drafter = drafts_with_drafter(prop)
        props = ("none", "draft", prop) if prop.startswith("lora:") else ("none", prop)
        return ServerConfig(
            name, "static", plugin=True, policy=name, proposers=props, k=k, drafter=drafter
        )
    if head == "vllm-ngram":
        k = parse_k(rest, max_k, where, hint=hint) if rest else max_k
        return ServerConfig(name, "static", k=k)
    if head == "vllm-dynamic":
        table = parse_table(rest, where=where) if rest else None
        if table is not None and any(r[2] > max_k for r in table):
            raise ValueError(f"{where}: a k above --max-k={max_k}; allowed: 0..{max_k}")
        return ServerConfig(name, "table", table=table)
    raise ValueError(f"--configs entry {name!r} is not known; allowed: {CONFIG_HELP}")


def parse_server_configs(names: list[str], max_k: int = 8) -> list[ServerConfig]:
    """Parse and order configurations for running (:attr:`ServerConfig.order`, then as given).

    Raises
    ------
    ValueError
        For an empty list, a duplicate, an unknown name, or ``adaptive-warm`` without ``adaptive`` and
        without a warm state (checked by the caller, which knows ``--warm-state``).
    """
    if not names:
        raise ValueError(f"--configs is empty; allowed: a comma-separated list of {CONFIG_HELP}")
    if len(set(names)) != len(names):
        raise ValueError(f"--configs={','.join(names)} contains duplicates")
    configs = [parse_server_config(n, max_k) for n in names]
    return sorted(configs, key=lambda c: c.order)


@dataclass(frozen=True, slots=True)
class ClientPass:
    """One call of vLLM's serving-benchmark client within a pattern.

    Attributes
    ----------
    label : str
        ``main``, or ``greedy`` / ``hot`` for the two passes of ``mixtemp``.
    temperature : float
        Sent with every request of the pass (``--temperature``).
    indices : tuple of int
        Which of the pattern's prompts this pass sends, in order.
    request_rate : float
        ``--request-rate`` (requests/s; ``inf``: all at once); unused with a ramp.
    burstiness : float
        ``--burstiness``.
    ramp : tuple of (int, int) or None
        ``--ramp-up-start-rps``, ``--ramp-up-end-rps`` with ``--ramp-up-strategy linear``.
    """

    label: str
    temperature: float
    indices: tuple[int, ...]
    request_rate: float = math.inf
    burstiness: float = 1.0
    ramp: tuple[int, int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class Pattern:
    """One load pattern (see the module docstring).

    Attributes
    ----------
    name : str
        Canonical spec, e.g. ``steady:2``, ``ramp:1-4``, ``burst:2:0.25``, ``mixtemp:2:0.25``.
    kind : str
        One of :data:`PATTERN_KINDS`.
    rate : float
        Requests/s (the ramp's end rate for ``ramp``).
    burstiness : float
        vLLM's ``--burstiness`` (1: Poisson).
    ramp_start : int or None
        The ramp's start rate (requests/s).
    hot_share : float
        Share of requests at temperature 1.0 (``mixtemp``), 0 otherwise.
    """

    name: str
    kind: str
    rate: float
    burstiness: float = 1.0
    ramp_start: int | None = None
    hot_share: float = 0.0
    meta: dict[str, object] = field(default_factory=dict, compare=False)

    def passes(self, n: int) -> list[ClientPass]:
        """The client passes sending the pattern's ``n`` prompts.

        ``mixtemp`` sends prompt i at temperature 1.0 when ``floor((i+1)*share) > floor(i*share)``
        (every 4th for a share of 0.25), the rest greedy; each pass at its share of the rate.
        """
        every = tuple(range(n))
        if self.kind == "ramp":
            return [
                ClientPass("main", 0.0, every, ramp=(int(self.ramp_start or 1), int(self.rate)))
            ]
        if self.kind != "mixtemp":
            return [ClientPass("main", 0.0, every, self.rate, self.burstiness)]
        hot = tuple(
            i
            for i in every
            if math.floor((i + 1) * self.hot_share) > math.floor(i * self.hot_share)
        )
        greedy = tuple(i for i in every if i not in set(hot))
        out = []
        if greedy:
            share = len(greedy) / n
            out.append(ClientPass("greedy", 0.0, greedy, self.rate * share, self.burstiness))
        if hot:
            share = len(hot) / n
            out.append(ClientPass("hot", HOT_TEMPERATURE, hot, self.rate * share, self.burstiness))
        return out


def _num(text: str, what: str, spec: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(
            f"--patterns entry {spec!r}: {what}={text!r} is not a number; allowed: {PATTERN_HELP}"
        ) from None
    if not v > 0:
        raise ValueError(f"--patterns entry {spec!r}: {what}={text!r} must be > 0")
    return v


def _g(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:g}"


def parse_pattern(spec: str) -> Pattern:
    """Parse one explicit pattern spec (``steady:<rate>``, ``ramp:<a>-<b>``, ``burst:<rate>:<b>``,
    ``mixtemp:<rate>:<share>``).

    Raises
    ------
    ValueError
        Naming the entry and the allowed forms.
    """
    kind, _, rest = spec.strip().partition(":")
    parts = rest.split(":") if rest else []
    if kind == "steady" and len(parts) == 1:
        rate = _num(parts[0], "rate", spec)
        return Pattern(f"steady:{_g(rate)}", "steady", rate)
    if kind == "burst" and len(parts) == 2:
        rate, b = _num(parts[0], "rate", spec), _num(parts[1], "burstiness", spec)
        if math.isinf(rate):
            raise ValueError(f"--patterns entry {spec!r}: a burst needs a finite rate")
        return Pattern(f"burst:{_g(rate)}:{_g(b)}", "burst", rate, burstiness=b)
    if kind == "mixtemp" and len(parts) == 2:
        rate, share = _num(parts[0], "rate", spec), _num(parts[1], "share", spec)
        if not share < 1:
            raise ValueError(
                f"--patterns entry {spec!r}: share={share:g} is invalid; allowed: 0 < share < 1"
            )
        return Pattern(f"mixtemp:{_g(rate)}:{_g(share)}", "mixtemp", rate, hot_share=share)
    if kind == "ramp" and len(parts) == 1:
        a, sep, b = parts[0].partition("-")
        try:
            start, end = int(a), int(b)
        except ValueError:
            start = end = -1
        if not sep or start < 1 or end <= start:
            raise ValueError(
                f"--patterns entry {spec!r} is invalid; allowed: ramp:<start>-<end> with integers "
                "1 <= start < end (vLLM's --ramp-up-start-rps/--ramp-up-end-rps are integers and the "
                "rate must stay > 0)"
            )
        return Pattern(f"ramp:{start}-{end}", "ramp", float(end), ramp_start=start)
    raise ValueError(f"--patterns entry {spec!r} is invalid; allowed: {PATTERN_HELP}")


def round_rate(x: float) -> float:
    """Two significant digits (requests/s), at least 0.01."""
    if x <= 0 or math.isinf(x) or math.isnan(x):
        raise ValueError(f"rate={x!r} is invalid; allowed: a finite rate > 0")
    digits = 1 - math.floor(math.log10(x))
    return max(0.01, round(x, digits))


def expand_patterns(
    specs: list[str],
    rates: tuple[float, ...] | list[float],
    *,
    burstiness: float = DEFAULT_BURSTINESS,
    hot_share: float = DEFAULT_HOT_SHARE,
) -> list[Pattern]:
    """Expand ``--patterns`` entries with the request rates (requests/s, ascending).

    * ``steady``: one steady pattern per rate;
    * ``ramp``: linear from ``max(1, round(light))`` to ``max(start + 1, ceil(2 * mid))``;
    * ``burst``: the middle rate with ``burstiness``;
    * ``mixtemp``: the middle rate with ``hot_share`` of the requests at temperature 1.0;

    where light is the lowest rate and mid the middle one (``rates[len // 2]``). Explicit specs are
    parsed as they are. Duplicates are dropped.

    Raises
    ------
    ValueError
        For an invalid spec or rate list.

    Examples
    --------
    >>> [p.name for p in expand_patterns(["steady", "ramp", "burst", "mixtemp"], (0.5, 2, 8))]
    ['steady:0.5', 'steady:2', 'steady:8', 'ramp:1-4', 'burst:2:0.25', 'mixtemp:2:0.25']
    """
    rates = sorted(float(r) for r in rates)
    if not rates or any(not (r > 0) or math.isinf(r) for r in rates):
        raise ValueError(f"--rates={rates!r} is invalid; allowed: finite rates > 0 (requests/s)")
    light, mid = rates[0], rates[len(rates) // 2]
    out: list[Pattern] = []
    for spec in specs:
        spec = spec.strip()
        if spec == "steady":
            out += [parse_pattern(f"steady:{_g(r)}") for r in rates]
        elif spec == "ramp":
            start = max(1, round(light))
            out.append(parse_pattern(f"ramp:{start}-{max(start + 1, math.ceil(2 * mid))}"))
        elif spec == "burst":
            out.append(parse_pattern(f"burst:{_g(mid)}:{_g(burstiness)}"))
        elif spec == "mixtemp":
            out.append(parse_pattern(f"mixtemp:{_g(mid)}:{_g(hot_share)}"))
        else:
            out.append(parse_pattern(spec))
    seen: set[str] = set()
    unique = []
    for p in out:
        if p.name not in seen:
            seen.add(p.name)
            unique.append(p)
    return unique


def calibrated_rates(saturation_rps: float) -> tuple[float, ...]:
    """Request rates from a measured saturation throughput: :data:`CALIBRATE_FACTORS` times it
    (light, saturated, beyond saturation), two significant digits.

    Examples
    --------
    >>> calibrated_rates(1.37)
    (0.34, 1.4, 5.5)
    """
    return tuple(round_rate(f * saturation_rps) for f in CALIBRATE_FACTORS)


def estimate_minutes(
    configs: list[ServerConfig],
    patterns: list[Pattern],
    requests: int,
    *,
    start_s: float,
    saturation_rps: float,
) -> float:
    """A rough duration in minutes: per configuration one server start (``start_s``) and per pattern
    the arrival span (requests / rate) or the drain at ``saturation_rps``, whichever is longer."""
    per_config = start_s
    for p in patterns:
        rate = p.rate if p.kind != "ramp" else (float(p.ramp_start or 1) + p.rate) / 2
        per_config += max(requests / rate, requests / saturation_rps) + 2.0
    return len(configs) * per_config / 60.0
