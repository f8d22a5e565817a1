"""flash-linear-attention's own kernels (fla-core as `make setup` puts it beside the venv,
the version the GPU check's wheel folder names) run on CPU by Triton's interpreter: the
load probes of helexa/kernels/fla_gdn.py at the flagship's head layout, and a whole hybrid
model whose Gated DeltaNet layers run every fla path helexa takes, against the same model
on the torch forms. Run by tests/kernels/test_fla_real.py in a process of its own (fla
must be importable before helexa imports it, and the venv's other processes should not pay
its import); prints one JSON object.

    TRITON_INTERPRET=1 PYTHONPATH=.venv/fla python -P tests/support/fla_real.py

(-P: not this folder first on the path, where the stand-in tests/support/fla.py would
shadow fla itself.)

Two shims let the interpreter run fla's kernels, neither touching what they compute:
Triton's autotuner times its configurations on a GPU driver (here every configuration is
given the same time, so the first runs), and fla's kernels call ``.to(tl.int64)`` on a
loop index, which the interpreter hands over as a Python int (here an int with ``.to``).
fla's chunked kernels in bf16 are wrong under the interpreter (numpy has no bf16: its
dots round differently), so the model here is fp16."""

from __future__ import annotations

import builtins
import functools
import json
import operator
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

CPU = torch.device("cpu")


class _Index(int):
    """A loop index as a compiled kernel sees it: ``.to(dtype)`` is itself."""

    def to(self, *args: Any, **kwargs: Any) -> _Index:
        return self


def _range(*args: Any):
    return (_Index(i) for i in builtins.range(*(operator.index(a) for a in args)))


def interpreter_shims() -> None:
    import triton.runtime.autotuner as autotuner

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/, after fla itself
    from support.triton_interp import faster_device_calls

    faster_device_calls()

    autotuner.Autotuner._bench = lambda self, *a, config, **kw: [1.0, 1.0, 1.0]
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops") and module is not None:
            module.range = _range  # type: ignore[attr-defined]


def probes(fla: Any, kh: int, vh: int, d: int) -> dict[str, str]:
    """The chunked kernels' and the decode kernel's load probes at these head counts and
    size, fp16: "" where fla agrees (the model below runs every probe at its own sizes as
    it loads; a head of 128 takes the chunked kernels' blocks past 64)."""
    names = ["probe_fla_chunked", "probe_fla_varlen", "probe_fla_decode"]
    return {n: getattr(fla, n)(CPU, kh, vh, d, d, torch.float16) for n in names}


def wrong_chunks(fla: Any) -> str:
    """The several-sequence probe with each chunk's (sequence, chunk) pair reversed: what
    the probe says of a layout fla does not take."""
    layout = fla.varlen_layout

    def reversed_pairs(lengths: list[int]) -> tuple[list[int], list[int]]:
        cu, chunks = layout(lengths)
        return cu, [x for i in range(0, len(chunks), 2) for x in (chunks[i + 1], chunks[i])]

    fla.varlen_layout = reversed_pairs
    try:
        return fla.probe_fla_varlen(CPU, 2, 6, 32, 32, torch.float16)
    finally:
        fla.varlen_layout = layout


def _steps(runner: Any) -> list[torch.Tensor]:
    """Two prefills in one step (70 tokens: past one of fla's 64-token chunks; and 5); a
    verification row of slot 0's token and 3 drafts beside slot 1's decode row; slot 0
    decoding after 2 of the 4 stood (the held row settled) beside slot 1; a pure decode
    step of both (fixed tokens throughout, so both runners see the same inputs)."""
    from helexa.neuron.engine.model_runner import SeqInput

    a, b = [(7 * i) % 500 + 1 for i in range(70)], [20, 21, 22, 23, 24]
    t0, t1 = list(range(12)), [12, 13]
    return [runner.execute([SeqInput(a, 0, t0, True, 0), SeqInput(b, 0, t1, True, 1)]),
            runner.execute([SeqInput([7, 8, 9, 10], 70, t0, True, 0, num_logits=4),
                            SeqInput([40], 5, t1, True, 1)]),
            runner.execute([SeqInput([11], 72, t0, True, 0), SeqInput([41], 6, t1, True, 1)]),
            runner.execute([SeqInput([12], 73, t0, True, 0), SeqInput([42], 7, t1, True, 1)])]


