"""The engine serving images: embeddings computed in the step that prefills them, image
tokens counted in the prompt and the reservation, the prefix cache keying image tokens by
the image's content (two different images of the same size never share KV: each answer
equals a cold run, and they differ), an image request's blocks and state returned once
whatever ends it, and images refused by a model without a tower."""

from __future__ import annotations

import pytest
from support.vision import (
    full_attention_copy,
    hf_inputs,
    image_inputs,
    image_request,
    make_image,
    vision_core,
)

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = m.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


@pytest.fixture(scope="module")
def dense_vl(vl_dir, tmp_path_factory):
    return full_attention_copy(vl_dir, tmp_path_factory.mktemp("dense") / "vl")


def run(core: EngineCore, *reqs: m.NewRequest) -> tuple[dict[str, list[int]], dict]:
    tokens: dict[str, list[int]] = {}
    admitted: dict[str, m.RequestUpdate] = {}
    inbound: m.ToEngine | None = m.ToEngine(new=list(reqs))
    while True:
        for u in core.step(inbound).updates:
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            assert not u.refused_code, u.refused_message
            if u.admitted:
                admitted[u.req_id] = u
        inbound = None
        core.pool.check()
        if not core.has_work:
            return tokens, admitted


def assert_whole(core: EngineCore) -> None:
    led = core.pool.ledger()
    assert led.free_bytes == led.total_bytes and not led.reserved_bytes and not led.used_bytes


def test_different_images_of_one_size_never_share_kv(dense_vl):
    from PIL import Image

    x, y = (Image.new("RGB", (100, 70), c) for c in ((0, 0, 0), (255, 255, 255)))  # 6 tokens
    cold = {name: run(vision_core(dense_vl, prefix_cache=False),
                      image_request(dense_vl, name, img))[0][name]
            for name, img in (("x", x), ("y", y))}
    assert cold["x"] != cold["y"]
    core = vision_core(dense_vl)
    first, _ = run(core, image_request(dense_vl, "x1", x))
    second, adm = run(core, image_request(dense_vl, "y1", y))  # same tokens, other pixels
    assert first["x1"] == cold["x"] and second["y1"] == cold["y"]
    image_at = image_request(dense_vl, "q", x).images[0].offset
    assert adm["y1"].cached_tokens <= image_at  # nothing from the image on was reused
    again, adm = run(core, image_request(dense_vl, "x2", x))
    assert again["x2"] == cold["x"]
    assert adm["x2"].cached_tokens > image_at  # the same image is a hit, past its tokens
    assert_whole(core)


def test_image_tokens_count_and_chunked_prefill_runs_the_tower_once(vl_dir):
    img = make_image(200, 130, 3)  # 24 image tokens, prefilled in chunks of 5
    req = image_request(vl_dir, "a", img)
    core = vision_core(vl_dir, prefill_chunk_tokens=5)
    tokens, adm = run(core, req)
    assert adm["a"].prompt_tokens == len(req.prompt_token_ids) >= 24 + 5
    assert core.runner.vision.tower_runs == 1
    assert tokens["a"] == run(vision_core(vl_dir), image_request(vl_dir, "b", img))[0]["b"]
    assert_whole(core)


def test_aborted_mid_image_and_refused_images_leave_the_pool_whole(vl_dir, tiny_checkpoint):
    core = vision_core(vl_dir, prefill_chunk_tokens=3)
    core.step(m.ToEngine(new=[image_request(vl_dir, "a", make_image(200, 130, 4), max_tokens=50)]))
    core.step(None)  # one chunk in: the image's embeddings are cached
    core.step(m.ToEngine(aborts=[m.Abort(req_id="a")]))
    assert not core.has_work
    assert_whole(core)
    bad = image_request(vl_dir, "b", make_image(64, 64, 5))
    shifted = m.NewRequest(req_id="b", prompt_token_ids=bad.prompt_token_ids, sampling=GREEDY,
                           images=[m.ImageInput(**{**_fields(bad.images[0]), "offset": 0})])
    upd = core.step(m.ToEngine(new=[shifted])).updates[0]
    assert upd.refused_code == "invalid_request_error" and "not image tokens" in upd.refused_message
    text_only = vision_core(tiny_checkpoint("qwen3_5"))
    ask = image_request(vl_dir, "c", make_image(64, 64, 6))
    upd = text_only.step(m.ToEngine(new=[ask])).updates[0]
    assert "takes no images" in upd.refused_message
    assert_whole(core)
    assert_whole(text_only)


