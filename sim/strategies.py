"""Hypothesis strategies for synthetic workloads and cost profiles (property tests).

Needs the ``hypothesis`` package (``pip install adaptive-spec[dev]``); the plain generators live in
:mod:`adaptive_spec.sim.synthetic`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cost_profiles import PRESETS, CostProfile, LinearCostProfile, RooflineCostProfile
from .requests import ReplayRequest
from .synthetic import AcceptanceProcess, Regime, RequestSpec, make_requests

PROPOSERS = ("ngram", "jacobi", "draft")


@st.composite
def acceptance_processes(draw: st.DrawFn) -> AcceptanceProcess:
    """Any acceptance process: geometric, bimodal (all-or-nothing) or fixed length; any offer rate."""
    kind = draw(st.sampled_from(("geometric", "geometric", "bimodal", "fixed")))
    return AcceptanceProcess(
        alpha=draw(st.floats(0.0, 1.0)),
        offer=draw(st.floats(0.0, 1.0)),
        kind=kind,
        length=draw(st.integers(0, 10)),
    )


@st.composite
def regimes(draw: st.DrawFn, proposers: tuple[str, ...] = PROPOSERS) -> Regime:
    """A regime with processes for a non-empty subset of ``proposers``."""
    chosen = draw(
        st.lists(st.sampled_from(proposers), min_size=1, max_size=len(proposers), unique=True)
    )
    return Regime(
        draw(st.sampled_from(("code", "chat", "math", "rag"))),
        {p: draw(acceptance_processes()) for p in sorted(chosen)},
    )


@st.composite
def request_specs(draw: st.DrawFn, max_length: int = 40) -> RequestSpec:
    """A request with 1..3 regime segments (regime shifts inside the request) and an arrival time."""
    length = draw(st.integers(1, max_length))
    n_seg = draw(st.integers(1, 3))
    starts = sorted({0, *draw(st.lists(st.integers(1, max(length - 1, 1)), max_size=n_seg - 1))})
    segs = tuple((s, draw(regimes())) for s in starts)
    return RequestSpec(
        length,
        segs,
        segs[0][1].name,
        arrival_s=draw(st.sampled_from((0.0, 0.0, draw(st.floats(0.0, 2.0))))),
        prompt_len=draw(st.integers(1, 32)),
    )


@st.composite
def workloads(
    draw: st.DrawFn, max_requests: int = 6, max_length: int = 40, max_k: int = 6
) -> tuple[list[ReplayRequest], int]:
    """``(requests, max_k)``: a drawn synthetic workload and its largest k."""
    k = draw(st.integers(1, max_k))
    specs = draw(st.lists(request_specs(max_length), min_size=1, max_size=max_requests))
    return make_requests(specs, k, seed=draw(st.integers(0, 2**16))), k


@st.composite
def cost_profiles(draw: st.DrawFn) -> CostProfile:
    """A linear profile with random non-negative coefficients, a roofline profile, or a preset
    (including the measured, tabulated ``h200-llama8b``)."""
    kind = draw(st.sampled_from(("linear", "linear", "roofline", "roofline", "preset")))
    if kind == "preset":
        return PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    if kind == "linear":
        return LinearCostProfile(
            c0=draw(st.floats(1e-3, 5e-2)),
            c_batch=draw(st.floats(0.0, 1e-2)),
            c_token=draw(st.floats(0.0, 1e-2)),
            c_draft_pass=draw(st.floats(0.0, 1e-2)),
            c_prefill_token=draw(st.floats(0.0, 1e-4)),
        )
    base = draw(st.floats(5e-3, 5e-2))
    return RooflineCostProfile(
        base_s=base,
        flat_tokens=draw(st.floats(1.0, 64.0)),
        per_token_s=draw(st.floats(0.0, 1e-3)),
        draft_ratio=draw(st.floats(0.0, 0.3)),
    )
