#!/usr/bin/env bash
# GPU acceptance run for the engine's data plane (issue 13), on a machine with a CUDA GPU and
# the cuda extra installed (pip install -e '.[cuda]': FlashInfer):
#   1. agreement: the cuda attention backend against the torch reference (logits within
#      tolerance, greedy equal: chunked prefill, ragged batches, shuffled pool, every KV
#      dtype), and greedy equivalence with transformers — HELEXA_TEST_DEVICE=cuda;
#   2. decode of a ~1B and a ~8B-shaped init-tiny checkpoint in bf16 at 1k and 8k context on a
#      shuffled pool: single stream and 8 streams, cuda with and without CUDA graphs beside
#      torch, against the HBM roofline (weight bytes per step / copy bandwidth measured in the
#      same run). Targets: single stream >= 0.85 of the roofline at 1k, >= 0.75 at 8k;
#      8 streams >= 5x one stream;
#   3. TP = 2 (bench/gpu_tp.sh) when two GPUs are there.
#
#   bench/gpu_engine.sh            # on a machine with a CUDA GPU
#   bench/gpu_engine.sh --cpu      # the same steps on CPU with small models: checks the script
#
# Environment: PYTHON (default .venv/bin/python), HELEXA_GPU_MODELS (folder for the
# checkpoints, made once; default /tmp), SIZES (default "1b 8b"), CONTEXTS ("1024 8192").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${HELEXA_GPU_MODELS:-/tmp}
DEVICE=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; fi

declare -A SHAPE
if [[ "$DEVICE" == cuda ]]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: run with --cpu to check the script")'
  "$PY" -c 'from helexa.kernels.backends import cuda; import sys; sys.exit(0 if cuda.available() else "FlashInfer missing: pip install -e .[cuda] (" + cuda.import_error() + ")")'
  "$PY" -c 'import torch, flashinfer; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "flashinfer", flashinfer.__version__)'
  SIZES=${SIZES:-1b 8b}
  CONTEXTS=${CONTEXTS:-1024 8192}
  # ~1B: hidden 2048, 16 layers, 16 heads / 8 kv heads (head_dim 128), mlp 5632, vocab 32000.
  SHAPE[1b]='hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632, vocab_size=32000, max_position_embeddings=32768'
  # ~8B (Llama-3-8B's shape): hidden 4096, 32 layers, 32 heads / 8 kv heads, mlp 14336, vocab 128256.
  SHAPE[8b]='hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256, max_position_embeddings=32768'
  BACKENDS=cuda,cuda:nographs,torch
  BENCH_ARGS=(--device cuda --dtype bfloat16 --roofline copy --repeats 3 --new-tokens 128
              --ttft-tokens 512 --driver runner --shuffle-pool --skip-transformers)
else
  SIZES=${SIZES:-1b}
  CONTEXTS=${CONTEXTS:-256}
  SHAPE[1b]='hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048'
  BACKENDS=cpu,torch
  BENCH_ARGS=(--device cpu --dtype bfloat16 --roofline copy --repeats 1 --new-tokens 16
              --ttft-tokens 128 --driver runner --shuffle-pool --skip-transformers)
fi

echo "== 1. agreement on $DEVICE: every backend against torch, and greedy against transformers"
HELEXA_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_backend_parity.py
HELEXA_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider \
  tests/neuron/models/test_greedy_equivalence.py -k "init_tiny or batched or chunked or save_pretrained"

for size in $SIZES; do
  model="$DIR/helexa-gpu-bench-$size-$DEVICE"
  if [[ ! -f "$model/model.safetensors" && ! -f "$model/model.safetensors.index.json" ]]; then
    "$PY" -c "from helexa.fixtures.tiny import init_tiny; init_tiny('$model', arch='llama', dtype='bfloat16', ${SHAPE[$size]})"
  fi
  for ctx in $CONTEXTS; do
    echo "== 2. $size ($DEVICE, bf16, ${SHAPE[$size]}), context $ctx, shuffled pool: $BACKENDS"
    "$PY" bench/engine.py --model "$model" --prompt-tokens "$ctx" --backend "$BACKENDS" "${BENCH_ARGS[@]}"
  done
done

if [[ "$DEVICE" == cuda ]] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
  echo "== 3. TP = 2"
  bench/gpu_tp.sh
else
  echo "== 3. TP = 2: skipped (one device)"
fi
