"""Proposers: n-gram (prompt lookup), Jacobi/lookahead and suffix (SuffixDecoding), behind one interface.

``make_proposer(name, **kw)`` builds one by name.
"""

from __future__ import annotations

from typing import Any

from .base import ProposalRequest, Proposer
from .jacobi import JacobiProposer
from .ngram import NgramProposer
from .suffix import SuffixFeatures, SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "jacobi": JacobiProposer,
    "suffix": SuffixProposer,
}


def make_proposer(name: str, **kw: Any) -> Proposer:
    """Build a proposer by name.

    Parameters
    ----------
    name : {"ngram", "jacobi", "suffix"}
    **kw
        Constructor arguments of the proposer class.

    Raises
    ------
    ValueError
        Unknown ``name`` (the message lists the allowed names) or invalid arguments.

    Examples
    --------
    >>> make_proposer("ngram", max_k=4).name
    'ngram'
    """
    cls = PROPOSERS.get(name)
    if cls is None:
        raise ValueError(f"proposer name={name!r} is unknown; allowed: {sorted(PROPOSERS)}")
    return cls(**kw)


__all__ = [
    "PROPOSERS",
    "JacobiProposer",
    "NgramProposer",
    "ProposalRequest",
    "Proposer",
    "SuffixFeatures",
    "SuffixProposer",
    "make_proposer",
]
