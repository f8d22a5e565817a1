#!/usr/bin/env bash
# GPU check for the hybrid and MoE families (issue 14), a few minutes on one CUDA GPU:
#   1. fla-core's chunked delta rule against the plain reference (bf16; skipped without fla);
#   2. greedy equivalence with transformers on the GPU (fp32: the plain kernels), every
#      family, alone and with seven batch-mates chunked over a shuffled pool;
#   3. decode tok/s of a tiny Qwen3.5 in bf16 (fla prefill when installed) against
#      transformers generate.
#
#   bench/gpu_hybrid.sh            # on a machine with a CUDA GPU
#   bench/gpu_hybrid.sh --cpu      # the same steps on CPU: checks the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; fi
MODEL=${HELEXA_GPU_MODEL:-/tmp/helexa-gpu-hybrid-$DEVICE}

echo "== 1. fla-core against the reference"
"$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_gated_delta.py -k fla -rs || true

echo "== 2. greedy equivalence with transformers on $DEVICE"
HELEXA_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" \
  tests/neuron/models/test_hybrid_equivalence.py -k "alone or seven"

echo "== 3. decode speed on $DEVICE (tiny qwen3_5, bf16)"
if [[ ! -f "$MODEL/model.safetensors" ]]; then
  "$PY" -c "from helexa.fixtures.tiny import init_tiny; init_tiny('$MODEL', arch='qwen3_5', dtype='bfloat16', hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536, vocab_size=8192)"
fi
"$PY" bench/engine.py --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --roofline copy \
  --repeats 3 --new-tokens 64 --prompt-tokens 128 --ttft-tokens 256
