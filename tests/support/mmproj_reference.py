"""llama.cpp's mmproj GGUF written from a tiny Qwen3.5 checkpoint with a vision tower, as
convert_hf_to_gguf.py ``--mmproj`` writes one (its Qwen3VLVisionModel on MmprojModel).

Metadata: ``general.architecture = clip``, ``general.type = mmproj``,
``clip.has_vision_encoder``, ``clip.projector_type = qwen3vl_merger``, ``clip.use_gelu``,
``clip.vision.{projection_dim (the text model's hidden size), image_size (sqrt of the
position grid × patch), patch_size, embedding_length, feed_forward_length, block_count,
attention.head_count, attention.layer_norm_epsilon, image_mean, image_std (from
preprocessor_config.json), spatial_merge_size}``. Tensors: names from gguf-py's
TensorNameMap for MODEL_ARCH.MMPROJ (as the converter maps them), the merger's norm as
``v.post_ln`` and its fc1 / fc2 as ``mm.0`` / ``mm.2``, the Conv3d patch kernel split
along time into ``v.patch_embd.weight`` and ``.weight.1``; position_embd kept F32, 1-D
tensors F32, the rest in ``weight_type``. ``split_qkv`` writes attn_q / attn_k / attn_v
as Qwen2-VL's converter does; ``pixel_bounds`` adds image_min_pixels / image_max_pixels
(which some converters write; Qwen3-VL's does not).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from support.gguf_reference import quantize


def _gguf_names(hf: str, depth: int) -> str:
    """gguf-py's mmproj name of one ``visual.*`` tensor, as the converter maps it."""
    if hf.startswith("visual.merger."):
        part, kind = hf.removeprefix("visual.merger.").split(".", 1)
        return {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[part] + "." + kind
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, depth)
    out = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert out is not None, hf
    return out


def write_mmproj(src: Path, out: Path, weight_type: str = "F32", *, split_qkv: bool = False,
                 pixel_bounds: bool = False, projector: str = "qwen3vl_merger",
                 projection_dim: int | None = None) -> None:
    """Write ``src``'s tower (a tiny ``--vision`` checkpoint) as an mmproj at ``out``;
    ``projector`` and ``projection_dim`` override what the converter would write."""
    cfg = json.loads((src / "config.json").read_text())
    v, text = cfg["vision_config"], cfg["text_config"]
    pre = json.loads((src / "preprocessor_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(projection_dim or text["hidden_size"])
    side = int(v["num_position_embeddings"] ** 0.5)
    w.add_vision_image_size(side * v["patch_size"])
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["depth"])
    w.add_vision_head_count(v["num_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_clip_projector_type(projector)
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(v["spatial_merge_size"])
    w.add_vision_attention_layernorm_eps(text.get("rms_norm_eps", 1e-6))
    if pixel_bounds:
        w.add_vision_min_pixels(pre["size"]["shortest_edge"])
        w.add_vision_max_pixels(pre["size"]["longest_edge"])
    tensors = {n.replace("model.visual.", "visual.", 1): t
               for n, t in load_file(str(src / "model.safetensors")).items()
               if n.startswith("model.visual.")}
    for hf, t in tensors.items():
        x = t.float().numpy()
        if hf == "visual.patch_embed.proj.weight":  # Conv3d -> two Conv2d, along time
            pieces = [("v.patch_embd.weight", x[:, :, 0]), ("v.patch_embd.weight.1", x[:, :, 1])]
        elif ".attn.qkv." in hf and split_qkv:
            name = _gguf_names(hf, v["depth"])
            pieces = [(name.replace("attn_qkv", f"attn_{p}"), part)
                      for p, part in zip("qkv", np.split(x, 3), strict=True)]
        else:
            pieces = [(_gguf_names(hf, v["depth"]), x)]
        for name, data in pieces:
            keep = data.ndim == 1 or ".position_embd." in name
            typ = "F32" if keep else weight_type
            if data.ndim > 2 and typ not in ("F32", "F16"):
                typ = "F16"  # the patch kernels: ggml quantises 2-D rows only
            packed = quantize(np.ascontiguousarray(data.reshape(-1, data.shape[-1])), typ)
            packed = packed.reshape(data.shape) if typ in ("F32", "F16") else packed
            w.add_tensor(name, packed, raw_dtype=None if typ in ("F32", "F16") else T[typ])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
