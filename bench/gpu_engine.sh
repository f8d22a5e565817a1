#!/usr/bin/env bash
# GPU check for the engine (issue 3), under 5 minutes on one CUDA GPU:
#   1. greedy equivalence with transformers on the GPU (fp32, the three archs, batched and
#      chunked prefill) — the same tests as on CPU, with HELEXA_TEST_DEVICE=cuda;
#   2. single-stream and 8-stream decode tok/s of a ~1B-parameter init-tiny checkpoint in
#      bf16, against transformers and the GPU's weight-streaming roofline (weight bytes per
#      step / measured copy bandwidth).
#
#   bench/gpu_engine.sh            # on a machine with a CUDA GPU
#   bench/gpu_engine.sh --cpu      # the same steps on CPU with a small model: checks the script
#
# Environment: PYTHON (default .venv/bin/python), HELEXA_GPU_MODEL (checkpoint folder to use
# or create; default under /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; fi

if [[ "$DEVICE" == cuda ]]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: run with --cpu to check the script")'
  "$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
  # ~1B parameters: hidden 2048, 16 layers, 16 heads / 8 kv heads (head_dim 128), mlp 5632, vocab 32000.
  SHAPE='hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632, vocab_size=32000'
  MODEL=${HELEXA_GPU_MODEL:-/tmp/helexa-gpu-bench-1b}
  BENCH_ARGS=(--device cuda --dtype bfloat16 --roofline copy --repeats 3)
else
  SHAPE='hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048'
  MODEL=${HELEXA_GPU_MODEL:-/tmp/helexa-gpu-bench-cpu-check}
  BENCH_ARGS=(--device cpu --dtype bfloat16 --roofline copy --repeats 1 --new-tokens 16 --ttft-tokens 128)
fi

echo "== 1. greedy equivalence with transformers on $DEVICE"
HELEXA_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider \
  tests/neuron/models/test_greedy_equivalence.py \
  -k "init_tiny or batched or chunked or save_pretrained"

echo "== 2. decode speed on $DEVICE ($SHAPE, bf16)"
if [[ ! -f "$MODEL/model.safetensors" ]]; then
  "$PY" -c "from helexa.tiny import init_tiny; init_tiny('$MODEL', arch='qwen3', dtype='bfloat16', $SHAPE)"
fi
"$PY" bench/engine.py --model "$MODEL" "${BENCH_ARGS[@]}"
