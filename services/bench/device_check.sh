#!/usr/bin/env bash
# GPU check for kernels/: the kernel tests compiled on CUDA (not interpreted), then the decode-attention
# benchmark. One short run (about 3-5 minutes on an H100/H200). Needs python3 with torch, triton, pytest and
# pytest-timeout (the device image has them; nothing is installed). Run from the repository root:
#     bash services/bench/device_check.sh
# Results go to $OUT (default /tmp/kvfleet-device-check): env.txt, kernel_tests.log, bench.log, bench.json,
# bench_splits.log, bench_splits.json. Exit status: nonzero if the tests or the bench failed.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-device-check}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python3}
status=0

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== kernel tests on CUDA =="
# the engine-equality test needs the tiny model's tokenizer package, which the device image lacks; it runs on CPU
timeout 240 "$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=10 \
  --ignore=tests/kernels/test_engine_triton.py 2>&1 | tee "$OUT/kernel_tests.log" || status=1

echo "== decode attention bench: Llama-3-8B heads, block size 16 =="
timeout 240 "$PY" -m services.bench.kernels --batch 64 128 256 --context 1024 4096 8192 --dtype float16 bfloat16 \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1

echo "== context-split sweep (flash-decoding), bfloat16 =="
timeout 90 "$PY" -m services.bench.kernels --batch 8 64 --context 1024 8192 --dtype bfloat16 --splits 1 2 4 8 16 \
  --skip-torch --json "$OUT/bench_splits.json" 2>&1 | tee "$OUT/bench_splits.log" || status=1

echo "device_check: exit status $status"
exit $status
