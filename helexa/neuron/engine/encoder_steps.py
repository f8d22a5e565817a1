"""An image's vision tower spread over engine steps, within a per-step budget.

Without a budget (`engine.vision_step_budget` = 0) the step that first prefills an
image's tokens runs its whole tower (vision_step.py), so every other stream on the model
waits that long for its next token, once per image. With one, the scheduler gives each
step at most that much tower work, counted in patches × blocks (an image of P patches
through a tower of D blocks is P × D; the patch embedding and the merger ride with its
first and last blocks): an image's blocks run a few at a time, one step after another,
its hidden state kept between them by the runner (VisionStep.advance), and its tokens
are prefilled only once its embeddings are whole. A step runs at least one block, of the
image part-way (else the first waiting), however large: one block of the largest image is
the least tower work a step can carry (its attention spans the whole image). vLLM bounds
its encoder work per step the same way, but never splits an image. The budget is chosen
by measuring the tower (vision_pace.py: `engine.vision_step_ms` over its cost per
patch-block, which `run` times in every step with tower work) unless one is configured.

Which images (scheduler.py calls `EncoderBudget`): a running request still prefilling
whose next image is not encoded yet has its chunk end before that image's tokens and gets
that image's next blocks. One image at most is part-way at any time (a new one starts
only once the one part-way is done), so the runner holds one hidden state between steps;
the one part-way goes first, then requests in batch order, then prompts promoted in the
step (one with no token to prefill yet is promoted for its blocks alone). A request's
progress is its own (`Request.encoded_images`, `encoded_blocks`): a request leaving the
batch part-way (paused) starts that image over, and one finished part-way has its state
dropped at once (`forget`); the runner also drops a state no step names.

Tensor parallelism (tp > 1) splits images the same way: each rank holds a shard of the
tower, so rank 0's VisionStep.advance sends the step's slices to the other ranks first
(TpEncode, tp_worker.py) and every rank runs the same blocks, their collectives in step,
keeping the same states part-way and the same cache of embeddings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from helexa.neuron.engine.messages import ImageInput
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.vision_pace import sync

if TYPE_CHECKING:
    from helexa.neuron.engine.engine_core import EngineCore


class EncodeSlice(msgspec.Struct, frozen=True, array_like=True):
    """Tower blocks [start, end) of one request's image this step (start 0: embed the
    patches first; end = depth: then the merger, and the embeddings are whole)."""

    req_id: str
    index: int  # the image's place among the request's images (PromptImages.spans)
    image: ImageInput
    start: int
    end: int


class EncoderBudget:
    """One step's tower work: the slices it runs, and how far each request's prefill may
    go once they have run."""

    def __init__(self, budget: int, depth: int) -> None:
        self.on = budget > 0 and depth > 0
        self.left, self.depth = budget, depth
        self.slices: list[EncodeSlice] = []
        self.partway = False  # an image stays part-way after this step: none other starts
        self._after: dict[str, tuple[int, int]] = {}  # progress once the step ran

    def first_partway(self, reqs: Sequence[Request]) -> list[Request]:
        """`reqs` with the one whose image is part-way first."""
        return sorted(reqs, key=lambda r: r.encoded_blocks == 0)

    def take(self, req: Request) -> bool:
        """Plan `req`'s next blocks where it waits for an image and the budget allows;
        whether it got any."""
        if not self.on or self.partway or req.req_id in self._after:
            return False
        j = _pending(req, req.encoded_images)
        if j is None:
            return False
        assert req.images is not None
        img = req.images.spans[j].image
        start = req.encoded_blocks if j == req.encoded_images else 0
        patches = img.grid_h * img.grid_w
        n = min(self.depth - start, self.left // patches)
        if n <= 0:
            if self.slices:
                return False  # the budget is spent; the first slice of a step always runs
            n = 1
        self.left -= n * patches
        end = start + n
        self.slices.append(EncodeSlice(req.req_id, j, img, start, end))
        self.partway = end < self.depth
        self._after[req.req_id] = (j + 1, 0) if end == self.depth else (j, end)
        return True

    def ready(self, req: Request) -> int:
        """The prompt position `req`'s prefill may reach this step: the first token of its
        first image not yet encoded (its own position where it is inside one)."""
        if not self.on or req.images is None:
            return req.num_prompt_tokens
        images, _ = self._after.get(req.req_id, (req.encoded_images, req.encoded_blocks))
        j = _pending(req, images)
        if j is None:
            return req.num_prompt_tokens
        return max(req.num_computed_tokens, req.images.spans[j].image.offset)


def _pending(req: Request, encoded: int) -> int | None:
    """The first of req's images from `encoded` on whose tokens are not all computed."""
    if req.images is None:
        return None
    for j in range(encoded, len(req.images.spans)):
        if req.images.spans[j].image.end > req.num_computed_tokens:
            return j
    return None


def run(core: EngineCore, slices: list[EncodeSlice]) -> None:
    """The step's tower work on the runner, then each request's progress. A step without
    slices drops any state the runner still holds (its request left the batch)."""
    vision: Any = getattr(core.runner, "vision", None)
    if vision is None or not core.scheduler.vision_depth:
        return
    start = time.perf_counter()
    ran = vision.advance(slices)
    if ran and core.vision_pace is not None:  # the budget follows the tower's pace
        sync(vision.device)
        core.vision_pace.observe(ran, time.perf_counter() - start)
        core.scheduler.vision_budget = core.vision_pace.budget
    for s in slices:
        req = core.requests[s.req_id]
        whole = s.end == core.scheduler.vision_depth
        req.encoded_images, req.encoded_blocks = (s.index + 1, 0) if whole else (s.index, s.end)


def only(core: EngineCore, slices: list[EncodeSlice], reqs: list[Request]) -> list[Request]:
    """The requests of `slices` not among `reqs` (a failed step fails them too)."""
    ids = {r.req_id for r in reqs}
    return [core.requests[s.req_id] for s in slices
            if s.req_id not in ids and s.req_id in core.requests]


def forget(core: EngineCore, req: Request) -> None:
    """A request finished or paused with an image part-way: the runner's state of it goes
    now, and it would start that image over."""
    if req.encoded_blocks:
        req.encoded_blocks = 0
        vision: Any = getattr(core.runner, "vision", None)
        if vision is not None:
            vision.forget(req.req_id)
