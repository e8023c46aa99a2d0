from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from adaptive_spec.models import default_model_path

    return default_model_path("bfloat16")


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path) -> Path:
    from adaptive_spec.models import cache_dir
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(cache_dir() / "tiny-llama-f32-v1", default_model_dir)
