#!/usr/bin/env bash
# GPU check of adaptive_spec.kernels: Triton-vs-reference equality on CUDA, then the bench.
#
# Runs on a machine with a GPU, python3 with torch + triton, and no install of this project
# (no venv, no vLLM): a temporary shim directory holds an empty `adaptive_spec` package with a
# symlink `adaptive_spec/kernels -> <repo>/kernels` (and `tests -> <repo>/tests` for the
# verification edge cases, with a no-op `pytest` stand-in when pytest is missing), and
# PYTHONPATH points at it, so `python3 -m adaptive_spec.kernels.check` / `.bench` import the
# kernels (which import only torch and triton) without the rest of the project.
#
# Usage (from anywhere):  OUT=/some/dir scripts/gpu_check.sh
#   OUT       where results go (default ./gpu_out): env.txt, compile.txt, checks.{txt,json},
#             edge.txt, bench.{txt,json}
#   DEVICE    cuda (default) or cpu (a dry run here: the interpreter and --quick sizes)
#   PYTHON    interpreter (default python3)
#   COMMIT    commit id to record when the copy has no .git
#   CHECKS    space-separated check names (default: all of kernels/check.py)
#   KERNELS   bench kernel groups (default verify,ngram,jacobi,lora)
#   GRID      verification bench sizes: full (default) or headline
#   TUNE      1: also time launch configurations of the verification kernels
#   BASELINE  path of another _rejection_triton.py to time next to this one
#   CHECK_S / BENCH_S  time limits in seconds (default 150 / 280)
# Exit status: 0 when the checks pass, 1 otherwise (the bench runs either way).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$PWD/gpu_out}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
KERNELS=${KERNELS:-verify,ngram,jacobi,lora}
GRID=${GRID:-full}
CHECK_S=${CHECK_S:-150}
BENCH_S=${BENCH_S:-280}
mkdir -p "$OUT"

SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/adaptive_spec"
printf '"""Shim: only the kernels sub-package of adaptive-spec (scripts/gpu_check.sh)."""\n' \
  > "$SHIM/adaptive_spec/__init__.py"
ln -s "$ROOT/kernels" "$SHIM/adaptive_spec/kernels"
ln -s "$ROOT/tests" "$SHIM/tests"
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  # The edge cases live in tests/test_kernels_triton.py, whose decorators need `pytest`.
  cat > "$SHIM/pytest.py" <<'PY'
"""No-op stand-in for pytest (scripts/gpu_check.sh): lets a test module be imported."""


class _Mark:
    def __getattr__(self, name):
        return lambda *a, **k: (lambda f: f)


mark = _Mark()


def fixture(*a, **k):
    return a[0] if a and callable(a[0]) else (lambda f: f)


def fail(msg=""):
    raise AssertionError(msg)
PY
fi
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# `python -m` puts the working directory first on sys.path: run from the shim so that the
# repository's own adaptive_spec/ (without kernels/) does not shadow it.
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
BASELINE_ARG=()
if [ -n "${BASELINE:-}" ]; then
  BASELINE_ARG=(--baseline "$(cd "$(dirname "$BASELINE")" && pwd)/$(basename "$BASELINE")")
fi
cd "$SHIM"
export PYTHONDONTWRITEBYTECODE=1
ONLY=()
for c in ${CHECKS:-}; do ONLY+=(--only "$c"); done

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit: ${COMMIT:-$(cd "$ROOT" && git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>/dev/null || echo "nvidia-smi: unavailable"
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

EDGE='from tests.test_kernels_triton import _edge_cases, test_verification_is_capturable_in_a_cuda_graph as graph
import sys
dev = sys.argv[1]
errors = _edge_cases(dev)
print("\n".join(errors) or "edge cases: all equal to the reference")
if dev == "cuda":
    graph()
    print("CUDA-graph capture: replay equals the eager call")
sys.exit(1 if errors else 0)'

status=0
if [ "$DEVICE" = cuda ]; then
  echo "== Triton vs reference on CUDA"
  timeout "$CHECK_S" "$PY" -W ignore -m adaptive_spec.kernels.check --device cuda ${ONLY[@]+"${ONLY[@]}"} \
    --json "$OUT/checks.json" > "$OUT/checks.txt" 2>&1 || status=1
  cat "$OUT/checks.txt"
  echo "== verification edge cases on CUDA"
  timeout "$CHECK_S" "$PY" -W ignore -c "$EDGE" cuda > "$OUT/edge.txt" 2>&1 || status=1
  tail -n 20 "$OUT/edge.txt"
  echo "== bench"
  TUNE_ARG=()
  [ "${TUNE:-0}" = 1 ] && TUNE_ARG=(--tune)
  timeout "$BENCH_S" "$PY" -W ignore -m adaptive_spec.kernels.bench --device cuda \
    --kernels "$KERNELS" --verify-grid "$GRID" ${TUNE_ARG[@]+"${TUNE_ARG[@]}"} ${BASELINE_ARG[@]+"${BASELINE_ARG[@]}"} \
    --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  grep -v '^\[bench\] {' "$OUT/bench.txt" | tail -n 150
else
  echo "== AOT compile for sm_90 (no GPU needed)"
  "$PY" -W ignore -m adaptive_spec.kernels.check --compile 90 > "$OUT/compile.txt" 2>&1 || status=1
  grep -c '^OK' "$OUT/compile.txt"
  echo "== Triton (interpreter) vs reference on CPU"
  TRITON_INTERPRET=1 timeout 600 "$PY" -W ignore -m adaptive_spec.kernels.check --device cpu \
    ${ONLY[@]+"${ONLY[@]}"} --json "$OUT/checks.json" > "$OUT/checks.txt" 2>&1 || status=1
  cat "$OUT/checks.txt"
  echo "== verification edge cases (interpreter)"
  TRITON_INTERPRET=1 timeout 600 "$PY" -W ignore -c "$EDGE" cpu > "$OUT/edge.txt" 2>&1 || status=1
  tail -n 20 "$OUT/edge.txt"
  echo "== bench (reference only, --quick)"
  timeout 600 "$PY" -W ignore -m adaptive_spec.kernels.bench --device cpu --quick \
    --kernels "$KERNELS" --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  tail -n 40 "$OUT/bench.txt"
fi
exit $status
