"""An image's vision tower spread over engine steps (engine/encoder_steps.py): no step runs
more tower work than `vision_step_budget` allows (one block of one image at the least), a
bystander decodes a token in every step while the image encodes, the embeddings and the
answer are exactly those of the whole-tower step, and a request aborted part-way leaves no
state behind."""

from __future__ import annotations

import json
import time
from collections import OrderedDict

import pytest
import torch
from support.vision import image_inputs, image_request, make_image, vision_core

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.encoder_steps import EncodeSlice
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.images import PromptImages
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.scheduler import Scheduler
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.models.vision import VisionBlock
from helexa.neuron.vision.patches import pixel_patches
from helexa.neuron.vision.processor import PreparedImage

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = m.SamplingParams(temperature=0.0)
IMAGE = (256, 192)  # 16 × 12 patches: 192 patches, 48 image tokens


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def text_request(rid: str, max_tokens: int) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=[5, 6, 7, 8, 9], max_tokens=max_tokens,
                        sampling=GREEDY)


def one(core: EngineCore, inbound: m.ToEngine | None = None) -> tuple[dict, int]:
    """One step: its new tokens by request, and the tower blocks it ran."""
    before = core.runner.vision.blocks_run
    tokens: dict[str, list[int]] = {}
    for u in core.step(inbound).updates:
        assert not u.refused_code, u.refused_message
        tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
    return tokens, core.runner.vision.blocks_run - before


def drain(core: EngineCore, inbound: m.ToEngine | None = None) -> list[tuple[dict, int]]:
    out = [one(core, inbound)]
    while core.has_work:
        out.append(one(core))
    return out


def test_the_tower_a_block_a_step_beside_a_bystander_answers_as_the_whole_tower(vl_dir):
    img = make_image(*IMAGE, seed=3)
    whole = vision_core(vl_dir, vision_step_budget=0)  # the tower in one step, as before the budget
    ask = image_request(vl_dir, "img", img, max_tokens=6)
    ref = [tok for t, _ in drain(whole, m.ToEngine(new=[ask]))
           for tok in t.get("img", [])]
    assert whole.runner.vision.blocks_run == depth(whole) >= 2
    core = vision_core(vl_dir, vision_step_budget=1)  # less than one block: one block a step
    one(core, m.ToEngine(new=[text_request("by", 40)]))
    one(core)  # the bystander is decoding
    seen = drain(core, m.ToEngine(new=[image_request(vl_dir, "img", img, max_tokens=6)]))
    assert [tok for t, _ in seen for tok in t.get("img", [])] == ref
    blocks = [b for _, b in seen]
    assert max(blocks) == 1 and sum(blocks) == depth(core)  # never more than one a step
    assert all("by" in t for t, b in seen if b)  # the bystander went on in each of them
    assert core.runner.vision.tower_runs == 1 and not core.runner.vision.partial


def depth(core: EngineCore) -> int:
    return core.runner.vision.model.visual.shape.depth


def test_a_prompt_that_starts_with_its_image_waits_for_its_blocks_alone(vl_dir):
    """Its first steps carry tower work and no token of it (a step of no rows at all)."""
    img = make_image(*IMAGE, seed=6)
    cfg = json.loads((vl_dir / "config.json").read_text())
    prompt = [cfg["image_token_id"]] * 48 + [5, 6, 7]
    new = m.NewRequest(req_id="a", prompt_token_ids=prompt, max_tokens=4, sampling=GREEDY,
                       images=image_inputs(vl_dir, prompt, [img]))
    ref = drain(vision_core(vl_dir, vision_step_budget=0), m.ToEngine(new=[new]))
    core = vision_core(vl_dir, vision_step_budget=1)
    seen = drain(core, m.ToEngine(new=[new]))
    assert [b for _, b in seen[:depth(core)]] == [1] * depth(core)
    assert not any(t.get("a") for t, _ in seen[:depth(core) - 1])
    assert [tok for t, _ in seen for tok in t.get("a", [])] == \
        [tok for t, _ in ref for tok in t.get("a", [])]


def test_split_encoding_equals_the_whole_towers_embeddings(vl_dir):
    core = vision_core(vl_dir, vision_step_budget=1)
    vision = core.runner.vision
    img = image_request(vl_dir, "a", make_image(*IMAGE, seed=4), max_tokens=6).images[0]
    depth = vision.model.visual.shape.depth
    for b in range(depth):
        vision.advance([EncodeSlice("a", 0, img, b, b + 1)])
        assert bool(vision.partial) == (b + 1 < depth)
    split = vision._cache[img.content_hash]
    p = PreparedImage(img.pixels, img.grid_h, img.grid_w, img.num_tokens, img.content_hash)
    with torch.inference_mode():
        whole = vision.model.visual(pixel_patches(p, vision.processor, vision._table),
                                    [(1, img.grid_h, img.grid_w)])
    assert torch.equal(split, whole)


def test_aborted_part_way_leaves_no_state_and_the_pool_whole(vl_dir):
    """Dropped at the abort itself: no later step need come (none does: nothing else runs)."""
    core = vision_core(vl_dir, vision_step_budget=1)
    ask = image_request(vl_dir, "img", make_image(*IMAGE, seed=5), max_tokens=6)
    one(core, m.ToEngine(new=[ask]))
    assert core.requests["img"].encoded_blocks == 1 and core.runner.vision.partial  # part-way
    core.step(m.ToEngine(aborts=[m.Abort(req_id="img")]))
    assert not core.has_work and not core.runner.vision.partial
    assert not core.runner.vision._cache
    led = core.pool.ledger()
    assert led.free_bytes == led.total_bytes and not led.reserved_bytes and not led.used_bytes


