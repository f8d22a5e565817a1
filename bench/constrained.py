"""Constrained decoding's cost to the batch: 8-stream decode tok/s, half of the streams
schema-constrained vs none, side by side in one run.

    .venv/bin/python bench/constrained.py [--threads 1] [--repeats 5] [--tokens 64] [--model DIR]

Without --model it uses the engine benchmark's checkpoint (helexa.fixtures.tiny.bench_checkpoint:
an init-tiny qwen3, hidden 512, 8 layers, vocab 8192). Both contenders run through
EngineCore (the engine's own step loop with the real sampler and grammar masks), 8
requests admitted together, `--tokens` decode tokens each (eos is no stop; the constrained
ones follow a JSON schema whose minimum length keeps them open that long, so both
contenders decode the same tokens; the script checks it), greedy. Contenders alternate within each repeat and the ratio is
the median over repeats of each repeat's own ratio (the machine's drifts cancel within a
pair). Also printed: llguidance's mask time per constrained row per step, measured on
its own. The issue's target: constrained/none >= 0.8.

Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from helexa import grammar
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.tokenizer import Tokenizer

# Its minimum length keeps every constrained stream open past `--tokens` (so both contenders
# decode the same number of tokens), through strings, separators and nesting.
SCHEMA = {"type": "object", "required": ["title", "notes"], "properties": {
    "title": {"type": "string", "minLength": 40, "maxLength": 80},
    "notes": {"type": "array", "minItems": 40,
              "items": {"type": "string", "minLength": 8, "maxLength": 40}}}}
STREAMS = 8


def run(core: EngineCore, prompts: list[list[int]], grammar_text: str | None, constrained: int,
        tokens: int, tag: str) -> float:
    """Decode tokens per second over the batch (prefill excluded); every stream must have
    produced `tokens` tokens."""
    new = [m.NewRequest(req_id=f"{tag}{i}", prompt_token_ids=p, max_tokens=tokens,
                        sampling=m.SamplingParams(temperature=0.0),
                        grammar=grammar_text if i < constrained else None)
           for i, p in enumerate(prompts)]
    out = core.step(m.ToEngine(new=new))
    counts = {r.req_id: 0 for r in new}
    for u in out.updates:
        counts[u.req_id] += len(u.new_token_ids)
    while any(core.requests[r].is_prefilling for r in core.requests):  # prefill first
        out = core.step()
        for u in out.updates:
            counts[u.req_id] += len(u.new_token_ids)
    start_tokens = sum(counts.values())
    t0 = time.perf_counter()
    while core.has_work:
        out = core.step()
        for u in out.updates:
            counts[u.req_id] += len(u.new_token_ids)
            if u.error:
                raise RuntimeError(f"{u.req_id}: {u.error}")
    secs = time.perf_counter() - t0
    short = {r: n for r, n in counts.items() if n != tokens}
    if short:
        raise RuntimeError(f"streams ended early (tokens each): {short}")
    return (sum(counts.values()) - start_tokens) / secs


def mask_us(model_dir: Path, grammar_text: str, vocab: int, eos: list[int]) -> float:
    """Median µs for one row's mask, llguidance alone."""
    import llguidance
    import llguidance.torch as lgt

    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab,
                                 eos_token=eos)
    mt = llguidance.LLMatcher(tok, grammar_text, log_level=0)
    mask = lgt.allocate_token_bitmask(1, vocab)
    times = []
    for t in tok.tokenize_str('{"title":"a long title of the bench","notes":["x","y"'):
        t0 = time.perf_counter()
        lgt.fill_next_token_bitmask(mt, mask, 0)
        times.append(time.perf_counter() - t0)
        mt.consume_token(t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from helexa.fixtures.tiny import bench_checkpoint
        args.model = bench_checkpoint()
    tok = Tokenizer.from_dir(args.model)
    spec = EngineSpec(model_id="bench", model_dir=str(args.model), num_blocks=512,
                      block_size=16, context=2048, bytes_per_token=0, prefix_cache=False,
                      limits=m.Limits(max_slots=STREAMS, anon_max_in_flight=STREAMS))
    core = EngineCore(spec)
    g = grammar.grammar_text(grammar.json_schema(SCHEMA))
    prompts = [tok.encode_chat([{"role": "user", "content": f"Record number {i}, as JSON."}])
               for i in range(STREAMS)]
    run(core, prompts, g, STREAMS // 2, args.tokens, "warm")  # first-use costs (llguidance tokenizer)
    free, half, ratios = [], [], []
    for r in range(args.repeats):
        a = run(core, prompts, g, 0, args.tokens, f"n{r}-")
        b = run(core, prompts, g, STREAMS // 2, args.tokens, f"c{r}-")
        free.append(a)
        half.append(b)
        ratios.append(b / a)
    core.close()
    print(f"model {args.model.name}, {STREAMS} streams x {args.tokens} decode tokens, "
          f"{args.threads} torch thread(s), {args.repeats} repeats")
    print(f"  none constrained   {statistics.median(free):8.1f} tok/s (median)")
    print(f"  half constrained   {statistics.median(half):8.1f} tok/s (median)")
    print(f"  ratio half/none    {statistics.median(ratios):8.3f} (target >= 0.8)")
    vocab = core.grammars.vocab_size
    print(f"  llguidance mask    {mask_us(args.model, g, vocab, tok.eos_token_ids):8.1f} "
          f"us per row per step (vocab {vocab})")


if __name__ == "__main__":
    main()
