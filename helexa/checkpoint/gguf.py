"""GGUF checkpoints (torch-free): where the file is, its metadata, and the model's config.

A model ``path`` may be a ``.gguf`` file or a folder holding exactly one (and no
safetensors; llama.cpp's ``mmproj*.gguf`` vision tower beside it is not the model, it
adds the tower to the config: mmproj.py). Hugging Face files beside it win: ``config.json`` over the GGUF
metadata, ``tokenizer.json`` over ``tokenizer.ggml.*`` (docs/quantization.md).
Which op each tensor runs on, and its bytes, is gguf_layout.py (it reads this
module, never the other way round); the neuron's loading is helexa/neuron/formats/gguf/.

The hybrid and MoE families (llama.cpp's ``qwen3moe``, ``qwen3next``, ``qwen35``,
``qwen35moe``: HybridForCausalLM) write the Gated DeltaNet shape as ``ssm.*`` keys:
``ssm.group_count`` = linear key heads, ``ssm.time_step_rank`` = linear value heads,
``ssm.state_size`` = key head dim, ``ssm.inner_size`` = value heads x value head dim,
``ssm.conv_kernel``; ``rope.dimension_count`` the rotated dims of a head (partial
rotary); ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length`` the experts; ``rope.dimension_sections`` M-RoPE's
sections (what image tokens rotate by, with the mmproj's tower: mmproj.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
# llama.cpp's architecture name -> the transformers one our loader builds.
DENSE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's architecture name -> (the transformers class our loader builds, model_type)
HYBRID_ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
ARCHITECTURES = {**DENSE_ARCHITECTURES,
                 **{k: cls for k, (cls, _) in HYBRID_ARCHITECTURES.items()}}


class GgufError(ValueError):
    """A GGUF file (or folder) this loader cannot serve; the message says what is wrong."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file of a model path: the path itself, or the one ``.gguf`` in a folder
    without safetensors; None for a safetensors checkpoint."""
    p = Path(path)
    if p.suffix == GGUF_SUFFIX:
        if not p.is_file():
            raise GgufError(f"{p}: no such GGUF file")
        if p.name.startswith("mmproj"):
            raise GgufError(f"{p}: an mmproj file holds a vision tower, not a model: give the "
                            "model's GGUF (the mmproj beside it loads with it)")
        return p
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    # a vision tower's mmproj*.gguf beside the model is not the model (mmproj.py)
    found = sorted(f for f in p.glob(f"*{GGUF_SUFFIX}") if not f.name.startswith("mmproj"))
    if len(found) > 1:
        raise GgufError(f"{p}: {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                        "give the model's path as the one to serve")
    return found[0] if found else None


def model_path_error(path: str | Path) -> str | None:
    """Why ``path`` is not a model to load (neither a checkpoint folder nor a GGUF file),
    or None when it is one."""
    try:
        gguf = find_gguf(path)
    except GgufError as e:
        return str(e)
    if gguf is None and not (Path(path) / "config.json").exists():
        return f"{path}: no config.json (expected a checkpoint folder or a .gguf file)"
    return None


def model_folder(path: str | Path) -> Path:
    """Where a model's side files (config.json, tokenizer.json) are: the folder itself,
    or the folder of a ``.gguf`` file."""
    p = Path(path)
    return p.parent if p.suffix == GGUF_SUFFIX else p


# The fewest bytes one metadata entry (key length + 1 byte of key + type + 1 byte of value)
# and one tensor record (name length + 1 byte + dims count + 1 dim + type + offset) take.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8


def check_header(path: Path) -> None:
    """Raise GgufError naming the field when the header's counts cannot fit in the file: a
    corrupt count made the reader allocate and walk for minutes, then die in a traceback."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise GgufError(f"{path.name}: not a GGUF file (no GGUF header in its first 24 bytes)")
    order = "big" if int.from_bytes(head[4:8], "little") & 0xFFFF == 0 else "little"
    tensors, kvs = (int.from_bytes(head[8:16], order), int.from_bytes(head[16:24], order))
    for field, count, each in (("tensor_count", tensors, _MIN_TENSOR_BYTES),
                               ("metadata_kv_count", kvs, _MIN_KV_BYTES)):
        if 24 + count * each > size:
            raise GgufError(f"{path.name}: corrupt header: {field} {count:,} cannot fit in a "
                            f"file of {size:,} bytes")


@lru_cache(maxsize=4)
def reader(path: Path) -> Any:
    """The file's GGUFReader (memory-mapped: opening reads only the header); GgufError in
    one line for a file whose header is corrupt."""
    from gguf import GGUFReader

    check_header(path)
    try:
        return GGUFReader(path)
    except Exception as e:  # a length or offset past the end, a bad type: the reader's own
        raise GgufError(f"{path.name}: corrupt GGUF header ({type(e).__name__}: {e})") from None


def metadata(path: Path, key: str, default: Any = None) -> Any:
    field = reader(path).get_field(key)
    return default if field is None else field.contents()


