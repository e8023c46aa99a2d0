from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Tests never read or write the automatic policy states of the cache directory (a test that checks
# them sets the variable itself).
os.environ["ADAPTIVE_SPEC_STATE_DIR"] = "off"

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from adaptive_spec.vllm.models import default_model_path

    return default_model_path("bfloat16")


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path) -> Path:
    from adaptive_spec.core.paths import cache_dir
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(cache_dir() / "tiny-llama-f32-v1", default_model_dir)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path):
    """One in-process vLLM engine per test session (several LLMs in one process are fragile):
    the tiny float32 model, n-gram method, num_speculative_tokens = 4, up to 4 requests at once."""
    from adaptive_spec.vllm.engine import build_llm

    return build_llm(
        tiny_model_dir,
        dtype="float32",
        max_k=4,
        concurrency=4,
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_gib=0.25,
    )


def tiny_prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of token ids with some repetition (so n-gram lookups find matches)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 49000) for _ in range(length // 2)]
        out.append(base + base[: length - len(base)])
    return out


def run_child_pytest(test_file: str | Path, switch: str, timeout: int = 900) -> None:
    """Run ``test_file``'s tests in a fresh pytest process with ``switch=1`` in its environment (vLLM
    engines do not coexist well in one process) and fail with its output unless they all passed."""
    import subprocess
    import sys

    env = {**os.environ, switch: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(test_file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout


def random_head_adapters(mgr: Any) -> dict[str, Any]:
    """Two random rank-4 LoRA adapters, ``a`` and ``b`` (seeds 1, 2), that fit the one decoder layer of
    the drafter ``mgr`` (a :class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager`) manages."""
    import torch

    from adaptive_spec.vllm.lora_draft import FUSED, LoraAdapter

    shapes = {
        part: (d_in, d_out)
        for fused, (d_in, outs) in mgr.shapes.items()
        for part, d_out in zip(FUSED[fused], outs, strict=True)
    }
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        g = torch.Generator().manual_seed(seed)
        w = {
            (0, m): (
                torch.randn(d_in, 4, generator=g) / d_in**0.5,
                torch.randn(4, d_out, generator=g) * 0.6,
            )
            for m, (d_in, d_out) in shapes.items()
        }
        out[name] = LoraAdapter(name, 4, 8.0, w)
    return out


def assert_lora_matches_dense(mgr: Any, adapters: dict[str, Any], names: list[str | None]) -> None:
    """For every decoder layer and fused module of the drafter ``mgr`` manages, call the module on one
    random token per entry of ``names`` (an adapter name, or None) with that plan of adapters, and
    check each token's output against the module's own output plus the dense reference update of its
    adapter (:func:`adaptive_spec.vllm.lora_draft.lora_delta_reference`)."""
    import torch

    from adaptive_spec.vllm.lora_draft import FUSED, lora_delta_reference

    slots = {n: mgr._slots[n] for n in adapters}
    torch.manual_seed(0)
    for layer_i, layer in enumerate(mgr._layers):
        for fused, parts in FUSED.items():
            mod = layer
            for part in fused.split("."):
                mod = getattr(mod, part)
            x = torch.randn(len(names), mgr.shapes[fused][0])
            mgr._plan(None)
            base = mod(x)[0].clone()
            mgr._plan([(-1 if n is None else slots[n], 1) for n in names])
            got = mod(x)[0]
            mgr._plan(None)
            for t, n in enumerate(names):
                want = base[t].clone()
                if n is not None:
                    want += torch.cat(
                        [
                            lora_delta_reference(x[t : t + 1], adapters[n], layer_i, p)
                            for p in parts
                        ],
                        -1,
                    )[0]
                torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
