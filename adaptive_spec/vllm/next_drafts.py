"""The decision after each engine step: which draft tokens each running request verifies at the next.

:class:`NextDrafts` turns vLLM's running requests into the driver's view (:class:`LiveRequest`: output
tokens so far, tokens it may still emit, temperature), hands the drafts the engine's own drafter made
this step (a draft model, with or without a LoRA adapter) to the driver as those proposers' drafts, and
asks the driver (:meth:`adaptive_spec.core.driver.StepDriver.decide`) for an arm and its drafts, cut to
k, per request. With LoRA adapters it then picks, per request, the adapter of the drafter's next pass
(:meth:`~adaptive_spec.core.protocol.SpecPolicy.drafter_preference`). The hooks
(:mod:`adaptive_spec.vllm.hooks`) call it from ``EngineCore.post_step`` and hand the result to vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.drafter_passes import DrafterPasses
from adaptive_spec.core.driver import DriverDecision, LiveRequest, StepDriver
from adaptive_spec.core.protocol import SpecPolicy


class NextDrafts:
    """The next step's arms and draft tokens for the running requests of one engine.

    Parameters
    ----------
    scheduler : vllm.v1.core.sched.scheduler.Scheduler
        The engine's scheduler (its ``running`` and ``waiting`` requests are read).
    driver : StepDriver
        Proposers, policy and bookkeeping of the decision.
    policy : SpecPolicy
        The driver's policy (asked which drafter adapter each request prefers).
    drafter_family : sequence of str
        The proposers whose drafts the engine's drafter makes: ``draft`` and ``lora:<name>``.
    lora : LoraDraftManager, optional
        The drafter's LoRA adapters, when a ``lora:<name>`` proposer is used.
    max_model_len : int
        The engine's context length (tokens): a request may emit no more than it leaves.
    """

    def __init__(
        self,
        scheduler: Any,
        driver: StepDriver,
        policy: SpecPolicy,
        drafter_family: Sequence[str],
        lora: Any,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.driver = driver
        self.policy = policy
        self.drafter_family = list(drafter_family)
        self.lora = lora
        self.max_model_len = int(max_model_len)
        # The drafter's passes at the next step: what the decisions use (DrafterPasses), probing up
        # to the policy's cap on the drafter's k; none when no proposer of the policy drafts with
        # the drafter or the cap is 0.
        cap = policy.drafter_k_cap()
        most = int(driver.max_k) if cap is None else min(int(cap), int(driver.max_k))
        self.passes = DrafterPasses(most) if self.drafter_family and most >= 1 else None

    def next_passes(self) -> int:
        """The passes the engine's drafter should run at the next step (0: only the pass that keeps
        its KV cache current)."""
        return self.passes.next if self.passes is not None else 0

    def decide(self, engine_drafts: dict[str, list[int]]) -> DriverDecision:
        """The driver's decision for every running request that decodes next (not finished, not in a
        prefill chunk).

        Parameters
        ----------
        engine_drafts : dict of str to list of int
            Request id -> the draft token ids the engine's drafter made this step (empty for an
            n-gram engine's requests: the driver's own n-gram proposer serves them).

        Returns
        -------
        DriverDecision
            ``req_ids`` and, aligned, ``arms`` and ``drafts`` (token ids, at most the arm's k each).

        Raises
        ------
        Exception
            Whatever the driver, the policy or a proposer raises (the hooks count it as a fault and
            fall back to the engine's own drafts).
        """
        sched = self.scheduler
        live: list[LiveRequest] = []
        for r in sched.running:
            if r.is_finished() or r.is_prefill_chunk:
                continue
            remaining = min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens)
            sp = r.sampling_params
            live.append(
                LiveRequest(
                    r.request_id,
                    r.num_output_tokens,
                    int(remaining),
                    float(getattr(sp, "temperature", 0.0) or 0.0),
                )
            )
        external: dict[str, dict[str, list[int]]] = {}
        if self.drafter_family and engine_drafts:
            for rid, d in engine_drafts.items():
                if d:
                    external.setdefault(self._drafts_source(rid), {})[rid] = d
        dec = self.driver.decide(
            live,
            batch_size=len(sched.running),
            queue_len=len(sched.waiting),
            external_drafts=external,
        )
        if self.passes is not None:
            family = set(self.drafter_family)
            self.passes.plan(
                [
                    len(d) if a.proposer in family else 0
                    for a, d in zip(dec.arms, dec.drafts, strict=True)
                ],
                [len(engine_drafts.get(rid) or ()) for rid in dec.req_ids],
            )
        if self.lora is not None:
            wanted = self.policy.drafter_adapters_wanted()
            for rid, arm in zip(dec.req_ids, dec.arms, strict=True):
                self._set_next_drafter(rid, arm, wanted)
        return dec

    def _drafts_source(self, rid: str) -> str:
        """The proposer whose drafts the engine's drafter made for ``rid`` this step."""
        if self.lora is None:
            return "draft"
        name = self.lora.adapter_of_last_drafts(rid)
        return "draft" if name is None else f"lora:{name}"

    def _set_next_drafter(self, rid: str, arm: Arm, adapters_wanted: bool = True) -> None:
        """Choose the adapter of ``rid``'s next drafter pass (see ``lora_adapters``); none while the
        policy wants no adapter applied (:meth:`~adaptive_spec.core.protocol.SpecPolicy.drafter_adapters_wanted`)."""
        if not adapters_wanted:
            self.lora.set_request_adapter(rid, None)
            return
        pick = self.policy.drafter_preference(rid, list(self.drafter_family))
        if pick not in self.drafter_family:
            if arm.proposer in self.drafter_family:
                pick = arm.proposer
            else:
                cur = self.lora.request_adapter(rid)
                pick = f"lora:{cur}" if cur is not None else self.drafter_family[0]
        self.lora.set_request_adapter(rid, None if pick == "draft" else pick.removeprefix("lora:"))
