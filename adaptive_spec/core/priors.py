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


def apply_prior(controller: Any, key: dict[str, Any]) -> bool:
    """Give an :class:`~adaptive_spec.core.controller.AdaptiveController` with no learned state the shipped
    prior of its model (the proposers it shares with the prior). Returns whether one was applied; a
    prior that does not fit is skipped with a warning, and a policy without an
    :class:`~adaptive_spec.core.acceptance.AcceptanceModel` gets none."""
    from adaptive_spec.core.acceptance import AcceptanceModel

    # A policy without per-position acceptance counts (e.g. a SmartSpec-style peer) gets none.
    if not isinstance(getattr(controller, "acceptance", None), AcceptanceModel):
        return False
    state = shipped_prior(key)
    if state is None:
        return False
    try:
        controller.acceptance.load_state_dict(state)
    except ValueError as e:
        logger.warning("shipped acceptance prior not used: %s", e)
        return False
    return True
