#!/usr/bin/env bash
# GPU check for tensor parallelism (`kvfleet worker --tensor-parallel-size N`): on a machine with N >= 2 GPUs,
# the launch path over NCCL (rank r on cuda:r, the step sent to the executors on a gloo group), greedy tokens
# equal to one GPU's, and a killed rank reported without a hang (services/bench/tp_check.py). About a minute.
# Needs python3 with torch (CUDA), triton and transformers; nothing is installed. From the repository root:
#     bash services/bench/device_check_tp.sh [N]
# Results go to $OUT (default /tmp/kvfleet-device-check): env_tp.txt, tp_check.log, tp_check.json.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-device-check}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
N=${1:-2}

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total --format=csv
  nvidia-smi topo -m
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'GPUs', torch.cuda.device_count())"
} > "$OUT/env_tp.txt" 2>&1
cat "$OUT/env_tp.txt"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "${GPUS:-0}" -lt "$N" ]; then
  echo "device_check_tp: $N GPUs needed, this machine has ${GPUS:-0}: skipped"
  exit 0
fi

echo "== tensor parallel over $N GPUs (NCCL) =="
timeout 300 "$PY" -m services.bench.tp_check --device cuda --tensor-parallel-size "$N" --json "$OUT/tp_check.json" \
  2>&1 | tee "$OUT/tp_check.log"
status=${PIPESTATUS[0]}
echo "device_check_tp: exit status $status"
exit $status
