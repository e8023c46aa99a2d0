"""``adaptive-spec distill``: train a draft model for a target, or a LoRA adapter for one, by knowledge
distillation; resumable.

One module per concern:

* :mod:`.command`: the command line (``add_parser``, ``main``) and the run from flags to stored draft;
* :mod:`.config`: the settings of a run (:class:`DistillConfig`) and the resume check;
* :mod:`.prompts`: prompts and reference replies from the workloads, data sets and JSONL files;
* :mod:`.sequences`: token sequences, their training windows, batches and files;
* :mod:`.data`: the target's replies (vLLM, transformers) or labelled reference replies, cached;
* :mod:`.teacher`: the target as teacher: loading, top-K labels, hidden-state cache, per-batch signal;
* :mod:`.student`: what is trained, behind one interface; the kinds are the layer cut
  (:mod:`.layer_cut`) and a LoRA adapter on a stored draft (:mod:`.lora`);
* :mod:`.forward`, :mod:`.loss`: forward passes and the distillation loss;
* :mod:`.training`: the training loop with checkpoints;
* :mod:`.evaluation`: greedy agreement and accepted length on held-out replies;
* the EAGLE-3 head (``--student eagle3``): :mod:`.eagle3_command` (the run), :mod:`.eagle3_data`
  (the target's hidden states and greedy tokens, the draft vocabulary), :mod:`.eagle3_head` (the head
  and its training-time-test unroll), :mod:`.eagle3_train` (training and the held-out report) and
  :mod:`.eagle3_lora` (LoRA adapters on a stored head, ``--lora``).

The names below are re-exported from those modules.
"""

from .command import add_parser, main
from .config import GENERATORS, TEACHERS, DistillConfig, check_resume
from .data import generate_continuations, generate_with_vllm, prepare_data, prepare_reference_data
from .evaluation import K_REPORT, AcceptanceStats, evaluate, format_report, simulate_greedy
from .forward import bf16_autocast, final_hidden
from .layer_cut import LayerCutStudent, build_layer_cut, layer_state, load_layers, shared_hashes
from .lora import LoraStudent, add_lora, load_lora_into, lora_linear, lora_weights
from .loss import LOSSES, distill_loss
from .prompts import (
    EXTRA_SOURCES,
    TEXT_SOURCES,
    TextPair,
    TextPrompt,
    format_prompt,
    load_prompts,
    load_reference_pairs,
    parse_sources,
    read_prompt_file,
)
from .sequences import (
    TokenSequence,
    collate,
    collate_topk,
    in_batches,
    load_sequences,
    save_sequences,
    usable,
    window,
)
from .student import Student, build_student
from .teacher import (
    TeacherBatch,
    build_teacher_cache,
    label_with_target,
    load_target,
    teacher_batch,
)
from .training import batch_order, train_draft

__all__ = [
    "EXTRA_SOURCES",
    "GENERATORS",
    "K_REPORT",
    "LOSSES",
    "TEACHERS",
    "TEXT_SOURCES",
    "AcceptanceStats",
    "DistillConfig",
    "LayerCutStudent",
    "LoraStudent",
    "Student",
    "TeacherBatch",
    "TextPair",
    "TextPrompt",
    "TokenSequence",
    "add_lora",
    "add_parser",
    "batch_order",
    "bf16_autocast",
    "build_layer_cut",
    "build_student",
    "build_teacher_cache",
    "check_resume",
    "collate",
    "collate_topk",
    "distill_loss",
    "evaluate",
    "final_hidden",
    "format_prompt",
    "format_report",
    "generate_continuations",
    "generate_with_vllm",
    "in_batches",
    "label_with_target",
    "layer_state",
    "load_layers",
    "load_lora_into",
    "load_prompts",
    "load_reference_pairs",
    "load_sequences",
    "load_target",
    "lora_linear",
    "lora_weights",
    "main",
    "parse_sources",
    "prepare_data",
    "prepare_reference_data",
    "read_prompt_file",
    "save_sequences",
    "shared_hashes",
    "simulate_greedy",
    "teacher_batch",
    "train_draft",
    "usable",
    "window",
]
