#!/usr/bin/env bash
# GPU check of adaptive_spec.kernels: Triton-vs-reference equality on CUDA, then the full bench.
#
# Runs on a machine with a GPU, python3 with torch + triton, and no install of this project
# (no venv, no vLLM): a temporary shim directory holds an empty `adaptive_spec` package with a
# symlink `adaptive_spec/kernels -> <repo>/kernels`, and PYTHONPATH points at it, so
# `python3 -m adaptive_spec.kernels.check` / `.bench` import the kernels (which import only
# torch and triton) without the rest of the project.
#
# Usage (from anywhere):  OUT=/some/dir scripts/gpu_check.sh
#   OUT      where results go (default ./gpu_out): env.txt, compile.txt, checks.{txt,json},
#            bench.{txt,json}
#   DEVICE   cuda (default) or cpu (a dry run here: the interpreter and --quick sizes)
#   PYTHON   interpreter (default python3)
#   COMMIT   commit id to record when the copy has no .git
# Exit status: 0 when the checks pass, 1 otherwise (the bench runs either way).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$PWD/gpu_out}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/adaptive_spec"
printf '"""Shim: only the kernels sub-package of adaptive-spec (scripts/gpu_check.sh)."""\n' \
  > "$SHIM/adaptive_spec/__init__.py"
ln -s "$ROOT/kernels" "$SHIM/adaptive_spec/kernels"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# `python -m` puts the working directory first on sys.path: run from the shim so that the
# repository's own adaptive_spec/ (without kernels/) does not shadow it.
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
cd "$SHIM"
export PYTHONDONTWRITEBYTECODE=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit: ${COMMIT:-$(cd "$ROOT" && git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>/dev/null || echo "nvidia-smi: unavailable"
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
if [ "$DEVICE" = cuda ]; then
  echo "== Triton vs reference on CUDA"
  timeout 150 "$PY" -W ignore -m adaptive_spec.kernels.check --device cuda \
    --json "$OUT/checks.json" > "$OUT/checks.txt" 2>&1 || status=1
  cat "$OUT/checks.txt"
  echo "== bench"
  timeout 280 "$PY" -W ignore -m adaptive_spec.kernels.bench --device cuda \
    --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  tail -n 120 "$OUT/bench.txt"
else
  echo "== AOT compile for sm_90 (no GPU needed)"
  "$PY" -W ignore -m adaptive_spec.kernels.check --compile 90 > "$OUT/compile.txt" 2>&1 || status=1
  grep -c '^OK' "$OUT/compile.txt"
  echo "== Triton (interpreter) vs reference on CPU"
  TRITON_INTERPRET=1 timeout 600 "$PY" -W ignore -m adaptive_spec.kernels.check --device cpu \
    --json "$OUT/checks.json" > "$OUT/checks.txt" 2>&1 || status=1
  cat "$OUT/checks.txt"
  echo "== bench (reference only, --quick)"
  timeout 600 "$PY" -W ignore -m adaptive_spec.kernels.bench --device cpu --quick \
    --kernels jacobi,lora,ngram --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  tail -n 40 "$OUT/bench.txt"
fi
exit $status
