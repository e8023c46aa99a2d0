"""Where measured step-cost tables live: shipped with the package, and cached per machine.

* **shipped**: ``adaptive_spec/data/cost_tables/*.json``, measured for the embedded default
  (``adaptive-spec calibrate``), matched on the engine key (:func:`adaptive_spec.core.machine.engine_key`);
* **cached**: a table calibrated on this machine is written (atomically) to
  ``<cache dir>/cost-tables/<key>.json`` and reused by later attaches with the same key, so
  calibration runs once per machine, model, dtype and thread count.

A file that cannot be read or does not parse is skipped with a warning, never half-loaded.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.machine import key_slug

logger = logging.getLogger(__name__)

#: The key fields a table must match to be used without calibration.
KEY_FIELDS = ("model", "dtype", "threads", "device")


def cache_path(key: dict[str, Any]) -> Path:
    from adaptive_spec.core.paths import cache_dir

    return cache_dir() / "cost-tables" / f"{key_slug(key)}.json"


def _read(path: Path) -> StepCostTable | None:
    try:
        return StepCostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("cost table %s skipped: %s", path, e)
        return None


def cached_table(key: dict[str, Any]) -> StepCostTable | None:
    """The table calibrated earlier on this machine for ``key``, if any."""
    t = _read(cache_path(key))
    return t if t is not None and t.matches(key, KEY_FIELDS) else None


def save_cached_table(table: StepCostTable) -> Path | None:
    """Cache a calibrated table under its key (atomic write); None (with a warning) if it cannot."""
    from adaptive_spec.core.state import write_policy_state

    path = cache_path(table.key)
    try:
        write_policy_state(json.dumps(table.to_dict()), path)
    except OSError as e:
        logger.warning("cost table not cached at %s (%s); it will be measured again", path, e)
        return None
    return path


def shipped_tables() -> list[StepCostTable]:
    """Every table shipped with the package."""
    out = []
    base = resources.files("adaptive_spec") / "data" / "cost_tables"
    if not base.is_dir():
        return out
    for f in sorted(base.iterdir(), key=lambda x: x.name):
        if f.name.endswith(".json"):
            t = _read(Path(str(f)))
            if t is not None:
                out.append(t)
    return out


def shipped_table(
    key: dict[str, Any], fields: tuple[str, ...] = KEY_FIELDS
) -> StepCostTable | None:
    """The shipped table matching ``key`` on ``fields`` (the first, by file name), if any."""
    for t in shipped_tables():
        if t.matches(key, fields):
            return t
    return None
