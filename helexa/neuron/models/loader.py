"""Load a Hugging Face checkpoint folder into our model, streaming tensor by tensor.

Parameters are allocated once at their final (per-rank) size and dtype; each
checkpoint tensor is then opened lazily with ``safe_open(...).get_slice`` and
handed to its parameter's ``weight_loader``, which reads only this rank's
rows or columns. Peak memory is therefore about the model's size plus one
tensor, never twice the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from helexa.checkpoint.gguf import ARCHITECTURES as _GGUF_ARCHS
from helexa.checkpoint.gguf import find_gguf
from helexa.checkpoint.gguf import reader as gguf_reader
from helexa.neuron.models.config import (
    ModelConfig,
    UnsupportedArchitecture,
    load_model_config,
    parse_dtype,
)
from helexa.neuron.models.hybrid import HybridForCausalLM
from helexa.neuron.models.llama import LlamaForCausalLM
from helexa.neuron.models.quant import QuantSpec, attach, quantize_model
from helexa.neuron.models.quant_ct import UnsupportedQuantization, attach_ct, parse_ct_config
from helexa.neuron.models.quant_gguf import attach_gguf, load_gguf_weights, share_tied_head
from helexa.neuron.models.quant_gptq import attach_gptq, parse_awq_config, parse_gptq_config

# progress(loaded_bytes, total_bytes), called after each tensor.
ProgressFn = Callable[[int, int], None]

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": HybridForCausalLM,
    "Qwen3NextForCausalLM": HybridForCausalLM,
    "Qwen3_5ForCausalLM": HybridForCausalLM,
    "Qwen3_5ForConditionalGeneration": HybridForCausalLM,
    "Qwen3_5MoeForCausalLM": HybridForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": HybridForCausalLM,
}

# A config.json beside a Qwen3.5 GGUF names the multimodal wrapper: its text model loads.
GGUF_ARCHITECTURES = (*_GGUF_ARCHS.values(), "Qwen3_5ForConditionalGeneration",
                      "Qwen3_5MoeForConditionalGeneration")

# Checkpoint tensors that carry no weights we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".weight_shape")  # shape: the layer knows its own


class MissingTensor(Exception):
    """A tensor the model needs is not in the checkpoint."""


def resolve_dtype(cfg: ModelConfig, dtype: str | torch.dtype) -> torch.dtype:
    """"auto" means the checkpoint's own dtype (config torch_dtype / dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(cfg.torch_dtype if dtype == "auto" else dtype)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files: from model.safetensors.index.json when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise MissingTensor(f"{model_dir}: shard files listed in {index.name} are missing: {missing}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise MissingTensor(f"{model_dir}: no *.safetensors weights (only safetensors are supported)")
    return found


def _target(name: str, model: nn.Module, params: dict[str, nn.Parameter]):
    """Map a checkpoint tensor name to (our parameter name, shard id); a model with its
    own ``checkpoint_map`` (the hybrid families) decides, and may say skip (None) or
    keep whole in ``extra_tensors`` ("")."""
    mapper = getattr(model, "checkpoint_map", None)
    if mapper is not None:
        return mapper(name)
    packed = getattr(model, "packed_modules", {})
    for src, (dst, shard) in packed.items():
        token = f".{src}."
        if token in name:
            return name.replace(token, f".{dst}."), shard
    return name, None


def expected_tensors(model: nn.Module, *, tie_word_embeddings: bool) -> dict[tuple[str, object], str]:
    """Every (parameter, shard) loading must fill, and the checkpoint name that fills it."""
    own = getattr(model, "expected_shards", None)
    if own is not None:
        return own()
    params = dict(model.named_parameters(remove_duplicate=False))
    expected: dict[tuple[str, object], str] = {}
    packed = getattr(model, "packed_modules", {})
    for pname in params:
        if tie_word_embeddings and pname == "lm_head.weight":
            continue
        shards = [(src, shard) for src, (dst, shard) in packed.items() if f".{dst}." in pname]
        if shards:
            for src, shard in shards:
                dst = packed[src][0]
                expected[(pname, shard)] = pname.replace(f".{dst}.", f".{src}.")
        else:
            expected[(pname, None)] = pname
    return expected


def check_loaded(expected: dict[tuple[str, object], str], loaded: set[tuple[str, object]]) -> None:
    missing = [ckpt for key, ckpt in expected.items() if key not in loaded]
    if missing:
        raise MissingTensor(
            f"checkpoint is missing {len(missing)} tensor(s): {', '.join(sorted(missing)[:8])}"
            + (" …" if len(missing) > 8 else "")
        )


