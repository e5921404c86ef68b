#!/usr/bin/env bash
# The GPU check, run from the repository root on a machine with one CUDA GPU and its own python3
# (torch with CUDA preinstalled, no network): the CUDA tests, then the single-GPU benchmark.
#
#   bash scripts/gpu_check.sh          # results under $OUT (default /tmp/gpu_check_out)
#   BENCH_ARGS=--smoke bash scripts/gpu_check.sh   # a tiny benchmark (tries the script on a CPU)
#
# Missing Python packages (pydantic and its needs, DeepSpeed and hjson) travel as wheels in .whl/
# and are installed into /tmp/site; shardspeed itself is used from src/ (nothing is pip-installed
# from the network). The benchmark runs even when a test fails. Bounded to about 6 minutes:
# 2 min of tests, 3.5 min of benchmark at most (typically about 3.5 min in all).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
start=$SECONDS

if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: installing the carried wheels FAILED; going on without them"
  fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== nvidia-smi"
  nvidia-smi || echo "nvidia-smi failed"
  echo "== versions"
  timeout 90 python3 - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("nccl", torch.cuda.nccl.version())
for name in ("pydantic", "pydantic_core", "typing_extensions", "safetensors", "numpy", "shardspeed", "deepspeed"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as exc:  # report and go on: the benchmark skips what is missing
        print(name, "NOT importable:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUT/env.txt"

echo "== CUDA tests"
timeout 120 python3 -m pytest -q tests/test_cuda.py tests/test_activation_checkpointing.py -p no:cacheprovider -rfEs \
  --durations=8 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=$?

echo "== benchmark"
timeout 210 python3 benchmarks/bench_gpu.py --deadline 150 --timeout 75 \
  --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=$?

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc (124: timed out)," \
  "$((SECONDS - start)) s in all" | tee -a "$OUT/env.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
