"""Where adaptive-spec keeps its files: the user's cache and the data shipped inside the package."""

from __future__ import annotations

import os
from pathlib import Path

#: Files shipped with the package: step-cost tables, acceptance priors, the distilled draft model.
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data"


def cache_dir() -> Path:
    """Return the cache root: ``$ADAPTIVE_SPEC_CACHE``, else ``$XDG_CACHE_HOME/adaptive-spec``, else
    ``~/.cache/adaptive-spec``."""
    env = os.environ.get("ADAPTIVE_SPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "adaptive-spec"
