"""Arms of the controller: a proposer and a speculation length k.

An arm ``(proposer, k)`` means: at the next engine step, this request verifies up to ``k`` draft tokens
proposed by ``proposer``. ``k = 0`` is plain decoding whatever the proposer, so every arm with ``k = 0``
is normalised to :data:`NO_SPEC` (``none:0``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE_PROPOSERS = ("none", "ngram", "jacobi", "suffix", "draft")
_LORA = re.compile(r"^lora:[A-Za-z0-9_.\-]+$")


def check_proposer_name(name: str) -> str:
    """Return ``name`` if it is a known proposer name, else raise ``ValueError``.

    Known names: ``none``, ``ngram``, ``jacobi``, ``suffix``, ``draft`` and ``lora:<adapter>``.
    """
    if not isinstance(name, str) or not (name in BASE_PROPOSERS or _LORA.match(name)):
        raise ValueError(
            f"proposer={name!r} is not known; allowed: {', '.join(BASE_PROPOSERS)}, lora:<adapter-name>"
        )
    return name


def drafts_with_drafter(proposer: str) -> bool:
    """Whether the engine's drafter (a draft model or an EAGLE head) makes ``proposer``'s drafts:
    ``draft`` and ``lora:<adapter>`` (the controller runs the other proposers itself)."""
    return proposer == "draft" or proposer.startswith("lora:")


@dataclass(frozen=True, slots=True, order=True)
class Arm:
    """One arm: ``proposer`` drafts up to ``k`` tokens (``k`` >= 0; ``k = 0`` is no speculation)."""

    proposer: str
    k: int

    def __post_init__(self) -> None:
        check_proposer_name(self.proposer)
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k={self.k!r} is invalid; allowed: an integer >= 0")
        if self.k == 0 and self.proposer != "none":
            object.__setattr__(self, "proposer", "none")
        if self.proposer == "none" and self.k != 0:
            raise ValueError(f"k={self.k} with proposer='none' is invalid; 'none' has k = 0")

    def __str__(self) -> str:
        return "none" if self.k == 0 else f"{self.proposer}:{self.k}"

    @classmethod
    def parse(cls, text: str) -> Arm:
        """Parse ``"none"``, ``"ngram:4"``, ``"lora:code:2"`` into an :class:`Arm`.

        Raises
        ------
        ValueError
            If the text is not ``none`` or ``<proposer>:<k>``.
        """
        text = text.strip()
        if text in ("none", "none:0"):
            return NO_SPEC
        name, sep, k = text.rpartition(":")
        if not sep or not k.isdigit():
            raise ValueError(
                f"arm={text!r} is invalid; expected 'none' or '<proposer>:<k>', e.g. 'ngram:4'"
            )
        return cls(name, int(k))


NO_SPEC = Arm("none", 0)


def arm_space(proposers: list[str], max_k: int) -> list[Arm]:
    """All arms for ``proposers`` with ``k`` in ``1..max_k``, plus :data:`NO_SPEC`.

    Raises
    ------
    ValueError
        For an unknown proposer name or ``max_k`` < 0.
    """
    if not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 0")
    arms = [NO_SPEC]
    for p in proposers:
        check_proposer_name(p)
        if p != "none":
            arms.extend(Arm(p, k) for k in range(1, max_k + 1))
    return arms
