"""The activation dtype of a GGUF model on CPU, chosen by measuring this CPU.

A GGUF file says bf16 as its ``auto`` dtype, but on CPU its quantised layers' op follows
the activations' dtype: fp32 runs helexa's integer kernels, bf16 torch's int4 and grouped
int8 ops, and which is faster depends on the CPU (float matmuls too). So a model entry
with ``dtype = "auto"`` whose devices are all CPU and whose file holds quantised layers,
or F32 ones (helexa/checkpoint/gguf_layout.py's ``measures_activations``), is measured
before it is planned: a child process (helexa/neuron/formats/gguf/activation.py, so the
daemon stays torch-free) times greedy decode steps of the model's first layers in both dtypes, at one
row and at eight, and scales them to the whole model. bf16 is chosen when its step takes
under ``BF16_SHARE`` of fp32's, summed over both (fp32 holds the file's scales exactly;
bf16 rounds them), else fp32. The plan and the engine then run the chosen dtype as if the
entry had said it; Watch's ``activations`` and ``helexa ctl status`` say which and why. A
measurement that fails leaves the file's own dtype, saying so. The choice is kept per file
for the daemon's life. docs/quantization.md, "Activation dtype on CPU".
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from helexa.checkpoint.gguf import GgufError, find_gguf, read_config
from helexa.checkpoint.gguf_layout import measures_activations
from helexa.checkpoint.shape import read_model_shape
from helexa.config.schema import ModelEntry, NeuronConfig, resolve_path

BF16_SHARE = 0.9  # bf16 must save a tenth of fp32's time to give up exact scales
TIMEOUT_SECS = 300.0
MEASURER = "helexa.neuron.formats.gguf.activation"
log = structlog.get_logger(component="neuron")
_cache: dict[tuple, Activations] = {}  # (file, mtime, threads) -> the choice


@dataclass(frozen=True)
class Activations:
    """The dtype a model's activations run in, and why (as status shows it)."""

    dtype: str  # fp32 | bf16 | fp16
    why: str

    def status(self) -> str:
        return f"{self.dtype} ({self.why})"


def measured_gguf(entry: ModelEntry, config_path: Path | None, devices: list[str]
                  ) -> Path | None:
    """The entry's GGUF file when its activation dtype is measured (``measures_activations``);
    None otherwise, or for a path the plan will refuse, naming what is wrong."""
    if entry.dtype != "auto" or entry.path is None:
        return None  # before opening anything: most entries stop here
    try:
        gguf = find_gguf(resolve_path(config_path, entry.path))
        if gguf is None or not measures_activations(gguf, read_config(gguf), entry.dtype,
                                                    devices):
            return None
    except (GgufError, KeyError, ValueError, OSError):
        return None
    return gguf


def decide(times: dict[str, Any]) -> Activations:
    """The choice from the measured µs (dtype -> rows -> µs of a decode step)."""
    f32, b16 = (sum(times[d].values()) for d in ("fp32", "bf16"))
    rows = "; ".join(f"{r} row{'s' * (r != '1')}: fp32 {times['fp32'][r] / 1000:.2f} ms, "
                     f"bf16 {times['bf16'][r] / 1000:.2f} ms" for r in times["fp32"])
    return Activations("bf16" if b16 < BF16_SHARE * f32 else "fp32",
                       f"measured on this CPU, a decode step at {rows}")


async def choose(cfg: NeuronConfig, entry: ModelEntry, config_path: Path | None,
                 devices: list[str]) -> Activations | None:
    """The measured choice for this entry, or None where the dtype is not measured."""
    gguf = measured_gguf(entry, config_path, devices)
    if gguf is None:
        return None
    key = (str(gguf), gguf.stat().st_mtime_ns, cfg.engine.torch_threads)
    if key in _cache:
        return _cache[key]
    try:
        times = await _run_measurer(gguf, cfg.engine.torch_threads)
    except (TimeoutError, OSError, RuntimeError, ValueError) as e:
        why = str(e) or type(e).__name__
        log.warning("model.activation_measure_failed", model=entry.id, error=why)
        return Activations(read_model_shape(read_config(gguf)).torch_dtype,
                           f"the file's own: measuring fp32 against bf16 failed: {why}")
    got = _cache[key] = decide(times)
    log.info("model.activation_dtype", model=entry.id, dtype=got.dtype, why=got.why,
             times_us=times)
    return got


async def _run_measurer(gguf: Path, threads: int | None) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", MEASURER, str(gguf), str(threads or 0),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_SECS)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the measurer exited with {proc.returncode}: {tail[0]}")
    times = json.loads(out)
    if not {"fp32", "bf16"} <= set(times):
        raise ValueError(f"the measurer answered {sorted(times)}, not fp32 and bf16")
    return times
