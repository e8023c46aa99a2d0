"""Which step-cost table a policy prices engine steps with, chosen when AdaptiveSpec attaches.

The candidates, in order (see ``AdaptiveSpec``'s ``cost_table`` and ``calibrate`` parameters): a table
given by the caller; the policy's own (a policy object passed in, or the loaded policy state's); a
table calibrated earlier on this machine (:func:`adaptive_spec.core.cost_tables.cached_table`); a table
shipped with adaptive-spec for this model, dtype, threads and device; a new measurement with dummy
steps (:mod:`adaptive_spec.vllm.calibrate`), cached for later runs. With ``calibrate="auto"`` a table
of this machine fits only if it measured the largest batch size this engine's calibration plans.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.protocol import SpecPolicy

logger = logging.getLogger(__name__)


def resolve_cost_table(
    policy: SpecPolicy,
    engine_key: dict[str, Any],
    *,
    given: StepCostTable | str | os.PathLike[str] | None,
    calibrate: bool | str,
    policy_given: bool,
    state_loaded: bool,
    max_num_seqs: int,
    measure: Callable[[], StepCostTable],
) -> str | None:
    """Give ``policy`` its step-cost table (``policy.cost``), if it prices steps.

    Parameters
    ----------
    policy : SpecPolicy
        A policy whose ``cost`` is a :class:`~adaptive_spec.core.cost_model.StepCostModel` gets a table;
        any other is left alone.
    engine_key : dict
        The engine's key (:func:`adaptive_spec.core.machine.engine_key`): model, dtype, threads, device.
    given : StepCostTable or path, optional
        A table, or a JSON file written by ``adaptive-spec calibrate --out``.
    calibrate : bool or "auto"
        ``True``: measure now; ``False``: never measure; ``"auto"``: measure when no table fits.
    policy_given : bool
        The policy was passed in as an object (its own table stands unless it is the prior).
    state_loaded : bool
        The policy's learned state, with its table, was loaded from a file.
    max_num_seqs : int
        The engine's largest batch (requests).
    measure : callable
        Measures the engine's table now (``AdaptiveSpec.calibrate``).

    Returns
    -------
    str or None
        Where the table came from (``given``, ``policy state``, ``calibrated now``, ``shipped``, ...);
        None for a policy that prices no steps.

    Raises
    ------
    ValueError
        For a ``given`` file that cannot be read as a table.
    """
    from adaptive_spec.core.cost_model import StepCostModel
    from adaptive_spec.core.cost_tables import (
        KEY_FIELDS,
        cached_table,
        save_cached_table,
        shipped_table,
    )
    from adaptive_spec.vllm.calibrate import plan_batches

    model = getattr(policy, "cost", None)
    if not isinstance(model, StepCostModel):
        return None
    key = engine_key
    table: StepCostTable | None = None
    source = ""
    # A table of this machine measured on a smaller engine prices larger batches by
    # extrapolation; with "auto" it is measured again up to this engine's batch size.
    top = plan_batches(int(max_num_seqs))[-1]

    def covers(t: StepCostTable) -> bool:
        return calibrate != "auto" or t.measured_batch_max() >= top

    own = state_loaded and model.table.matches(key, KEY_FIELDS)
    cached: StepCostTable | None = None
    if given is not None:
        table = given if isinstance(given, StepCostTable) else read_table(given)
        source = "given"
    elif policy_given and model.table.source != "prior" and calibrate is not True:
        return "the policy's own"
    elif calibrate is True:
        source = "calibrated now"
    elif own and covers(model.table):
        return "policy state"
    elif (cached := cached_table(key)) is not None and covers(cached):
        table = cached
        source = "calibrated earlier on this machine"
    elif cached is not None or own:
        logger.info(
            "adaptive-spec: this machine's step-cost table measured batch sizes up to %d; this "
            "engine runs up to %d, so it is calibrated again",
            (cached if cached is not None else model.table).measured_batch_max(),
            top,
        )
        source = "calibrated now"
    elif (table := shipped_table(key)) is not None:
        source = "shipped"
    elif calibrate == "auto":
        source = "calibrated now"
    elif state_loaded:
        return "policy state (another engine or machine)"
    else:
        table = shipped_table(key, KEY_FIELDS[:2])
        source = "shipped (another machine)" if table is not None else "prior"
    if source == "calibrated now":
        table = measure()
        save_cached_table(table)
    policy.cost = StepCostModel(table)
    return source


def read_table(path: str | os.PathLike[str]) -> StepCostTable:
    """A step-cost table from a JSON file (``adaptive-spec calibrate --out``).

    Raises
    ------
    ValueError
        When the file cannot be read or holds no valid table; the message names the file and the fix.
    """
    p = Path(path)
    try:
        return StepCostTable.from_dict(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cost_table={str(p)!r} cannot be read ({e}); fix: give a file written by "
            "`adaptive-spec calibrate --out`"
        ) from None
