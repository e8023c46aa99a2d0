"""Time every kernel against its PyTorch reference (``python -m adaptive_spec.kernels.bench``).

On CUDA: Triton versus the reference at realistic sizes (batch 1-256, k 1-8, vocabulary 49,152
and 128,256), timed with ``triton.testing.do_bench`` (median); verification also reports its
bandwidth floor, the bytes of the logits read once divided by the GPU's measured copy
bandwidth (a device-to-device copy of 1 GiB: (read + write bytes) / time). On CPU: the
references only, at small sizes (``--quick``), timed with ``time.perf_counter`` (median).

Writes JSON (``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ._common import triton_status


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        def cuda_time(fn: Callable[[], Any]) -> float:
            return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))

        return cuda_time

    def cpu_time(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        t_end = time.perf_counter() + 0.3
        while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return cpu_time


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s ((read + write) / time)."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _timer(device)(lambda: dst.copy_(src))
    return 2 * n * 4 / (ms / 1e3)


def _verify_inputs(b: int, k: int, vocab: int, mode: str, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(b * 1000 + k * 10 + vocab % 7)
    rows = b * (k + 1)
    logits = torch.randn(rows, vocab, device=device, generator=g, dtype=torch.float32).to(dtype)
    draft = torch.randint(0, vocab, (b * k,), device=device, generator=g)
    am = logits.float().argmax(-1).view(b, k + 1)[:, :k].reshape(-1)
    keep = torch.rand(b * k, device=device, generator=g) < 0.7
    draft = torch.where(keep, am, draft)
    cu = torch.arange(1, b + 1, device=device, dtype=torch.int64) * k
    kw: dict[str, Any] = {"max_k": k}
    if mode != "greedy":
        kw["temperature"] = torch.full((b,), 0.8, device=device)
        kw["seeds"] = torch.randint(0, 2**62, (b,), device=device, generator=g)
    if mode == "stochastic_q":
        kw["draft_probs"] = torch.softmax(torch.randn(b * k, vocab, device=device, generator=g), -1)
    return logits, draft, cu, kw


def _graph_replay(fn: Callable[[], Any], t: Callable[[Callable[[], Any]], float]):
    """(GPU ms of ``fn`` under CUDA-graph replay, outputs of the captured call) or (None, None).

    Replaying a captured graph issues the same kernels with no Python, no allocator and no
    launch overhead: the time is the GPU's alone.
    """
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        ms = t(graph.replay)
        torch.cuda.synchronize()
    except Exception as exc:  # a call that cannot be captured: report, keep going
        print(f"[bench] CUDA-graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        return None, None
    return ms, out


def _host_us(fn: Callable[[], Any], device: torch.device, n: int = 30) -> float:
    """Host time to issue one call (microseconds): ``n`` calls back to back, no synchronisation."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return dt / n * 1e6


def _same(a, b) -> bool:
    fields = ("output_token_ids", "num_emitted", "num_accepted", "target_argmax")
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