def load_weights(model: nn.Module, files: list[Path], *, tie_word_embeddings: bool,
                 progress: ProgressFn | None = None) -> None:
    """Stream every checkpoint tensor into its parameter; MissingTensor if any is absent."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = expected_tensors(model, tie_word_embeddings=tie_word_embeddings)
    total = sum(_tensor_bytes(f) for f in files)
    done_bytes = 0
    loaded: set[tuple[str, object]] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if tie_word_embeddings and name == "lm_head.weight":
                    continue  # tied: the embedding is the head
                target = _target(name, model, params)
                if target is None:
                    continue
                pname, shard = target
                if pname == "":  # kept whole, unsharded (multi-token-prediction weights)
                    model.extra_tensors[name] = f.get_tensor(name)
                    continue
                param = params.get(pname)
                if param is None:
                    raise UnsupportedArchitecture(f"{path.name}: unexpected tensor {name!r}")
                sl = f.get_slice(name)
                with torch.no_grad():
                    param.weight_loader(param, sl, shard)
                loaded.add((pname, shard))
                done_bytes += _slice_bytes(sl)
                if progress is not None:
                    progress(min(done_bytes, total), total)
    check_loaded(expected, loaded)


def load_gguf(model: nn.Module, path: Path, dtype: torch.dtype,
              progress: ProgressFn | None = None) -> None:
    """Load a GGUF file's weights (helexa/neuron/models/quant_gguf.py): quantised layers keep
    the file's values in their op's layout, float ones load as they are."""
    attach_gguf(model, path, dtype)
    expected = _gguf_expected(model, expected_tensors(
        model, tie_word_embeddings=model.cfg.tie_word_embeddings))
    total = sum(int(t.n_bytes) for t in gguf_reader(path).tensors)
    done = [0]
    loaded: set[tuple[str, object]] = set()

    def on_loaded(name: str | None, key: tuple[str, object] | None, nbytes: int) -> None:
        if key is not None:
            loaded.add(key)
        done[0] += nbytes
        if nbytes and progress is not None:
            progress(min(done[0], total), total)

    load_gguf_weights(model, path, on_loaded=on_loaded)
    check_loaded(expected, loaded)


def _gguf_expected(model: nn.Module, expected: dict[tuple[str, object], str]
                   ) -> dict[tuple[str, object], str]:
    """What a GGUF file must fill of ``expected``: a quantised layer's (or expert stack's)
    unpacked parts in place of its weight; Qwen3-Next's in_proj_qkvz as the attn_qkv and
    attn_gate the file holds."""
    out: dict[tuple[str, object], str] = {}
    for (pname, shard), ckpt in expected.items():
        keys = [(pname, shard, ckpt)]
        if shard == "qkvz":
            keys = [(pname, "qkv", ckpt.replace("qkvz", "qkv")),
                    (pname, "z", ckpt.replace("qkvz", "z"))]
        mod_name, attr = pname.rsplit(".", 1)
        prefix = "gguf_" if attr == "weight" else f"gguf_{attr}_"  # a layer, or an expert stack
        parts = [c for c in model.get_submodule(mod_name)._parameters if c.startswith(prefix)
                 and (attr != "weight" or c.count("_") == 1)]
        if parts:
            keys = [(f"{mod_name}.{c}", s, n) for _, s, n in keys for c in parts]
        out.update({(p, s): n for p, s, n in keys})
    return out


def _slice_bytes(sl) -> int:
    numel = 1
    for dim in sl.get_shape():
        numel *= dim
    return numel * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4}.get(sl.get_dtype(), 1)


def _tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in one safetensors file (headers only are read)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return sum(_slice_bytes(f.get_slice(name)) for name in f.keys())


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto",
               tp_rank: int = 0, tp_size: int = 1, progress: ProgressFn | None = None,
               quantize: QuantSpec | None = None) -> nn.Module:
    """Build the model for ``model_dir`` and load this rank's weights; ``quantize``
    quantises them at load (helexa/neuron/models/quant.py)."""
    model_dir = Path(model_dir)
    raw, cfg = load_model_config(model_dir)
    gguf = find_gguf(model_dir)
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitecture(f"architecture {cfg.architecture!r} is not supported")
    torch_dtype = resolve_dtype(cfg, dtype)
    files = checkpoint_files(model_dir) if gguf is None else []
    with torch.device(device):
        model = cls(cfg, tp_rank=tp_rank, tp_size=tp_size, dtype=torch_dtype, device=device)
    qc = raw.get("quantization_config")
    if gguf is not None:  # quantised (or not) in the file, tensor by tensor
        if quantize is not None and quantize.kind != "none":
            raise UnsupportedQuantization(f"{gguf}: a GGUF file keeps its own quantisation; "
                                          f"quantize = {quantize.kind!r} applies to float "
                                          "safetensors checkpoints")
        if cfg.architecture not in GGUF_ARCHITECTURES:
            raise UnsupportedArchitecture(f"{gguf}: GGUF loads the architectures "
                                          f"{', '.join(GGUF_ARCHITECTURES)}, "
                                          f"not {cfg.architecture}")
        load_gguf(model, gguf, torch_dtype, progress)
        quantize_model(model)
        share_tied_head(model)
        model.finalize()
        model.eval()
        return model
    if qc and getattr(model, "mtp", None) is not None:
        # the file's quantisation scheme may or may not cover mtp.*: kept aside, not run
        model.mtp = None
    if qc:  # weights quantised in the checkpoint
        method = qc.get("quant_method")
        if method not in ("compressed-tensors", "gptq", "awq"):
            raise UnsupportedQuantization(
                f"{model_dir}: quantization_config.quant_method {method!r} is not supported "
                "(compressed-tensors pack-quantized, gptq and awq are)")
        if quantize is not None and quantize.kind != "none":
            raise UnsupportedQuantization(f"{model_dir}: already quantised ({method}); "
                                          f"quantize = {quantize.kind!r} applies to float checkpoints")
        if method in ("gptq", "awq"):
            attach_gptq(model, (parse_gptq_config if method == "gptq" else parse_awq_config)(qc))
        else:
            attach_ct(model, parse_ct_config(qc))
    elif quantize is not None:
        attach(model, quantize)
    load_weights(model, files, tie_word_embeddings=cfg.tie_word_embeddings, progress=progress)
    quantize_model(model)  # before finalize: what is quantised is the checkpoint's weight
    model.finalize()
    model.eval()
    return model
