"""The proposers :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` builds when it attaches.

:func:`make_proposers` makes the ones the controller runs itself (``ngram``, ``jacobi``, ``suffix``:
:mod:`adaptive_spec.proposers`); the engine's drafter makes the drafts of ``draft`` and ``lora:<name>``,
and :func:`make_lora` installs the adapters of the ``lora:<name>`` proposers in it
(:mod:`adaptive_spec.vllm.lora_draft`). Errors name the parameter, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from adaptive_spec.proposers.base import Proposer


def make_proposers(
    names: Sequence[str],
    max_k: int,
    ngram_min: int,
    ngram_max: int,
    suffix: Mapping[str, Any] | None,
    tenant_of: Callable[[str], str | None],
) -> dict[str, Proposer]:
    """The proposers among ``names`` that run in the controller, by name.

    ``max_k``: the engine's ``num_speculative_tokens``; ``ngram_min``/``ngram_max``: the n-gram lookup's
    match lengths; ``suffix``: :class:`~adaptive_spec.proposers.SuffixProposer`'s other parameters;
    ``tenant_of``: request id -> its tenant (the suffix proposer's ``scope="tenant"``).

    Raises
    ------
    ValueError
        For n-gram lengths outside ``1 <= ngram_min <= ngram_max <= 64`` or bad suffix options.
    """
    out: dict[str, Proposer] = {}
    if "ngram" in names or "jacobi" in names:
        from adaptive_spec.proposers import JacobiProposer, NgramProposer
    if "ngram" in names:
        try:
            out["ngram"] = NgramProposer(min_n=ngram_min, max_n=ngram_max, max_k=max_k)
        except ValueError as e:
            raise ValueError(
                f"ngram_min={ngram_min!r}, ngram_max={ngram_max!r} are invalid ({e}); allowed: "
                "1 <= ngram_min <= ngram_max <= 64"
            ) from None
    if "jacobi" in names:
        out["jacobi"] = JacobiProposer(max_k=max_k)
    if "suffix" in names:
        out["suffix"] = make_suffix(suffix, max_k, tenant_of)
    return out


def make_suffix(
    options: Mapping[str, Any] | None, max_k: int, tenant_of: Callable[[str], str | None]
) -> Proposer:
    """The suffix proposer with ``options`` (its parameters other than ``max_k``).

    Raises
    ------
    ValueError
        For ``max_k`` among the options or a parameter the proposer does not take.
    """
    from adaptive_spec.proposers import SuffixProposer

    opts = dict(options or {})
    if "max_k" in opts:
        raise ValueError(
            f"suffix={options!r} is invalid: max_k is the engine's num_speculative_tokens; "
            "allowed: SuffixProposer's other parameters"
        )
    if opts.get("scope") == "tenant" and opts.get("tenant_of") is None:
        opts["tenant_of"] = tenant_of
    try:
        return SuffixProposer(max_k=max_k, **opts)
    except TypeError as e:
        raise ValueError(
            f"suffix={options!r} is invalid ({e}); allowed: SuffixProposer's parameters"
        ) from None


def make_lora(core: Any, names: Sequence[str], lora_adapters: Mapping[str, Any]) -> Any:
    """The drafter's LoRA manager (:class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager`) with the
    adapters of the ``lora:<name>`` proposers among ``names``, or None when there are none.

    ``lora_adapters``: adapter name -> directory or ``LoraAdapter``. Raises what loading or registering
    an adapter raises; a manager that failed to register every adapter is detached first.
    """
    used = {p.removeprefix("lora:") for p in names if p.startswith("lora:")}
    if not used:
        return None
    from adaptive_spec.vllm.lora_draft import LoraAdapter, LoraDraftManager, load_lora_adapter

    loaded = {
        n: a if isinstance(a, LoraAdapter) else load_lora_adapter(a, n)
        for n, a in lora_adapters.items()
        if n in used
    }
    lora = LoraDraftManager(
        core, max_rank=max(a.rank for a in loaded.values()), max_adapters=len(loaded)
    )
    try:
        for n, a in loaded.items():
            lora.register(n, a)
    except BaseException:
        lora.detach()
        raise
    return lora