def _req(rid: str, prompt: list[int], images: list[m.ImageInput]) -> Request:
    r = Request(rid, prompt, output_budget=4)
    r.status = RequestStatus.IN_FLIGHT
    r.images = PromptImages.of(images)
    return r


def _image(offset: int, side: int) -> m.ImageInput:
    return m.ImageInput(offset=offset, rows=side // 2, cols=side // 2, grid_h=side,
                        grid_w=side, pixels=b"", content_hash=bytes([offset]) * 8)


def test_the_scheduler_holds_an_images_tokens_until_its_blocks_ran():
    """A 16-patch image (4 tokens at 3) through a tower of 4 blocks under a budget of 32
    patch-blocks: the text before it prefills at once, its tokens once the tower is done;
    a prompt that starts with an image is promoted for its blocks alone."""
    sched = Scheduler(4, 64, 64, vision_budget=32, vision_depth=4)
    a = _req("a", [1, 2, 3, 9, 9, 9, 9, 4], [_image(3, 4)])
    b = _req("b", [9, 9, 9, 9, 5], [_image(0, 4)])
    plan = sched.schedule([], [a, b])
    assert plan.prefill == [("a", 3)] and plan.promoted == ["a"]  # b waits: a is part-way
    assert [(s.req_id, s.start, s.end) for s in plan.encode] == [("a", 0, 2)]
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens, a.encoded_blocks = 3, 2
    plan = sched.schedule([a], [b])  # a's last two blocks, then its tokens in this step
    assert [(s.req_id, s.start, s.end) for s in plan.encode] == [("a", 2, 4)]
    assert plan.prefill == [("a", 5)] and plan.promoted == []
    a.num_computed_tokens, a.encoded_images, a.encoded_blocks = 8, 1, 0
    plan = sched.schedule([a], [b])
    assert [(s.req_id, s.start, s.end) for s in plan.encode] == [("b", 0, 2)]
    assert plan.promoted == ["b"] and plan.prefill == []  # its first token is its image's


class _Seen(OrderedDict):
    """A VisionStep's embedding cache that keeps what was put in it (the cache lets an
    image go once its tokens are prefilled)."""

    def __init__(self) -> None:
        super().__init__()
        self.put: dict[bytes, torch.Tensor] = {}

    def __setitem__(self, key: bytes, value: torch.Tensor) -> None:
        self.put[key] = value
        super().__setitem__(key, value)


def test_a_slow_tower_under_the_auto_budget_splits_an_image_beside_a_bystander(
        vl_dir, monkeypatch):
    """The default budget (auto: engine.vision_step_ms over the tower's measured cost) on a
    tower whose every block takes longer than a step's target: the image runs a block a
    step while the bystander decodes, to the whole tower's embeddings and answer."""
    img = make_image(*IMAGE, seed=8)
    whole = vision_core(vl_dir, vision_step_budget=0)
    whole.runner.vision._cache = ref_cache = _Seen()
    ask = image_request(vl_dir, "img", img, max_tokens=6)
    ref = [tok for t, _ in drain(whole, m.ToEngine(new=[ask])) for tok in t.get("img", [])]
    block_forward = VisionBlock.forward

    def slow(self, *args):  # a block a CPU takes seconds over, shortened: twice the target
        time.sleep(0.050)  # of a step (engine.vision_step_ms, 25 by default)
        return block_forward(self, *args)

    monkeypatch.setattr(VisionBlock, "forward", slow)
    core = vision_core(vl_dir)  # the defaults: the budget unset, measured
    core.runner.vision._cache = cache = _Seen()
    one(core, m.ToEngine(new=[text_request("by", 40)]))
    one(core)
    seen = drain(core, m.ToEngine(new=[ask]))
    blocks = [b for _, b in seen if b]
    assert len(blocks) == depth(core) >= 2 and max(blocks) == 1  # over several steps
    assert all("by" in t for t, b in seen if b)  # the bystander decoded in each
    assert [tok for t, _ in seen for tok in t.get("img", [])] == ref
    key = ask.images[0].content_hash
    assert torch.equal(cache.put[key], ref_cache.put[key])
    assert core.limits.vision_step_budget is None  # it was the auto budget that split it


def test_at_tp2_every_rank_runs_the_steps_blocks_and_the_answer_is_the_whole_towers(vl_dir):
    """Two ranks over gloo: the image whole (budget 0), then, reloaded to one block a step,
    the same image again over several steps beside a bystander, to the same answer."""
    spec = EngineSpec(model_id="vl", model_dir=str(vl_dir), num_blocks=96, block_size=8,
                      context=512, prefix_cache=False, bytes_per_token=0, tp=2,
                      devices=["cpu", "cpu"],
                      limits=m.Limits(anon_max_in_flight=16, vision_step_budget=0))
    core = EngineCore(spec)
    try:
        img = make_image(*IMAGE, seed=9)
        seen = drain(core, m.ToEngine(new=[image_request(vl_dir, "a", img, max_tokens=6)]))
        assert [b for _, b in seen if b] == [depth(core)]  # whole, in one step
        ref = [tok for t, _ in seen for tok in t.get("a", [])]
        one(core, m.ToEngine(new=[text_request("by", 40)],
                             limits=m.Limits(anon_max_in_flight=16, vision_step_budget=1)))
        one(core)
        seen = drain(core, m.ToEngine(new=[image_request(vl_dir, "b", img, max_tokens=6)]))
        blocks = [b for _, b in seen if b]
        assert blocks == [1] * depth(core)  # a block a step, on every rank
        assert all("by" in t for t, b in seen if b)
        assert [tok for t, _ in seen for tok in t.get("b", [])] == ref
    finally:
        core.close()
