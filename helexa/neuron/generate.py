"""`helexa generate`: offline generation from a checkpoint folder, in-process.

    helexa generate --model DIR --prompt TEXT [--chat] [--max-tokens N]
                    [--temperature T] [--seed S] [--device cpu] [--dtype auto]

Tokenises the prompt (as a one-turn chat with --chat, through the
checkpoint's chat template), runs an EngineCore in this process on a pool
just large enough for the request, and prints the text as it is generated
(stops at an eos token or after --max-tokens). The same engine and sampler
as the daemon, without gRPC or a second process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from helexa.budget import blocks_for_tokens
from helexa.neuron.engine import messages


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helexa generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of a chat")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    return p


def generate(model_dir: Path, prompt_ids: list[int], *, max_tokens: int,
             sampling: messages.SamplingParams, stop_token_ids: list[int],
             device: str = "cpu", dtype: str = "auto", kv_dtype: str = "auto",
             block_size: int = 16, on_tokens=None) -> tuple[list[int], messages.FinishReason]:
    """Run one request through an in-process EngineCore; returns (tokens, finish reason)."""
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    total = len(prompt_ids) + max_tokens
    from helexa.checkpoint.gguf import read_config

    config = read_config(model_dir)  # config.json, or a GGUF file's metadata
    max_pos = int(config.get("max_position_embeddings") or total)
    if total > max_pos:
        raise ValueError(f"prompt {len(prompt_ids)} + max tokens {max_tokens} = {total} tokens;"
                         f" the model addresses {max_pos} positions")
    spec = EngineSpec(model_id=model_dir.name, model_dir=str(model_dir), devices=[device],
                      dtype=dtype, kv_dtype=kv_dtype, block_size=block_size,
                      num_blocks=blocks_for_tokens(total, block_size), context=total,
                      prefix_cache=False,
                      limits=messages.Limits(max_slots=1, max_in_flight=1,
                                             max_batched_tokens=max(total, 512),
                                             prefill_chunk_tokens=max(total, 512)))
    core = EngineCore(spec)
    inbound: messages.ToEngine | None = messages.ToEngine(new=[messages.NewRequest(
        req_id="generate", prompt_token_ids=prompt_ids, max_tokens=max_tokens,
        sampling=sampling, stop_token_ids=stop_token_ids)])
    tokens: list[int] = []
    while True:
        out = core.step(inbound)
        inbound = None
        for upd in out.updates:
            if upd.refused_code:
                raise ValueError(f"{upd.refused_code}: {upd.refused_message}")
            tokens += upd.new_token_ids
            if on_tokens is not None and upd.new_token_ids:
                on_tokens(upd.new_token_ids)
            if upd.finished is not None:
                if upd.finished == messages.FinishReason.ERROR:
                    raise RuntimeError(upd.error)
                return tokens, upd.finished


class _CurrentStderr:
    """sys.stderr as it is at each write (a caller may swap it, as pytest's capture does)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model_dir = Path(args.model)
    from helexa.checkpoint.gguf import model_path_error

    problem = model_path_error(model_dir)
    if problem is not None:
        print(f"helexa generate: {problem}", file=sys.stderr)
        return 2
    import torch

    from helexa.log import setup_logging
    from helexa.neuron.detokenizer import IncrementalDetokenizer
    from helexa.neuron.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    # stdout carries the text alone; warnings go to whatever sys.stderr is when they happen
    setup_logging("neuron", "warning", stream=_CurrentStderr())
    tok = Tokenizer.from_dir(model_dir)
    if args.chat:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    sampling = messages.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, seed=args.seed)

    def show(ids: list[int]) -> None:
        sys.stdout.write(detok.add(ids))
        sys.stdout.flush()

    try:
        _, _reason = generate(model_dir, prompt_ids, max_tokens=args.max_tokens, sampling=sampling,
                              stop_token_ids=[] if args.ignore_eos else tok.eos_token_ids,
                              device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                              block_size=args.block_size, on_tokens=show)
    except ValueError as e:
        print(f"\nhelexa generate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(detok.flush() + "\n")
    return 0
