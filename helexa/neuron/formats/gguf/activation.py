"""How long a GGUF model's decode step takes on this CPU in each activation dtype: the
measurement behind ``dtype = "auto"`` for a quantised or F32 file (docs/quantization.md,
"Activation dtype on CPU"; helexa/neuron/activation.py runs it and decides).

A quantised layer's op follows its activations' dtype (format.py's GgufLinear): fp32
runs helexa/kernels/cpu/kquant.py's integer kernels inside the native decode call, bf16
torch's int4 op (Q4_K) and the grouped int8 op beside bf16 norms, attention and
elementwise ops; which is faster depends on the CPU (AVX512-BF16 and AMX, or neither) and
on more than the matmuls (bench/engine.py --gguf measured one stream 2.3x faster in fp32
on an AVX-512 Xeon where the matmuls alone were within 10%). So the model itself is
timed: the file's first ``unit`` decoder layers (one; a hybrid's run of linear-attention
layers up to its first full-attention one), then twice that, each loaded with the engine's
ModelRunner in both dtypes and stepped greedily at one and at eight rows. The two give a
layer's time and the rest's (embedding, head, sampling); a whole step is the rest plus
every layer. A file of at most ``WHOLE_BYTES``, or a model of fewer than two units, is
timed whole.

Run as ``python -m helexa.neuron.formats.gguf.activation FILE [THREADS]``: prints
{dtype: {rows: µs of a whole decode step}, "layers": [timed layer counts]} as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from helexa.neuron.formats.base import Checkpoint, open_checkpoint
from helexa.neuron.models.config import parse_model_config

CANDIDATES = ("fp32", "bf16")
ROWS = (1, 8)  # one stream's decode step, and eight streams'
PROMPT = 16  # tokens each stream prefills before its decode steps
WHOLE_BYTES = 256 << 20  # a file this small is timed whole, not by its first layers
WARM, TIMED = 3, 12  # rounds of decode steps: untimed, then timed (the fastest kept)


def truncated(ckpt: Checkpoint, layers: int) -> Checkpoint:
    """The checkpoint as a model of its first ``layers`` decoder layers, text only, no MTP."""
    raw = copy.deepcopy(ckpt.raw)
    text = raw.get("text_config", raw)
    total = int(text["num_hidden_layers"])
    for key, value in list(text.items()):  # per-layer lists: the first layers'
        if isinstance(value, list) and len(value) == total:
            text[key] = value[:layers]
    text["num_hidden_layers"] = layers
    text["mtp_num_hidden_layers"] = 0
    cfg = replace(parse_model_config(raw), vision=None)
    return Checkpoint(ckpt.path, raw, cfg, ckpt.gguf, None, first_layers=layers)


def unit_of(ckpt: Checkpoint) -> int:
    """Layers of the repeating unit: a hybrid's up to its first full-attention layer."""
    types = ckpt.config.layer_types
    return types.index("full_attention") + 1 if "full_attention" in types else 1


class Stepper:
    """One truncated model loaded in one dtype, with a stream for the one-row steps and
    ROWS[-1] more for the wide ones, each prefilled with PROMPT tokens."""

    def __init__(self, ckpt: Checkpoint, dtype: str) -> None:
        from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

        self.SeqInput = SeqInput
        streams = 1 + max(ROWS)
        self.per = -(-(PROMPT + WARM + TIMED + 2) // 16)  # blocks per stream
        self.hybrid = ckpt.config.is_hybrid
        self.runner = ModelRunner(ckpt, dtype=dtype, num_blocks=streams * self.per + 1,
                                  block_size=16, max_num_seqs=streams,
                                  max_batched_tokens=PROMPT * streams,
                                  num_state_slots=streams if self.hybrid else 0,
                                  cuda_graphs=False)
        prompt = [(7 * i + 3) % self.runner.vocab_size for i in range(PROMPT)]
        self.done = [PROMPT] * streams
        logits = self.runner.execute([self._seq(i, prompt, 0) for i in range(streams)])
        self.last = logits.argmax(-1).tolist()

    def _seq(self, i: int, tokens: list[int], computed: int) -> Any:
        table = list(range(i * self.per + 1, (i + 1) * self.per + 1))
        return self.SeqInput(tokens, computed, table, True, i if self.hybrid else -1)

    def step(self, rows: int) -> float:
        """Seconds of one greedy decode step of ``rows`` streams."""
        ids = [0] if rows == 1 else list(range(1, rows + 1))
        seqs = [self._seq(i, [self.last[i]], self.done[i]) for i in ids]
        t0 = time.perf_counter()
        logits = self.runner.execute(seqs)
        took = time.perf_counter() - t0
        for i, x in zip(ids, logits.argmax(-1).tolist(), strict=True):
            self.last[i], self.done[i] = x, self.done[i] + 1
        return took


def measure(path: Path) -> dict[str, Any]:
    """dtype -> rows -> µs of a whole decode step, from the truncated models' steps: every
    model and row count stepped in turn, round after round, so a neighbour's load falls on
    all of them alike; each keeps its fastest step (interference only adds)."""
    ckpt = open_checkpoint(path)
    total, unit = ckpt.config.num_layers, unit_of(ckpt)
    whole = 2 * unit > total or path.stat().st_size <= WHOLE_BYTES
    counts = [total] if whole else [unit, 2 * unit]
    steppers = {(d, n): Stepper(truncated(ckpt, n), d) for d in CANDIDATES for n in counts}
    best: dict[tuple[str, int, int], float] = {}
    try:
        for k in range(WARM + TIMED):
            for (d, n), st in steppers.items():
                for m in ROWS:
                    took = st.step(m)
                    if k >= WARM:
                        best[d, n, m] = min(best.get((d, n, m), took), took)
    finally:
        for st in steppers.values():
            st.runner.close()
    out: dict[str, Any] = {"layers": counts}
    for d in CANDIDATES:
        est = {}
        for m in ROWS:
            first = best[d, counts[0], m] * 1e6
            per_unit = max(0.0, best[d, counts[-1], m] * 1e6 - first) if len(counts) > 1 else 0
            est[str(m)] = round(first + per_unit * (total / unit - 1), 1)
        out[d] = est
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1 and int(argv[1]):
        torch.set_num_threads(int(argv[1]))
    with contextlib.redirect_stdout(sys.stderr):  # the kernels' choices are logged
        got = measure(Path(argv[0]))
    json.dump(got, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
