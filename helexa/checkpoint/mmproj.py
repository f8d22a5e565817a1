"""llama.cpp's ``mmproj`` GGUF (a model's vision tower in a file of its own), torch-free.

llama.cpp serves a vision-language GGUF as two files: the text model and, beside it,
``mmproj*.gguf`` (convert_hf_to_gguf.py ``--mmproj``; for Qwen3.5 and Qwen3-VL its
Qwen3VLVisionModel). :func:`find_mmproj` finds that file beside a model (or takes the one
named); :func:`vision_config` reads its ``clip.*`` metadata back into config.json's
``vision_config`` and checks the tensors against it; :func:`processor_config` gives the
preprocessor_config.json keys it carries (``clip.vision.image_mean`` / ``image_std``,
patch and merge sizes, and the pixel bounds where the converter wrote them: the Qwen3-VL
converter does not, so transformers' Qwen2VLImageProcessor defaults apply). The tensor
names and layouts are helexa/neuron/formats/gguf/mmproj.py's.

Only the Qwen3-VL merger (``clip.projector_type = qwen3vl_merger``) without deepstack
layers is our tower (helexa/neuron/models/vision.py); any other mmproj is refused naming
the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helexa.checkpoint.gguf import GGUF_SUFFIX, GgufError, metadata, reader, tensor_types

MMPROJ_PREFIX = "mmproj"  # llama.cpp's name: mmproj-<model>-<type>.gguf
PROJECTOR = "qwen3vl_merger"
# The markers of Qwen3.5's chat template (the processor's), by config.json's key.
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>"}


def is_mmproj(path: Path) -> bool:
    return path.suffix == GGUF_SUFFIX and path.name.startswith(MMPROJ_PREFIX)


def find_mmproj(model_path: str | Path, named: str | Path | None = None) -> Path | None:
    """The mmproj of a GGUF model: ``named`` when given, else the one ``mmproj*.gguf`` in
    the model's folder (None when there is none); two there are refused, naming them."""
    if named:
        p = Path(named)
        if not p.is_file():
            raise GgufError(f"{p}: no such mmproj file")
        return p
    p = Path(model_path)
    folder = p.parent if p.suffix == GGUF_SUFFIX else p
    found = sorted(f for f in folder.glob(f"{MMPROJ_PREFIX}*{GGUF_SUFFIX}") if f != p)
    if len(found) > 1:
        raise GgufError(f"{folder}: {len(found)} mmproj files ({', '.join(f.name for f in found)}); "
                        "name the one to serve with --mmproj")
    return found[0] if found else None


def _field(path: Path, key: str) -> Any:
    value = metadata(path, key)
    if value is None:
        raise GgufError(f"{path}: metadata {key} is missing")
    return value


def _expect(path: Path, field: str, got: Any, want: Any) -> None:
    if got != want:
        raise GgufError(f"{path}: {field} is {got!r}, expected {want!r}")


def vision_config(path: Path, text_hidden_size: int) -> dict[str, Any]:
    """config.json's ``vision_config`` of the tower in ``path``, checked against the file's
    tensors and the text model it feeds (``text_hidden_size``)."""
    _expect(path, "general.architecture", metadata(path, "general.architecture"), "clip")
    kind = metadata(path, "clip.vision.projector_type") or metadata(path, "clip.projector_type")
    _expect(path, "clip.projector_type", kind, PROJECTOR)
    deepstack = metadata(path, "clip.vision.is_deepstack_layers") or []
    if any(deepstack):  # Qwen3-VL's extra mergers: not in Qwen3.5, not in our tower
        raise GgufError(f"{path}: clip.vision.is_deepstack_layers has deepstack layers, which "
                        "the Qwen3.5 tower does not run")
    hidden = int(_field(path, "clip.vision.embedding_length"))
    patch = int(_field(path, "clip.vision.patch_size"))
    merge = int(metadata(path, "clip.vision.spatial_merge_size", 2))
    depth = int(_field(path, "clip.vision.block_count"))
    _expect(path, "clip.vision.projection_dim",
            int(metadata(path, "clip.vision.projection_dim", text_hidden_size)), text_hidden_size)
    tensors = tensor_types(path)

    def shape(name: str) -> tuple[int, ...]:
        if name not in tensors:
            raise GgufError(f"{path}: tensor {name} is missing")
        return tensors[name][1]

    embd = shape("v.patch_embd.weight")  # [hidden, channels, patch, patch]: one frame
    _expect(path, "v.patch_embd.weight shape", embd[:1] + embd[2:], (hidden, patch, patch))
    temporal = 2 if "v.patch_embd.weight.1" in tensors else 1
    positions = shape("v.position_embd.weight")
    _expect(path, "v.position_embd.weight columns", positions[1], hidden)
    side = int(round(positions[0] ** 0.5))
    _expect(path, "v.position_embd.weight rows (a square grid)", side * side, positions[0])
    merged = hidden * merge * merge
    _expect(path, "mm.0.weight shape", shape("mm.0.weight"), (merged, merged))
    _expect(path, "mm.2.weight shape", shape("mm.2.weight"), (text_hidden_size, merged))
    blocks = {int(n.split(".")[2]) for n in tensors if n.startswith("v.blk.")}
    _expect(path, "clip.vision.block_count (v.blk.* in the file)", len(blocks), depth)
    up = shape("v.blk.0.ffn_up.weight")
    heads = int(_field(path, "clip.vision.attention.head_count"))
    if hidden % heads:
        raise GgufError(f"{path}: clip.vision.attention.head_count {heads} does not divide "
                        f"clip.vision.embedding_length {hidden}")
    return {"model_type": "qwen3_5_vision", "depth": depth, "hidden_size": hidden,
            "intermediate_size": int(metadata(path, "clip.vision.feed_forward_length", up[0])),
            "num_heads": heads, "out_hidden_size": text_hidden_size, "patch_size": patch,
            "temporal_patch_size": temporal, "spatial_merge_size": merge,
            "in_channels": embd[1], "num_position_embeddings": positions[0],
            # clip.use_gelu: ggml's GELU is the tanh approximation, as Qwen3.5's tower
            "hidden_act": "gelu_pytorch_tanh"}


