"""Triton-versus-reference checks of every kernel on random inputs (``python -m ...kernels.check``).

Each check draws fresh random inputs from its own seed (ragged batches, zero-length drafts,
several vocabulary sizes; never all-zero tensors), runs the PyTorch reference and the Triton
kernel on the same device and returns ``None`` when they agree or a description of the first
disagreement. Integer outputs must be equal; LoRA outputs (floating point) must agree within a
tolerance of the output dtype.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1``, which must be set before ``triton``
is first imported; the CLI sets it itself when no GPU is present. ``tests/test_kernels_triton.py``
runs this module in a subprocess on CPU (so the test session's own Triton import is not
affected) and in-process on CUDA.

Usage: ``python -m adaptive_spec.kernels.check [--device cuda] [--json out.json] [--only NAME]``;
exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

Check = Callable[[torch.device, bool], "str | None"]


def _gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _cmp_int(name: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.shape != b.shape:
        return f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not torch.equal(a.cpu(), b.cpu()):
        diff = (a.cpu() != b.cpu()).nonzero()
        first = tuple(diff[0].tolist())
        return (
            f"{name}: {diff.shape[0]} of {a.numel()} entries differ; first at {first}: "
            f"reference {a.cpu()[first].item()} vs triton {b.cpu()[first].item()}"
        )
    return None


def _verify_case(
    device: torch.device,
    seed: int,
    ks: list[int],
    vocab: int,
    *,
    stochastic: bool,
    with_q: bool,
    dtype: torch.dtype = torch.float32,
) -> str | None:
    from .rejection import flatten_drafts, verify

    g = _gen(seed, device)
    drafts = [torch.randint(0, vocab, (k,), generator=g) for k in ks]
    d, cu = flatten_drafts(drafts)
    rows = d.numel() + len(ks)
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    am = logits.argmax(-1)
    start = 0
    for i, k in enumerate(ks):  # make about 60 % of the drafts agree with the target argmax
        for j in range(k):
            if torch.rand(1, generator=g).item() < 0.6:
                d[start + j] = am[start + i + j]
        start += k
    q = torch.softmax(torch.randn(d.numel(), vocab, generator=g) * 2, -1) if with_q else None
    temp = None
    seeds = None
    if stochastic:
        temp = torch.rand(len(ks), generator=g) + 0.3
        temp[0] = 0.0  # one greedy request inside a stochastic batch
        seeds = torch.randint(0, 2**62, (len(ks),), generator=g)
    args = [
        t.to(device) if t is not None else None for t in (logits.to(dtype), d, cu, q, temp, seeds)
    ]
    kw = dict(draft_probs=args[3], temperature=args[4], seeds=args[5])
    ref = verify(args[0], args[1], args[2], backend="torch", **kw)
    tri = verify(args[0], args[1], args[2], backend="triton", **kw)
    for f in ("output_token_ids", "num_emitted", "num_accepted", "target_argmax"):
        err = _cmp_int(f"{f} (seed {seed}, ks {ks}, V {vocab})", getattr(ref, f), getattr(tri, f))
        if err:
            return err
    return None


def _cases(small: bool, seed: int) -> list[tuple[int, list[int]]]:
    """(vocabulary size, draft lengths) pairs: ragged, with zero-length drafts."""
    if small:
        return [(50, [3, 0, 2, 5]), (700, [1, 4, 0, 0, 2]), (700, [0]), (9000, [2, 0, 1])]
    g = torch.Generator().manual_seed(seed)
    return [
        (1000, [0, 1, 8, 3]),
        (49152, torch.randint(0, 9, (64,), generator=g).tolist()),
        (128256, [8] * 32),
        (128256, [0, 5, 0, 2]),
    ]


def check_verify_greedy(device: torch.device, small: bool) -> str | None:
    """Greedy verification, ragged batches with zero-length drafts."""
    for i, (v, ks) in enumerate(_cases(small, 1)):
        if err := _verify_case(device, 100 + i, ks, v, stochastic=False, with_q=False):
            return err
    return None


def check_verify_stochastic_onehot(device: torch.device, small: bool) -> str | None:
    """Stochastic verification of deterministic drafts (q one-hot), mixed temperatures."""
    for i, (v, ks) in enumerate(_cases(small, 2)):
        if err := _verify_case(device, 200 + i, ks, v, stochastic=True, with_q=False):
            return err
    return None


def check_verify_stochastic_draft_probs(device: torch.device, small: bool) -> str | None:
    """Stochastic verification with draft probabilities q (residual resampling)."""
    for i, (v, ks) in enumerate(_cases(small, 3)):
        if err := _verify_case(device, 300 + i, ks, v, stochastic=True, with_q=True):
            return err
    return None


def check_verify_bf16(device: torch.device, small: bool) -> str | None:
    """bfloat16 logits (computation in float32) in both modes."""
    v, ks = _cases(small, 4)[1]
    for s, (st, wq) in enumerate([(False, False), (True, False), (True, True)]):
        if err := _verify_case(
            device, 400 + s, ks, v, stochastic=st, with_q=wq, dtype=torch.bfloat16
        ):
            return err
    return None


def check_ngram_match(device: torch.device, small: bool) -> str | None:
    """Prompt lookup: ragged histories (lengths 0, 1, ...), several windows, n ranges, budgets."""
    from .ngram import ngram_match

    b, lmax = (6, 80) if small else (64, 4096)
    for seed, vocab in enumerate([2, 3, 5, 50]):
        g = _gen(500 + seed, device)
        tok = torch.randint(0, vocab, (b, lmax), generator=g)
        num = torch.randint(0, lmax + 1, (b,), generator=g)
        num[0], num[1] = 0, 1
        ks = torch.randint(0, 9, (b,), generator=g)
        mnt = torch.randint(0, 12, (b,), generator=g)
        for window in (8, 64) if small else (1024, 2048):
            for lo, hi in ((1, 1), (2, 4)) if small else ((1, 1), (2, 4), (3, 6)):
                kw = dict(min_n=lo, max_n=hi, max_window=window, max_k=8)
                a = [x.to(device) for x in (tok, num, ks, mnt)]
                ref = ngram_match(a[0], a[1], a[2], max_new_tokens=a[3], backend="torch", **kw)
                tri = ngram_match(a[0], a[1], a[2], max_new_tokens=a[3], backend="triton", **kw)
                for f in ("draft_token_ids", "num_draft_tokens", "match_len"):
                    tag = f"{f} (seed {seed}, window {window}, n {lo}..{hi})"
                    if err := _cmp_int(tag, getattr(ref, f), getattr(tri, f)):
                        return err
    return None


def check_jacobi_step(device: torch.device, small: bool) -> str | None:
    """Jacobi step: accepted prefix, emitted tokens, next iterate."""
    from .jacobi import jacobi_step

    b = 7 if small else 256
    for seed, k in enumerate([0, 1, 5, 8]):
        g = _gen(600 + seed, device)
        y = torch.randint(0, 3, (b, k), generator=g)
        z = torch.randint(0, 3, (b, k + 1), generator=g)
        ln = torch.randint(0, k + 1, (b,), generator=g)
        a = [x.to(device) for x in (y, ln, z)]
        ref = jacobi_step(*a, backend="torch")
        tri = jacobi_step(*a, backend="triton")
        for f in ("accepted", "emitted", "num_emitted", "next_iterate", "next_len"):
            if err := _cmp_int(f"{f} (seed {seed}, K {k})", getattr(ref, f), getattr(tri, f)):
                return err
    return None


def check_lookahead_ngrams(device: torch.device, small: bool) -> str | None:
    """Lookahead n-gram harvest along trajectory diagonals, with unknown (-1) tokens."""
    from .jacobi import lookahead_ngrams

    b, w = (5, 9) if small else (64, 32)
    for seed, n in enumerate([2, 3, 5]):
        g = _gen(700 + seed, device)
        traj = torch.randint(-1, 6, (b, n - 1, w), generator=g).to(device)
        pred = torch.randint(-1, 6, (b, w), generator=g).to(device)
        ref = lookahead_ngrams(traj, pred, backend="torch")
        tri = lookahead_ngrams(traj, pred, backend="triton")
        if err := _cmp_int(f"ngrams (seed {seed}, N {n})", ref, tri):
            return err
    return None


def check_lookahead_pool_update(device: torch.device, small: bool) -> str | None:
    """Ring-pool insertion with duplicates, invalid n-grams and eviction over several steps."""
    from .jacobi import lookahead_pool_update

    b = 4 if small else 128
    for seed, (n, c) in enumerate([(2, 4), (3, 5), (4, 16)]):
        g = _gen(800 + seed, device)
        pool_r = torch.full((b, c, n), -1, dtype=torch.int64, device=device)
        ptr_r = torch.zeros(b, dtype=torch.int64, device=device)
        pool_t, ptr_t = pool_r.clone(), ptr_r.clone()
        for step in range(3):
            ng = torch.randint(-1, 3, (b, 6, n), generator=g).to(device)
            lookahead_pool_update(pool_r, ptr_r, ng, backend="torch")
            lookahead_pool_update(pool_t, ptr_t, ng, backend="triton")
            if err := _cmp_int(f"pool (seed {seed}, step {step})", pool_r, pool_t):
                return err
            if err := _cmp_int(f"pool_ptr (seed {seed}, step {step})", ptr_r, ptr_t):
                return err
    return None


def _lora_case(device: torch.device, small: bool, dtype: torch.dtype, seed: int) -> str | None:
    from .lora import lora_bgmv

    t, din, dout, r, n_ad = (7, 40, 24, 5, 3) if small else (256, 4096, 4096, 16, 8)
    g = _gen(seed, device)
    x = torch.randn(t, din, generator=g)
    a = torch.randn(n_ad, din, r, generator=g) / din**0.5
    bm = torch.randn(n_ad, r, dout, generator=g) / r**0.5
    idx = torch.randint(-1, n_ad, (t,), generator=g)
    idx[0] = -1
    y = torch.randn(t, dout, generator=g)
    scale = torch.rand(n_ad, generator=g) + 0.5
    args = [v.to(device) for v in (x, a, bm)]
    args = [v.to(dtype) for v in args]
    y0 = y.to(device=device, dtype=dtype)
    idx, scale = idx.to(device), scale.to(device)
    ref = lora_bgmv(y0.clone(), *args, idx, scale, backend="torch").float()
    tri = lora_bgmv(y0.clone(), *args, idx, scale, backend="triton").float()
    if not torch.equal(tri[idx < 0], y0.float()[idx < 0]):
        return f"lora {dtype}: rows with index -1 were modified"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (ref - tri).abs().max().item()
    scale_ref = ref.abs().max().item()
    if err > tol * max(1.0, scale_ref):
        return f"lora {dtype}: max abs difference {err:.3g} > {tol} x max(1, {scale_ref:.3g})"
    return None


def check_lora_fp32(device: torch.device, small: bool) -> str | None:
    """Multi-LoRA BGMV in float32 (indices include -1)."""
    return _lora_case(device, small, torch.float32, 900)


def check_lora_bf16(device: torch.device, small: bool) -> str | None:
    """Multi-LoRA BGMV in bfloat16 (float32 accumulation)."""
    return _lora_case(device, small, torch.bfloat16, 901)


CHECKS: dict[str, Check] = {
    "verify_greedy": check_verify_greedy,
    "verify_stochastic_onehot": check_verify_stochastic_onehot,
    "verify_stochastic_draft_probs": check_verify_stochastic_draft_probs,
    "verify_bf16": check_verify_bf16,
    "ngram_match": check_ngram_match,
    "jacobi_step": check_jacobi_step,
    "lookahead_ngrams": check_lookahead_ngrams,
    "lookahead_pool_update": check_lookahead_pool_update,
    "lora_fp32": check_lora_fp32,
    "lora_bf16": check_lora_bf16,
}


def _compile_specs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """(name, kernel, pointer/scalar signature, constexprs) of every Triton kernel variant."""
    from . import _jacobi_triton as jt
    from . import _lora_triton as lt
    from . import _ngram_triton as nt
    from . import _rejection_triton as rt

    i32, i64, f32 = "i32", "i64", "*fp32"
    specs: list[tuple[str, object, dict[str, str], dict[str, object]]] = []
    specs += rt.compile_specs()  # verification: its own module lists its variants
    sig = {"tok_ptr": "*i64", "stride_b": i64, "num_ptr": "*i64", "cap_ptr": "*i64"}
    sig |= {"out_ptr": "*i64", "num_out_ptr": "*i64", "n_out_ptr": "*i64"}
    sig |= {"lmax": i32, "max_window": i32, "max_k": i32}
    specs.append(
        ("ngram", nt._ngram_kernel, sig, {"MIN_N": 2, "MAX_N": 4, "BLOCK": 2048, "KBLOCK": 8})
    )
    sig = {"y_ptr": "*i64", "y_stride": i64, "len_ptr": "*i64", "z_ptr": "*i64", "z_stride": i64}
    sig |= {
        "acc_ptr": "*i64",
        "emit_ptr": "*i64",
        "nxt_ptr": "*i64",
        "nxt_len_ptr": "*i64",
        "K": i32,
    }
    specs.append(("jacobi_step", jt._jacobi_step_kernel, sig, {"KB": 16}))
    sig = {"traj_ptr": "*i64", "t_stride_b": i64, "t_stride_l": i64, "pred_ptr": "*i64"}
    sig |= {"p_stride_b": i64, "out_ptr": "*i64", "W": i32, "M": i32}
    specs.append(("lookahead_ngrams", jt._ngrams_kernel, sig, {"N": 3, "NB": 4, "BLOCK": 16}))
    sig = {"pool_ptr": "*i64", "ptr_ptr": "*i64", "ng_ptr": "*i64", "C": i32, "M": i32}
    specs.append(("pool_update", jt._pool_update_kernel, sig, {"N": 3, "CB": 64, "NB": 4}))
    for dt in ("fp32", "bf16"):
        sig = {"x_ptr": f"*{dt}", "x_stride": i64, "a_ptr": f"*{dt}", "a_stride_l": i64}
        sig |= {"a_stride_k": i64, "idx_ptr": "*i64", "t_ptr": f32, "d_in": i32, "rank": i32}
        specs.append((f"lora_shrink {dt}", lt._shrink_kernel, sig, {"RB": 16, "BLOCK_K": 256}))
        sig = {"t_ptr": f32, "b_ptr": f"*{dt}", "b_stride_l": i64, "b_stride_r": i64}
        sig |= {"idx_ptr": "*i64", "scale_ptr": f32, "y_ptr": f"*{dt}", "y_stride": i64}
        sig |= {"d_out": i32, "rank": i32}
        specs.append((f"lora_expand {dt}", lt._expand_kernel, sig, {"RB": 16, "BLOCK_N": 256}))
    return specs


def compile_kernels(arch: int = 90) -> dict[str, str | None]:
    """Compile every Triton kernel variant ahead of time for CUDA ``sm_<arch>`` (no GPU needed).

    Catches what the interpreter does not (non-constexpr globals, type errors of the compiled
    language). Needs Triton's NVIDIA backend with its bundled ``ptxas``; must run without
    ``TRITON_INTERPRET``.

    Returns
    -------
    dict
        ``{variant: None}`` on success, else the error text.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    out: dict[str, str | None] = {}
    for name, fn, sig, const in _compile_specs():
        full = dict(sig) | {k: "constexpr" for k in const}
        try:
            triton.compile(ASTSource(fn=fn, signature=full, constexprs=const), target=target)
            out[name] = None
        except Exception as exc:  # report every failing variant
            out[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return out


def run_checks(
    device: torch.device | str, names: list[str] | None = None, small: bool | None = None
) -> dict[str, dict[str, object]]:
    """Run the checks; returns ``{name: {"ok": bool, "detail": str, "seconds": float}}``.

    Parameters
    ----------
    device : torch.device or str
        Where both implementations run (CPU needs ``TRITON_INTERPRET=1`` set before ``triton``
        was imported).
    names : list of str or None
        Subset of :data:`CHECKS` (default: all).
    small : bool or None
        Small sizes (interpreter); default: True on CPU.

    Raises
    ------
    ValueError
        An unknown check name.
    """
    device = torch.device(device)
    small = device.type != "cuda" if small is None else small
    names = list(CHECKS) if names is None else names
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; allowed: {list(CHECKS)}")
    out: dict[str, dict[str, object]] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            err = CHECKS[name](device, small)
        except Exception as exc:  # report, keep running the other checks
            err = f"raised {type(exc).__name__}: {exc}"
        out[name] = {
            "ok": err is None,
            "detail": err or "",
            "seconds": round(time.perf_counter() - t0, 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 = all checks passed)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--only", action="append", default=None, help="run only this check (repeatable)"
    )
    ap.add_argument("--large", action="store_true", help="GPU sizes even on CPU")
    ap.add_argument(
        "--compile", type=int, default=None, metavar="ARCH", help="only compile for sm_ARCH"
    )
    args = ap.parse_args(argv)
    if args.compile is not None:
        comp = compile_kernels(args.compile)
        for name, err in comp.items():
            print(
                f"{'OK  ' if err is None else 'FAIL'} compile sm_{args.compile} {name} {err or ''}"
            )
        return 0 if all(e is None for e in comp.values()) else 1
    res = run_checks(args.device, args.only, small=False if args.large else None)
    for name, r in res.items():
        status = "PASS" if r["ok"] else "FAIL"
        print(f"{status} {name:32s} {r['seconds']:8.2f}s {r['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(args.device), "results": res}, f, indent=2)
    return 0 if all(r["ok"] for r in res.values()) else 1


if __name__ == "__main__":
    compile_only = any(a.startswith("--compile") for a in sys.argv[1:])
    if not torch.cuda.is_available() and not compile_only and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