def _fields(img: m.ImageInput) -> dict:
    return {f: getattr(img, f) for f in img.__struct_fields__}


def test_one_tower_call_holds_at_most_the_largest_image(vl_dir, tmp_path):
    """Images of two requests prefilled in one step: each is the processor's largest, so
    they go through the tower in two calls (the activations helexa plan sets aside are one
    largest image's), and each answer equals its request run alone."""
    import json
    import shutil

    small = shutil.copytree(vl_dir, tmp_path / "small")
    proc = json.loads((small / "preprocessor_config.json").read_text())
    proc["size"] = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    (small / "preprocessor_config.json").write_text(json.dumps(proc))
    a, b = make_image(128, 128, 5), make_image(128, 128, 6)  # 64 patches: max_pixels each
    core = vision_core(small)
    both, _ = run(core, image_request(small, "a", a), image_request(small, "b", b))
    assert core.runner.vision.tower_runs == 2
    assert both["a"] == run(vision_core(small), image_request(small, "a", a))[0]["a"]
    assert both["b"] == run(vision_core(small), image_request(small, "b", b))[0]["b"]
    assert_whole(core)


def test_an_image_requests_decode_steps_run_on_shifted_1d_positions(vl_dir, monkeypatch):
    """A CUDA graph reads only a step's 1-D positions: every step no image token is in (an
    image request's decode steps, and text chunks after the image) reaches the executor
    with no MmStep and its positions shifted by the request's rope_delta, max(rows, cols) -
    rows x cols for one image, and the tokens are those of the M-RoPE path (each step's
    (t, h, w) handed to the model, as before)."""
    from helexa.neuron.engine.vision_step import VisionStep

    img = make_image(200, 130, 3)
    core = vision_core(vl_dir)
    seen: list[tuple[bool, list[int]]] = []
    executor, real_run = core.runner.backend.executor, core.runner.backend.executor.run

    def run_step(model, ids, positions, *rest):
        seen.append((model.mm is None, positions.tolist()))
        return real_run(model, ids, positions, *rest)

    monkeypatch.setattr(executor, "run", run_step)
    req = image_request(vl_dir, "a", img)
    tokens = run(core, req)[0]["a"]
    image = req.images[0]
    delta = max(image.rows, image.cols) - image.rows * image.cols
    assert delta < 0 and not seen[0][0]  # the chunk with the image: the M-RoPE path
    decodes = [pos for plain, pos in seen if len(pos) == 1]
    assert len(decodes) == len(tokens) - 1
    assert all(plain for plain, pos in seen[1:])  # no image token after the first chunk
    prompt = len(req.prompt_token_ids)
    assert decodes == [[prompt + i + delta] for i in range(len(decodes))]

    def mrope_attach(self, seqs, starts, positions):  # the M-RoPE path for every step
        self.model.mm = self.inputs(seqs, starts, positions) if self.takes_images else None
        return positions

    monkeypatch.setattr(VisionStep, "attach", mrope_attach)
    assert run(vision_core(vl_dir), image_request(vl_dir, "b", img))[0]["b"] == tokens


