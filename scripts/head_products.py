"""What the head's six matrix products cost per draft pass, float32 against bf16 weights.

    python scripts/head_products.py --rows 1,4 --repeats 25

The shapes are the shipped EAGLE-3 head's (``fc`` 1728 -> 576, the decoder layer's fused ``qkv_proj``
1152 -> 960, ``o_proj``, ``gate_up_proj``, ``down_proj`` and the 8,192-row LM head), with oneDNN handles
made as vLLM's CPU build makes them (``create_onednn_mm``); the bf16 run casts each input to bf16 and
each output back to float32, as :mod:`adaptive_spec.vllm.drafter_bf16` does. "cold" reads a buffer the
size of the float32 target (540 MB) before each pass, as the target's forward does before the first
draft pass of a step; "warm" runs the pass right after another (a later pass of the same step). Prints
the median time of the six products per pass, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = ((576, 1728), (960, 1152), (576, 576), (3072, 576), (576, 1536), (8192, 576))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,4", help="comma-separated rows per product (requests)")
    ap.add_argument("--repeats", type=int, default=25, help="passes timed per setting (default 25)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args()
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flush = torch.randn(135_000_000)  # 540 MB: the float32 target's weights
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    handles = {
        name: [(ops.create_onednn_mm(torch.randn(n, k).to(dt).t(), 32), k) for n, k in SHAPES]
        for name, dt in dtypes.items()
    }

    def one_pass(name: str, xs: list) -> float:
        dt = dtypes[name]
        t0 = time.perf_counter()
        for (h, _), x in zip(handles[name], xs, strict=True):
            ops.onednn_mm(h, x.to(dt), None).to(torch.float32)
        return time.perf_counter() - t0

    print(f"{'rows':>4} {'cache':>5} {'float32 ms':>11} {'bf16 ms':>8} {'ratio':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        for cache in ("cold", "warm"):
            times: dict[str, list[float]] = {name: [] for name in dtypes}
            for _ in range(args.repeats):
                for name in dtypes:  # interleaved
                    if cache == "cold":
                        flush.sum()
                    else:
                        one_pass(name, xs)
                    times[name].append(one_pass(name, xs))
            f, b = (1e3 * statistics.median(times[n]) for n in dtypes)
            print(f"{rows:>4} {cache:>5} {f:>11.3f} {b:>8.3f} {b / f:>5.2f}x")


if __name__ == "__main__":
    main()
