"""Shipped acceptance priors: what the controller knows about a model before its first request.

A prior is the acceptance model of a controller run on prompts that the benchmarks and the main job
never use (:data:`adaptive_spec.commands.workloads.PRIOR_SKIP`), turned into Beta priors per context cell
(:meth:`adaptive_spec.core.acceptance.AcceptanceModel.set_prior_from_counts`: each cell's mean, with at most
``strength`` pseudo-observations, so live traffic outweighs it within a few dozen observations).
Files live in ``adaptive_spec/data/priors/`` and are matched on the model and dtype (acceptance depends
on the model, not on the machine). ``adaptive-spec calibrate --prior`` makes one.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT = "adaptive-spec-acceptance-prior"
VERSION = 1
PRIOR_FIELDS = ("model", "dtype")


def prior_document(
    acceptance_state: dict[str, Any], key: dict[str, Any], info: dict[str, Any]
) -> dict:
    """The JSON document of a prior (``acceptance_state`` from ``AcceptanceModel.state_dict``)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": dict(key),
        "info": info,
        "acceptance": acceptance_state,
    }


def shipped_prior(key: dict[str, Any]) -> dict[str, Any] | None:
    """The acceptance state of the shipped prior for ``key``'s model and dtype, if any."""
    base = resources.files("adaptive_spec") / "data" / "priors"
    if not base.is_dir():
        return None
    for f in sorted(base.iterdir(), key=lambda x: x.name):
        if not f.name.endswith(".json"):
            continue
        try:
            doc = json.loads(Path(str(f)).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            logger.warning("acceptance prior %s skipped: %s", f.name, e)
            continue
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            continue
        if all(doc.get("key", {}).get(k) == key.get(k) for k in PRIOR_FIELDS):
            return doc["acceptance"]
    return None


def fit_max_k(state: dict[str, Any], max_k: int) -> dict[str, Any]:
    """A prior's acceptance state for a controller of a smaller ``max_k``: draft positions
    ``1..max_k`` of it. Acceptance at position ``i`` is conditional on the drafts before it being
    accepted, so it does not depend on how many positions follow. A state of ``max_k`` or fewer
    positions is returned unchanged (:meth:`AcceptanceModel.load_state_dict` refuses a shorter one).

    Raises
    ------
    ValueError
        For a state without a readable ``shape``.
    """
    try:
        shape = [int(x) for x in state["shape"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"acceptance state has a missing or malformed shape ({e})") from None
    if shape[-1] <= max_k:
        return state
    import numpy as np

    out = dict(state)
    for name in ("acc", "tri", "prior_a", "prior_b"):
        out[name] = np.asarray(state[name], dtype=float)[..., :max_k].tolist()
    out["shape"] = [*shape[:-1], max_k]
    out["max_k"] = max_k
    return out


def apply_prior(controller: Any, key: dict[str, Any]) -> bool:
    """Give an :class:`~adaptive_spec.core.controller.AdaptiveController` with no learned state the shipped
    prior of its model (the proposers it shares with the prior; its first ``max_k`` draft positions,
    :func:`fit_max_k`). Returns whether one was applied; a prior that does not fit is skipped with a
    warning, and a policy without an
    :class:`~adaptive_spec.core.acceptance.AcceptanceModel` gets none."""
    from adaptive_spec.core.acceptance import AcceptanceModel

    # A policy without per-position acceptance counts (e.g. a SmartSpec-style peer) gets none.
    if not isinstance(getattr(controller, "acceptance", None), AcceptanceModel):
        return False
    state = shipped_prior(key)
    if state is None:
        return False
    try:
        state = fit_max_k(state, controller.acceptance.max_k)
        controller.acceptance.load_state_dict(state)
    except ValueError as e:
        logger.warning("shipped acceptance prior not used: %s", e)
        return False
    return True