def test_a_step_reading_more_images_than_the_cache_holds(vl_dir):
    """Two requests of 9 images each, prefilled in one step: 18 images the step reads,
    past the embedding cache's 16. None of them is evicted before the step reads it (it
    failed every request of the step with a KeyError), a text request beside them is
    served, and the pool comes back whole."""
    images = [make_image(32, 32, seed=s) for s in range(18)]
    reqs = []
    for i in range(2):
        mine = images[9 * i: 9 * i + 9]
        ask = [{"role": "user", "content": [{"type": "image"} for _ in mine]
                + [{"type": "text", "text": "Which?"}]}]
        prompt = hf_inputs(vl_dir, ask, mine)["input_ids"][0].tolist()
        reqs.append(m.NewRequest(req_id=f"nine{i}", prompt_token_ids=prompt, max_tokens=3,
                                 sampling=GREEDY, images=image_inputs(vl_dir, prompt, mine)))
    reqs.append(m.NewRequest(req_id="text", prompt_token_ids=[5, 6, 7], max_tokens=3,
                             sampling=GREEDY))
    core = vision_core(vl_dir, prefill_chunk_tokens=1024)
    assert sum(len(r.images) for r in reqs if r.images) > core.runner.vision.max_cached
    tokens, _ = run(core, *reqs)
    assert {k: len(v) for k, v in tokens.items()} == {"nine0": 3, "nine1": 3, "text": 3}
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_the_embedding_cache_holds_no_more_than_two_largest_images(vl_dir):
    """Images encoded and never finished (their requests aborted mid-image) stay cached
    until pushed out: the cache keeps at most two of the largest image's embeddings
    between steps (max_cached_bytes), whatever their count, newest kept."""
    core = vision_core(vl_dir)
    vision = core.runner.vision
    images = [make_image(448 + 16 * i, 448, seed=i) for i in range(12)]  # ~800-1,100 patches each
    ask = [{"role": "user", "content": [{"type": "image"} for _ in images]}]
    prompt = hf_inputs(vl_dir, ask, images)["input_ids"][0].tolist()
    inputs = image_inputs(vl_dir, prompt, images)
    for img in inputs:  # one at a time, as steps that reach an image and never finish it
        vision._encode([img])
        vision._evict({img.content_hash})
    assert 0 < vision.cached_bytes <= vision.max_cached_bytes
    # each entry holds its own memory (a view of a tower call's output over several images
    # would keep all of it alive, unseen by the bound)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for t in vision._cache.values())
    assert len(vision._cache) < len(inputs)
    assert inputs[-1].content_hash in vision._cache  # the newest stays


def test_an_unfinished_image_outlives_a_step_that_finishes_others(vl_dir):
    """The cache is cut after a step drops the images it finished: request C's half-read
    image survives a step of request R that finishes image a and starts b, since b and C's
    image fit the bound once a is gone (cut before the drop, C's image was evicted and its
    tower run repeated). Three of the largest images: two fit the bound, three do not."""
    import torch

    from helexa.neuron.engine.images import PromptImages
    from helexa.neuron.engine.seq_input import SeqInput

    core = vision_core(vl_dir)
    vision = core.runner.vision
    big = [make_image(1024, 1024, seed=60 + i) for i in range(3)]  # the processor's largest

    def prompt_of(images):
        ask = [{"role": "user", "content": [{"type": "image"} for _ in images]}]
        ids = hf_inputs(vl_dir, ask, images)["input_ids"][0].tolist()
        return ids, PromptImages.of(image_inputs(vl_dir, ids, images))

    c_ids, c_imgs = prompt_of(big[:1])
    r_ids, r_imgs = prompt_of(big[1:])
    c, (a, b) = c_imgs.spans[0].image, [sp.image for sp in r_imgs.spans]
    assert 2 * c.num_tokens * 64 * 4 == vision.max_cached_bytes  # fp32, hidden 64

    def step(ids, imgs, start, end):
        delta, spans = imgs.chunk(start, end)
        seq = SeqInput(ids[start:end], start, [], False, 0, rope_delta=delta, images=spans)
        vision.inputs([seq], [0], torch.arange(start, end))

    runs = vision.tower_runs
    step(c_ids, c_imgs, 0, c.offset + 10)  # C reads half its image
    step(r_ids, r_imgs, 0, a.offset + 10)  # R reads half of a
    step(r_ids, r_imgs, a.offset + 10, b.offset + 10)  # R finishes a, starts b; C waits
    assert set(vision._cache) == {c.content_hash, b.content_hash}
    step(c_ids, c_imgs, c.offset + 10, len(c_ids))  # C finishes: no second tower run
    assert vision.tower_runs == runs + 3 and c.content_hash not in vision._cache