def _load_baseline(path: str) -> Callable[..., Any]:
    """``verify_triton`` of another implementation file (before/after comparisons)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("adaptive_spec.kernels._baseline", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--baseline {path!r}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.verify_triton


def bench_verify(
    device: torch.device,
    quick: bool,
    use_triton: bool,
    bw: float | None,
    grid: str = "full",
    baseline: str | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Verification rows: greedy, stochastic (one-hot q), stochastic with draft probabilities.

    Columns: ``ref_ms`` (PyTorch reference, per call), ``triton_ms`` (Triton, end-to-end per
    call: CUDA events around the call, so host time shows when the host is the slower side),
    ``gpu_ms`` (Triton under CUDA-graph replay: device time only), ``host_us`` (host time to
    issue one Triton call), ``match`` (Triton output equal to the reference's, bit for bit, and
    the graph replay equal to the eager call), ``floor_ms`` (logits bytes / copy bandwidth).
    ``baseline`` (a file path) adds ``base_ms`` / ``base_gpu_ms`` for another implementation.
    """
    from .rejection import verify

    t = _timer(device)
    base_fn = _load_baseline(baseline) if baseline else None
    rows = []
    modes = ["greedy", "stochastic", "stochastic_q"]
    head = [(256, 8, 128256, m, dt) for dt in (torch.float32, torch.bfloat16) for m in modes]
    if quick:
        cases = [(b, k, 49152, m, torch.float32) for b in (1, 16) for k in (1, 8) for m in modes]
    elif grid == "headline":
        cases = head + [(256, 8, 128256, m, torch.float16) for m in modes]
    else:
        sizes = [(b, k, v) for v in (49152, 128256) for b in (1, 16, 64, 256) for k in (1, 4, 8)]
        cases = head + [(256, 8, 128256, m, torch.float16) for m in modes]
        cases += [(b, k, v, m, torch.float32) for (b, k, v) in sizes for m in modes]
        cases = list(dict.fromkeys(cases))
    for b, k, v, mode, dt in cases:
        logits, draft, cu, kw = _verify_inputs(b, k, v, mode, dt, device)
        row: dict[str, Any] = {
            "kernel": "verify",
            "config": f"{mode} B={b} k={k} V={v} {str(dt).replace('torch.', '')}",
            "ref_ms": t(partial(verify, logits, draft, cu, backend="torch", **kw)),
        }
        if use_triton:
            tri = partial(verify, logits, draft, cu, backend="triton", **kw)
            row["triton_ms"] = t(tri)
            row["host_us"] = _host_us(tri, device)
            gpu_ms, captured = _graph_replay(tri, t)
            row["gpu_ms"] = gpu_ms
            eager = tri()
            ok = _same(eager, verify(logits, draft, cu, backend="torch", **kw))
            row["match"] = ok and (captured is None or _same(eager, captured))
            if base_fn is not None and (b, k, v) == (256, 8, 128256):
                base = partial(base_fn, logits, draft, cu, **kw)
                row["base_ms"] = t(base)
                row["base_gpu_ms"] = _graph_replay(base, t)[0]
        if bw:
            row["floor_ms"] = logits.numel() * logits.element_size() / bw * 1e3
        rows.append(row)
        if on_row is not None:
            on_row(row)
        del logits, draft, cu, kw
    return rows


def tune_verify(
    device: torch.device, bw: float | None, on_row: Callable[[dict], None] | None = None
) -> list[dict]:
    """GPU time (CUDA-graph replay) of launch configurations at batch 256, k 8, V 128,256."""
    from ._rejection_triton import DEFAULT_CONFIGS, TritonConfig, verify_triton

    t = _timer(device)
    rows: list[dict] = []
    shapes = {  # (block, unroll, num_warps) of the row pass
        torch.float32: [(1024, 4, 8), (512, 4, 4), (1024, 2, 8), (1024, 8, 8), (2048, 4, 16)],
        torch.bfloat16: [(2048, 4, 8), (1024, 4, 4), (2048, 2, 8), (2048, 8, 8), (4096, 4, 16)],
    }
    for dt, shape_list in shapes.items():
        d = DEFAULT_CONFIGS[dt.itemsize]
        trials: list[tuple[str, TritonConfig]] = []
        for mode in ("greedy", "stochastic"):
            for blk, unroll, nw in shape_list:
                for chunk in (16384, 32768, 131072):
                    cfg = TritonConfig(blk, unroll, nw, chunk, d.sample_chunks, d.sample_warps)
                    trials.append((mode, cfg))
        for sw in (4, 8):
            for sc in (1, 2, 4, 8):
                cfg = TritonConfig(d.block, d.unroll, d.num_warps, d.chunk, sc, sw)
                trials.append(("stochastic_q", cfg))
        inputs: dict[str, tuple] = {}
        for mode, cfg in trials:
            if mode not in inputs:
                inputs.clear()
                torch.cuda.empty_cache()
                inputs[mode] = _verify_inputs(256, 8, 128256, mode, dt, device)
            logits, draft, cu, kw = inputs[mode]
            fn = partial(verify_triton, logits, draft, cu, config=cfg, **kw)
            try:
                ms, _ = _graph_replay(fn, t)
            except Exception as exc:  # a configuration that does not compile: skip it
                print(f"[tune] {cfg}: {type(exc).__name__}: {exc}", flush=True)
                ms = None
            row = {
                "kernel": "tune",
                "config": f"{mode} {str(dt).replace('torch.', '')} block={cfg.block} "
                f"unroll={cfg.unroll} warps={cfg.num_warps} chunk={cfg.chunk} "
                f"sample_chunks={cfg.sample_chunks} sample_warps={cfg.sample_warps}",
                "gpu_ms": ms,
            }
            if bw and ms:
                row["floor_ms"] = logits.numel() * logits.element_size() / bw * 1e3
                row["x_floor_gpu"] = ms / row["floor_ms"]
            rows.append(row)
            if on_row is not None:
                on_row(row)
        inputs.clear()
    return rows


