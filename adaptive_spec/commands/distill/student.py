"""The students: what ``adaptive-spec distill`` trains, behind one interface.

A student holds the draft model being trained (a causal LM whose final normed hidden states, through
the target's shared LM head, give its next-token distribution: :func:`~.forward.final_hidden`), names
the parameters training updates, and stores itself when training ends. The kinds:

* the **layer cut** (:class:`~.layer_cut.LayerCutStudent`): decoder layers of the target, trained and
  stored as a draft model (:mod:`adaptive_spec.vllm.drafts`);
* a **LoRA adapter** (:class:`~.lora.LoraStudent`, ``--lora NAME``) on a stored layer-cut draft, which
  stays frozen; stored as an adapter (:mod:`adaptive_spec.vllm.lora_draft`).

:func:`build_student` picks the kind from the run's settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from .config import DistillConfig
from .layer_cut import LayerCutStudent
from .lora import LoraStudent


class Student(Protocol):
    """A draft being distilled.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        The draft; :func:`~.evaluation.evaluate` and :func:`~.training.train_draft` run it.
    baseline_name : str
        The report's label of the student before training (``untrained-cut``, ``base-draft``).
    """

    model: Any
    baseline_name: str

    def trainable(self) -> list[Any]:
        """The parameters training updates (call once, after evaluating the untrained student)."""
        ...

    def save(
        self, out: str | Path, *, name: str, training: dict[str, Any], measured: dict[str, Any]
    ) -> None:
        """Store the trained student in directory ``out``, with its training settings and results."""
        ...


def build_student(
    cfg: DistillConfig,
    target: Any,
    *,
    target_dir: Path,
    draft_dir: Path | None,
    export: str | None = None,
) -> Student:
    """The student of a run: a LoRA adapter on the stored draft ``draft_dir`` when ``cfg.lora`` names
    one, else a layer cut of ``cfg.layers`` layers of ``target`` (also assembled into a loadable model
    directory ``export``, when given).

    Raises
    ------
    ValueError
        For a layer count the target does not have, or a stored draft that does not fit it.
    """
    if cfg.lora is not None:
        if draft_dir is None:
            raise ValueError("a LoRA student needs the stored draft it adapts (draft_dir)")
        return LoraStudent.load(target, draft_dir, cfg)
    return LayerCutStudent.cut(target, cfg.layers, target_dir=target_dir, export=export)
