"""A hybrid model's prefill step on fla's chunked kernels (fla-core as `make setup` puts it
in .venv/fla, run on CPU by Triton's interpreter as in fla_real.py): the most bytes its
tensors hold at once, beside helexa plan's estimate of the step (helexa/checkpoint/
step_memory.py step_activations), which on CUDA counts fla's chunked intermediates. Run by
tests/checkpoint/test_step_memory.py in a process of its own; prints one JSON object.

    TRITON_INTERPRET=1 PYTHONPATH=.venv/fla:.:tests python -P tests/support/fla_step_memory.py

fp16 (the interpreter's bf16 is wrong, fla_real.py says why): the same two bytes a value."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

TOKENS = 128  # two of fla's 64-token chunks, one prefill


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: fla's kernels run here in Triton's interpreter")
    from helexa.checkpoint.shape import read_model_shape
    from helexa.checkpoint.step_memory import layer_token_bytes, step_activations
    from helexa.kernels import fla_gdn as fla
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.engine.seq_input import SeqInput
    from support.fla_real import interpreter_shims, two_layer_qwen3_5
    from support.live_bytes import LiveBytes

    if fla._fla_chunk is None:
        raise SystemExit("fla-core is not importable here (make setup installs it to .venv/fla)")
    interpreter_shims()
    fla.fla_available = lambda device, dtype: dtype != torch.float32  # as on CUDA
    # the load's probes taken as passed: whether fla agrees with the torch forms is
    # tests/kernels/test_fla_real.py's to check, and they run before the step, outside
    # what is measured (interpreted, they were most of this script's time)
    fla.probe_fla_chunked = fla.probe_fla_varlen = lambda *args, **kwargs: ""
    # wide linear-attention heads beside a narrow MLP and attention: the Gated DeltaNet
    # layer is the step's largest, as the flagship's is
    # and one layer of each kind: the peak is one layer's (the estimate is per layer)
    path = two_layer_qwen3_5(Path(tempfile.mkdtemp()) / "m", hidden_size=64,
                     num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=64,
                     vocab_size=512, linear_heads=(2, 6), dtype="float16")
    runner = ModelRunner(path, num_blocks=TOKENS // 16 + 2, block_size=16, max_num_seqs=1,
                         max_batched_tokens=TOKENS, num_state_slots=1, backend="torch")
    step = [SeqInput([(7 * i) % 500 + 1 for i in range(TOKENS)], 0,
                     list(range(TOKENS // 16)), True, 0)]
    pools = [t for owner in [*runner.kv_pools, *runner.linear_states.layers]
             for t in vars(owner).values() if isinstance(t, torch.Tensor)]
    with torch.inference_mode(), LiveBytes(runner.model) as live:
        live.held |= {t.untyped_storage().data_ptr() for t in pools}  # the pools: not the step's
        runner.execute(step)
    shape = read_model_shape(path / "config.json")
    est = step_activations(shape, 1, TOKENS, 2, 1, cuda=False)
    print(json.dumps({"backend": runner.linear_states.describe(), "peak": live.peak,
                      "estimate": est.total, "layer": est.layer,
                      "kinds": layer_token_bytes(shape, 1, 2)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