def processor_config(path: Path) -> dict[str, Any]:
    """The preprocessor_config.json keys the mmproj carries (image_processor.py reads them)."""
    out: dict[str, Any] = {
        "patch_size": int(_field(path, "clip.vision.patch_size")),
        "merge_size": int(metadata(path, "clip.vision.spatial_merge_size", 2)),
        "temporal_patch_size": 2 if "v.patch_embd.weight.1" in tensor_types(path) else 1,
        "image_mean": [float(x) for x in _field(path, "clip.vision.image_mean")],
        "image_std": [float(x) for x in _field(path, "clip.vision.image_std")],
    }
    for key in ("min_pixels", "max_pixels"):
        value = metadata(path, f"clip.vision.image_{key}")
        if value is not None:
            out[key] = int(value)
    return out


def vision_token_ids(model_path: Path, gguf: Path) -> dict[str, int]:
    """config.json's vision token ids, from the tokenizer (tokenizer.json beside the model,
    else the GGUF's token list); a tokenizer without them is refused, naming the token."""
    beside = (gguf.parent / "tokenizer.json")
    if beside.is_file():
        tok = json.loads(beside.read_text())
        ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        ids = {**tok["model"]["vocab"], **ids}
    else:
        ids = {t: i for i, t in enumerate(metadata(gguf, "tokenizer.ggml.tokens") or [])}
    out = {}
    for key, token in VISION_TOKENS.items():
        if token not in ids:
            raise GgufError(f"{model_path}: the tokenizer has no {token} (the vision marker "
                            "an mmproj's images need)")
        out[key] = int(ids[token])
    return out


def with_tower(raw: dict[str, Any], model_path: Path, gguf: Path, mmproj: Path
               ) -> dict[str, Any]:
    """A text model's config dict (GGUF metadata's) as the multimodal wrapper config.json
    a Qwen3.5 checkpoint with its tower has: text_config, vision_config, token ids."""
    if not str(raw.get("model_type", "")).startswith("qwen3_5"):
        raise GgufError(f"{mmproj}: an mmproj loads beside a Qwen3.5 model (qwen35, qwen35moe), "
                        f"not {raw.get('model_type')!r}")
    if "vision_config" in raw:  # an HF config.json beside the file declares it
        vision_config(mmproj, int({**raw, **raw.get("text_config", {})}["hidden_size"]))
        return raw
    text_type = raw["model_type"].removesuffix("_text")
    arch = "Qwen3_5MoeForConditionalGeneration" if "moe" in text_type else \
        "Qwen3_5ForConditionalGeneration"
    return {"architectures": [arch], "model_type": text_type,
            "text_config": {k: v for k, v in raw.items() if k != "architectures"},
            "vision_config": vision_config(mmproj, int(raw["hidden_size"])),
            "tie_word_embeddings": raw.get("tie_word_embeddings", False),
            **vision_token_ids(model_path, gguf)}


def mmproj_bytes(path: Path) -> int:
    """The file's tensor bytes as stored (the tower loads them as the model's float dtype)."""
    return sum(int(t.n_bytes) for t in reader(path).tensors)
