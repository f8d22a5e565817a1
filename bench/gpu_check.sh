#!/usr/bin/env bash
# The prepared GPU check (issue 23): on a bare Linux machine with one NVIDIA GPU, its driver,
# CUDA's compiler (nvcc: FlashInfer's JIT) and a PyTorch build, and no network, install what
# else it needs from a folder of wheels, then run bench/gpu_check.py: greedy parity against
# transformers (dense and hybrid, bf16, GQA group 6), batch-1 and batch-8 decode tok/s with
# the fraction of the weight-streaming roofline, kernels and host syncs per decode step,
# TTFT of a 4k prompt and the first-load compile time, and last a small model widened in
# place (more decode rows and a larger step, no reload: graphs, memory, tokens, and a widen
# the card cannot hold refused), printed and written as JSON. At most 8 minutes of wall
# time (HELEXA_CHECK_SECS), the wheels' install included (the driver skips stages not
# started a minute before the end).
#
#   bench/gpu_check.sh [--out FILE]                   # on the GPU machine
#   bench/gpu_check.sh --dry-run [--out FILE]         # every stage on CPU, small: checks the script
#   bench/gpu_check.sh --stages profile,ttft,spec_vision,compare,int8g,widen --decode-from gpu_check.json --out rest.json
#                                                     # the rest of a run cut short
#
# Environment: PYTHON (default: python3 on the PATH, the machine's PyTorch), HELEXA_WHEELS
# (default ./wheels: filled on a connected machine as docs/operating.md "The GPU check" says),
# HELEXA_CHECK_SECS (default 480: the whole check's seconds), HELEXA_CHECK_SCRATCH (where the
# checkpoints are made; default: the temporary folder, or /dev/shm where only it holds 40 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${HELEXA_WHEELS:-wheels}
DRY=()
STAGES=()
OUT=gpu_check.json
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=(--dry-run); shift ;;
    --out) OUT=$2; shift 2 ;;
    --stages) STAGES+=(--stages "$2"); shift 2 ;;
    --decode-from) STAGES+=(--decode-from "$2"); shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--dry-run, --out FILE, --stages LIST, --decode-from FILE)" >&2; exit 2 ;;
  esac
done

if [[ ${#DRY[@]} -eq 0 ]]; then
  command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: no NVIDIA driver" >&2; exit 1; }
  command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found: FlashInfer's JIT needs CUDA's compiler" >&2; exit 1; }
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # No network: what the machine lacks comes from the folder (bench/gpu_wheels.py: its own
  # PyTorch is never replaced); the repository itself is imported in place.
  if [[ -d "$WHEELS" ]]; then
    "$PY" bench/gpu_wheels.py "$WHEELS"
  fi
  "$PY" -c 'import msgspec, structlog, grpc, tomli_w, gguf, llguidance; from transformers import Qwen3_5ForConditionalGeneration' || {
    echo "gpu_check: a needed package does not import (wheel folder: $WHEELS; "'docs/operating.md, "The GPU check")' >&2; exit 1; }
  # without FlashInfer the check still runs (on the torch backend) and its env stage says why
  "$PY" -c 'import flashinfer' || echo "gpu_check: FlashInfer does not import: the torch backend runs" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one bound for the whole check, the wheels' install above included: 8 minutes, or
# HELEXA_CHECK_SECS (a device call of 10 minutes takes 560); the driver starts no stage in
# its last minute, and the bound's SIGTERM ends it with the report on record and its
# temporary checkpoints removed (a KILL 30 s later if not)
TOTAL=${HELEXA_CHECK_SECS:-480}
LEFT=$((TOTAL - SECONDS))
if (( LEFT < 120 )); then
  echo "gpu_check: the install took ${SECONDS} s of the ${TOTAL}; run this again (the wheels are in now)" >&2
  exit 3
fi
exec timeout -k 30 "$LEFT" "$PY" bench/gpu_check.py "${DRY[@]}" "${STAGES[@]}" --out "$OUT" \
  --budget-secs "$((LEFT - 60))"