def bench_ngram(device: torch.device, quick: bool, use_triton: bool) -> list[dict]:
    """Prompt lookup: 2k-token contexts with repeats, and 50k-token contexts with no match."""
    from .ngram import ngram_match

    t = _timer(device)
    rows = []
    sizes = [(1, 2048), (16, 2048)] if quick else [(1, 2048), (16, 2048), (256, 2048)]
    sizes += [(1, 50_000)] if quick else [(16, 50_000), (256, 50_000)]
    for b, length in sizes:
        g = torch.Generator(device=device).manual_seed(b + length)
        if length > 10_000:  # distinct tokens: no match anywhere
            tok = torch.stack(
                [torch.randperm(length, device=device, generator=g) for _ in range(b)]
            )
        else:
            tok = torch.randint(0, 64, (b, length), device=device, generator=g)
        num = torch.full((b,), length, device=device, dtype=torch.int64)
        kw = dict(min_n=2, max_n=4, max_window=2048, max_k=8)
        row: dict[str, Any] = {
            "kernel": "ngram_match",
            "config": f"B={b} context={length} window=2048 k=8",
            "ref_ms": t(partial(ngram_match, tok, num, 8, backend="torch", **kw)),
        }
        if use_triton:
            row["triton_ms"] = t(partial(ngram_match, tok, num, 8, backend="triton", **kw))
        rows.append(row)
    return rows


def _pool_update_fresh(pool, ptr, ng, backend: str) -> None:
    from .jacobi import lookahead_pool_update

    lookahead_pool_update(pool.clone(), ptr.clone(), ng, backend=backend)


def bench_jacobi(device: torch.device, quick: bool, use_triton: bool) -> list[dict]:
    """Jacobi step, lookahead n-gram harvest and pool update."""
    from .jacobi import jacobi_step, lookahead_ngrams

    t = _timer(device)
    rows = []
    for b in (16,) if quick else (16, 256):
        g = torch.Generator(device=device).manual_seed(b)
        k = 8
        y = torch.randint(0, 5, (b, k), device=device, generator=g)
        z = torch.randint(0, 5, (b, k + 1), device=device, generator=g)
        ln = torch.full((b,), k, device=device)
        traj = torch.randint(0, 50, (b, 2, 16), device=device, generator=g)
        pred = torch.randint(0, 50, (b, 16), device=device, generator=g)
        ng = lookahead_ngrams(traj, pred, backend="torch")
        pool = torch.full((b, 64, 3), -1, dtype=torch.int64, device=device)
        ptr = torch.zeros(b, dtype=torch.int64, device=device)
        cases = [
            ("jacobi_step", f"B={b} K={k}", partial(jacobi_step, y, ln, z)),
            ("lookahead_ngrams", f"B={b} N=3 W=16", partial(lookahead_ngrams, traj, pred)),
            (
                "lookahead_pool_update",
                f"B={b} C=64 N=3 M={ng.shape[1]}",
                partial(_pool_update_fresh, pool, ptr, ng),
            ),
        ]
        for name, cfg, fn in cases:
            row: dict[str, Any] = {
                "kernel": name,
                "config": cfg,
                "ref_ms": t(partial(fn, backend="torch")),
            }
            if use_triton:
                row["triton_ms"] = t(partial(fn, backend="triton"))
            rows.append(row)
    return rows


def bench_lora(device: torch.device, quick: bool, use_triton: bool) -> list[dict]:
    """Multi-LoRA BGMV, d = 4096, r = 16, 8 adapters, bfloat16 (float32 on CPU)."""
    from .lora import lora_bgmv

    t = _timer(device)
    rows = []
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    d, r, n_ad = (1024, 16, 4) if quick else (4096, 16, 8)
    for tok in (1, 16) if quick else (1, 16, 256):
        g = torch.Generator(device=device).manual_seed(tok)
        x = torch.randn(tok, d, device=device, generator=g).to(dt)
        a = (torch.randn(n_ad, d, r, device=device, generator=g) / d**0.5).to(dt)
        bm = (torch.randn(n_ad, r, d, device=device, generator=g) / r**0.5).to(dt)
        idx = torch.randint(-1, n_ad, (tok,), device=device, generator=g)
        y = torch.randn(tok, d, device=device, generator=g).to(dt)
        row: dict[str, Any] = {
            "kernel": "lora_bgmv",
            "config": f"T={tok} d={d} r={r} L={n_ad} {str(dt).replace('torch.', '')}",
            "ref_ms": t(partial(lora_bgmv, y, x, a, bm, idx, 0.5, backend="torch")),
        }
        if use_triton:
            row["triton_ms"] = t(partial(lora_bgmv, y, x, a, bm, idx, 0.5, backend="triton"))
        rows.append(row)
    return rows


