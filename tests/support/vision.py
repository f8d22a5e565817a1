"""transformers as the reference for images: its processor on a tiny vision checkpoint, its
greedy decoding of a prompt with images, and test images.

transformers' Qwen3VLProcessor insists on a video processor, and this machine's video
processor needs torchvision (not installed): `hf_processor` builds the processor without
one; images go through the checkpoint's own image processor (the PIL backend).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

NEAR_TIE = 0.02


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Any:
    """A PIL image of smooth random colour (so resizing changes it, and not into noise)."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    small = (rng.rand(max(2, height // 8), max(2, width // 8), 3) * 255).astype("uint8")
    img = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    return img.convert(mode) if mode != "RGB" else img


@cache
def hf_processor(model_dir: str) -> Any:
    import transformers as tf
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class NoVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    return NoVideo(image_processor=tf.AutoImageProcessor.from_pretrained(model_dir),
                   tokenizer=tok, video_processor=None, chat_template=tok.chat_template)


@cache
def hf_model(model_dir: str) -> Any:
    import transformers as tf

    return tf.Qwen3_5ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()


def hf_inputs(model_dir: Path, messages: list[dict], images: list[Any]) -> dict[str, Any]:
    """The processor's inputs for a chat (its template, image pads expanded)."""
    proc = hf_processor(str(model_dir))
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    return dict(proc(text=[text], images=images or None, return_tensors="pt"))


def hf_greedy_images(model_dir: Path, inputs: dict[str, Any], max_new: int
                     ) -> tuple[list[int], int]:
    """transformers' greedy continuation of the processor's inputs, and the first step whose
    top two logits are within NEAR_TIE (max_new if none)."""
    model = hf_model(str(model_dir))
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    tie = max_new
    for step, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            tie = step
            break
    return new, tie


def image_inputs(model_dir: Path, prompt: list[int], images: list[Any]) -> list[Any]:
    """Our engine's ImageInputs of a prompt whose image pads are expanded (the processor's
    input_ids): each run of pads is the next image."""
    import json

    from helexa.neuron.engine.messages import ImageInput
    from helexa.neuron.vision.processor import ImageProcessor

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    pad, merge = cfg["image_token_id"], cfg["vision_config"]["spatial_merge_size"]
    proc = ImageProcessor.from_dir(model_dir)
    assert proc is not None
    out, i = [], 0
    for img in images:
        p = proc.prepare(img)
        i = prompt.index(pad, i)
        rows, cols = p.grid_h // merge, p.grid_w // merge
        assert prompt[i: i + rows * cols] == [pad] * (rows * cols)
        out.append(ImageInput(offset=i, rows=rows, cols=cols, grid_h=p.grid_h, grid_w=p.grid_w,
                              pixels=p.pixels, content_hash=p.content_hash))
        i += rows * cols
    return out


def greedy_generate_images(runner: Any, prompts: list[list[int]], images: list[list[Any]],
                           max_new: int, *, prefill_chunk: int | None = None) -> list[list[int]]:
    """support.greedy's driver, each sequence carrying its images (ImageInputs): every step
    holds a chunk of each prompt still prefilling and a decode token of the others."""
    from helexa.neuron.engine.images import PromptImages
    from helexa.neuron.engine.model_runner import SeqInput
    from support.greedy import assign_blocks

    n = len(prompts)
    tables = assign_blocks([len(p) + max_new for p in prompts], runner.block_size,
                           runner.num_blocks, shuffle_seed=5)
    mm = [PromptImages.of(imgs) for imgs in images]
    fed, outputs = [0] * n, [[] for _ in range(n)]
    chunk = prefill_chunk or max(len(p) for p in prompts)
    while True:
        active = [i for i in range(n) if len(outputs[i]) < max_new]
        if not active:
            return outputs
        step = []
        for i in active:
            p, m = prompts[i], mm[i]
            if fed[i] < len(p):
                toks = p[fed[i]: fed[i] + chunk]
                delta, spans = m.chunk(fed[i], fed[i] + len(toks)) if m else (0, [])
                step.append(SeqInput(toks, fed[i], tables[i], fed[i] + len(toks) == len(p), i,
                                     rope_delta=delta, images=spans))
                fed[i] += len(toks)
            else:
                step.append(SeqInput([outputs[i][-1]], len(p) + len(outputs[i]) - 1, tables[i],
                                     True, i, rope_delta=m.rope_delta if m else 0))
        picks = iter(runner.execute(step).argmax(dim=-1).tolist())
        for i, s in zip(active, step, strict=True):
            if s.need_logits:
                outputs[i].append(next(picks))


def full_attention_copy(src: Path, dst: Path, seed: int = 1) -> Path:
    """`src` (a tiny vision Qwen3.5) with every layer full attention: no linear-attention
    state, so the prefix cache is on for it (it is off for hybrids). Its linear layers'
    weights become random attention weights, scaled as init-tiny scales them."""
    import json
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg["text_config"]
    h, hd, heads, kv = (text["hidden_size"], text["head_dim"], text["num_attention_heads"],
                        text["num_key_value_heads"])
    t = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    residual = 1.0 / math.sqrt(2 * text["num_hidden_layers"])
    root = "model.language_model.layers."
    for i, kind in enumerate(text["layer_types"]):
        if kind == "full_attention":
            continue
        for name in [k for k in t if k.startswith(f"{root}{i}.linear_attn.")]:
            del t[name]
        a = f"{root}{i}.self_attn."
        for name, rows, cols, scale in (("q_proj", 2 * heads * hd, h, 1.0),
                                        ("k_proj", kv * hd, h, 1.0), ("v_proj", kv * hd, h, 1.0),
                                        ("o_proj", h, heads * hd, residual)):
            t[a + name + ".weight"] = torch.randn(rows, cols, generator=g) * scale / math.sqrt(cols)
        for name in ("q_norm", "k_norm"):
            t[a + name + ".weight"] = 0.1 * torch.randn(hd, generator=g)
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    text.pop("full_attention_interval", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# The engine over a tiny vision checkpoint, as its tests drive it.
VISION_GREEDY: dict[str, Any] = {"temperature": 0.0}
ASK_ABOUT_AN_IMAGE = [{"role": "user", "content": [
    {"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]}]


def vision_core(model_dir: Path, *, prefix_cache: bool = True, **limits: Any) -> Any:
    """An EngineCore on `model_dir` with a small pool (96 blocks of 8, context 512) and
    `limits` over 16 anonymous places."""
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    spec = EngineSpec(model_id="vl", model_dir=str(model_dir), num_blocks=96, block_size=8,
                      context=512, prefix_cache=prefix_cache, bytes_per_token=0,
                      limits=m.Limits(anon_max_in_flight=16, **limits))
    return EngineCore(spec)


def image_request(model_dir: Path, rid: str, image: Any, max_tokens: int = 10) -> Any:
    """A greedy NewRequest asking about `image`, its prompt as transformers' processor
    makes it."""
    from helexa.neuron.engine import messages as m

    prompt = hf_inputs(model_dir, ASK_ABOUT_AN_IMAGE, [image])["input_ids"][0].tolist()
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=m.SamplingParams(**VISION_GREEDY),
                        images=image_inputs(model_dir, prompt, [image]))
