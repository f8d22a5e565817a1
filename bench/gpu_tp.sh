#!/usr/bin/env bash
# GPU check for tensor parallelism (issue 6), on a machine with 2+ CUDA GPUs:
#   1. TP=2 over NCCL decodes greedily as TP=1 does (the three archs, one with fewer kv heads
#      than ranks), and a killed rank fails the model cleanly as on gloo —
#      tests/neuron/engine/test_tp.py with HELEXA_TEST_DEVICE=cuda;
#   2. TP=2 vs TP=1 decode tok/s (1 and 8 streams) of a ~1B-parameter init-tiny bf16
#      checkpoint, with the bytes each rank moves per step (bench/tp.py).
#
#   bench/gpu_tp.sh          # on a machine with 2+ GPUs
#   bench/gpu_tp.sh --cpu    # the same steps on CPU over gloo with a small model: checks the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; fi

if [[ "$DEVICE" == cuda ]]; then
  "$PY" -c 'import torch, sys; n = torch.cuda.device_count(); sys.exit(0 if n >= 2 else f"{n} CUDA device(s): TP=2 needs two (--cpu checks the script)")'
  SHAPE='hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632, vocab_size=32000'
  MODEL=${HELEXA_GPU_MODEL:-/tmp/helexa-gpu-bench-1b}
  BENCH_ARGS=(--device cuda --dtype bfloat16 --repeats 3 --new-tokens 128)
  TESTS=(-k "greedy_matches or killed_rank")  # a dead rank fails the model, not the process
else
  SHAPE='hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048'
  MODEL=${HELEXA_GPU_MODEL:-/tmp/helexa-gpu-bench-cpu-check}
  BENCH_ARGS=(--device cpu --repeats 1 --new-tokens 16)
  TESTS=()
fi

echo "== 1. TP=2 greedy equivalence with TP=1 on $DEVICE"
HELEXA_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider tests/neuron/engine/test_tp.py "${TESTS[@]}"

echo "== 2. TP=2 vs TP=1 decode on $DEVICE ($SHAPE)"
if [[ ! -f "$MODEL/model.safetensors" ]]; then
  "$PY" -c "from helexa.fixtures.tiny import init_tiny; init_tiny('$MODEL', arch='qwen3', dtype='bfloat16', $SHAPE)"
fi
"$PY" bench/tp.py --model "$MODEL" "${BENCH_ARGS[@]}"