def _counted(fn: Any, calls: list[dict[str, Any]], kind: str) -> Any:
    """fn, each call recorded (its signature kept: helexa reads what fla's kernels take)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append({"kind": kind, "varlen": kwargs.get("cu_seqlens") is not None,
                      "chunk_indices": kwargs.get("chunk_indices") is not None,
                      "gates_in_kernel": bool(kwargs.get("use_gate_in_kernel")),
                      "tokens": int((kwargs.get("q") if "q" in kwargs else args[0]).shape[1])
                      if kind != "norm" else 0})
        return fn(*args, **kwargs)
    return call


def two_layer_qwen3_5(out: Path, **kw: Any) -> Path:
    """init_tiny's qwen3_5 with one Gated DeltaNet layer and one attention layer (its config's
    layer_types given, its weights made from them), not init_tiny's three of the first to one
    of the second: each Gated DeltaNet layer's fla kernels, interpreted, take seconds."""
    from helexa.fixtures import tiny

    made = tiny.hybrid_config

    def one_of_each(arch: str, **kw: Any) -> dict:
        cfg = made(arch, **kw)
        cfg["text_config"].update(layer_types=["linear_attention", "full_attention"],
                                  full_attention_interval=2)
        return cfg

    tiny.hybrid_config = one_of_each
    try:
        return tiny.init_tiny(out, arch="qwen3_5", num_layers=2, **kw)
    finally:
        tiny.hybrid_config = made


def model(fla: Any) -> dict[str, Any]:
    """A 2-layer qwen3_5 (a Gated DeltaNet layer, 2 key heads and 6 value heads of 32: the
    flagship's group of 3; an attention layer) in fp16: _steps on the torch forms, then on
    fla's kernels."""
    from helexa.kernels import fla_norm
    from helexa.kernels.backends import gdn
    from helexa.neuron.engine.model_runner import ModelRunner

    path = two_layer_qwen3_5(Path(tempfile.mkdtemp()) / "m", head_dim=32, linear_heads=(2, 6),
                             dtype="float16")

    def runner() -> ModelRunner:
        return ModelRunner(path, num_blocks=16, block_size=8, max_num_seqs=2,
                           max_batched_tokens=128, num_state_slots=2, backend="torch")

    plain = runner()
    plain_backend = plain.attention_backend
    want = _steps(plain)
    plain.close()
    # as on CUDA with fla installed: every fla path offered, each proved at load
    fla.fla_available = lambda device, dtype: dtype != torch.float32
    fla.fla_decode_available = lambda device: True
    fla_norm.fla_norm_available = lambda device: fla_norm._fla_norm_gated is not None
    calls: list[dict[str, Any]] = []
    fla._fla_chunk = _counted(fla._fla_chunk, calls, "chunked")
    fla._fla_recurrent = _counted(fla._fla_recurrent, calls, "recurrent")
    fla_norm._fla_norm_gated = _counted(fla_norm._fla_norm_gated, calls, "norm")
    fallbacks: list[str] = []
    gdn.log.warning = lambda event, **kw: fallbacks.append(f"{event}: {kw}")  # type: ignore
    fused = runner()
    calls.clear()  # the load probes'
    got = _steps(fused)
    layers = len(fused.linear_states.layers)
    backend = fused.attention_backend
    fused.close()
    return {"plain_backend": plain_backend, "backend": backend, "fallbacks": fallbacks,
            "linear_layers": layers, "calls": calls,
            "steps": [{"rows": list(w.shape), "same_shape": g.shape == w.shape,
                       "max_error": float((g.float() - w.float()).abs().max()),
                       "spread": float(w.float().std()),
                       "same_argmax": bool(torch.equal(g.argmax(-1), w.argmax(-1)))}
                      for g, w in zip(got, want, strict=True)]}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: fla's kernels run here in Triton's interpreter")
    from helexa.kernels import fla_gdn as fla

    if fla._fla_chunk is None or fla._fla_recurrent is None:
        raise SystemExit("fla-core is not importable here (make setup installs it to .venv/fla)")
    import fla as fla_package

    interpreter_shims()
    out = {"fla": fla_package.__version__,
           "takes": {"chunk_indices": fla._TAKES_CHUNK_INDICES, "cu_seqlens_cpu": fla._TAKES_CU_CPU,
                     "gated": fla.fla_gated_available()},
           "probes": {"2x6x128": probes(fla, 2, 6, 128)},
           "wrong_chunks": wrong_chunks(fla)}
    out["model"] = model(fla)
    print(json.dumps(out))  # the last line (the runners log to stdout before it)


if __name__ == "__main__":
    main()
