"""Run the runnable examples in the docstrings of :mod:`adaptive_spec.bandits`."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import adaptive_spec.bandits as bandits
import pytest

MODULES = sorted(m.name for m in pkgutil.iter_modules(bandits.__path__, "adaptive_spec.bandits."))


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_examples_exist_for_the_entry_points() -> None:
    found = sum(
        doctest.testmod(importlib.import_module(m), report=False).attempted for m in MODULES
    )
    assert found >= 5
