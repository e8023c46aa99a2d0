"""Cost profiles: the engine step time a replay charges, as a function of what the step computes.

The profile classes live in :mod:`adaptive_spec.sim.profile_models` (linear, roofline, tabulated
measurements, the controller's step-cost table) and the fit to a trace's step times in
:mod:`adaptive_spec.sim.profile_fit`; this module gathers them with the named presets
(:data:`PRESETS`, each with its source), the command-line spelling of a profile
(:func:`get_profile`) and the step-cost table a controller would measure under a profile
(:func:`profile_table`).
"""

from __future__ import annotations

import numpy as np

from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.trace import Trace

from .profile_fit import StepFeatures, fit_linear_profile, step_features
from .profile_models import (
    COEF_NAMES,
    CostProfile,
    LinearCoefficients,
    LinearCostProfile,
    RooflineCostProfile,
    TableCostProfile,
    TabulatedCostProfile,
    is_draft_model,
)

__all__ = [
    "COEF_NAMES",
    "H200_LLAMA8B_MS",
    "PRESETS",
    "CostProfile",
    "LinearCoefficients",
    "LinearCostProfile",
    "RooflineCostProfile",
    "StepFeatures",
    "TableCostProfile",
    "TabulatedCostProfile",
    "fit_linear_profile",
    "get_profile",
    "is_draft_model",
    "profile_table",
    "step_features",
]

# Measured with sim/measure_profile.py on one NVIDIA H200 (PyTorch 2.11.0+cu130, bf16, CUDA graphs):
# a decoder with Llama-3-8B's shapes (random weights), KV cache of 1024 tokens, one step of B requests
# with T = k + 1 new tokens each; median of 20 replays. The draft is a 1B-shaped decoder (hidden 2048,
# 16 layers): about 0.25 of a target step per pass. Prefill: (9.378 - 6.550) ms / 128 tokens at B = 1.
# The jump from T = 1 to T = 2 at large B is PyTorch's attention: its grouped-query kernel for one
# query token is 3.7x faster per layer than for two or more (0.07 vs 0.26 ms at B = 64).
H200_LLAMA8B_MS = (
    (5.083, 5.585, 5.598, 5.632, 5.701),
    (5.332, 5.715, 5.748, 5.807, 5.882),
    (5.710, 7.349, 7.468, 7.725, 8.236),
    (7.419, 15.083, 15.185, 17.482, 24.145),
)


PRESETS: dict[str, CostProfile] = {
    # Linearised from step times measured in vLLM here: vLLM 0.32 CPU build, SmolLM2-135M bf16,
    # 2 threads: one step at batch 1 costs about 29 ms with no drafts and 35 ms verifying 8; at batch 4
    # about 35 ms with no drafts and 48 ms verifying 32 (8 per request). Least squares over these four
    # points: c0 = 28.8 ms, c_batch = 1.46 ms, c_token = 0.43 ms. A draft pass of a 2-layer cut costs
    # about 0.17 of a target pass (measured with transformers): 0.17 * 29 ms = 4.9 ms. The prefill
    # cost per prompt token (0.05 ms) is an assumption, not a measurement.
    "cpu-smollm2": LinearCostProfile(
        0.0288,
        0.00146,
        0.00043,
        0.0049,
        0.00005,
        name="cpu-smollm2",
        source="step times measured in vLLM 0.32 CPU (SmolLM2-135M bf16, 2 threads), linearised",
    ),
    # An assumed memory-bound GPU (not measured here): verifying k tokens costs the same as one until
    # a step holds 256 tokens, then compute-bound; a draft model 20x cheaper than the target.
    "gpu-flat": RooflineCostProfile(
        base_s=0.020,
        flat_tokens=256,
        per_token_s=0.020 / 256,
        draft_ratio=0.05,
        name="gpu-flat",
        source="assumed parameters: memory-bound accelerator, flat up to 256 tokens/step, draft ratio 0.05",
    ),
    # The same shape with a low threshold: verification stops being free at 32 tokens per step, so the
    # best k falls with batch size (the regime SmartSpec studies).
    "gpu-tight": RooflineCostProfile(
        base_s=0.020,
        flat_tokens=32,
        per_token_s=0.020 / 64,
        draft_ratio=0.05,
        name="gpu-tight",
        source="assumed parameters: flat up to 32 tokens/step, then 0.3 ms per token, draft ratio 0.05",
    ),
    "h200-llama8b": TabulatedCostProfile(
        batch_sizes=(1, 4, 16, 64),
        tokens_per_request=(1, 2, 3, 5, 9),
        step_s=tuple(tuple(v / 1e3 for v in row) for row in H200_LLAMA8B_MS),
        draft_step_s=(0.001250, 0.001333, 0.001435, 0.001877),
        prefill_s_per_token=(9.378 - 6.550) / 128 / 1e3,
        name="h200-llama8b",
        source="measured: sim/measure_profile.py on one H200, Llama-3-8B-shaped decoder in PyTorch "
        "(bf16, CUDA graphs, 1024-token KV cache), 1B-shaped draft; not vLLM's kernels",
    ),
}


