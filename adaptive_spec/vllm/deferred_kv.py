"""The EAGLE head's KV-cache pass, deferred to the next step that drafts with it.

vLLM's EAGLE drafter runs a first pass over every step's new tokens even when the step drafts nothing
(``num_spec_tokens_to_schedule == 0``): that pass writes the head's keys and values for those
positions, which later drafts attend to. On a CPU this pass is most of what an engine with a head
costs over one without speculation while the controller drafts with something else (one decoder layer
and its Python overhead per step: about 2.5 ms of a 33 ms step for SmolLM2-135M at one request).

:class:`DeferredDrafterKV` replaces that pass, on steps without draft passes, by a copy of its inputs
(the drafter's input token, position and KV-cache slot, and the target's auxiliary hidden states, per
token) and writes the keys and values of all copied tokens in one batched forward at the next step
that drafts (before vLLM's own pass of that step), when the stash grows past ``max_tokens``, and when
the controller detaches. The drafts are then those of the eager pass:

* the head has one decoder layer, whose keys and values at a position are a function of that
  position's own inputs alone (the fused hidden states and the token embedding, then RoPE at the
  position); attention to other positions only shapes the layer's output, which the KV-cache pass
  discards. So writing a token's KV later writes the same values (up to the float rounding of a
  different batch size in the projections);
* the writes keep their order: a slot written several times before a flush (a rejected draft
  position written again at the next step) gets its last value, and every deferred write lands before
  any write of the drafting step itself.

Verification never reads the drafter's cache, so the target's output does not depend on it: a
deferred write only changes which drafts are proposed, not which tokens are emitted.

Applies to vLLM's ``EagleProposer`` for ``eagle`` / ``eagle3`` heads of one decoder layer without
LoRA adapters, data parallelism, M-RoPE or extra input slots; :func:`deferrable` says why not
otherwise, and the drafter then keeps vLLM's own pass.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Tokens stashed before a flush is forced (about 7 KB each for SmolLM2-135M's 3 x 576 float32 states).
MAX_TOKENS = 8192


def deferrable(drafter: Any) -> str | None:
    """Why the KV-cache pass of ``drafter`` cannot be deferred, or None when it can.

    Parameters
    ----------
    drafter : vllm.v1.spec_decode.eagle.EagleProposer
        The engine's drafter (``model_runner.drafter``).
    """
    method = getattr(drafter, "method", None)
    if method not in ("eagle", "eagle3"):
        return f"drafter method {method!r} is not an EAGLE head"
    model = getattr(drafter, "model", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != 1:
        return "the head does not have exactly one decoder layer"
    if getattr(drafter, "needs_extra_input_slots", False) or getattr(
        drafter, "parallel_drafting", False
    ):
        return "the drafter uses extra input slots (parallel drafting)"
    if getattr(drafter, "use_heterogeneous_vocab", False):
        return "the drafter maps token ids between vocabularies"
    if getattr(drafter, "uses_mrope", False) or getattr(drafter, "supports_mm_inputs", False):
        return "the drafter takes M-RoPE positions or multimodal inputs"
    vcfg = getattr(drafter, "vllm_config", None)
    if vcfg is None or vcfg.parallel_config.data_parallel_size > 1:
        return "data parallelism (ranks must agree on every drafter forward)"
    return None


class DeferredDrafterKV:
    """Defers the KV-cache pass of an EAGLE drafter on steps without draft passes (module docstring).

    Parameters
    ----------
    drafter : vllm.v1.spec_decode.eagle.EagleProposer
        The engine's drafter; :func:`deferrable` must return None for it.
    max_tokens : int >= 1
        Stashed tokens that force a flush.

    Attributes
    ----------
    deferred_steps : int
        Steps whose KV-cache pass was deferred.
    flushes, flushed_tokens : int
        Batched forwards run and the tokens (distinct slots) they wrote.
    """

    def __init__(self, drafter: Any, max_tokens: int = MAX_TOKENS) -> None:
        why = deferrable(drafter)
        if why is not None:
            raise ValueError(f"the drafter's KV-cache pass cannot be deferred: {why}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} is invalid; allowed: an integer >= 1")
        self.drafter = drafter
        self.max_tokens = max_tokens
        # (drafter input ids [n] int32, positions [n] int64, slots [n] int64, aux hidden [n, 3H])
        self._stash: list[tuple[Any, Any, Any, Any]] = []
        self._stashed = 0
        self.deferred_steps = 0
        self.flushes = 0
        self.flushed_tokens = 0

    # -- the drafter's propose -----------------------------------------------------------------
    def wrap(self, propose: Any, fault: Any = None) -> Any:
        """``propose`` (the drafter's bound method) with the deferral: same signature and result.

        A failure of the deferral is handed to ``fault(where, exc)`` and the step runs vLLM's own
        pass (what was stashed is dropped: later drafts may be worse, the output is unchanged)."""

        def deferred_propose(num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            try:
                if num_speculative_tokens == 0:
                    return self._defer(*args, **kwargs)
                self.flush()
            except Exception as e:
                self._stash.clear()
                self._stashed = 0
                if fault is None:
                    raise
                fault("drafter kv deferral", e)
            return propose(num_speculative_tokens, *args, **kwargs)

        return deferred_propose

    def _defer(
        self,
        target_token_ids: Any,
        target_positions: Any,
        target_hidden_states: Any,
        next_token_ids: Any,
        token_indices_to_sample: Any,
        common_attn_metadata: Any,
        sampling_metadata: Any = None,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: Any = None,
        slot_mappings: Any = None,
    ) -> Any:
        """Stash what vLLM's first pass would read (its input shift included) and return no drafts."""
        import torch

        d = self.drafter
        cad = common_attn_metadata
        n = int(target_token_ids.shape[0])
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1:] - 1
        # vLLM's EAGLE input shift: position p reads the token at p + 1 and the target's state at p;
        # the last position of each request reads the token sampled (or the next prompt token).
        # (a request's rejected tail keeps token 0: those positions are written again before any
        # draft attends to them)
        ids = torch.zeros(n, dtype=d.input_ids.dtype, device=target_token_ids.device)
        ids[: n - 1] = target_token_ids[1:n]
        ids[token_indices_to_sample] = next_token_ids.to(ids.dtype)
        self._stash.append(
            (
                ids,
                target_positions[:n].to(torch.int64).clone(),
                cad.slot_mapping[:n].to(torch.int64).clone(),
                target_hidden_states[:n].clone(),
            )
        )
        self._stashed += n
        self.deferred_steps += 1
        d.num_speculative_tokens = 0
        d._last_draft_probs = None
        if self._stashed >= self.max_tokens:
            self.flush()
        return torch.empty(cad.batch_size(), 0, device=ids.device, dtype=torch.int64)

    # -- the batched KV-cache pass -------------------------------------------------------------
    def flush(self) -> None:
        """Write the KV of every stashed token (the last value of each slot), then empty the stash."""
        if not self._stash:
            return
        import numpy as np
        import torch

        ids, pos, slots, hidden = (torch.cat(parts) for parts in zip(*self._stash, strict=True))
        self._stash.clear()
        self._stashed = 0
        s = slots.cpu().numpy()
        # the last write of each slot, in write order; padding slots (< 0) write nothing
        _, first_from_end = np.unique(s[::-1], return_index=True)
        keep = np.sort(len(s) - 1 - first_from_end)
        keep = keep[s[keep] >= 0]
        if len(keep) == 0:
            return
        if len(keep) < len(s):
            idx = torch.from_numpy(keep).to(ids.device)
            ids, pos, slots, hidden = ids[idx], pos[idx], slots[idx], hidden[idx]
        chunk = max(1, min(int(self.drafter.max_num_tokens), int(self.drafter.input_ids.shape[0])))
        for a in range(0, len(keep), chunk):
            self._write(
                ids[a : a + chunk], pos[a : a + chunk], slots[a : a + chunk], hidden[a : a + chunk]
            )
        self.flushes += 1
        self.flushed_tokens += len(keep)

    def _write(self, ids: Any, pos: Any, slots: Any, hidden: Any) -> None:
        """One forward of the head over ``n`` tokens, each its own one-token request, so that the
        attention layer writes their keys and values at their slots (its output is discarded)."""
        import torch
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        d = self.drafter
        n = int(ids.shape[0])
        d.input_ids[:n] = ids
        d._set_positions(n, pos)
        d.hidden_states[:n] = d.model.combine_hidden_states(hidden)
        dev = ids.device
        qsl = torch.arange(n + 1, dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=1,
            # each token reads one key of its own block: in bounds, and its output is not used
            block_table_tensor=(slots // d.block_size).to(torch.int32).view(n, 1),
            slot_mapping=slots,
            causal=True,
        )
        _, per_layer = d.build_per_group_and_layer_attn_metadata(cad)
        mode, n_in, across_dp = d._determine_batch_execution_and_padding(n)
        with set_forward_context(
            per_layer,
            d.vllm_config,
            num_tokens=n_in,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=d._get_slot_mapping(n_in, slots),
        ):
            d.model(
                input_ids=d.input_ids[:n_in],
                positions=d._get_positions(n_in),
                hidden_states=d.hidden_states[:n_in],
                inputs_embeds=None,
            )

    def stats(self) -> dict[str, int]:
        """``deferred_steps``, ``flushes``, ``flushed_tokens`` and ``stashed`` (tokens waiting)."""
        return {
            "deferred_steps": self.deferred_steps,
            "flushes": self.flushes,
            "flushed_tokens": self.flushed_tokens,
            "stashed": self._stashed,
        }


def install_deferred_kv(drafter: Any, patches: Any, fault: Any = None) -> DeferredDrafterKV | None:
    """Defer ``drafter``'s KV-cache pass through ``patches`` (flushed when they are restored).

    Returns the :class:`DeferredDrafterKV`, or None (logged) where :func:`deferrable` refuses: the
    drafter then keeps vLLM's own pass. ``fault(where, exc)`` receives the deferral's failures (that
    step then runs vLLM's own pass) and a failed flush at restore.
    """
    why = deferrable(drafter)
    if why is not None:
        logger.info("adaptive-spec: the drafter's KV-cache pass runs at every step: %s", why)
        return None
    kv = DeferredDrafterKV(drafter)
    patches.set(drafter, "propose", kv.wrap(drafter.propose, fault))

    def flush_at_restore() -> None:
        try:
            kv.flush()
        except Exception as e:  # detaching never fails on a flush; later drafts are only worse
            logger.warning("adaptive-spec: deferred drafter KV flush failed: %s", e)
            if fault is not None:
                fault("drafter kv flush", e)

    patches.before_restore(flush_at_restore)
    return kv
