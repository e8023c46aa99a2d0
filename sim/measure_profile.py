"""Measure a verification-step cost profile on a GPU (standalone: needs only torch).

A decoder-only model with Llama-3-8B's shapes (random bf16 weights: timing does not depend on their
values) runs one step of ``B`` requests, each with ``T = k + 1`` new tokens (the verified drafts plus
one) over a KV cache of ``context`` tokens: embedding, per layer RMSNorm + fused QKV projection +
grouped-query attention over the cache (``scaled_dot_product_attention``) + output projection +
SwiGLU MLP, then the LM head over every new token. Each shape is captured in a CUDA graph and
replayed (GPU time, no Python launch overhead); the median over ``--iters`` replays is reported.
A 1B-shaped draft model's single-token step gives the draft-to-target cost ratio.

This is a microbenchmark of the model's arithmetic and memory traffic in PyTorch, not of vLLM's
kernels or scheduler; ``adaptive_spec.sim.cost_profiles`` documents how its numbers are used.

Usage: ``python3 sim/measure_profile.py --out profile.json`` (``--tiny`` for a CPU smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

TARGET = {"hidden": 4096, "layers": 32, "inter": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
DRAFT = {"hidden": 2048, "layers": 16, "inter": 8192, "heads": 32, "kv_heads": 8, "vocab": 128256}
TINY = {"hidden": 64, "layers": 2, "inter": 128, "heads": 2, "kv_heads": 1, "vocab": 1000}


BACKENDS = ("default", "flash", "efficient", "cudnn", "math")


def attention_context(backend: str):
    """A context manager restricting scaled_dot_product_attention to one backend."""
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    return sdpa_kernel([b])


def probe_attention(cfg: dict, context: int, device: str, dtype: torch.dtype, iters: int) -> dict:
    """Milliseconds of one layer's attention call per backend at a few (B, T); None if it fails."""
    d = cfg["hidden"] // cfg["heads"]
    out: dict = {}
    for backend in BACKENDS:
        row = {}
        for B, T in ((16, 1), (16, 2), (64, 1), (64, 2), (64, 9)):
            q = torch.randn(B, cfg["heads"], T, d, device=device, dtype=dtype)
            k = torch.randn(B, cfg["kv_heads"], context + T, d, device=device, dtype=dtype)
            v = torch.randn_like(k)
            try:
                with attention_context(backend):
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    torch.cuda.synchronize()
                row[f"{B}x{T}"] = 1e3 * (time.perf_counter() - t0) / iters
            except RuntimeError as e:
                row[f"{B}x{T}"] = None
                row["error"] = str(e).split("\n")[0][:200]
        out[backend] = row
        print("attention", backend, row, flush=True)
    return out


class Decoder:
    """Random-weight decoder with a preallocated KV cache for up to ``max_batch`` requests."""

    def __init__(
        self, cfg: dict, max_batch: int, max_len: int, device: str, dtype: torch.dtype
    ) -> None:
        h, d = cfg["hidden"], cfg["hidden"] // cfg["heads"]
        self.cfg, self.d = cfg, d
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype)

        qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * d
        self.emb = w(cfg["vocab"], h)
        self.layers = [
            {
                "n1": torch.ones(h, device=device, dtype=dtype),
                "qkv": w(h, qkv),
                "o": w(cfg["heads"] * d, h),
                "n2": torch.ones(h, device=device, dtype=dtype),
                "gu": w(h, 2 * cfg["inter"]),
                "down": w(cfg["inter"], h),
                "k": torch.zeros(
                    max_batch, cfg["kv_heads"], max_len, d, device=device, dtype=dtype
                ),
                "v": torch.zeros(
                    max_batch, cfg["kv_heads"], max_len, d, device=device, dtype=dtype
                ),
            }
            for _ in range(cfg["layers"])
        ]
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.head = w(h, cfg["vocab"])

    def step(self, ids: torch.Tensor, context: int) -> torch.Tensor:
        """Logits for ``ids`` [B, T] appended after ``context`` cached tokens."""
        B, T = ids.shape
        c = self.cfg
        x = self.emb[ids]
        for L in self.layers:
            y = F.rms_norm(x, (x.shape[-1],), L["n1"])
            q, k, v = (y @ L["qkv"]).split(
                [c["heads"] * self.d, c["kv_heads"] * self.d, c["kv_heads"] * self.d], dim=-1
            )
            q = q.view(B, T, c["heads"], self.d).transpose(1, 2)
            L["k"][:B, :, context : context + T] = k.view(B, T, c["kv_heads"], self.d).transpose(
                1, 2
            )
            L["v"][:B, :, context : context + T] = v.view(B, T, c["kv_heads"], self.d).transpose(
                1, 2
            )
            att = F.scaled_dot_product_attention(
                q, L["k"][:B, :, : context + T], L["v"][:B, :, : context + T], enable_gqa=True
            )
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ L["o"]
            y = F.rms_norm(x, (x.shape[-1],), L["n2"])
            gate, up = (y @ L["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ L["down"]
        return F.rms_norm(x, (x.shape[-1],), self.norm) @ self.head


def time_step(
    model: Decoder, B: int, T: int, context: int, iters: int, cuda: bool, backend: str = "default"
) -> float:
    """Median milliseconds of one step (CUDA graph replay on a GPU, plain calls on the CPU)."""
    with attention_context(backend):
        return _time_step(model, B, T, context, iters, cuda)


def _time_step(model: Decoder, B: int, T: int, context: int, iters: int, cuda: bool) -> float:
    ids = torch.randint(0, model.cfg["vocab"], (B, T), device="cuda" if cuda else "cpu")
    if not cuda:
        model.step(ids, context)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            model.step(ids, context)
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model.step(ids, context)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(ids, context)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    ap.add_argument(
        "--attn-backend",
        default="auto",
        choices=("auto", *BACKENDS),
        help="attention backend; auto: the fastest at B=64, T=9 among those that run (GPU only)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    tcfg, dcfg = (TINY, TINY) if args.tiny else (TARGET, DRAFT)
    batches = (1, 2) if args.tiny else (1, 4, 16, 64)
    ts = (1, 2, 5) if args.tiny else (1, 2, 3, 5, 9)
    extra = [] if args.tiny else [(1, 33), (1, 129), (1, 257), (4, 65), (16, 17)]
    max_len = args.context + 300
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "target": tcfg,
        "draft": dcfg,
        "target_ms": [],
        "draft_ms": [],
    }
    t0 = time.time()
    backend = "default" if not cuda else args.attn_backend
    if backend == "auto":
        probe = probe_attention(tcfg, args.context, dev, dtype, args.iters)
        res["attention_probe_ms"] = probe
        ok = {
            b: r["64x9"]
            for b, r in probe.items()
            if r.get("64x9") is not None and r.get("16x2") is not None
        }
        backend = min(ok, key=ok.get) if ok else "default"
    res["attention_backend"] = backend
    model = Decoder(tcfg, max(batches), max_len, dev, dtype)
    for B, T in [(B, T) for B in batches for T in ts] + extra:
        res["target_ms"].append(
            [B, T, time_step(model, B, T, args.context, args.iters, cuda, backend)]
        )
        print("target", res["target_ms"][-1], flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    draft = Decoder(dcfg, max(batches), max_len, dev, dtype)
    for B in batches:
        res["draft_ms"].append(
            [B, 1, time_step(draft, B, 1, args.context, args.iters, cuda, backend)]
        )
        print("draft", res["draft_ms"][-1], flush=True)
    res["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
