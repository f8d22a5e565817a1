"""A chat prompt with images, on the daemon's side: the template's parts, the images
decoded and resized, and each image's one pad token repeated once per image token.

The checkpoint's chat template writes each image part as its vision markers around one
`<|image_pad|>` (Qwen's templates: `<|vision_start|><|image_pad|><|vision_end|>`); the
pads a template can yield come from its markup alone (tokenizer.py quotes special-token
text a caller sends), so the i-th pad in the prompt is the i-th image of the chat. Each
is then repeated rows × cols times, as transformers' processor does, and the engine
gets an ImageInput per image with where its tokens are.

Every image is decoded under the neuron's own limits (helexa/image_decode.py): the
router checks first, a direct gRPC caller is checked here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.checkpoint.vision_shape import VisionShape, read_vision_shape
from helexa.image_decode import ImageError, ImageLimits, decode_image, image_size
from helexa.neuron.engine.messages import ImageInput
from helexa.neuron.vision.processor import ImageProcessor, PreparedImage
from helexa.neuron.work import CallerGone
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

# A direct caller's bounds; the router's, set by its operator, are usually tighter.
NEURON_LIMITS = ImageLimits(max_bytes=32 * 2**20, max_pixels=16384 * 16384)
MAX_IMAGES = 256


def message_content(m: pb.ChatMessage) -> Any:
    """The template's `content` of a message: its text, or its parts as the OpenAI-style
    list Qwen's templates read ({"type": "text", "text"} and {"type": "image"})."""
    if not m.parts:
        return m.content
    return [{"type": "text", "text": p.text} if p.WhichOneof("kind") == "text"
            else {"type": "image"} for p in m.parts]


def chat_images(chat: pb.Chat) -> list[bytes]:
    """Every image of a chat, in the order its template renders them."""
    return [p.image.data for m in chat.messages for p in m.parts
            if p.WhichOneof("kind") == "image"]


@dataclass(frozen=True)
class VisionPrompt:
    processor: ImageProcessor
    shape: VisionShape

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> VisionPrompt | None:
        """A checkpoint's, when it takes images: a tower in config.json (or, for a GGUF
        model, an mmproj beside it) and its processor."""
        from helexa.checkpoint.gguf import GgufError, read_config

        try:
            raw = read_config(model_dir)
        except (GgufError, FileNotFoundError):
            return None  # not a model path: its load says why
        shape = read_vision_shape(raw)
        processor = ImageProcessor.from_dir(model_dir) if shape is not None else None
        if shape is None or processor is None:
            return None
        if processor.merge_size != shape.spatial_merge_size or \
                processor.patch_size != shape.patch_size:
            raise ValueError(f"{model_dir}: the image processor's patch/merge "
                             f"({processor.patch_size}/{processor.merge_size}) differ from the "
                             f"tower's ({shape.patch_size}/{shape.spatial_merge_size})")
        return cls(processor, shape)

    def prepare(self, images: list[bytes], gone: threading.Event | None = None
                ) -> list[PreparedImage]:
        """Each image decoded and resized, or a Refusal naming the image and its fault;
        CallerGone before the next image, or the next image's resize, once `gone` is set."""
        if len(images) > MAX_IMAGES:
            raise Refusal("invalid_request_error",
                          f"messages: {len(images)} images; at most {MAX_IMAGES} are accepted")
        out = []
        for i, data in enumerate(images):
            try:
                out.append(self.prepare_one(data, gone))
            except ImageError as e:
                raise Refusal("invalid_request_error", f"image {i + 1}: {e}") from None
        return out

    def prepare_one(self, data: bytes, gone: threading.Event | None = None
                    ) -> PreparedImage:
        """One image decoded no larger than its resize needs (image_decode.py, `fit`) and
        resized for the tower, as from its full size."""
        if gone is not None and gone.is_set():
            raise CallerGone
        size = image_size(data, NEURON_LIMITS)  # a header parse: cheap beside the decode
        fit = self.processor.fitted(*size)
        image = decode_image(data, NEURON_LIMITS, fit=fit)
        if gone is not None and gone.is_set():
            raise CallerGone
        return self.processor.prepare(image, size)

    def expand(self, ids: list[int], images: list[PreparedImage]
               ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's pad repeated per image token, and the ImageInputs."""
        pad = self.shape.image_token_id
        found = [i for i, t in enumerate(ids) if t == pad]
        if len(found) != len(images):
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template placed {len(found)} of the "
                          f"{len(images)} images (it renders images in user turns only?)")
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        m = self.shape.spatial_merge_size
        for at, img in zip(found, images, strict=True):
            out += ids[prev:at]
            rows, cols = img.llm_grid(m)
            inputs.append(ImageInput(offset=len(out), rows=rows, cols=cols, grid_h=img.grid_h,
                                     grid_w=img.grid_w, pixels=img.pixels,
                                     content_hash=img.content_hash))
            out += [pad] * (rows * cols)
            prev = at + 1
        return out + ids[prev:], inputs

    def status(self) -> pb.VisionInput:
        """What Watch says of it: how a router estimates an image's tokens."""
        p = self.processor
        return pb.VisionInput(pixels_per_token=p.factor ** 2, min_pixels=p.min_pixels,
                              max_pixels=p.max_pixels)


def with_images(tokenizer: Any, request: pb.GenerateRequest | pb.TokenizeRequest,
                ids: list[int], gone: threading.Event | None = None
                ) -> tuple[list[int], list[ImageInput]]:
    """A chat's prompt ids with its images' tokens in place, and its ImageInputs; a Refusal
    when the model takes no images or an image cannot be used."""
    if request.WhichOneof("prompt" if isinstance(request, pb.GenerateRequest) else "input") \
            != "chat":
        return ids, []
    images = chat_images(request.chat)
    if not images:
        return ids, []
    vision: VisionPrompt | None = getattr(tokenizer, "vision", None)
    if vision is None:
        raise Refusal("invalid_request_error",
                      f"messages: `{request.model}` takes no images (it has no vision tower)")
    return vision.expand(ids, vision.prepare(images, gone))
