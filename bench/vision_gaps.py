"""Bystander gap benchmark: how long a decoding stream waits for its next token while another
request's largest image goes through the vision tower, with the tower in one step
(engine.vision_step_budget = 0, as before the budget) and spread over steps: by the auto
budget (engine.vision_step_ms over the tower's measured cost, vision_pace.py) or a fixed one.

    .venv/bin/python bench/vision_gaps.py [--threads 1] [--repeats 3] [--budgets 0,auto,1]

The model (built once, cached): an init-tiny qwen3_5 --vision with hidden 256, 4 layers
(3 Gated DeltaNet, 1 full attention), whose tower is made deeper and wider than
init-tiny's so that it weighs what a real one does against its text model: depth 8,
hidden 128, 2 heads, intermediate 512, fp32. The image is the largest the processor
takes, 1024 × 1024: 4,096 patches, 1,024 image tokens (prefilled in chunks of 512).

Each run is one in-process EngineCore (as a neuron's engine process runs it): a text
request decoding (the bystander), then the image request; the engine steps until the
image request has its first token. Printed per budget: the bystander's largest gap
between two tokens from the image's arrival to that first token (median over repeats),
its median gap, the steps and the tower blocks the largest step ran, and the image
request's time to first token; then each budget's largest gap over budget 0's, and the
bystander's decode step alone before the image came (what the auto budget's
engine.vision_step_ms is set beside).

Benchmarks print figures; they assert nothing. GPU figures are not measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # support.vision: images and their ImageInputs
TOWER = {"depth": 8, "hidden_size": 128, "num_heads": 2, "intermediate_size": 512}


def default_model() -> Path:
    from safetensors.torch import load_file, save_file

    from helexa.fixtures import vision as vis
    from helexa.fixtures.tiny import cache_dir, init_tiny

    out = cache_dir() / "bench" / "qwen3_5-vision-h256-l4-tower8x128"
    if (out / "model.safetensors").is_file():
        return out
    init_tiny(out, arch="qwen3_5", vision=True, hidden_size=256, num_layers=4, num_heads=8,
              num_kv_heads=4, intermediate_size=768, vocab_size=2048, seed=0)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vision_config"].update(TOWER)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    weights = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
               if not k.startswith("model.visual.")}
    weights.update(vis.vision_weights(cfg, seed=0))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def one_run(model_dir: Path, budget: int | None, image: object) -> dict[str, float]:
    from support.vision import image_inputs

    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    pad = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    greedy = m.SamplingParams(temperature=0.0)
    spec = EngineSpec(model_id="vl", model_dir=str(model_dir), num_blocks=256, block_size=16,
                      context=2048, bytes_per_token=0,
                      limits=m.Limits(anon_max_in_flight=8, vision_step_budget=budget))
    core = EngineCore(spec)
    prompt = [5, 6, 7] + [pad] * 1024 + [8, 9]
    img = m.NewRequest(req_id="img", prompt_token_ids=prompt, max_tokens=4, sampling=greedy,
                       images=image_inputs(model_dir, prompt, [image]))
    core.step(m.ToEngine(new=[m.NewRequest(req_id="by", prompt_token_ids=list(range(10, 40)),
                                           max_tokens=1500, sampling=greedy)]))
    core.step(None)
    start = time.perf_counter()
    for _ in range(5):  # the bystander decodes: its step alone, the image not yet come
        core.step(None)
    before_gap = (time.perf_counter() - start) / 5
    vision = core.runner.vision
    last = arrived = time.perf_counter()
    gaps: list[float] = []
    steps = most_blocks = 0
    inbound: m.ToEngine | None = m.ToEngine(new=[img])
    while True:
        before = vision.blocks_run
        out = core.step(inbound)
        inbound = None
        now = time.perf_counter()
        steps += 1
        most_blocks = max(most_blocks, vision.blocks_run - before)
        got = {u.req_id for u in out.updates if u.new_token_ids}
        if "by" in got:
            gaps.append(now - last)
            last = now
        if "img" in got:
            core.close()
            return {"max_gap": max(gaps), "median_gap": statistics.median(gaps),
                    "ttft": now - arrived, "steps": steps, "blocks": most_blocks,
                    "decode": before_gap}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="0,auto,1",
                    help="patch-blocks a step; auto = unset (measured); 0 = whole")
    args = ap.parse_args(argv)
    from helexa.log import setup_logging

    setup_logging("bench", level="warning")  # the engines' load lines would bury the table
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model()
    budgets = [None if b == "auto" else int(b) for b in args.budgets.split(",")]
    from support.vision import make_image

    image = make_image(1024, 1024, seed=7)
    one_run(model_dir, budgets[0], image)  # warm (kernel choices, allocator)
    runs: dict[int | None, list[dict[str, float]]] = {b: [] for b in budgets}
    for _ in range(args.repeats):  # interleaved: a shared machine's drift hits all alike
        for b in budgets:
            runs[b].append(one_run(model_dir, b, image))
    med = statistics.median
    print(f"model {model_dir}  tower {TOWER}  image 1024x1024 (4096 patches)  "
          f"threads {args.threads}  repeats {args.repeats}")
    base = med(r["max_gap"] for r in runs[budgets[0]])
    for b in budgets:
        rs = runs[b]
        worst = med(r["max_gap"] for r in rs)
        print(f"  budget {'auto' if b is None else b:>6}  bystander max gap {worst * 1000:8.1f} ms  median gap "
              f"{med(r['median_gap'] for r in rs) * 1000:6.1f} ms  image ttft "
              f"{med(r['ttft'] for r in rs) * 1000:8.1f} ms  steps {med(r['steps'] for r in rs):.0f}"
              f"  most blocks a step {max(r['blocks'] for r in rs)}  max gap / budget "
              f"{budgets[0]}'s {worst / base:5.2f}  decode step before the image "
              f"{med(r['decode'] for r in rs) * 1000:5.1f} ms")


if __name__ == "__main__":
    main()
