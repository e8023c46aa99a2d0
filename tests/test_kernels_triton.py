"""Every Triton kernel equals its PyTorch reference on random inputs.

On CUDA the checks of :mod:`adaptive_spec.kernels.check` run in this process at realistic
sizes. On CPU they run under ``TRITON_INTERPRET=1`` at small sizes in a subprocess: the
interpreter must be chosen before ``triton`` is first imported, which this test session may
already have done (vLLM and transformers import it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from adaptive_spec.kernels import triton_status
from adaptive_spec.kernels.check import CHECKS, _cmp_int, run_checks

TRITON_OK, TRITON_REASON = triton_status()
pytestmark = pytest.mark.skipif(
    not TRITON_OK, reason=f"Triton kernels not testable: {TRITON_REASON}"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    if torch.cuda.is_available():
        return run_checks("cuda")
    out = tmp_path_factory.mktemp("triton") / "checks.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-W", "ignore", "-m", "adaptive_spec.kernels.check"]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not out.exists():
        pytest.fail(f"kernel checks did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["results"]


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernel_equals_reference(results: dict, name: str) -> None:
    r = results[name]
    assert r["ok"], f"{name}: {r['detail']}"


NVIDIA_BACKEND = TRITON_OK and importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not NVIDIA_BACKEND, reason="Triton has no NVIDIA backend (ptxas) here")
def test_every_kernel_variant_compiles_for_sm90() -> None:
    """Ahead-of-time compilation catches what the interpreter does not (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-W", "ignore", "-m", "adaptive_spec.kernels.check", "--compile", "90"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if "compile sm_90" in ln]
    assert len(lines) >= 18, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, "\n".join(ln for ln in lines if ln.startswith("FAIL"))


def test_the_comparison_reports_differences() -> None:
    a = torch.tensor([[1, 2], [3, 4]])
    assert _cmp_int("x", a, a.clone()) is None
    b = a.clone()
    b[1, 0] = 9
    msg = _cmp_int("x", a, b)
    assert msg is not None and "1 of 4" in msg and "(1, 0)" in msg
    assert "shape" in (_cmp_int("x", a, a[:1]) or "")


def test_unknown_check_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        run_checks("cpu", ["nope"])


# ---------------------------------------------------------------- verification edge cases
def _edge_batch(seed: int, ks: list[int], vocab: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    drafts = [torch.randint(0, vocab, (k,), generator=g) for k in ks]
    parts = [torch.as_tensor(d, dtype=torch.int64) for d in drafts]
    d = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    cu = torch.cumsum(torch.tensor([len(p) for p in parts], dtype=torch.int64), 0)
    logits = torch.randn(d.numel() + len(ks), vocab, generator=g) * 3.0
    am = logits.argmax(-1)
    start = 0
    for i, k in enumerate(ks):  # about 60 % of the drafts agree with the target argmax
        for j in range(k):
            if torch.rand(1, generator=g).item() < 0.6:
                d[start + j] = am[start + i + j]
        start += k
    temp = torch.rand(len(ks), generator=g) + 0.3
    temp[0] = 0.0
    seeds = torch.randint(0, 2**62, (len(ks),), generator=g)
    q = torch.softmax(torch.randn(d.numel(), vocab, generator=g) * 2, -1)
    return logits.to(dtype), d, cu, temp, seeds, q


def _edge_cases(device: str) -> list[str]:
    """Triton versus the reference on the cases the random checks rarely reach; [] = all equal."""
    from adaptive_spec.kernels import verify

    errors: list[str] = []

    def cmp(tag: str, logits, d, cu, **kw) -> None:
        args = [t.to(device) for t in (logits, d, cu)]
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        ref = verify(*args, backend="torch", **kw)
        tri = verify(*args, backend="triton", **kw)
        for f in ("output_token_ids", "num_emitted", "num_accepted", "target_argmax"):
            if err := _cmp_int(f"{tag}: {f}", getattr(ref, f), getattr(tri, f)):
                errors.append(err)

    logits, d, cu, temp, seeds, q = _edge_batch(1, [5, 2, 0, 7], 300)
    st = dict(temperature=temp, seeds=seeds)
    cmp("truncated max_k=0 greedy", logits, d, cu, max_k=0)
    for mk in (1, 3):  # drafts past max_k are not verified; their rows still get an argmax
        cmp(f"truncated max_k={mk} greedy", logits, d, cu, max_k=mk)
        cmp(f"truncated max_k={mk} stochastic", logits, d, cu, max_k=mk, **st)
        cmp(f"truncated max_k={mk} draft probs", logits, d, cu, max_k=mk, draft_probs=q, **st)
    cmp("all greedy via zero temperatures", logits, d, cu, temperature=temp * 0, seeds=seeds)
    ones = torch.ones_like(q)  # q >= p everywhere: the residual is zero, the sample falls back to p
    cmp("zero residual falls back to p", logits, d, cu, draft_probs=ones, **st)
    bad = d.clone()
    bad[0], bad[1], bad[5] = -3, 300, 10**12  # outside [0, V): rejected
    cmp("invalid draft ids greedy", logits, bad, cu)
    cmp("invalid draft ids stochastic", logits, bad, cu, **st)
    cmp("invalid draft ids draft probs", logits, bad, cu, draft_probs=q, **st)
    cmp("int32 ids and offsets", logits, d.int(), cu.int(), draft_probs=q, **st)
    wide = torch.randn(logits.shape[0], 320)
    wide[:, :300] = logits
    wq = torch.zeros(q.shape[0], 310)
    wq[:, :300] = q
    cmp("strided rows", wide[:, :300], d, cu, draft_probs=wq[:, :300], **st)
    cmp("float16 logits", logits.half(), d, cu, draft_probs=q, **st)
    masked = logits.clone()  # top-5 per row, the rest -inf (top-k sampling)
    kth = masked.topk(5, dim=-1).values[:, -1:]
    masked[masked < kth] = float("-inf")
    cmp("top-k masked logits", masked, d, cu, **st)
    cmp("top-k masked logits draft probs", masked, d, cu, draft_probs=q, **st)
    logits, d, cu, temp, seeds, q = _edge_batch(2, [0, 0, 0], 9000)
    cmp("no drafts, empty draft probs", logits, d, cu, draft_probs=q, temperature=temp, seeds=seeds)
    logits, d, cu, temp, seeds, q = _edge_batch(3, [1], 9000)  # one row pair, many splits
    cmp("one request, wide vocabulary", logits, d, cu, draft_probs=q, temperature=temp, seeds=seeds)
    g = torch.Generator().manual_seed(4)
    ks = torch.randint(0, 2, (130,), generator=g).tolist()  # more requests than one lookup block
    ks[-1] = 1
    logits, d, cu, _temp, _seeds, _q = _edge_batch(4, ks, 40)
    cmp("130 requests greedy", logits, d, cu)
    empty = verify(
        torch.zeros(0, 7, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
        backend="triton",
    )
    if empty.output_token_ids.shape != (0, 1) or empty.num_accepted.numel() != 0:
        errors.append(f"empty batch: shape {tuple(empty.output_token_ids.shape)}")
    return errors


@pytest.fixture(scope="module")
def edge_errors() -> list[str]:
    if torch.cuda.is_available():
        return _edge_cases("cuda")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = (
        "import json; from tests.test_kernels_triton import _edge_cases; "
        "print('EDGE' + json.dumps(_edge_cases('cpu')))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("EDGE")]
    if not lines:
        pytest.fail(f"edge cases did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def test_triton_verification_edge_cases_equal_the_reference(edge_errors: list[str]) -> None:
    assert edge_errors == []


def test_the_launch_plan_covers_the_vocabulary() -> None:
    from adaptive_spec.kernels._rejection_triton import (
        DEFAULT_CONFIGS,
        SAMPLE_SPLIT_MAX,
        SPLIT_MAX,
        plan,
    )
    from adaptive_spec.kernels.philox import NOISE_SUB

    for cfg in DEFAULT_CONFIGS.values():
        for vocab in (1, 50, 4096, 4097, 49152, 128256, 262144, 1_000_000):
            for n_rows, batch in ((1, 1), (2, 1), (9, 1), (80, 16), (2304, 256), (9000, 1000)):
                g = plan(n_rows, batch, vocab, 132, cfg)
                assert g["chunk"] % (cfg.block * cfg.unroll) == 0
                assert 1 <= g["n_split"] <= SPLIT_MAX
                assert (g["n_split"] - 1) * g["chunk"] < vocab <= g["n_split"] * g["chunk"]
                assert g["n_chunks"] * 4 * NOISE_SUB >= vocab
                assert 1 <= g["s2"] <= SAMPLE_SPLIT_MAX
                assert (g["s2"] - 1) * g["chunks_per_prog"] < g["n_chunks"]
                assert g["s2"] * g["chunks_per_prog"] >= g["n_chunks"]
    big = plan(2304, 256, 128256, 132, DEFAULT_CONFIGS[4])
    assert big["n_split"] * 2304 >= 4 * 132  # enough programs to fill the GPU
    small = plan(2, 1, 128256, 132, DEFAULT_CONFIGS[4])
    assert small["n_split"] > 8 and small["s2"] > 8  # a small batch is split finer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_verification_is_capturable_in_a_cuda_graph() -> None:
    """No host synchronisation with max_k given: the call captures and replays identically."""
    from adaptive_spec.kernels import verify

    logits, d, cu, temp, seeds, q = _edge_batch(5, [3, 0, 4, 2], 2000)
    a = [t.cuda() for t in (logits, d, cu, temp, seeds, q)]
    kw = dict(temperature=a[3], seeds=a[4], draft_probs=a[5], max_k=4, backend="triton")
    eager = verify(a[0], a[1], a[2], **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = verify(a[0], a[1], a[2], **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager.output_token_ids, captured.output_token_ids)
    assert torch.equal(eager.target_argmax, captured.target_argmax)
