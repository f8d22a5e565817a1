"""A step's images on the runner's side: the tower runs in the step that prefills an
image's tokens, and the step's rows get their M-RoPE positions.

`VisionStep.inputs(seqs, starts, positions)` returns the model's MmStep for the step, or
None when no sequence in it has images or shifted positions (every text-only step: the
model then runs exactly as before). Every image whose tokens the step touches and whose
embeddings are not cached yet goes through the tower, images of several requests
together in calls of at most the largest image's patches (so a step's activations stay
within what `helexa plan` set aside); the embeddings stay cached by content hash until
a chunk reaches the image's last token, so a prefill chunked smaller than an image runs
the tower once. The cache is bounded (`max_cached` images, and the bytes of two of the
largest image's embeddings, oldest first out, never an image the step reads): an image
whose request was aborted mid-image is dropped in time, and one evicted early is
recomputed.

With a per-step budget (engine/encoder_steps.py) the engine runs each image's tower a few
blocks a step instead (`advance`), the hidden state part-way kept here between steps
(`partial`), and the embeddings cached once whole, before any chunk reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from helexa.checkpoint.vision_shape import VisionShape
from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.images import chunk_positions
from helexa.neuron.engine.messages import ImageInput
from helexa.neuron.models.mrope import MmStep
from helexa.neuron.models.vision import TowerState
from helexa.neuron.vision.patches import pixel_patches, value_table
from helexa.neuron.vision.processor import ImageProcessor, PreparedImage

if TYPE_CHECKING:
    from helexa.neuron.engine.encoder_steps import EncodeSlice
    from helexa.neuron.engine.model_runner import SeqInput


class VisionStep:
    def __init__(self, model: Any, processor: ImageProcessor | None, device: torch.device,
                 max_cached: int = 16, ranks: Any = None) -> None:
        self.model = model  # has .visual (the tower) when it takes images
        self.processor = processor
        self.device = device
        self.max_cached = max_cached
        self._table = value_table(processor, device) if processor is not None else None
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.tower_runs = 0  # tower calls so far (tests: chunked prefill runs it once)
        self.blocks_run = 0  # tower blocks run so far, over every image (tests: per step)
        self.partial: dict[tuple[str, int], TowerState] = {}  # (req_id, image): part-way
        self.ranks = ranks  # rank 0 at tp > 1: its TpWorkers, told each step's tower work

    @property
    def max_cached_bytes(self) -> int:
        """Two of the largest image's embeddings (the processor's largest, merged, in the
        tower's dtype): between steps the cache holds no more; 0 without a tower."""
        if not self.takes_images:
            return 0
        assert self.processor is not None
        v: VisionShape = self.model.visual.shape
        elt: int = next(self.model.visual.parameters()).element_size()
        return v.embedding_cache_bytes(self.processor.max_patches, elt)

    @property
    def cached_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cache.values())

    @property
    def takes_images(self) -> bool:
        return self.processor is not None and getattr(self.model, "visual", None) is not None

    def attach(self, seqs: Sequence[SeqInput], starts: Sequence[int],
               positions: torch.Tensor) -> torch.Tensor:
        """Set the model's MmStep for the step (M-RoPE positions, and the tower's embeddings
        for the images this step's chunks reach) and return the 1-D positions the model
        runs with. A step no image token is in (every decode step, and text chunks) gets no
        MmStep: each row's three positions are equal, which plain rope rotates exactly as
        M-RoPE would (helexa/neuron/models/mrope.py), so its rows' positions come back
        shifted by their rope_delta instead. A CUDA graph reads only those 1-D positions: an
        image request's decode steps replay like any other, at the right positions."""
        if not self.takes_images:
            return positions
        if any(s.images for s in seqs):
            self.model.mm = self.inputs(seqs, starts, positions)
            return positions
        self.model.mm = None
        if not any(s.rope_delta for s in seqs):
            return positions
        shift = [0] * positions.shape[0]
        for s, first_row in zip(seqs, starts, strict=True):
            shift[first_row:first_row + len(s.token_ids)] = [s.rope_delta] * len(s.token_ids)
        return positions + to_device(shift, positions.dtype, positions.device)

    def inputs(self, seqs: Sequence[SeqInput], starts: Sequence[int],
               positions: torch.Tensor) -> MmStep | None:
        if not any(s.images or s.rope_delta for s in seqs):
            return None
        n_rows = positions.shape[0]
        host = [0] * (3 * n_rows)  # (t, h, w) of every row, laid out [3, N], one copy
        rows: list[int] = []
        pieces: list[tuple[bytes, int, int]] = []  # (image hash, first, end) of its tokens
        for s, first_row in zip(seqs, starts, strict=True):
            n, c = len(s.token_ids), s.num_computed
            for axis, values in enumerate(chunk_positions(c, n, s.rope_delta, s.images)):
                host[axis * n_rows + first_row: axis * n_rows + first_row + n] = values
            for span in s.images:
                img = span.image
                lo, hi = max(img.offset, c), min(img.end, c + n)
                if lo < hi:
                    rows.extend(range(first_row + lo - c, first_row + hi - c))
                    pieces.append((img.content_hash, lo - img.offset, hi - img.offset))
        pos3 = to_device(host + rows, positions.dtype, positions.device)
        rows_d, pos3 = pos3[3 * n_rows:], pos3[:3 * n_rows].view(3, n_rows)
        if not pieces:
            return MmStep(pos3, None, None)
        self._encode([span.image for s in seqs for span in s.images])
        embeds = torch.cat([self._cache[key][a:b] for key, a, b in pieces])
        for s in seqs:  # an image whose last token this step reached is done with
            for span in s.images:
                if span.image.end <= s.num_computed + len(s.token_ids):
                    self._cache.pop(span.image.content_hash, None)
        self._evict({key for key, _, _ in pieces})
        return MmStep(pos3, rows_d, embeds)

    def _evict(self, keep: set[bytes]) -> None:
        """Once the step has read its images and dropped those it finished: the oldest out
        until the cache holds at most ``max_cached`` images and ``max_cached_bytes``, never
        one of ``keep`` (a chunked image the step reads is kept, however many)."""
        over, size, bound = len(self._cache) - self.max_cached, self.cached_bytes, \
            self.max_cached_bytes
        for key in [k for k in self._cache if k not in keep]:  # the oldest first
            if over <= 0 and size <= bound:
                break
            over, size = over - 1, size - self._cache[key].numel() * self._cache[key].element_size()
            del self._cache[key]

    def _encode(self, images: list[ImageInput]) -> None:
        """Run the tower once over every image not cached yet."""
        todo: dict[bytes, ImageInput] = {}
        for img in images:
            if img.content_hash in self._cache:
                self._cache.move_to_end(img.content_hash)
            else:
                todo.setdefault(img.content_hash, img)
        if not todo:
            return
        prepared = self._prepared(todo.values())
        assert self.processor is not None
        for group in _groups(prepared, self.processor.max_patches):
            self._run_tower(group)

    def _prepared(self, images: Iterable[ImageInput]) -> list[PreparedImage]:
        """`images` as the tower's input; ValueError where this model takes none."""
        if not self.takes_images or self._table is None or self.processor is None:
            raise ValueError("this model takes no images")
        return [PreparedImage(i.pixels, i.grid_h, i.grid_w, i.num_tokens, i.content_hash)
                for i in images]

    def advance(self, slices: Sequence[EncodeSlice]) -> int:
        """This step's tower work (encoder_steps.py): each slice's blocks of its image, from
        its patches (start 0) or its state part-way; an image whose blocks are all run is
        merged into its embeddings, cached. A state no slice names is dropped (its request
        left the batch or ended). Returns the patch-blocks it ran (an image cached whole
        already runs none). At tp > 1 rank 0 sends the slices first: every rank runs the
        same blocks of its shard of the tower, their collectives in step, and holds the
        same states and cache."""
        if self.ranks is not None and (slices or self.partial):
            self.ranks.send_encode(list(slices))
            try:
                return self._advance(slices)
            except (RuntimeError, ValueError) as e:  # as a step's: a rank died or wedged
                if isinstance(e, RuntimeError) or self.ranks.failed:
                    self.ranks.fail_step(e)
                raise
        return self._advance(slices)

    def _advance(self, slices: Sequence[EncodeSlice]) -> int:
        ran = 0
        named = {(s.req_id, s.index) for s in slices}
        for key in [k for k in self.partial if k not in named]:
            del self.partial[key]
        for s in slices:
            key, img = (s.req_id, s.index), s.image
            if img.content_hash in self._cache:  # whole already (another request's)
                self.partial.pop(key, None)
                continue
            state = self.partial.get(key)
            if s.start == 0:
                p = self._prepared([img])[0]
                assert self.processor is not None and self._table is not None
                state = self.model.visual.embed(pixel_patches(p, self.processor, self._table),
                                                [(1, img.grid_h, img.grid_w)])
            elif state is None:
                raise ValueError(f"image {s.index} of {s.req_id}: blocks from {s.start} "
                                 "but no state part-way")
            self.model.visual.run_blocks(state, s.start, s.end)
            self.blocks_run += s.end - s.start
            ran += (s.end - s.start) * img.grid_h * img.grid_w
            if s.end < len(self.model.visual.blocks):
                self.partial[key] = state
                continue
            self.partial.pop(key, None)
            self._cache[img.content_hash] = self.model.visual.merger(state.x)
            self.tower_runs += 1
        return ran

    def forget(self, req_id: str) -> None:
        """A request's states part-way, dropped (it finished or left the batch)."""
        for key in [k for k in self.partial if k[0] == req_id]:
            del self.partial[key]

    def _run_tower(self, prepared: list[PreparedImage]) -> None:
        assert self.processor is not None and self._table is not None
        patches = torch.cat([pixel_patches(p, self.processor, self._table) for p in prepared])
        out = self.model.visual(patches, [(1, p.grid_h, p.grid_w) for p in prepared])
        self.tower_runs += 1
        self.blocks_run += len(self.model.visual.blocks)
        parts = out.split([p.num_tokens for p in prepared])
        for p, part in zip(prepared, parts, strict=True):
            # each image its own memory: a view would keep the whole call's output alive
            # after its partners are done with, and the byte bound would not see it
            self._cache[p.content_hash] = part.clone() if len(parts) > 1 else part


def _groups(prepared: list[PreparedImage], max_patches: int) -> list[list[PreparedImage]]:
    """Consecutive images in calls of at most `max_patches` patches together (the largest
    image's: the activations helexa plan sets aside, checkpoint/vision_shape.py)."""
    groups: list[list[PreparedImage]] = []
    total = 0
    for p in prepared:
        n = p.grid_h * p.grid_w
        if not groups or total + n > max_patches:
            groups.append([])
            total = 0
        groups[-1].append(p)
        total += n
    return groups