def get_profile(spec: str, trace: Trace | None = None) -> CostProfile:
    """A profile from its command-line spelling.

    ``auto`` (``table`` when the trace recorded one, else ``fit``), ``table`` (the controller's
    measured step-cost table from the trace header), ``fit`` (fit to ``trace``), a preset name
    (:data:`PRESETS`), ``linear:c0,c_batch,c_token[,c_draft_pass[,c_prefill_token]]``
    or ``roofline:base_s,flat_tokens,per_token_s[,draft_ratio]`` (seconds).

    Raises
    ------
    ValueError
        For an unknown spelling, bad numbers, or ``fit`` without a trace.
    """
    if spec == "auto":
        spec = "table" if trace is not None and trace.header.get("cost_table") else "fit"
    if spec == "table":
        table = trace.header.get("cost_table") if trace is not None else None
        if not table:
            raise ValueError(
                "profile='table' needs a trace whose header holds the controller's cost table "
                "(recorded by adaptive-spec with a cost-pricing policy); use --profile fit"
            )
        return TableCostProfile(
            StepCostTable.from_dict(table),
            source=f"the recorded run's step-cost table ({trace.header.get('cost_table_source')})",
        )
    if spec == "fit":
        if trace is None:
            raise ValueError("profile='fit' needs a trace to fit")
        return fit_linear_profile(trace)
    if spec in PRESETS:
        return PRESETS[spec]
    kind, _, rest = spec.partition(":")
    try:
        vals = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        vals = None
    if kind == "linear" and vals and 3 <= len(vals) <= 5:
        return LinearCostProfile(*vals, source="given on the command line")
    if kind == "roofline" and vals and 3 <= len(vals) <= 4:
        return RooflineCostProfile(*vals, source="given on the command line")
    raise ValueError(
        f"profile={spec!r} is not known; allowed: auto, table, fit, {', '.join(PRESETS)}, "
        "linear:c0,c_batch,c_token[,c_draft_pass[,c_prefill_token]], roofline:base_s,flat_tokens,per_token_s[,draft_ratio]"
    )


def profile_table(profile: CostProfile, *, max_batch: int = 256, max_k: int = 16) -> StepCostTable:
    """The step-cost table a controller would measure on an engine whose steps cost ``profile``:
    the profile evaluated on the table grid up to ``max_batch`` requests and ``max_batch * max_k``
    draft tokens (the table extrapolates beyond). A :class:`TableCostProfile` gives its own table.
    Replay gives this table to the policies that price steps, so that they and the oracle work
    under one cost model."""
    if isinstance(profile, TableCostProfile) and profile.scale == 1.0 and profile.draft_pass_s == 0:
        return profile.table
    from adaptive_spec.core.cost_table import BATCH_GRID, TOKEN_GRID

    bg = [b for b in BATCH_GRID if b <= max(max_batch, 2)]
    if len(bg) < 2:
        bg = [1, 2]
    vg = [v for v in TOKEN_GRID if v <= max(bg[-1] * max_k, 2)]
    B, V = np.meshgrid(np.asarray(bg, dtype=float), np.asarray(vg, dtype=float), indexing="ij")
    t = np.asarray(profile.step_time(B, V), dtype=float).reshape(B.shape)
    return StepCostTable(
        np.asarray(bg),
        np.asarray(vg),
        t,
        counts=np.full(t.shape, 8.0),
        source=f"profile:{profile.name}",
    )
