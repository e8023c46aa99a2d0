"""The settings of a distillation run: what defines its checkpoint directory, and which of them may
change when it resumes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: ``--teacher``: where the target's distribution comes from (:mod:`~.teacher`).
TEACHERS = ("topk", "online", "cached")
#: ``--generator``: where the training replies come from (:mod:`~.data`).
GENERATORS = ("vllm", "hf", "none")


@dataclass
class DistillConfig:
    """Everything that defines a run (its hash names the checkpoint directory)."""

    target: str
    data: list[str]
    prompts: int = 200
    eval_prompts: int = 8
    skip: int = 48
    layers: int = 2
    lora: str | None = None
    lora_domain: str | None = None
    draft: str | None = None
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    loss: str = "kl"
    temperature: float = 1.0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    gen_batch_size: int = 16
    gen_temperature: float = 0.0
    samples: int = 1
    teacher: str = "topk"
    generator: str = "vllm"
    topk: int = 8
    seed: int = 0
    device: str = "cpu"
    autocast: bool = True
    save_every: int = 50
    student: str = "layer-cut"
    draft_vocab: int = 8192
    ttt_steps: int = 4
    init_from: str | None = None

    def run_id(self) -> str:
        keep = asdict(self)
        keep.pop("device")
        keep.pop("save_every")
        if keep["init_from"] is None:  # runs from before the setting keep their directories
            keep.pop("init_from")
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


# Fields a checkpoint directory's data and training state depend on; ``steps``, ``save_every`` and
# ``device`` may change between a run and its resumption.
_RESUMABLE_CHANGES = ("steps", "save_every", "device")


def check_resume(ckpt_dir: Path, cfg: DistillConfig) -> None:
    """Refuse to resume from a checkpoint directory written with other settings.

    Raises
    ------
    ValueError
        Naming the settings that differ.
    """
    path = ckpt_dir / "config.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    new = asdict(cfg)
    diff = sorted(k for k in new if k not in _RESUMABLE_CHANGES and old.get(k) != new[k])
    if diff:
        raise ValueError(
            f"checkpoint directory {ckpt_dir} was written with other settings ({', '.join(diff)}): "
            "use another --checkpoint-dir, or delete it to start over"
        )
