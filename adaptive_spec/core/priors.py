"""Shipped acceptance priors: what the controller knows about a model before its first request.

A prior is the acceptance model of a controller run on prompts that the benchmarks and the main job
never use (:data:`adaptive_spec.commands.workloads.PRIOR_SKIP`), turned into Beta priors per context cell
(:meth:`adaptive_spec.core.acceptance.AcceptanceModel.set_prior_from_counts`: each cell's mean, with at most
``strength`` pseudo-observations, so live traffic outweighs it within a few dozen observations).
Files live in ``adaptive_spec/data/priors/`` and are matched on the model and dtype (acceptance depends
on the model, not on the machine). ``adaptive-spec calibrate --prior`` makes one for the lookup
proposers (n-gram, Jacobi).

A drafter's acceptance depends on the drafter too: ``adaptive-spec calibrate --head-prior`` learns it
in an engine with that drafter and writes a **drafter prior**, whose key also names the drafter
(``drafter``: the name of its loadable directory, which for an assembled head holds the head's name and
the start of its weights' SHA-256, :func:`adaptive_spec.vllm.eagle3.assemble_cached_head`). It holds
one row, ``draft``, and serves the controller's ``draft`` arm and each ``lora:<name>`` arm (an adapter
starts from its head's acceptance). A retrained head has another name, so an old drafter prior never
applies to it.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from adaptive_spec.core.arms import drafts_with_drafter

logger = logging.getLogger(__name__)

FORMAT = "adaptive-spec-acceptance-prior"
VERSION = 1
PRIOR_FIELDS = ("model", "dtype")
#: Key field of a drafter prior: the drafter's directory name (absent from a lookup prior's key).
DRAFTER_FIELD = "drafter"
#: The one proposer row of a drafter prior.
DRAFTER_ROW = "draft"


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


def prior_key(key: dict[str, Any], drafter_dir: str | Path | None) -> dict[str, Any]:
    """The key an engine's priors are looked up with: its key (model, dtype, ...) and, for an engine
    with a drafter, ``drafter``: the name of the drafter's directory (``drafter_dir``; None: no
    drafter)."""
    out = dict(key)
    if drafter_dir:
        out[DRAFTER_FIELD] = Path(str(drafter_dir)).name
    return out


def shipped_prior(key: dict[str, Any], *, drafter: bool = False) -> dict[str, Any] | None:
    """The acceptance state of the shipped prior for ``key``'s model and dtype, if any: the lookup
    proposers' prior, or with ``drafter`` the drafter prior of ``key["drafter"]`` (None when ``key``
    names no drafter)."""
    want = key.get(DRAFTER_FIELD) if drafter else None
    if drafter and not want:
        return None
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
        doc_key = doc.get("key", {})
        if doc_key.get(DRAFTER_FIELD) == want and all(
            doc_key.get(k) == key.get(k) for k in PRIOR_FIELDS
        ):
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


def select_rows(state: dict[str, Any], rows: dict[str, str]) -> dict[str, Any]:
    """An acceptance state with only the proposer rows ``rows`` names (source name -> name in the
    result), e.g. ``{"draft": "lora:code"}``: how a drafter prior is cut from a controller's state and
    handed to an adapter's arm.

    Raises
    ------
    ValueError
        For a state without a readable ``proposers`` or ``shape``, or a row it does not have.
    """
    try:
        props = [str(p) for p in state["proposers"]]
        shape = [int(x) for x in state["shape"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"acceptance state has a missing or malformed field ({e})") from None
    missing = [r for r in rows if r not in props]
    if missing:
        raise ValueError(f"acceptance state has no row {missing[0]!r}; it has {', '.join(props)}")
    import numpy as np

    idx = [props.index(r) for r in rows]
    out = dict(state)
    for name in ("acc", "tri", "prior_a", "prior_b"):
        out[name] = np.asarray(state[name], dtype=float)[idx].tolist()
    out["proposers"] = list(rows.values())
    out["shape"] = [len(idx), *shape[1:]]
    return out


def apply_prior(controller: Any, key: dict[str, Any]) -> bool:
    """Give an :class:`~adaptive_spec.core.controller.AdaptiveController` with no learned state the shipped
    prior of its model (the proposers it shares with the prior; its first ``max_k`` draft positions,
    :func:`fit_max_k`) and, when ``key`` names the engine's drafter (``key["drafter"]``) and the
    controller has drafter arms (``draft``, ``lora:<name>``), that drafter's prior for each of them.
    Returns whether a prior was applied; a prior that does not fit is skipped with a warning, and a
    policy without an :class:`~adaptive_spec.core.acceptance.AcceptanceModel` gets none."""
    from adaptive_spec.core.acceptance import AcceptanceModel

    # A policy without per-position acceptance counts (e.g. a SmartSpec-style peer) gets none.
    model = getattr(controller, "acceptance", None)
    if not isinstance(model, AcceptanceModel):
        return False
    applied = False
    state = shipped_prior(key)
    if state is not None:
        try:
            model.load_state_dict(fit_max_k(state, model.max_k))
            applied = True
        except ValueError as e:
            logger.warning("shipped acceptance prior not used: %s", e)
    arms = [p for p in model.proposers if drafts_with_drafter(p)]
    state = shipped_prior(key, drafter=True) if arms else None
    if state is not None:
        try:
            state = fit_max_k(state, model.max_k)
            for arm in arms:
                model.load_state_dict(select_rows(state, {DRAFTER_ROW: arm}))
            applied = True
        except ValueError as e:
            logger.warning("shipped drafter acceptance prior not used: %s", e)
    return applied
