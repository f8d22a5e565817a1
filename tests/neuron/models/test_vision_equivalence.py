"""Qwen3.5 with images decodes greedily as transformers' Qwen3_5ForConditionalGeneration does
with its own processor, token for token up to the first near-tie, on a tiny vision
checkpoint transformers' save_pretrained wrote: one image, two images of different sizes,
an image in each of two turns, a batch mixing image and text-only requests, a prefill
chunked smaller than an image, and tensor parallel 2 over gloo. A text-only request to the
vision checkpoint is the text model's, token for token; the tower alone and the M-RoPE
positions equal transformers' own."""

from __future__ import annotations

import shutil

import pytest
import torch
from support.greedy import greedy_generate
from support.vision import (
    greedy_generate_images,
    hf_greedy_images,
    hf_inputs,
    hf_model,
    image_inputs,
    make_image,
)

from helexa.neuron.engine.images import PromptImages, chunk_positions
from helexa.neuron.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW_TOKENS = 24


def _user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else
                                        {"type": "text", "text": p} for p in parts]}


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint, tmp_path_factory):
    """init-tiny --vision, loaded and saved again by transformers' own save_pretrained."""
    src = tiny_checkpoint("qwen3_5", vision=True)
    out = tmp_path_factory.mktemp("vl") / "saved"
    hf_model(str(src)).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(src / f, out / f)
    return out


def runner(model_dir, tp: int = 1) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=128, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", device="cpu",
                       devices=["cpu"] * tp, tp_size=tp, num_state_slots=8)


def check(model_dir, messages, images, ours_of) -> None:
    inputs = hf_inputs(model_dir, messages, images)
    prompt = inputs["input_ids"][0].tolist()
    ref, tie = hf_greedy_images(model_dir, inputs, NEW_TOKENS)
    assert tie >= 6, f"reference near-tie at step {tie}: the test would prove little"
    ours = ours_of(prompt, image_inputs(model_dir, prompt, images))
    assert ours[:tie] == ref[:tie], f"ours {ours[:tie]}\nref  {ref[:tie]}"


@pytest.fixture(scope="module")
def one(vl_dir):
    return runner(vl_dir)


def test_one_image(vl_dir, one):
    check(vl_dir, [_user(None, "What is in this picture?")], [make_image(100, 70, 1)],
          lambda p, im: greedy_generate_images(one, [p], [im], NEW_TOKENS)[0])


def test_two_images_of_different_sizes_chunked_smaller_than_an_image(vl_dir, one):
    imgs = [make_image(200, 130, 2), make_image(64, 130, 3)]  # 24 and 8 image tokens
    before = one.vision.tower_runs
    check(vl_dir, [_user("Compare", None, "with", None, "please.")], imgs,
          lambda p, im: greedy_generate_images(one, [p], [im], NEW_TOKENS,
                                               prefill_chunk=7)[0])
    # chunks of 7 cross each image; the tower ran once per chunk that began an image
    assert one.vision.tower_runs - before == 2


def test_an_image_in_each_of_two_turns(vl_dir, one):
    msgs = [_user(None, "Describe it."), {"role": "assistant", "content": "A grid of colour."},
            _user("And this one?", None)]
    check(vl_dir, msgs, [make_image(96, 96, 4), make_image(150, 80, 5)],
          lambda p, im: greedy_generate_images(one, [p], [im], NEW_TOKENS)[0])


def test_a_batch_mixing_image_and_text_only_requests(vl_dir, one):
    cases = [([_user(None, "What is this?")], [make_image(100, 70, 11)]),
             ([_user("Say something about tea.")], []),
             ([_user(None, "and", None)], [make_image(64, 64, 7), make_image(128, 90, 8)]),
             ([_user("A longer text-only question, asked alongside images.")], [])]
    prompts, imgs, refs = [], [], []
    for msgs, images in cases:
        inputs = hf_inputs(vl_dir, msgs, images)
        p = inputs["input_ids"][0].tolist()
        prompts.append(p)
        imgs.append(image_inputs(vl_dir, p, images))
        refs.append(hf_greedy_images(vl_dir, inputs, NEW_TOKENS))
    outs = greedy_generate_images(one, prompts, imgs, NEW_TOKENS, prefill_chunk=5)
    for ours, (ref, tie) in zip(outs, refs, strict=True):
        assert tie >= 6 and ours[:tie] == ref[:tie]


def test_tp2_over_gloo(vl_dir):
    imgs = [make_image(160, 100, 9)]
    two = runner(vl_dir, tp=2)
    try:
        check(vl_dir, [_user(None, "Two ranks, one picture.")], imgs,
              lambda p, im: greedy_generate_images(two, [p], [im], NEW_TOKENS,
                                                   prefill_chunk=9)[0])
    finally:
        two.close()


def test_text_only_is_the_text_models_output(vl_dir, one, tiny_checkpoint):
    text_model = runner(tiny_checkpoint("qwen3_5", head_dim=32))
    prompt = hf_inputs(vl_dir, [_user("No picture here, only words.")], [])["input_ids"][0]
    prompt = prompt.tolist()
    assert greedy_generate(one, [prompt], NEW_TOKENS) == greedy_generate(text_model, [prompt],
                                                                         NEW_TOKENS)


def test_the_tower_alone_and_the_positions_equal_transformers(vl_dir, one):
    imgs = [make_image(100, 70, 1), make_image(40, 300, 3), make_image(330, 200, 2)]
    inputs = hf_inputs(vl_dir, [_user(None, "x", None, None, "y")], imgs)
    model = hf_model(str(vl_dir))
    with torch.inference_mode():
        ref = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
        ours = one.model.visual(inputs["pixel_values"], grids)
    torch.testing.assert_close(ours, ref.pooler_output, atol=1e-5, rtol=1e-5)
    prompt = inputs["input_ids"][0].tolist()
    expected, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"])
    mm = PromptImages.of(image_inputs(vl_dir, prompt, imgs))
    assert mm is not None
    for start, n in ((0, len(prompt)), (3, 17), (20, 9)):  # chunks inside and across images
        delta, spans = mm.chunk(start, start + n)
        got = chunk_positions(start, n, delta, spans)
        assert [list(a) for a in got] == expected[:, 0, start: start + n].tolist()
    assert mm.rope_delta == int(expected.max()) + 1 - len(prompt)
