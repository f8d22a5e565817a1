"""The vision tower a checkpoint's config.json declares (Qwen3.5's `vision_config`), torch-free.

One parse for `helexa plan` (the tower's weights per card and the activations of one
tower call) and the neuron (the tower it builds, helexa/neuron/models/vision.py); None
when config.json declares no tower. The image and vision-marker token ids live at
config.json's top level, as Qwen's checkpoints write them. The pixel bounds of
preprocessor_config.json are read here too (`pixel_bounds`), for the plan and the
neuron's image processor alike: the largest image bounds one tower call. A GGUF
model's tower and processor settings may come from llama.cpp's mmproj file beside it
(helexa/checkpoint/mmproj.py); `processor_settings` answers for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' Qwen2VLImageProcessor defaults, for a preprocessor_config.json without them
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
FP32_BYTES = 4


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size: the merger writes into it
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int  # a square learned grid, interpolated to each image
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one image token before the merger's projection (merge² patches)."""
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def param_split(self, tp: int) -> tuple[int, int]:
        """(parameters split over tp cards, parameters every card holds): qkv, the MLPs and
        the merger's projections split as the text model's layers do; the patch embedding,
        position grid, norms and the row-parallel layers' biases are whole on every card."""
        h, i, m, o = self.hidden_size, self.intermediate_size, self.merged_size, self.out_hidden_size
        block_split = 3 * h * h + 3 * h + h * h + h * i + i + i * h  # qkv (+b), proj, fc1 (+b), fc2
        block_whole = 4 * h + h + h  # two layer norms, proj and fc2 biases
        merger_split = m * m + m + m * o
        merger_whole = 2 * h + o
        whole = (self.patch_dim * h + h + self.num_position_embeddings * h
                 + self.depth * block_whole + merger_whole)
        return self.depth * block_split + merger_split, whole


    def encoder_activation_bytes(self, patches: int, tp: int, elt: int) -> int:
        """Peak activation bytes on one card of one tower call over `patches` patches
        (the engine never encodes more at once: vision_step.py), an estimate from what a
        block holds live: the residual stream and a norm's output (2 × hidden each
        patch), then the larger of attention's (qkv, q and k rotated in fp32, the output:
        hidden / tp × (3 + 2 × 4 / elt + 1)) and the MLP's (fc1's output and its
        activation: 2 × intermediate / tp), plus the fp32 rotary tables and patches, the
        patches in the tower's dtype and the merger's output (out_hidden per merged patch).
        Attention runs one image at a time in a fused kernel, so no n × n scores. A CPU
        run's live tensors, tracked (tests/neuron/models/test_vision_memory.py), stay
        within it."""
        h, i = self.hidden_size, self.intermediate_size
        attn = (h // tp) * (4 * elt + 2 * FP32_BYTES)
        mlp = 2 * (i // tp) * elt
        per_patch = (2 * h * elt + max(attn, mlp) + FP32_BYTES * (2 * self.head_dim + self.patch_dim)
                     + self.patch_dim * elt)
        merged = -(-patches // self.spatial_merge_size ** 2)
        return patches * per_patch + merged * self.out_hidden_size * elt

    def embedding_cache_bytes(self, patches: int, elt: int) -> int:
        """What the engine's embedding cache holds at most between steps (one card):
        two of the largest image's embeddings (``patches`` patches, merged, out_hidden
        wide; helexa/neuron/engine/vision_step.py). It lives beside the text model's
        activations and the tower's, so the headroom counts it on top of both."""
        return 2 * -(-patches // self.spatial_merge_size ** 2) * self.out_hidden_size * elt


def pixel_bounds(preprocessor: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a preprocessor_config.json dict: transformers takes size
    {shortest_edge, longest_edge} (pixels, not edges, for this processor), and the older
    top-level min_pixels / max_pixels over it."""
    size = preprocessor.get("size") or {}
    lo = preprocessor.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    hi = preprocessor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return int(lo or DEFAULT_MIN_PIXELS), int(hi or DEFAULT_MAX_PIXELS)


def processor_settings(model_path: str | Path) -> dict[str, Any] | None:
    """The image processor's settings of a model path: preprocessor_config.json in its
    folder, else those of the mmproj beside a GGUF model (helexa/checkpoint/mmproj.py);
    None when it has neither, or is a GGUF model with no mmproj (no tower weights)."""
    from helexa.checkpoint.gguf import GgufError, find_gguf, model_folder
    from helexa.checkpoint.mmproj import find_mmproj, processor_config

    try:
        gguf = find_gguf(model_path)
    except GgufError:
        return None  # not a model path: whoever opens it says why
    mmproj = find_mmproj(gguf) if gguf is not None else None
    if gguf is not None and mmproj is None:
        return None  # a text GGUF: the tower config.json may declare is in no file
    path = model_folder(model_path) / "preprocessor_config.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    return processor_config(mmproj) if mmproj is not None else None


def max_image_patches(model_dir: Path, shape: VisionShape) -> int:
    """Patches of the largest image the checkpoint's processor makes (its max_pixels; the
    processor's default where the folder has no preprocessor_config.json)."""
    raw = processor_settings(model_dir) or {}
    patch = int(raw.get("patch_size", shape.patch_size))
    return pixel_bounds(raw)[1] // (patch * patch)


def read_vision_shape(raw: dict[str, Any]) -> VisionShape | None:
    """The tower of a config.json dict, or None when it declares none."""
    v = raw.get("vision_config")
    if not isinstance(v, dict) or "hidden_size" not in v:
        return None
    rope = v.get("rope_parameters") or {}
    patch = v.get("patch_size", 16)
    temporal = v.get("temporal_patch_size", 2)
    if isinstance(patch, (list, tuple)) or isinstance(temporal, (list, tuple)):
        raise ValueError("vision_config: non-square patch sizes are not supported")
    return VisionShape(
        depth=int(v.get("depth", 27)), hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_heads=int(v.get("num_heads", 16)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)), patch_size=int(patch),
        temporal_patch_size=int(temporal),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", 3)),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(raw.get("image_token_id", 248056)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
        video_token_id=int(raw.get("video_token_id", 248057)))


def tower_loads(model_dir: Path) -> bool:
    """Whether the tower a folder's config.json declares loads with it: a folder of weights
    needs preprocessor_config.json beside them (else the model loads text only); a
    config.json with no weights beside it (a catalogue's copy) is planned with its tower."""
    if not any(model_dir.glob("*.safetensors")):
        return True
    return processor_settings(model_dir) is not None
