"""The machine key and the default dtype: bf16 only where the hardware runs it natively."""

from __future__ import annotations

import argparse

import pytest

from adaptive_spec.core.machine import cpu_isa, dtype_arg, native_bf16, resolve_dtype


@pytest.mark.parametrize(
    ("flags", "isa", "bf16"),
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "amx", True),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512bf16", True),
        ({"avx2", "avx512f"}, "avx512", False),
        ({"avx2", "fma"}, "avx2", False),
        (set(), "", False),
    ],
)
def test_isa_and_native_bf16_from_flags(flags: set[str], isa: str, bf16: bool) -> None:
    assert cpu_isa(flags) == isa
    assert native_bf16(flags) is bf16


def test_resolve_dtype() -> None:
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("FLOAT32") == "float32"
    assert resolve_dtype("auto") in ("bfloat16", "float32")
    with pytest.raises(ValueError, match=r"dtype='fp16' is invalid; allowed: auto"):
        resolve_dtype("fp16")


def test_dtype_flag_error_is_one_line() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="auto", type=dtype_arg)
    assert p.parse_args([]).dtype in ("bfloat16", "float32")
    with pytest.raises(argparse.ArgumentTypeError, match="allowed: auto"):
        dtype_arg("half")