def tensor_types(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type name, [rows, cols] as torch orders them)."""
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in reader(path).tensors}


def type_summary(path: Path) -> str:
    """The file's weight types, most common first (for `helexa plan`): "Q4_K, Q6_K, F32"."""
    counts: dict[str, int] = {}
    for typ, _ in tensor_types(path).values():
        counts[typ] = counts.get(typ, 0) + 1
    return ", ".join(sorted(counts, key=lambda t: -counts[t]))


def read_config(path: str | Path) -> dict[str, Any]:
    """The model's config.json dict: the HF file beside the GGUF when there is one,
    else built from the GGUF metadata; with an mmproj beside a GGUF model, the
    multimodal wrapper's, its tower from the mmproj (mmproj.py)."""
    from helexa.checkpoint.mmproj import find_mmproj, with_tower

    beside = model_folder(path) / "config.json"
    gguf = find_gguf(path)
    if beside.is_file():
        raw = json.loads(beside.read_text())
    elif gguf is None:
        raise GgufError(f"{path}: no config.json and no GGUF file")
    else:
        raw = config_from_metadata(gguf)
    mmproj = find_mmproj(gguf) if gguf is not None else None
    return raw if mmproj is None else with_tower(raw, Path(path), gguf, mmproj)


def config_from_metadata(path: Path) -> dict[str, Any]:
    """A transformers-style config.json dict from ``<arch>.*`` metadata."""
    arch = metadata(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path.name}: general.architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = metadata(path, f"{arch}.{name}", default)
        if value is None:
            raise GgufError(f"{path.name}: metadata {arch}.{name} is missing")
        return value

    tensors = tensor_types(path)
    scaling = metadata(path, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in tensors:
        raise GgufError(f"{path.name}: rope scaling {scaling!r} (or rope_freqs) is not read from "
                        "GGUF metadata: put the model's config.json beside the file")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv = metadata(path, f"{arch}.attention.head_count_kv", heads)
    head_dim = int(metadata(path, f"{arch}.attention.key_length", hidden // heads))
    hybrid = arch in HYBRID_ARCHITECTURES
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": HYBRID_ARCHITECTURES[arch][1] if hybrid else arch,
        "hidden_size": hidden, "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,  # a per-layer list has 0 for linear-attention layers
        "num_key_value_heads": int(kv if not isinstance(kv, list) else max(kv)),
        "head_dim": head_dim,
        "intermediate_size": int(metadata(path, f"{arch}.feed_forward_length", 0)
                                 if hybrid else key("feed_forward_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(metadata(path, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": tensors["token_embd.weight"][1][0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if hybrid:
        cfg.update(_family_config(arch, key,
                                  lambda name, default=None: metadata(path, f"{arch}.{name}", default),
                                  tensors, head_dim))
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear",
                               "factor": float(key("rope.scaling.factor"))}
    for name in ("bos", "eos"):
        token = metadata(path, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            cfg[f"{name}_token_id"] = int(token)
    return cfg


def _f32(value: float) -> float:
    """GGUF keeps floats as float32: 1e-6 reads back as 9.99999997e-07; its shortest
    float32 spelling is the number the converter was given."""
    import numpy as np

    return float(str(np.float32(value)))


def _family_config(arch: str, key: Callable[..., Any], meta: Callable[..., Any],
                   tensors: dict[str, tuple[str, tuple[int, ...]]], head_dim: int) -> dict[str, Any]:
    """The hybrid / MoE keys of a config.json dict, from ``<arch>.*`` metadata and the
    tensors present (which layers are linear attention, which have experts)."""
    layers = int(key("block_count"))
    cfg: dict[str, Any] = {}
    if arch != "qwen3moe":  # Gated DeltaNet layers: those with an ssm_a tensor
        vh = int(key("ssm.time_step_rank"))
        cfg.update(
            layer_types=["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention"
                         for i in range(layers)],
            full_attention_interval=int(meta("full_attention_interval", 4)),
            linear_num_key_heads=int(key("ssm.group_count")), linear_num_value_heads=vh,
            linear_key_head_dim=int(key("ssm.state_size")),
            linear_value_head_dim=int(key("ssm.inner_size")) // vh,
            linear_conv_kernel_dim=int(key("ssm.conv_kernel")), attn_output_gate=True)
        rotary = meta("rope.dimension_count")
        if rotary and int(rotary) != head_dim:
            cfg["partial_rotary_factor"] = int(rotary) / head_dim
        sections = meta("rope.dimension_sections")  # M-RoPE's (t, h, w) split, then a 0
        if sections and any(sections):
            cfg["rope_parameters"] = {"rope_theta": _f32(meta("rope.freq_base", 10000.0)),
                                      "mrope_section": [int(x) for x in sections[:3]]}
    experts = meta("expert_count")
    if experts:
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")),
                   # llama.cpp renormalises the top k for all four families
                   norm_topk_prob=bool(meta("expert_weights_norm", True)),
                   decoder_sparse_step=1, mlp_only_layers=dense)
        shared = meta("expert_shared_feed_forward_length")
        if shared is None:
            shared = next((shape[0] for name, (_, shape) in tensors.items()
                           if name.endswith("ffn_up_shexp.weight")), 0)
        if shared:
            cfg["shared_expert_intermediate_size"] = int(shared)
    return cfg
