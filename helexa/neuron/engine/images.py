"""A prompt's images inside the engine: which of them a step's chunk touches, the M-RoPE
positions of its tokens, and the token ids the prefix cache files them under. Plain
Python, no tensors.

Positions (Qwen3.5's get_rope_index, for images: one frame each). A text token has one
position on all three axes (t, h, w), which is plain rope; the tokens of an image of
rows × cols tokens starting at position s carry (s, s + row, s + col); the text after
it continues from s + max(rows, cols). So every image shifts the positions of what
follows by max(rows, cols) − rows × cols (≤ 0): `rope_delta`. A request's decode
tokens sit at their index plus the delta of all its images.

Prefix cache: an image's tokens are all the same pad id, so two requests with
different images of the same size would share KV. `hash_ids` gives each image's
tokens an id of their own, made from the image's content hash (negative, so no real
token has it), for hashing only; the model still reads the pad id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from helexa.neuron.engine.messages import ImageInput


class ImageSpan(msgspec.Struct, frozen=True, array_like=True):
    """One image a chunk touches: where its tokens are, where its positions start."""

    image: ImageInput
    rope_start: int  # the position its first token carries on every axis


@dataclass(frozen=True)
class PromptImages:
    """A request's images with their rope starts (offset + the delta of those before)."""

    spans: tuple[ImageSpan, ...]

    @classmethod
    def of(cls, images: Sequence[ImageInput]) -> PromptImages | None:
        if not images:
            return None
        delta, spans = 0, []
        for img in sorted(images, key=lambda i: i.offset):
            spans.append(ImageSpan(img, img.offset + delta))
            delta += max(img.rows, img.cols) - img.num_tokens
        return cls(tuple(spans))

    @property
    def rope_delta(self) -> int:
        """The position shift of every token after the last image (all decode tokens)."""
        last = self.spans[-1]
        return last.rope_start + max(last.image.rows, last.image.cols) - last.image.end

    def chunk(self, start: int, end: int) -> tuple[int, list[ImageSpan]]:
        """(rope delta of the text at `start`, the images tokens [start, end) touch)."""
        delta, touched = 0, []
        for s in self.spans:
            img = s.image
            if img.end <= start:
                delta = s.rope_start + max(img.rows, img.cols) - img.end
            elif img.offset < end:
                touched.append(s)
        return delta, touched

    def hash_ids(self, prompt: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """prompt[start:end] with each image's tokens standing for its content (hashing)."""
        end = len(prompt) if end is None else min(end, len(prompt))
        out = prompt[start:end]
        for s in self.spans:
            img = s.image
            lo, hi = max(img.offset, start), min(img.end, end)
            if lo < hi:
                tag = -1 - (int.from_bytes(img.content_hash[:8], "little") >> 1)
                out[lo - start: hi - start] = [tag] * (hi - lo)
        return out


def check_images(images: Sequence[ImageInput], prompt: list[int], runner: object) -> str:
    """Why the engine cannot take these images with this prompt ("" when it can): the model
    takes none, or an image's tokens are not where it says (the daemon placed them)."""
    vision = getattr(runner, "vision", None)
    shape = getattr(getattr(runner, "config", None), "vision", None)
    if vision is None or not vision.takes_images or shape is None:
        return "images: this model takes no images (it has no vision tower)"
    end = 0
    for i, img in enumerate(sorted(images, key=lambda im: im.offset)):
        if img.offset < end or img.end > len(prompt) or img.rows < 1 or img.cols < 1:
            return f"images[{i}]: its tokens [{img.offset}, {img.end}) overlap another's or " \
                   f"run past the prompt's {len(prompt)}"
        if any(t != shape.image_token_id for t in prompt[img.offset: img.end]):
            return f"images[{i}]: prompt tokens [{img.offset}, {img.end}) are not image tokens"
        end = img.end
    return ""


def chunk_positions(start: int, n: int, rope_delta: int, spans: Sequence[ImageSpan]
                    ) -> tuple[list[int], list[int], list[int]]:
    """The (t, h, w) positions of tokens [start, start + n) of a sequence."""
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    i, end, delta = start, start + n, rope_delta

    def text(upto: int) -> None:
        nonlocal i
        run = range(i + delta, upto + delta)
        t.extend(run)
        h.extend(run)
        w.extend(run)
        i = upto

    for s in spans:
        img = s.image
        if img.offset > i:
            text(min(img.offset, end))
        stop = min(img.end, end)
        for j in range(i - img.offset, stop - img.offset):
            row, col = divmod(j, img.cols)
            t.append(s.rope_start)
            h.append(s.rope_start + row)
            w.append(s.rope_start + col)
        i = max(i, stop)
        delta = s.rope_start + max(img.rows, img.cols) - img.end
    if i < end:
        text(end)
    return t, h, w
