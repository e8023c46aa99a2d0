"""The Examples sections of the kernels' and proposers' docstrings run and hold."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "adaptive_spec.kernels.rejection",
    "adaptive_spec.kernels.ngram",
    "adaptive_spec.kernels.jacobi",
    "adaptive_spec.proposers",
    "adaptive_spec.proposers.ngram",
    "adaptive_spec.proposers.jacobi",
    "adaptive_spec.proposers.suffix",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
