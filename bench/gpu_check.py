"""The prepared GPU check's driver (bench/gpu_check.sh runs it): one process, every stage,
one JSON report.

    python bench/gpu_check.py [--dry-run] [--out gpu_check.json] [--budget-secs 420]

Stages, each a key of the report (``stages``), each timed and caught on its own so one
failing stage still leaves the others' figures:

- ``env``: torch, the device, whether FlashInfer and fla import (and why not).
- ``compile``: the first load of a bf16 model plus its first prefill and decode step, in a
  fresh process (FlashInfer's JIT compiles here), against a second load of the same model.
- ``parity``: greedy decode of helexa against transformers on the device, bf16, for a dense
  (qwen3) and a hybrid (qwen3_5) init-tiny checkpoint with a GQA group of 6 (12 query heads,
  2 kv heads): the tokens, the first step where they differ, and two yardsticks for a
  divergence: where transformers' eager attention leaves its own sdpa tokens, and
  transformers' logit margin between the two tokens at helexa's first divergence.
- ``decode``: batch-1 and batch-8 decode tok/s of a larger dense and a hybrid checkpoint,
  with the fraction of the weight-streaming roofline: measured copy bandwidth (a device
  tensor copied, read + write bytes / s) ÷ the weight bytes a step reads (all, less an
  untied input embedding, of which a step gathers a row) = steps/s at best. These drive
  the model runner alone; ``verify_batch1`` a speculative verification step (the last
  token and 3 drafts) against a decode step, µs each (what MTP's drafts cost the target:
  speculation gains where 1 + accepted drafts exceeds the ratio; and the host syncs a
  verification step makes, one of them the check's own read of its token);
  ``engine_batch1`` is
  batch 1 through the engine's step loop, as
  a client's stream gets it, with lookahead decode and without (``lookahead_vs_sync``),
  whose greedy tokens must ``match`` (every lookahead run's those of the first sync run);
  ``engine_constrained`` the same for a JSON-schema request (dense model), whose two runs'
  tokens must ``match``.
- ``profile``: over a few batch-1 decode steps (torch.profiler): kernels launched and host
  syncs per step (CUDA: device kernels, and cuda*Synchronize / blocking copies; dry run on
  CPU: aten ops, and aten::_local_scalar_dense), the kernels' device time per step against
  its wall time (host-bound where the gap is large), and the costliest kernels; then, out
  of the profiler, the host's µs a step in each part of the runner's step (HostTimes).
- ``ttft``: time to first token of a 4096-token prompt (dry run: 256).

The decode, profile and ttft stages share one runner of each big model (``Models.big``):
a 16 GB load and its graph capture once for the three, not once each. The report's
``models_s`` is the seconds each checkpoint took to make, ``loads_s`` those of every
runner load by checkpoint, and ``stage_loads`` how many each stage made, by checkpoint:
where the check's time went.
- ``spec_vision``: (``mtp``) speculation with an MTP head through the engine, against plain
  decoding, and (``vision``) a prompt with an image against transformers' Qwen3.5 and its
  processor.
- ``compare``: batch 1 of each big model again with one GPU kernel turned off, the ratio
  to the decode stage's run: the models' torch norms, SiLU and rope (HELEXA_CUDA_FUSED=0);
  a hybrid's conv1d decode on the torch form (HELEXA_TRITON_CONV=0);
  for a hybrid on FlashInfer's Gated DeltaNet pool decode, fla's kernel on gathered
  states instead (HELEXA_FLASHINFER_GDN=0); for a model whose GQA group both of
  FlashInfer's decode kernels serve, batch 1 and 8 on the kernel cuda.tensor_cores did
  not choose (``other_decode_kernel``: the measurement its rule waits for); the dense
  model over an int8 KV pool, batch 1 and 8, on the Triton quantised-KV write and decode
  (its decode steps in CUDA graphs) and on the torch path, eagerly (``int8_kv``). Last,
  so a check short of time loses these and not the figures before.
- ``int8g``: one large grouped int8 layer (GGUF Q5_K's layout) at 1, 8 and 32 rows on the
  Triton kernel, the dequantised tiles and a bf16 F.linear, and the same weight as per-row
  int8 on torch's op and on the kernel at one group a row, and as int4 at 1, 8 and 512
  rows (helexa's int4 product, torch's op alone, bf16): µs a call and the fraction of
  copy bandwidth its bytes make (stage_int8g); and one MoE block's routed experts on the
  routed kernel against the gathered copies it replaces, bf16, int8 and int4, at 1 and 8
  tokens (``moe``). After compare: it is not one of the issue's figures.
- ``widen``: a small dense model rebuilt through the engine's pool re-plan for more decode
  rows and a larger step without reloading its weights, then a widen the card cannot
  hold (bench/gpu_widen.py): the graph sizes captured, the memory reserved at each point,
  whether its greedy tokens match an eager load's and its own before the widen, the
  refusal's message. Last: it takes the time the others leave.

``--dry-run`` runs every stage on CPU at small sizes (tests/integration/bench/
test_gpu_check.py runs it) so the script cannot rot where no GPU is; its figures mean
nothing about a GPU.
Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_widen import stage_widen  # bench/: the script's own folder, first on sys.path

from helexa.kernels import flashinfer_gdn
from helexa.kernels.backends import cuda_fused
from helexa.kernels.backends.cuda import CUDA_CORE_GROUPS

# in the order the figures come first: a run cut short loses the later ones
STAGES = ("env", "compile", "parity", "decode", "profile", "ttft", "spec_vision", "compare",
          "int8g", "widen")
# the stages that share each big model's runner (Models.big): loaded once for the three
HELD_BY = ("decode", "profile", "ttft")
GROUP_6 = dict(num_heads=12, num_kv_heads=2)  # Qwen3.5-27B's GQA group (24 / 4)


def sizes(dry: bool) -> dict[str, Any]:
    """Checkpoint shapes and lengths: GPU ones sized to stream weights, dry-run ones tiny.

    On the GPU the big dense checkpoint is Qwen3-8B's shape whole (36 layers of hidden 4096,
    intermediate 12288, 32 query / 8 kv heads of 128, its 151,936-token vocabulary: 8.2B
    parameters, 16.4 GB in bf16), and the big hybrid an 8B-class Qwen3.5 (32 layers of that
    width, one in four full attention with a GQA group of 6, Gated DeltaNet of 16 key / 32
    value heads), their random weights drawn on the GPU so they are made in seconds.
    """
    hd = 8 if dry else 128  # one head size: FlashInfer compiles one set of modules
    # 4 layers: a hybrid holds one full-attention layer in 4
    small = dict(hidden_size=12 * hd, num_layers=4, intermediate_size=4 * 12 * hd,
                 vocab_size=512 if dry else 4096, head_dim=hd, **GROUP_6)
    layer_8b = dict(hidden_size=4096, intermediate_size=12288, head_dim=128, vocab_size=151936)
    big = small if dry else dict(layer_8b, num_layers=36, num_heads=32, num_kv_heads=8)
    hybrid_big = small if dry else dict(layer_8b, num_layers=32, num_heads=24, num_kv_heads=4,
                                        linear_heads=(16, 32))
    return dict(small=small, big=big, hybrid_big=hybrid_big,
                parity_tokens=8 if dry else 32,
                decode_tokens=4 if dry else 64, prompt=16 if dry else 128,
                ttft_prompt=256 if dry else 4096, copy_mib=16 if dry else 2048,
                profile_steps=2 if dry else 8)


# seconds each ModelRunner load took (weights to the device, graphs captured), by checkpoint
# folder: where the check's time goes, in the report as ``loads_s``
LOADS: dict[str, list[float]] = {}


class Runner:
    """A ModelRunner driven with greedy argmax: streams prefilled, then decoded together."""

    BLOCK = 16

    def __init__(self, model_dir: Path, device: str, streams: int, tokens: int,
                 kv_dtype: str = "auto") -> None:
        from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

        self.SeqInput = SeqInput
        self.per = -(-tokens // self.BLOCK) + 1
        t = time.perf_counter()
        self.runner = ModelRunner(model_dir, device=device, dtype="bfloat16",
                                  num_blocks=streams * self.per + 1, block_size=self.BLOCK,
                                  max_num_seqs=max(8, streams), max_batched_tokens=4096,
                                  num_state_slots=max(8, streams), kv_dtype=kv_dtype)
        self.name = model_dir.name
        LOADS.setdefault(self.name, []).append(time.perf_counter() - t)
        self.device = torch.device(device)

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        self.tables = [list(range(i * self.per, (i + 1) * self.per)) for i in range(len(prompts))]
        self.lens = [len(p) for p in prompts]
        last = []
        for i, p in enumerate(prompts):
            logits = self.runner.execute([self.SeqInput(p, 0, self.tables[i], True, i)])
            last.append(int(logits[0].argmax()))
        return last

    def step(self, last: list[int]) -> list[int]:
        logits = self.runner.execute([self.SeqInput([x], self.lens[i], self.tables[i], True, i)
                                      for i, x in enumerate(last)])
        self.lens = [n + 1 for n in self.lens]
        return logits.argmax(-1).tolist()

    def close(self) -> None:
        self.runner.close()
        del self.runner  # the weights go with the last reference (free_device collects)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(root: Path, name: str, arch: str, shape: dict[str, Any],
               device: str = "cpu") -> Path:
    from helexa.fixtures.tiny import init_tiny

    return init_tiny(root / name, arch=arch, dtype="bfloat16", device=device, **shape)


# set by run while a stage runs: puts a stage's figures so far on record (each_model calls
# it after each model, so a stage killed at the time bound keeps what it measured)
progress: Callable[[dict[str, Any]], None] = lambda partial: None  # noqa: E731


def each_model(names: tuple[str, ...], measure: Callable[[str], dict[str, Any]],
               out: dict[str, Any], held: Models | None = None) -> dict[str, Any]:
    """``measure`` each model into ``out`` on its own: one that raises leaves its error and
    the others' figures (the run then counts the stage failed: ``failed``) and, where
    ``held`` holds a runner of it, that runner closed."""
    for name in names:
        try:
            out[name] = measure(name)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            out[name] = {"error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc(limit=6)}
            out.setdefault("failed", []).append(name)
            if held is not None:
                held.drop(name)
        free_device()
        progress(out)
    return out


def free_device() -> None:
    """Drop what closed runners left (their cycles: HostTimes' wrappers, engine cores) and
    give the allocator's cache back, so that the big models held (Models.big) are the only
    ones on the card."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_env(ctx: dict[str, Any]) -> dict[str, Any]:
    from importlib import metadata

    from helexa.kernels.backends import cuda

    out: dict[str, Any] = {"torch": torch.__version__, "device": ctx["device"],
                           "flashinfer": cuda.available(), "flashinfer_error": cuda.import_error()}
    for name in ("flashinfer-python", "fla-core", "triton", "transformers",
                 "nvidia-cutlass-dsl"):  # (the last: FlashInfer's Gated DeltaNet decode)
        try:
            out.setdefault("versions", {})[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.setdefault("versions", {})[name] = None
    out["scratch"] = ctx["scratch"]  # where the checkpoints are made, and why there
    if ctx["device"] == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        free, total = torch.cuda.mem_get_info(0)
        out["gpu_free_gb"], out["gpu_total_gb"] = free / 1e9, total / 1e9
    try:
        import fla  # noqa: F401
        out["fla"] = True
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["fla"] = f"{type(e).__name__}: {e}"
    return out


def stage_compile(ctx: dict[str, Any]) -> dict[str, Any]:
    def load_and_step() -> tuple[float, str]:
        path = ctx["dense"]  # made (the first time) before the clock starts
        t = time.perf_counter()
        r = Runner(path, ctx["device"], 1, 64)
        r.step(r.prefill([[1, 2, 3, 4]]))
        sync(r.device)
        backend = r.runner.attention_backend
        r.close()
        return time.perf_counter() - t, backend

    first, backend = load_and_step()  # the first in this process: JIT compiles, caches warm
    second, _ = load_and_step()
    return {"first_load_s": first, "second_load_s": second, "compile_s": max(0.0, first - second),
            "backend": backend}


def _hf(path: Path, device: str, impl: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                attn_implementation=impl).to(device)


def _greedy(hf: Any, prompt: list[int], n: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _diverges(a: list[int], b: list[int]) -> int:
    """The first position two different token lists part (or the shorter one ends)."""
    short = min(len(a), len(b))
    return next((i for i in range(short) if a[i] != b[i]), short)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def stage_parity(ctx: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens of helexa and of transformers (sdpa), and two yardsticks for a
    divergence in bf16: where transformers' own eager attention leaves its sdpa tokens
    (the noise floor of bf16 greedy decoding on random weights), and, at helexa's first
    divergence, transformers' logit margin between its token and helexa's over the same
    prefix (a near tie, in units of the logits' spread, is rounding, not a wrong kernel)."""
    n, out = ctx["sizes"]["parity_tokens"], {}
    dev = ctx["device"]

    def parity(name: str) -> dict[str, Any]:
        prompt = [(7 * i + 3) % 500 + 1 for i in range(ctx["sizes"]["prompt"])]
        r = Runner(ctx[name], dev, 1, len(prompt) + n)
        ours = r.prefill([prompt])
        for _ in range(n - 1):
            ours.append(r.step(ours[-1:])[0])
        r.close()
        res: dict[str, Any] = {"gqa_group": 6, "helexa": ours}
        for impl in ("sdpa", "eager"):
            hf = _hf(ctx[name], dev, impl)
            res[impl] = _greedy(hf, prompt, n, dev)
            if impl == "sdpa":
                d = _first_diff(ours, res[impl])
                if d is not None:
                    with torch.inference_mode():
                        logits = hf(torch.tensor([prompt + ours[:d]], device=dev)).logits[0, -1]
                    lf = logits.float()
                    res["margin_at_divergence"] = float(lf[res[impl][d]] - lf[ours[d]])
                    res["logit_std"] = float(lf.std())
            del hf
        res["transformers"] = res.pop("sdpa")
        res["match"] = ours == res["transformers"]
        res["first_divergence"] = _first_diff(ours, res["transformers"])
        res["transformers_eager_vs_sdpa_divergence"] = _first_diff(res["eager"],
                                                                    res["transformers"])
        return res

    return each_model(("dense", "hybrid"), parity, out)


def stage_spec_vision(ctx: dict[str, Any]) -> dict[str, Any]:
    """Speculation with an MTP head through the engine against plain decoding (``mtp``),
    and a prompt with an image against transformers (``vision``): after the issue's
    figures, each failing on its own."""
    return each_model(("mtp", "vision"), lambda name: {"mtp": mtp_engine,
                                                      "vision": vision_parity}[name](ctx), {})


def vision_parity(ctx: dict[str, Any]) -> dict[str, Any]:
    """Greedy decoding of a prompt with an image on the device, bf16: helexa (its decode
    steps, which no image token is in, replaying CUDA graphs at the request's M-RoPE-shifted
    positions) against transformers' Qwen3.5 with its own processor (tests/support/vision.py),
    on a tiny vision checkpoint of the parity stage's text shape: the tokens, the first step
    where they differ, and transformers' logit margin there (as the text parity's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.vision import greedy_generate_images, hf_inputs, image_inputs, make_image
    from transformers import Qwen3_5ForConditionalGeneration

    path, dev, n = ctx["vision"], ctx["device"], ctx["sizes"]["parity_tokens"]
    img = make_image(200, 130, 1)
    ask = [{"role": "user", "content": [{"type": "image"},
                                        {"type": "text", "text": "What is in this picture?"}]}]
    inputs = hf_inputs(path, ask, [img])
    prompt = inputs["input_ids"][0].tolist()
    images = image_inputs(path, prompt, [img])
    r = Runner(path, dev, 1, len(prompt) + n)
    ours = greedy_generate_images(r.runner, [prompt], [images], n)[0]
    backend = r.runner.attention_backend
    r.close()
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).to(dev)
    on_dev = {k: v.to(dev) for k, v in inputs.items()}
    with torch.inference_mode():
        gen = hf.generate(**on_dev, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          pad_token_id=0)
    ref = gen[0, len(prompt):].tolist()
    res: dict[str, Any] = {"image_tokens": images[0].rows * images[0].cols,
                           "backend": backend, "helexa": ours, "transformers": ref,
                           "match": ours == ref, "first_divergence": _first_diff(ours, ref)}
    d = res["first_divergence"]
    if d is not None:
        try:  # a yardstick: its failure must not cost the tokens above
            ids = torch.tensor([prompt + ours[:d]], device=dev)
            image = {k: on_dev[k] for k in ("pixel_values", "image_grid_thw")}
            if "mm_token_type_ids" in on_dev:  # per token: the generated ones are text (0)
                kinds = on_dev["mm_token_type_ids"]
                image["mm_token_type_ids"] = torch.cat(
                    [kinds, kinds.new_zeros(1, ids.shape[1] - kinds.shape[1])], dim=1)
            with torch.inference_mode():
                logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids),
                            **image).logits[0, -1].float()
            res["margin_at_divergence"] = float(logits[ref[d]] - logits[ours[d]])
            res["logit_std"] = float(logits.std())
        except Exception as e:  # noqa: BLE001 - reported, not raised
            res["margin_error"] = f"{type(e).__name__}: {e}"
    del hf
    return res


# the speculation policies mtp_engine runs: off, drafting spec_k every step, and a full
# batch's probes only (the steps between them chained by lookahead decode)
MTP_POLICIES: dict[str, dict[str, Any]] = {
    "plain": dict(speculation="off"),
    "drafting": dict(speculation="mtp", spec_k=3, spec_full_below=1.0, spec_off_above=1.01,
                     spec_min_acceptance=0.0),
    "probes": dict(speculation="mtp", spec_k=2, spec_full_below=0.0, spec_off_above=0.0)}


def mtp_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    """Speculation with the MTP head on the device, through EngineCore on a tiny hybrid
    with a head: the greedy tokens of each MTP_POLICIES entry, the first step where a
    speculating run leaves plain decoding's (verification rows round in another order than
    decode rows, so a near tie may flip in bf16), drafted and accepted tokens, and the
    steps lookahead launched from device tokens (``probes``: the MTP head observes the
    chained steps' hidden states, which their graph replays keep)."""
    from helexa.neuron.engine import lookahead
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    n = ctx["sizes"]["parity_tokens"]
    prompt = [(5 * i + 2) % 500 + 1 for i in range(ctx["sizes"]["prompt"])]
    out: dict[str, Any] = {}
    real_launch = lookahead.launch
    followed: dict[str, int] = {}

    def launch(core: Any, plan: Any, inputs: Any, tokens: Any = None, **kw: Any) -> Any:
        name = core.ahead_name  # the run counting: its steps launched from device tokens
        followed[name] = followed.get(name, 0) + (tokens is not None)
        return real_launch(core, plan, inputs, tokens, **kw)

    lookahead.launch = launch  # type: ignore[assignment]
    try:
        for name, policy in MTP_POLICIES.items():
            limits = m.Limits(max_in_flight=1, anon_max_in_flight=1, max_slots=1, **policy)
            core = EngineCore(EngineSpec(model_id="mtp-check", model_dir=str(ctx["hybrid_mtp"]),
                                         devices=[ctx["device"]], num_blocks=64, prefix_cache=False,
                                         context=len(prompt) + n + 8, limits=limits))
            core.lookahead = True  # as on a GPU by default: the dry run takes its path too
            core.ahead_name = name  # type: ignore[attr-defined]
            try:
                req = m.NewRequest(req_id=name, prompt_token_ids=prompt, max_tokens=n,
                                   sampling=m.SamplingParams(temperature=0.0))
                tokens, _ = engine_request(core, req)
                st = core.status()
                out[name] = {"tokens": tokens, "drafter": st.drafter,
                             "drafted": st.spec_drafted_tokens, "accepted": st.spec_accepted_tokens,
                             "followed_steps": followed.get(name, 0)}
            finally:
                core.close()
    finally:
        lookahead.launch = real_launch  # type: ignore[assignment]
    for name in ("drafting", "probes"):
        out[name]["first_divergence"] = _first_diff(out["plain"]["tokens"], out[name]["tokens"])
    return out


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes/s a device copy moves (each byte read once and written once)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps, t = 5, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.nbytes * reps / (time.perf_counter() - t)


def streamed_bytes(model: torch.nn.Module, held: int) -> int:
    """Weight bytes one decode step reads: all held, less an untied input embedding (a step
    gathers one row of it per token; the LM head, tied or not, is read whole)."""
    emb = next((m.weight for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    head = next((m.weight for n, m in model.named_modules() if n.endswith("lm_head")), None)
    if emb is None or (head is not None and head.data_ptr() == emb.data_ptr()):
        return held
    return held - emb.numel() * emb.element_size()


def decode_steps_per_s(r: Runner, batch: int, prompt: int, steps: int) -> float:
    """Prefill ``batch`` streams, one warm step (graph replay, plans), then ``steps`` timed."""
    last = r.step(r.prefill([[(i + j) % 400 + 1 for j in range(prompt)] for i in range(batch)]))
    sync(r.device)
    t = time.perf_counter()
    for _ in range(steps):
        last = r.step(last)
    sync(r.device)
    return steps / (time.perf_counter() - t)


def verify_vs_decode(r: Runner, steps: int, k: int = 3) -> dict[str, Any]:
    """A speculative verification step at batch 1 (a row of the last token and ``k`` drafts,
    logits at each: what MTP's drafts cost the target) against a decode step, on the same
    runner and stream: µs of each and their ratio. Speculation gains where the tokens a
    verification yields, 1 + its accepted drafts, exceed the ratio. Every draft is taken as
    accepted, so each verification also settles the whole row before it (a hybrid's held
    state, advanced by that row's k + 1 positions)."""
    last = r.prefill([[(j * 11) % 400 + 1 for j in range(16)]])
    last = r.step(last)  # warm: the graph replays, the plans

    def timed(run: Callable[[], None]) -> float:
        sync(r.device)
        t = time.perf_counter()
        for _ in range(steps):
            run()
        sync(r.device)
        return (time.perf_counter() - t) / steps * 1e6

    def decode() -> None:
        nonlocal last
        last = r.step(last)

    def verify() -> None:
        nonlocal last
        row = last + [(last[0] + d) % 400 + 1 for d in range(k)]
        logits = r.runner.execute([r.SeqInput(row, r.lens[0], r.tables[0], True, 0,
                                              num_logits=k + 1)])
        r.lens[0] += k + 1
        last = [int(logits[-1].argmax())]

    decode_us = timed(decode)
    verify()  # warm: the verification's own kernels and plans
    verify_us = timed(verify)
    from torch.profiler import ProfilerActivity, profile

    # host-side events suffice, but a CPU-only profile first in a process can leave a later
    # one (the profile stage's) without the device's events: the same activities as there
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            verify()
        sync(r.device)
    own = 1 if r.device.type == "cuda" else 0  # the closing sync above is the check's
    return {"drafts": k, "decode_step_us": decode_us, "verify_step_us": verify_us,
            "verify_vs_decode": verify_us / decode_us,
            "host_syncs_per_verify_step": (host_syncs(prof.events(), r.device) - own) / steps}


def host_syncs(events: Any, device: torch.device) -> int:
    """Host syncs among profiler events: on CUDA cuda*Synchronize calls and blocking
    cudaMemcpy; on CPU (the dry run) aten::_local_scalar_dense, a scalar read."""
    names = (("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy") if device.type == "cuda" else ("aten::_local_scalar_dense",))
    return sum(1 for e in events if e.name in names)


def engine_batch1_core(r: Runner, s: dict[str, Any], model_dir: Path | None = None) -> Any:
    """EngineCore on the stage's runner, one request at a time (``model_dir``: its
    tokenizer, which a grammar needs)."""
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    limits = m.Limits(max_in_flight=1, anon_max_in_flight=1, max_slots=1,
                      max_batched_tokens=4096, prefill_chunk_tokens=4096)
    return EngineCore(EngineSpec(model_id="gpu-check", model_dir=str(model_dir or ""),
                                 num_blocks=r.runner.num_blocks, block_size=r.BLOCK,
                                 devices=[str(r.device)],
                                 context=s["prompt"] + s["decode_tokens"] + 8,
                                 prefix_cache=False, limits=limits), r.runner)


def engine_request(core: Any, req: Any) -> tuple[list[int], float]:
    """Step ``core`` until ``req``, sent first, is done: its tokens, and the seconds from
    its first token to its last."""
    from helexa.neuron.engine import messages as m

    got: list[int] = []
    first, inbound = 0.0, m.ToEngine(new=[req])
    while core.has_work or inbound is not None:
        for u in core.step(inbound).updates:
            if u.error or u.refused_code:
                raise RuntimeError(f"engine run failed: {u.error or u.refused_code}")
            if u.new_token_ids and not got:
                first = time.perf_counter()
            got += u.new_token_ids
        inbound = None
    return got, time.perf_counter() - first


def engine_decode(r: Runner, s: dict[str, Any], roofline_steps: float) -> dict[str, Any]:
    """Batch-1 decode as a client's stream gets it: through EngineCore (scheduler, sampler,
    stops) on the decode stage's runner, with lookahead (helexa/neuron/engine/lookahead.py)
    and without, interleaved, the median of three each; tok/s from the first token to the
    last. Lookahead's pinned copies and events run on CUDA alone (on the CPU its copies are
    the tensors themselves), so its greedy tokens are checked against the sync run's here."""
    from statistics import median

    from helexa.neuron.engine import messages as m

    core = engine_batch1_core(r, s)
    out: dict[str, Any] = {"lookahead_by_default": core.lookahead}
    rates: dict[str, list[float]] = {"lookahead": [], "sync": []}
    runs: dict[str, list[list[int]]] = {"lookahead": [], "sync": []}
    prompt = [(j * 7) % 400 + 1 for j in range(s["prompt"])]
    for rep in range(3):
        for mode in rates:
            core.lookahead = mode == "lookahead"
            req = m.NewRequest(req_id=f"{mode}{rep}", prompt_token_ids=prompt,
                               max_tokens=s["decode_tokens"],
                               sampling=m.SamplingParams(temperature=0.0))
            got, secs = engine_request(core, req)
            rates[mode].append((len(got) - 1) / secs)
            runs[mode].append(got)
    for mode, tok_s in rates.items():
        out[mode] = {"tok_s": median(tok_s), "roofline_fraction": median(tok_s) / roofline_steps}
    want = runs["sync"][0]
    out["match"] = all(got == want for got in runs["lookahead"])
    out["first_divergence"] = next((_diverges(got, want) for got in runs["lookahead"]
                                    if got != want), None)
    out["lookahead_vs_sync"] = out["lookahead"]["tok_s"] / out["sync"]["tok_s"]
    return out


def engine_constrained(r: Runner, path: Path, s: dict[str, Any], roofline_steps: float
                       ) -> dict[str, Any]:
    """A JSON-schema request at batch 1 through EngineCore, with lookahead and without:
    each following step's mask is computed once the step before is read, while its
    forward runs (lookahead.sample). The two runs' tokens must match; tok/s of each, and
    the seconds the grammar's start-up took at load."""
    from helexa import grammar
    from helexa.neuron.engine import messages as m

    t = time.perf_counter()
    core = engine_batch1_core(r, s, path)
    out: dict[str, Any] = {"grammar_warm_s": time.perf_counter() - t}
    schema = grammar.grammar_text(grammar.json_schema(
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}))
    prompt = [(j * 7) % 400 + 1 for j in range(s["prompt"])]
    tokens: dict[str, list[int]] = {}
    for mode in ("lookahead", "sync"):
        core.lookahead = mode == "lookahead"
        req = m.NewRequest(req_id=mode, prompt_token_ids=prompt, grammar=schema,
                           max_tokens=s["decode_tokens"],
                           sampling=m.SamplingParams(temperature=0.0))
        got, secs = engine_request(core, req)
        tokens[mode] = got
        rate = (len(got) - 1) / secs
        out[mode] = {"tokens": len(got), "tok_s": rate,
                     "roofline_fraction": rate / roofline_steps}
    out["match"] = tokens["lookahead"] == tokens["sync"]
    out["lookahead_vs_sync"] = out["lookahead"]["tok_s"] / out["sync"]["tok_s"]
    return out


def decode_with(ctx: dict[str, Any], name: str, off: tuple[str, ...] = (),
                kv_dtype: str = "auto", batches: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Decode steps/s of checkpoint ``name`` at each of ``batches`` (``batch<b>``), its
    switches ``off`` set to "0" and its pool of ``kv_dtype``; its backend line and kv dtype."""
    s = ctx["sizes"]
    os.environ.update(dict.fromkeys(off, "0"))
    try:
        r = Runner(ctx[name], ctx["device"], max(batches), s["prompt"] + s["decode_tokens"] + 8,
                   kv_dtype=kv_dtype)
        got: dict[str, Any] = {"backend": r.runner.attention_backend,
                               "kv_dtype": r.runner.kv_dtype}
        for batch in batches:
            got[f"batch{batch}"] = decode_steps_per_s(r, batch, s["prompt"], s["decode_tokens"])
        r.close()
    finally:
        for env in off:
            del os.environ[env]
    return got


def batch1_with(ctx: dict[str, Any], name: str, env: str) -> dict[str, Any]:
    """Batch-1 decode tok/s of checkpoint ``name`` with switch ``env`` set to "0" (the
    fused norms' or FlashInfer's Gated DeltaNet decode turned off), and its backend line."""
    got = decode_with(ctx, name, (env,))
    return {"tok_s": got["batch1"], "backend": got["backend"]}


def int8_kv_decode(ctx: dict[str, Any], name: str, roofline_steps: float) -> dict[str, Any]:
    """Batch 1 and 8 decode of checkpoint ``name`` over an int8 KV pool, whose writes and
    attention run Triton kernels where their probes agreed (kernels/cuda/quant_write.py,
    quant_decode.py; its decode steps then captured as CUDA graphs), and again on the torch
    path (both switches at 0: eagerly): each run's backend line, steps/s and fraction of
    the weights' roofline (the KV's bytes at these prompts are a rounding error beside the
    weights'), and the kernels' speed-up at batch 1."""
    out = {}
    off = ("HELEXA_TRITON_QUANT_WRITE", "HELEXA_TRITON_QUANT_DECODE")
    for label, envs in (("triton", ()), ("torch_path", off)):
        got = decode_with(ctx, name, envs, "int8", (1, 8))
        for batch in ("batch1", "batch8"):
            got[batch] = {"steps_s": got[batch],
                          "roofline_fraction": got[batch] / roofline_steps}
        out[label] = got
    out["triton_vs_torch_path_batch1"] = (out["triton"]["batch1"]["steps_s"]
                                          / out["torch_path"]["batch1"]["steps_s"])
    return out


def other_decode_kernel(path: Path, device: str, s: dict[str, Any], roofline_steps: float,
                        chosen: dict[str, Any]) -> dict[str, Any]:
    """Decode of the same model on FlashInfer's other decode kernel than the one
    cuda.tensor_cores chose (tensor cores where it chose CUDA cores, and back), batch 1 and
    8 beside the chosen kernel's steps: the measurement its rule waits for."""
    from helexa.kernels.backends import cuda

    rule = cuda.tensor_cores
    on_tensor_cores = "tensor cores" in chosen["backend"]
    cuda.tensor_cores = lambda group: not on_tensor_cores
    try:
        r = Runner(path, device, 8, s["prompt"] + s["decode_tokens"] + 8)
        out: dict[str, Any] = {"kernel": "CUDA cores" if on_tensor_cores else "tensor cores",
                               "backend": r.runner.attention_backend}
        for batch in (1, 8):
            steps = decode_steps_per_s(r, batch, s["prompt"], s["decode_tokens"])
            out[f"batch{batch}"] = {"tok_s": steps * batch,
                                    "roofline_fraction": steps / roofline_steps,
                                    "vs_chosen": steps / chosen[f"batch{batch}"]["steps_s"]}
        r.close()
    finally:
        cuda.tensor_cores = rule
    return out


def stage_decode(ctx: dict[str, Any]) -> dict[str, Any]:
    s, dev = ctx["sizes"], torch.device(ctx["device"])
    bw = copy_bandwidth(dev, s["copy_mib"])
    out: dict[str, Any] = {"copy_bandwidth_gbs": bw / 1e9}
    ctx["decode"] = out  # what the compare stage measures beside (a failed model: its error)

    def decode(name: str) -> dict[str, Any]:
        ctx[name]  # the checkpoint made first: load_s is the load alone
        t = time.perf_counter()  # graphs for 1..8 rows captured, each size's kernels built
        r = ctx.big(name)  # kept for the profile and ttft stages
        load_s = time.perf_counter() - t
        step_bytes = streamed_bytes(r.runner.model, r.runner.weight_bytes)
        roofline_steps = bw / step_bytes  # weights streamed once per step
        res: dict[str, Any] = {"load_s": load_s, "weight_bytes": r.runner.weight_bytes,
                               "step_weight_bytes": step_bytes,
                               "roofline_steps_per_s": roofline_steps,
                               "backend": r.runner.attention_backend}
        for batch in (1, 8):
            steps = decode_steps_per_s(r, batch, s["prompt"], s["decode_tokens"])
            res[f"batch{batch}"] = {"tok_s": steps * batch, "steps_s": steps,
                                    "roofline_fraction": steps / roofline_steps}
        try:  # its failure must not cost the stage the figures above
            res["verify_batch1"] = verify_vs_decode(r, s["profile_steps"])
        except Exception as e:  # noqa: BLE001 - reported, not raised
            res["verify_batch1"] = {"error": f"{type(e).__name__}: {e}"}
        try:  # its failure must not cost the stage the figures above
            res["engine_batch1"] = engine_decode(r, s, roofline_steps)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            res["engine_batch1"] = {"error": f"{type(e).__name__}: {e}"}
        if name == "dense_big":  # the grammar's path is the same for every family
            try:
                res["engine_constrained"] = engine_constrained(r, ctx[name], s, roofline_steps)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                res["engine_constrained"] = {"error": f"{type(e).__name__}: {e}"}
        return res

    each_model(("dense_big", "hybrid_big"), decode, out, ctx)
    return out


def stage_compare(ctx: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode of each big model with one of its GPU kernels turned off, beside the
    decode stage's run with it: the fused norms, SiLU and rope (HELEXA_CUDA_FUSED=0), the
    hybrid's FlashInfer Gated DeltaNet decode (HELEXA_FLASHINFER_GDN=0), and FlashInfer's
    other decode kernel (batch 8 too). Last, so that a check running out of time loses
    these ratios and not the figures of the stages before."""
    if "decode" not in ctx:
        raise RuntimeError("the decode stage did not run: nothing to compare with")
    s, out = ctx["sizes"], {}
    for name, res in ctx["decode"].items():
        if not isinstance(res, dict) or "error" in res:  # a figure, or a model that failed
            continue
        roofline_steps = res["roofline_steps_per_s"]
        got: dict[str, Any] = {}
        # the same steps with the models' torch norms, SiLU and rope (cuda_fused.py's switch)
        plain = batch1_with(ctx, name, cuda_fused.ENV)["tok_s"]
        got["batch1_torch_norms"] = {"tok_s": plain, "roofline_fraction": plain / roofline_steps}
        got["fused_vs_torch_norms_batch1"] = res["batch1"]["steps_s"] / plain
        if "FlashInfer pool decode" in res["backend"]:  # the hybrid's decode on fla instead
            try:  # its failure must not cost the stage the figures above
                other = batch1_with(ctx, name, flashinfer_gdn.FI_GDN_ENV)
                other["roofline_fraction"] = other["tok_s"] / roofline_steps
                got["batch1_without_flashinfer_gdn"] = other
                got["flashinfer_gdn_vs_other_batch1"] = res["batch1"]["steps_s"] / other["tok_s"]
            except Exception as e:  # noqa: BLE001 - reported, not raised
                got["batch1_without_flashinfer_gdn"] = {"error": f"{type(e).__name__}: {e}"}
        if "conv1d decode Triton" in res["backend"]:  # the hybrid's conv on the torch form
            try:  # its failure must not cost the stage the figures above
                other = batch1_with(ctx, name, "HELEXA_TRITON_CONV")
                other["roofline_fraction"] = other["tok_s"] / roofline_steps
                got["batch1_torch_conv"] = other
                got["triton_conv_vs_torch_batch1"] = res["batch1"]["steps_s"] / other["tok_s"]
            except Exception as e:  # noqa: BLE001 - reported, not raised
                got["batch1_torch_conv"] = {"error": f"{type(e).__name__}: {e}"}
        if name == "dense_big":  # an int8 KV pool: the Triton decode kernel, then the torch path
            try:  # its failure must not cost the stage the figures above
                got["int8_kv"] = int8_kv_decode(ctx, name, roofline_steps)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                got["int8_kv"] = {"error": f"{type(e).__name__}: {e}"}
        group = re.search(r"GQA group (\d+)", res["backend"])
        if group and int(group[1]) in CUDA_CORE_GROUPS:  # both decode kernels serve it
            try:  # its failure must not cost the stage the figures above
                got["other_decode_kernel"] = other_decode_kernel(ctx[name], ctx["device"], s,
                                                                 roofline_steps, res)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                got["other_decode_kernel"] = {"error": f"{type(e).__name__}: {e}"}
        out[name] = got
    return out


class HostTimes:
    """Host time a decode step spends in each part of ModelRunner.execute, by timing the
    calls (wrapped on this runner's objects alone, nothing in the engine's own path): what
    a call queues on the device is not waited for, so each figure is the host's own work
    plus any wait the call makes (a blocking copy shows up in the part that makes it).
    ``read_tokens`` is the argmax and the read-back of the sampled tokens: the one wait a
    step needs, in which the host idles until the device has run the step."""

    def __init__(self, r: Runner) -> None:
        self.us: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []
        runner = r.runner
        self._wrap(runner, "_prepare", "prepare")
        self._wrap(runner.backend.attention, "plan", "attention_plan")
        if runner.linear_states is not None:
            self._wrap(runner.linear_states, "plan", "state_plan")
        self._wrap(runner.backend.executor, "run", "forward_or_replay")

    def _wrap(self, obj: Any, attr: str, part: str) -> None:
        inner = getattr(obj, attr)
        self.us[part] = 0.0
        if attr in vars(obj):  # an attribute of the object's own: put it back
            self._undo.append(lambda: setattr(obj, attr, inner))
        else:  # the class's method: drop the wrapper that shadows it
            self._undo.append(lambda: delattr(obj, attr))

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.us[part] += (time.perf_counter() - t) * 1e6

        setattr(obj, attr, timed)

    def restore(self) -> None:
        """The wrapped calls as they were (the runner is the decode stage's, held for ttft)."""
        while self._undo:
            self._undo.pop()()

    def per_step(self, r: Runner, last: list[int], steps: int) -> dict[str, float]:
        """Run ``steps`` decode steps; µs per step of each part, the read-back and the
        whole step, and what none of the parts covers (``other``)."""
        for part in self.us:
            self.us[part] = 0.0
        read, start = 0.0, time.perf_counter()
        for _ in range(steps):
            logits = r.runner.execute([r.SeqInput([x], r.lens[i], r.tables[i], True, i)
                                       for i, x in enumerate(last)])
            r.lens = [n + 1 for n in r.lens]
            t = time.perf_counter()
            last = logits.argmax(-1).tolist()
            read += time.perf_counter() - t
        wall = (time.perf_counter() - start) * 1e6
        out = {part: us / steps for part, us in self.us.items()}
        out["read_tokens"] = read * 1e6 / steps
        out["step_wall"] = wall / steps
        out["other"] = out["step_wall"] - sum(v for k, v in out.items() if k != "step_wall")
        return out


def stage_profile(ctx: dict[str, Any]) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    s, cuda_dev = ctx["sizes"], ctx["device"] == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda_dev else [])
    out: dict[str, Any] = {}

    def profiled(name: str) -> dict[str, Any]:
        r = ctx.big(name)  # the decode stage's, where it ran
        last = r.step(r.prefill([list(range(1, s["prompt"] + 1))]))
        sync(r.device)
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(s["profile_steps"]):
                last = r.step(last)
            sync(r.device)
            wall = time.perf_counter() - t
        host = HostTimes(r)  # the same steps again, outside the profiler
        try:
            host_us = host.per_step(r, last, s["decode_tokens"])
        finally:
            host.restore()  # the held runner goes on to ttft unwrapped
        events = prof.events()
        top: dict[str, list[float]] = {}
        if cuda_dev:  # device events less copies and fills: the kernels launched
            launched = [e for e in events if e.device_type == DeviceType.CUDA
                        and not e.name.startswith(("Memcpy", "Memset"))]
            kernels = len(launched)
            for e in launched:
                slot = top.setdefault(e.name[:90], [0, 0.0])
                slot[0] += 1
                slot[1] += e.time_range.elapsed_us()
            kind = "cuda kernels; cuda*Synchronize and blocking cudaMemcpy"
        else:
            kernels = sum(1 for e in events if e.name.startswith("aten::"))
            kind = "dry run: aten ops; aten::_local_scalar_dense"
        # less the check's own closing sync (inside the profiler, for the wall time)
        syncs = host_syncs(events, r.device) - (1 if cuda_dev else 0)
        per = s["profile_steps"]
        costliest = sorted(top.items(), key=lambda kv: -kv[1][1])[:12]
        return {"kernels_per_step": kernels / per, "host_syncs_per_step": syncs / per,
                "counted": kind,
                # device time the kernels take, against the step's wall time timed outside
                # the profiler (which, tracing every launch, about doubled it on the H200)
                "kernel_us_per_step": sum(v[1] for v in top.values()) / per,
                "wall_us_per_step": host_us["step_wall"],
                "profiled_wall_us_per_step": wall / per * 1e6,
                # outside the profiler: where a step's host time goes (HostTimes)
                "host_us_per_step": host_us,
                "top_kernels": [{"name": k, "per_step": v[0] / per,
                                 "us_per_step": v[1] / per} for k, v in costliest]}

    return each_model(("dense_big", "hybrid_big"), profiled, out, ctx)


def stage_ttft(ctx: dict[str, Any]) -> dict[str, Any]:
    n = ctx["sizes"]["ttft_prompt"]
    r = ctx.big("dense_big")  # the decode stage's, where it ran
    prompt = [(i * 13) % 400 + 1 for i in range(n)]
    r.prefill([prompt])  # warm: the prefill path, and the allocator at this prompt's size
    sync(r.device)
    t = time.perf_counter()
    r.prefill([prompt])
    sync(r.device)
    ttft = time.perf_counter() - t
    return {"prompt_tokens": n, "ttft_s": ttft}


def _us_per_call(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()  # warm: compiles, plans, allocations
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps * 1e6


def stage_int8g(ctx: dict[str, Any]) -> dict[str, Any]:
    """One large grouped int8 layer (Qwen3.5-27B's down projection, 5120 x 17408, groups of
    32 with zeros: GGUF Q5_K's layout; dry run 256 x 1024) at 1, 8 and 32 rows (two of the
    kernel's 16-row blocks, each reading the weight again): µs a call on
    the Triton kernel (helexa/kernels/cuda/int8g.py; its probe's verdict first), on the
    dequantised tiles, and as a bf16 F.linear of the float weight; each call's bytes read
    (int8 weight with its scales and zeros; the float weight's 2 bytes a value) as a
    fraction of the measured copy bandwidth. Dry run: the kernel through Triton's
    interpreter (main sets TRITON_INTERPRET)."""
    from helexa.kernels import quant as qk
    from helexa.kernels.cuda import int8g as ci

    dry = ctx["device"] == "cpu"
    dev = torch.device(ctx["device"])
    n, k, group = (256, 1024, 32) if dry else (5120, 17408, 32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(dev)
    sc = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).to(dev, torch.bfloat16)
    zs = (torch.randn(n, k // group, generator=gen) * 0.01).to(dev, torch.bfloat16)
    w = qk.dequantize_int8g(q, sc, zs, group).to(torch.bfloat16)
    sms = 4 if dry else torch.cuda.get_device_properties(dev).multi_processor_count
    out: dict[str, Any] = {"shape": [n, k], "group": group, "unavailable": ci.unavailable()}
    row_s = (torch.rand(n, generator=gen) * 0.02 + 1e-3).to(dev, torch.bfloat16)
    serves = not out["unavailable"]
    if not dry and serves:
        out["probe"] = ci.probe(dev, torch.bfloat16, group, True, qk.int8g_tiles, sms) or "ok"
        out["probe_row"] = ci.probe(dev, torch.bfloat16, k, False, qk.int8g_tiles, sms) or "ok"
        serves = out["probe"] == out["probe_row"] == "ok"
    bw = copy_bandwidth(dev, ctx["sizes"]["copy_mib"])
    quant_bytes = q.numel() + 2 * (sc.numel() + zs.numel())
    reps = 1 if dry else 50  # (dry: Triton's interpreter, seconds a call)
    for rows in (1, 8, 32):
        x = torch.randn(rows, k, generator=gen).to(dev, torch.bfloat16)
        paths: dict[str, tuple[Callable[[], Any], int]] = {
            "tiles": (lambda x=x: qk.int8g_tiles(x, q, sc, zs, group), quant_bytes),
            "bf16_linear": (lambda x=x: torch.nn.functional.linear(x, w), 2 * n * k),
            # per-row int8 (quantize = "int8"): torch's op against the kernel at one group
            # a row, the choice helexa/kernels/quant.py int8_linear makes on CUDA
            "row_torch_op": (lambda x=x: torch.ops.aten._weight_int8pack_mm(x, q, row_s),
                             q.numel() + 2 * n)}
        if serves:
            paths["triton"] = (lambda x=x: ci.run(x, q, sc, zs, group, sms, interpret=dry),
                               quant_bytes)
            paths["row_triton"] = (lambda x=x: ci.run(x, q, row_s[:, None], None, k, sms,
                                                      interpret=dry), q.numel() + 2 * n)
        out[f"rows{rows}"] = time_paths(paths, dev, reps, bw, (
            ("triton", "tiles"), ("triton", "bf16_linear"), ("row_triton", "row_torch_op")))
    out["int4"] = int4_rows(dev, w, reps, bw)
    out["moe"] = moe_rows(dev, reps, bw, dry)
    return out


def moe_rows(dev: torch.device, reps: int, bw: float, dry: bool) -> dict[str, Any]:
    """One MoE block's routed experts (Qwen3.5-35B-A3B's shape: 256 experts of gate/up 2 x
    512 x 2048 and down 2048 x 512, top 8, at 1 and 8 tokens; dry run 8 of 2 x 64 x 128,
    top 2, at 1 and 2): the routed kernel (helexa/kernels/cuda/moe_routed.py: each pair's expert read
    in place, two launches) against the gathered copies it replaces (each pair's expert
    copied out, then a product a pair), for bf16 stacks, grouped int8 ones (GGUF Q8_0's
    groups of 32) and, on the GPU, torch's int4 layout (Q4_K's groups of 32); each path's
    bytes the chosen experts' (time_paths: ``routed_vs_gathered`` its gain)."""
    from types import SimpleNamespace

    from helexa.kernels import moe_experts as me
    from helexa.kernels import quant as qk
    from helexa.kernels.cuda import moe_routed as mr
    from helexa.neuron.formats.gguf.experts import QuantExperts

    e, h, i, k = (8, 128, 64, 2) if dry else (256, 2048, 512, 8)
    gen = torch.Generator().manual_seed(2)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.02).to(dev, torch.bfloat16)

    stacks = {"bf16": (QuantExperts(SimpleNamespace(w13=w13, w2=w2)), 2)}
    parts = {}  # random values, as stage_int8g's layer: the timings read bytes, not them
    for which, w in (("w13", w13), ("w2", w2)):
        parts[f"{which}_qweight"] = torch.randint(-128, 128, w.shape, generator=gen,
                                                  dtype=torch.int8).to(dev)
        parts[f"{which}_qscales"] = (torch.rand(*w.shape[:2], w.shape[2] // 32, generator=gen)
                                     * 0.02 + 1e-3).to(dev, torch.bfloat16)
    quant = QuantExperts(SimpleNamespace(**parts))
    quant.ops = {"w13": ("int8", 32, 2 * i), "w2": ("int8", 32, h)}
    stacks["int8"] = (quant, 1 + 2 / 32)
    if not dry:  # torch's CUDA int4 layout (its packing runs on the card only)
        q4 = {}
        for which, w in (("w13", w13), ("w2", w2)):
            inner = qk.cuda_inner_k_tiles(w.shape[-1])
            q = torch.randint(0, 16, w.shape, generator=gen).to(dev)
            sz = torch.rand(e, w.shape[-1] // 32, w.shape[1], 2, generator=gen) * 0.01
            q4[f"{which}_qweight"] = torch.stack([qk.int4_pack_cuda(q[j], inner)
                                                  for j in range(e)])
            q4[f"{which}_qscales_zeros"] = sz.to(dev, torch.bfloat16)
        quant4 = QuantExperts(SimpleNamespace(**q4))
        quant4.ops = {"w13": ("int4", 32, 2 * i), "w2": ("int4", 32, h)}
        stacks["int4"] = (quant4, 0.5 + 4 / 32)
    got: dict[str, Any] = {"shape": {"experts": e, "hidden": h, "inter": i, "top_k": k}}
    for name, (kernel, bytes_per_value) in stacks.items():
        kernel.routed = {w: kernel.routed_stack(w) for w in ("w13", "w2")}
        for tokens in (1, 2) if dry else (1, 8):
            chosen = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
            chosen = chosen.to(dev)
            x = torch.randn(tokens, h, generator=gen).to(dev, torch.bfloat16)
            weights = torch.rand(tokens, k, generator=gen).to(dev, torch.bfloat16)
            nbytes = int(tokens * k * 3 * i * h * bytes_per_value)
            routed = dict(kernel.routed)

            def gathered(kernel: Any = kernel, x: Any = x, chosen: Any = chosen,
                         weights: Any = weights, routed: Any = routed) -> Any:
                if not kernel.ops:  # float stacks: run_experts' gathered form
                    return me.experts_gathered(x, w13, w2, chosen, weights)
                kernel.routed = {}  # the quantised stacks' copies' form
                try:
                    return me.quantised_gathered(x, kernel, chosen, weights)
                finally:
                    kernel.routed = routed

            got[f"{name}_tokens{tokens}"] = time_paths({
                "routed": (lambda kernel=kernel, x=x, chosen=chosen, weights=weights:
                           mr.experts(x, chosen, weights, kernel.routed["w13"],
                                      kernel.routed["w2"]), nbytes),
                "gathered": (gathered, nbytes)}, dev, reps, bw, (("routed", "gathered"),))
    return got


def time_paths(paths: dict[str, tuple[Callable[[], Any], int]], dev: torch.device, reps: int,
               bw: float, pairs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Each path's µs a call and the fraction of copy bandwidth its bytes make (a path
    that raises: its error, the others' figures kept), and for each (a, b) of ``pairs``
    ``a_vs_b``: b's µs over a's (above 1, a is the faster)."""
    got: dict[str, Any] = {}
    for name, (fn, nbytes) in paths.items():
        try:
            us = _us_per_call(fn, dev, reps)
            got[name] = {"us": us, "bandwidth_fraction": nbytes / (us * 1e-6) / bw}
        except Exception as e:  # noqa: BLE001 - reported, not raised
            got[name] = {"error": f"{type(e).__name__}: {e}"}
    for a, b in pairs:
        if "us" in got.get(a, {}) and "us" in got.get(b, {}):
            got[f"{a}_vs_{b}"] = got[b]["us"] / got[a]["us"]
    return got


def int4_rows(dev: torch.device, w: torch.Tensor, reps: int, bw: float) -> dict[str, Any]:
    """The same weight quantised to int4 (groups of 128), at a decode step's rows and a
    prefill chunk's (512): helexa's int4 product (``helexa``: torch's op, tinygemm, up to
    64 rows; beyond, the weight dequantised in tiles onto cuBLAS where its probe agreed,
    helexa/kernels/cuda/int4_tiles.py), torch's op alone (``torch_op``: it reads its inputs
    again for each tile of outputs) and the bf16 F.linear (time_paths)."""
    from helexa.kernels import quant as qk
    from helexa.neuron.formats.quantise import quantize_int4

    n, k = w.shape
    q, sc, zs = quantize_int4(w, 128, torch.bfloat16)
    packed, sz = qk.int4_pack(q), qk.int4_scales_zeros(sc, zs, torch.bfloat16)
    raw = (torch.ops.aten._weight_int4pack_mm if dev.type == "cuda"
           else torch.ops.aten._weight_int4pack_mm_for_cpu)
    gen = torch.Generator().manual_seed(1)
    quant_bytes = n * k // 2 + sz.numel() * sz.element_size()
    got: dict[str, Any] = {}
    for rows in (1, 8, 512):
        x = torch.randn(rows, k, generator=gen).to(dev, torch.bfloat16)
        got[f"rows{rows}"] = time_paths({
            "helexa": (lambda x=x: qk.int4_linear(x, packed, 128, n, sz, None), quant_bytes),
            "torch_op": (lambda x=x: raw(x, packed, 128, sz), quant_bytes),
            "bf16_linear": (lambda x=x: torch.nn.functional.linear(x, w), 2 * n * k)},
            dev, reps, bw, (("helexa", "torch_op"), ("helexa", "bf16_linear"),
                            ("torch_op", "bf16_linear")))
    return got


class Models(dict):  # type: ignore[type-arg]
    """The stages' context: a checkpoint by name (``ctx["dense_big"]``) is made the first
    time a stage asks for it, inside that stage's error handling, so a stage needing no big
    model never waits for one and a disk too small fails the stage that needed it, not the
    run."""

    def __init__(self, root: Path, specs: dict[str, tuple[str, dict[str, Any], str]],
                 **items: Any) -> None:
        super().__init__(**items)
        self.root, self.specs, self.made_s = root, specs, {}
        self.held: dict[str, Runner] = {}

    def big(self, name: str) -> Runner:
        """The runner of big checkpoint ``name`` that the decode, profile and ttft stages
        share (HELD_BY), loaded the first time one asks: 8 streams of the ttft prompt's
        length, so each stage's streams fit. A 16 GB model loads and captures its graphs
        once for the three, not once each; both big models stay on the card (about 40 GB
        with their pools) until a stage outside HELD_BY starts (release)."""
        if name not in self.held:
            s = self["sizes"]
            tokens = max(s["ttft_prompt"], s["prompt"] + s["profile_steps"]
                         + s["decode_tokens"]) + 8
            self.held[name] = Runner(self[name], self["device"], 8, tokens)
        return self.held[name]

    def drop(self, name: str) -> None:
        """Close ``name``'s held runner, if any (a measurement on it failed: the next stage
        loads it afresh)."""
        if (r := self.held.pop(name, None)) is not None:
            r.close()

    def release(self) -> None:
        for name in list(self.held):
            self.drop(name)

    def __missing__(self, name: str) -> Path:
        if name not in self.specs:
            raise KeyError(name)
        arch, shape, device = self.specs[name]
        t = time.perf_counter()
        self[name] = path = make_model(self.root, name, arch, shape, device)
        self.made_s[name] = time.perf_counter() - t
        return path


# the checkpoints a whole run makes, on disk at once: the two big ones (16.4 GB each in
# bf16) and the small ones, with room to spare
SCRATCH_BYTES = 40 * 10**9


def scratch_folder(need: int, candidates: list[str] | None = None) -> tuple[str, dict[str, Any]]:
    """Where the run makes its checkpoints: HELEXA_CHECK_SCRATCH where set; else the
    temporary folder where ``need`` bytes fit there, or else the candidate (memory-backed
    /dev/shm) with the most room that holds them, so a machine whose disk is short of the
    big checkpoints still measures them; and what was found, for the env stage."""
    import shutil

    if chosen := os.environ.get("HELEXA_CHECK_SCRATCH"):
        return chosen, {"path": chosen, "why": "HELEXA_CHECK_SCRATCH"}
    default = tempfile.gettempdir()
    free: dict[str, int] = {}
    for path in [default, *(candidates if candidates is not None else ["/dev/shm"])]:
        try:
            if os.access(path, os.W_OK):
                free[path] = shutil.disk_usage(path).free
        except OSError:
            continue
    gb = {p: round(f / 1e9, 1) for p, f in free.items()}
    if free.get(default, 0) >= need or not free:
        return default, {"path": default, "free_gb": gb, "why": "the temporary folder"}
    best = max(free, key=lambda p: free[p])
    why = (f"{default} has {gb.get(default, 0)} GB free, {need / 1e9:.0f} GB wanted"
           if free[best] >= need and best != default else "no folder holds it: the largest")
    return best, {"path": best, "free_gb": gb, "why": why}


def run(dry: bool, out_path: Path, budget_secs: float,
        stages: tuple[str, ...] = STAGES, decode_from: Path | None = None) -> dict[str, Any]:
    global progress
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible to torch (use --dry-run on CPU)")
    report: dict[str, Any] = {"dry_run": dry, "stages": {}}
    LOADS.clear()
    start = time.perf_counter()
    where, scratch = scratch_folder(0 if dry else SCRATCH_BYTES)
    with tempfile.TemporaryDirectory(prefix="helexa-gpu-check-", dir=where) as tmp:
        s = sizes(dry)
        specs = {"dense": ("qwen3", s["small"], "cpu"), "hybrid": ("qwen3_5", s["small"], "cpu"),
                 "hybrid_mtp": ("qwen3_5", dict(s["small"], mtp=True), "cpu"),
                 "vision": ("qwen3_5", dict(s["small"], vision=True), "cpu"),
                 "dense_big": ("qwen3", s["big"], device),
                 "hybrid_big": ("qwen3_5", s["hybrid_big"], device)}
        ctx = Models(Path(tmp), specs, device=device, sizes=s, scratch=scratch)
        if decode_from is not None and "decode" not in stages:  # beside a first run's figures
            ctx["decode"] = json.loads(decode_from.read_text())["stages"]["decode"]
        fns: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "env": stage_env, "compile": stage_compile, "parity": stage_parity,
            "decode": stage_decode, "profile": stage_profile, "ttft": stage_ttft,
            "spec_vision": stage_spec_vision, "compare": stage_compare, "int8g": stage_int8g,
            "widen": lambda ctx: stage_widen(ctx, lambda partial: progress(partial))}
        try:
            for name in stages:
                if name not in HELD_BY:  # the big models' shared runners off the card
                    ctx.release()
                    free_device()
                at = time.perf_counter() - start
                if at > budget_secs:
                    report["stages"][name] = {"ok": False, "error": "skipped: over the time budget"}
                    continue
                # on record before it runs: a stage the time bound kills says so in the report
                report["stages"][name] = {"ok": False, "error": f"started {at:.0f} s into the run "
                                          "and never finished (killed at the time bound?)"}
                out_path.write_text(json.dumps(report, indent=2, default=str))

                def on_record(partial: dict[str, Any], name: str = name) -> None:
                    report["stages"][name]["partial"] = partial
                    out_path.write_text(json.dumps(report, indent=2, default=str))

                progress = on_record
                t, loaded = time.perf_counter(), {k: len(v) for k, v in LOADS.items()}
                try:
                    got = fns[name](ctx)
                    result = {"ok": not got.get("failed"), **got}
                except Exception as e:  # noqa: BLE001 - one failing stage leaves the others
                    result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                              "trace": traceback.format_exc(limit=6)}
                free_device()
                result["secs"] = time.perf_counter() - t
                report["stages"][name] = result
                # beside, not in, the stage's result: compare reads decode's dicts as models
                report.setdefault("stage_loads", {})[name] = {
                    k: len(v) - loaded.get(k, 0) for k, v in LOADS.items()
                    if len(v) > loaded.get(k, 0)}
                report["models_s"] = ctx.made_s  # each checkpoint's making, in its first stage
                report["loads_s"] = LOADS  # each runner's load, by checkpoint
                print(f"== {name}: {json.dumps(result, default=str)[:2000]}", flush=True)
                # after every stage: a run cut short by its time limit still leaves its figures
                out_path.write_text(json.dumps(report, indent=2, default=str))
        finally:
            ctx.release()  # the last stage may have been one of HELD_BY
    progress = lambda partial: None  # noqa: E731
    report["secs"] = time.perf_counter() - start
    out_path.write_text(json.dumps(report, indent=2, default=str))
    return report


def exit_on_sigterm() -> None:
    """The time bound's SIGTERM (gpu_check.sh's timeout) as an exit: the checkpoints'
    temporary folder (tens of GB at whole-model sizes, which a second run on the same disk
    would need again) is removed, and the report keeps what each stage put on record."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every stage on CPU, small sizes")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--budget-secs", type=float, default=420.0,
                    help="stages not started by then are skipped (the script's limit is 8 min)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="a comma-separated subset, run in the usual order (compare needs decode,"
                         " or --decode-from): a second run for the stages a first one left")
    ap.add_argument("--decode-from", type=Path,
                    help="a first run's report, whose decode figures compare measures beside")
    args = ap.parse_args(argv)
    if args.dry_run:  # the int8g stage's Triton kernel on CPU: chosen before Triton's import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    wanted = args.stages.split(",")
    if unknown := [x for x in wanted if x not in STAGES]:
        ap.error(f"unknown stage(s) {', '.join(unknown)}: the stages are {', '.join(STAGES)}")
    if "compare" in wanted and "decode" not in wanted and args.decode_from is None:
        ap.error("the compare stage measures beside the decode stage's figures: add decode, "
                 "or --decode-from a first run's report")
    if args.decode_from is not None and "decode" not in wanted:
        try:
            json.loads(args.decode_from.read_text())["stages"]["decode"]["dense_big"]
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--decode-from {args.decode_from}: no decode figures there "
                     f"({type(e).__name__}: {e})")
    stages = tuple(x for x in STAGES if x in wanted)
    exit_on_sigterm()
    report = run(args.dry_run, args.out, args.budget_secs, stages, args.decode_from)
    failed = [k for k, v in report["stages"].items() if not v["ok"]]
    print(f"gpu_check: {len(stages) - len(failed)}/{len(stages)} stages ok"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''}; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
