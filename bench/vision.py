"""Vision prefill benchmark: the prefill of one chat request holding a 1024 × 768 image, helexa
against transformers on the same checkpoint, side by side in one run.

    .venv/bin/python bench/vision.py [--threads 1] [--repeats 5] [--model DIR]

Without --model it builds (once, cached) a Qwen3.5 with a vision tower: an init-tiny
qwen3_5 --vision with hidden 256, 8 layers (6 Gated DeltaNet, 2 full attention), 8 heads /
4 kv heads, intermediate 768, and init-tiny's small tower (hidden 32, depth 2), fp32. The
image is 1024 × 768: 3,072 patches, 768 image tokens in the prompt.

Each contender does what a request's prefill does, from the image file to the first
token's logits:
- helexa: decode and resize (helexa/neuron/vision/, Pillow), the template and the image
  pads, then one ModelRunner step over the whole prompt (the tower in that step);
- transformers: its processor (PIL backend) on the same image and chat, then one forward
  of Qwen3_5ForConditionalGeneration with use_cache.
Contenders run interleaved, each once per repeat; the ratio is the median over repeats of
each repeat's own ratio (a shared machine's drifts cancel within a pair). The split of
helexa's time into preprocessing and the model step is printed beside it.

Benchmarks print figures; they assert nothing. GPU figures are not measured here.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the transformers reference helpers


def default_model() -> Path:
    from helexa.fixtures.tiny import cache_dir, init_tiny

    out = cache_dir() / "bench" / "qwen3_5-vision-h256-l8"
    if not (out / "model.safetensors").is_file():
        init_tiny(out, arch="qwen3_5", vision=True, hidden_size=256, num_layers=8, num_heads=8,
                  num_kv_heads=4, intermediate_size=768, vocab_size=2048, seed=0)
    return out


def image_file(width: int, height: int) -> bytes:
    from support.vision import make_image

    buf = io.BytesIO()
    make_image(width, height, seed=7).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model()
    data = image_file(args.width, args.height)

    from PIL import Image
    from support.vision import hf_model, hf_processor

    from helexa.neuron import agent
    from helexa.neuron.engine.images import PromptImages
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
    from helexa.neuron.tokenizer import Tokenizer
    from helexa.neuron.vision.prompt import with_images
    from helexa.proto import neuron_pb2 as pb

    tok = Tokenizer.from_dir(model_dir)
    req = pb.GenerateRequest(model="bench", chat=pb.Chat(messages=[pb.ChatMessage(
        role="user", parts=[pb.ContentPart(image=pb.Image(data=data)),
                            pb.ContentPart(text="Describe this picture in detail.")])]))
    runner = ModelRunner(model_dir, num_blocks=256, block_size=16, max_num_seqs=1,
                         max_batched_tokens=4096, dtype="float32", num_state_slots=1)
    hf, proc = hf_model(str(model_dir)), hf_processor(str(model_dir))
    hf_msgs = [{"role": "user", "content": [{"type": "image"},
                                            {"type": "text", "text": "Describe this picture "
                                                                     "in detail."}]}]

    def helexa_prefill() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        msgs, kwargs = agent.template_inputs(req.chat, "")
        ids, images = with_images(tok, req, tok.encode_chat(msgs, **kwargs))
        t1 = time.perf_counter()
        delta, spans = PromptImages.of(images).chunk(0, len(ids))
        runner.execute([SeqInput(ids, 0, list(range(-(-len(ids) // 16))), True, 0,
                                 rope_delta=delta, images=spans)])
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, len(ids)

    def hf_prefill() -> tuple[float, int]:
        t0 = time.perf_counter()
        text = proc.tokenizer.apply_chat_template(hf_msgs, tokenize=False,
                                                  add_generation_prompt=True)
        inputs = proc(text=[text], images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        with torch.inference_mode():
            hf(**inputs, use_cache=True)
        return time.perf_counter() - t0, int(inputs["input_ids"].shape[1])

    helexa_prefill(), hf_prefill()  # warm both (kernel choices, allocator, caches)
    ours, pre, theirs, ratios = [], [], [], []
    for _ in range(args.repeats):
        total, prep, n_ours = helexa_prefill()
        ref, n_ref = hf_prefill()
        ours.append(total)
        pre.append(prep)
        theirs.append(ref)
        ratios.append(total / ref)
    assert n_ours == n_ref, (n_ours, n_ref)
    med = statistics.median
    print(f"model {model_dir}  image {args.width}x{args.height}  prompt {n_ours} tokens  "
          f"threads {args.threads}  repeats {args.repeats}")
    print(f"  helexa prefill        {med(ours) * 1000:8.1f} ms  (preprocess "
          f"{med(pre) * 1000:.1f} ms, model step {(med(ours) - med(pre)) * 1000:.1f} ms)")
    print(f"  transformers prefill  {med(theirs) * 1000:8.1f} ms  (processor + one forward)")
    print(f"  helexa / transformers {med(ratios):8.2f}  (median of per-repeat ratios; < 1 is "
          "faster)")
    runner.close()


if __name__ == "__main__":
    main()