def _finish(rows: list[dict]) -> None:
    for r in rows:
        if r.get("triton_ms"):
            r["speedup"] = r["ref_ms"] / r["triton_ms"]
            if r.get("floor_ms"):
                r["x_floor"] = r["triton_ms"] / r["floor_ms"]
        if r.get("gpu_ms") and r.get("floor_ms"):
            r["x_floor_gpu"] = r["gpu_ms"] / r["floor_ms"]


def print_table(rows: list[dict], title: str) -> None:
    """Print the rows as a table (rich when installed, plain text otherwise)."""
    cols = ["kernel", "config", "ref_ms", "triton_ms", "gpu_ms", "host_us", "speedup", "floor_ms"]
    cols += ["x_floor", "x_floor_gpu", "match", "base_ms", "base_gpu_ms"]
    cols = [c for c in cols if any(c in r for r in rows)]

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}" if v < 10 else f"{v:.1f}"
        return str(v)

    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in cols:
            table.add_column(c, justify="left" if c in ("kernel", "config") else "right")
        for r in rows:
            table.add_row(*(fmt(r.get(c)) for c in cols))
        Console(width=200).print(table)
    except ImportError:
        print(title)
        widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        for r in rows:
            print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (default on CPU)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument(
        "--kernels",
        default="verify,ngram,jacobi,lora",
        help="comma-separated subset of verify,ngram,jacobi,lora",
    )
    ap.add_argument(
        "--verify-grid",
        choices=("full", "headline"),
        default="full",
        help="verification sizes: the full grid or batch 256, k 8, V 128,256 only",
    )
    ap.add_argument(
        "--tune", action="store_true", help="also time launch configurations (CUDA graphs)"
    )
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="FILE",
        help="another _rejection_triton.py to time next to this one (before/after)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    quick = args.quick or device.type != "cuda"
    ok, reason = triton_status()
    use_triton = device.type == "cuda" and ok
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    allowed = {"verify", "ngram", "jacobi", "lora"}
    if bad := [k for k in wanted if k not in allowed]:
        ap.error(f"--kernels has {bad}; allowed: {sorted(allowed)}")
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    meta = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _triton_version() if ok else f"unavailable ({reason})",
        "copy_bandwidth_GBps": bw / 1e9,
        "quick": quick,
        "timed": "triton vs reference" if use_triton else "reference only",
    }
    rows: list[dict] = []

    def save(row: dict | None = None) -> None:
        """Write the JSON after every row: a time-out keeps what was measured."""
        if row is not None:
            _finish([row])
            print(f"[bench] {row}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)

    def verify_rows() -> list[dict]:
        return bench_verify(
            device,
            quick,
            use_triton,
            bw,
            grid=args.verify_grid,
            baseline=args.baseline,
            on_row=lambda r: (rows.append(r), save(r)),
        )

    runners = {
        "verify": verify_rows,
        "ngram": lambda: bench_ngram(device, quick, use_triton),
        "jacobi": lambda: bench_jacobi(device, quick, use_triton),
        "lora": lambda: bench_lora(device, quick, use_triton),
    }
    if args.tune and use_triton:
        runners["tune"] = lambda: tune_verify(
            device, bw, on_row=lambda r: (rows.append(r), save(r))
        )
        wanted.append("tune")
    for name in wanted:
        t0 = time.perf_counter()
        new = runners[name]()
        if name not in ("verify", "tune"):  # these append (and save) row by row
            rows += new
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _finish(rows)
        print(f"[bench] {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        save()
    title = (
        f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
        f"copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s | {meta['timed']} | {meta['date']}"
    )
    print_table(rows, title)
    return 0


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
