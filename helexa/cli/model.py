"""`helexa model init-tiny DIR`: write a tiny random checkpoint for tests and local runs."""

from __future__ import annotations

import argparse

from helexa.fixtures.tiny import ARCHS, CHAT_TEMPLATES, TINY_CONTEXT, init_tiny


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="helexa model", description=__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    tiny = sub.add_parser("init-tiny", help="write a tiny Hugging Face checkpoint folder "
                          "(random weights, a real byte-level BPE tokenizer, ChatML template)")
    tiny.add_argument("dir", help="folder to write (created if missing)")
    tiny.add_argument("--arch", choices=ARCHS, default="qwen3")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=None,
                      help="number of decoder layers (default 2; 4 for the hybrid and MoE archs)")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    tiny.add_argument("--head-dim", type=int, default=None, help="default hidden-size / heads")
    tiny.add_argument("--intermediate-size", type=int, default=128)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--max-position-embeddings", type=int, default=TINY_CONTEXT,
                      help=f"positions the checkpoint advertises (default {TINY_CONTEXT}: "
                           "room for a coding agent's prompt)")
    tiny.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument("--legacy-config", action="store_true",
                      help="write config.json as transformers 4.x did (rope_theta, torch_dtype)")
    tiny.add_argument("--mtp", action="store_true",
                      help="add a multi-token-prediction head (qwen3_next, qwen3_5, qwen3_5_moe;"
                           " speculation = \"mtp\")")
    tiny.add_argument("--vision", action="store_true",
                      help="add Qwen3.5's vision tower, preprocessor_config.json and image tokens"
                           " (qwen3_5, qwen3_5_moe)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--chat-template", choices=list(CHAT_TEMPLATES), default="chatml",
                      help="chatml (Qwen3's, <tool_call>{json}) or qwen3_5 (XML tool calls)")
    args = ap.parse_args(argv)

    try:
        out = init_tiny(
            args.dir, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers,
            num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings, seed=args.seed,
            dtype=args.dtype, tie_word_embeddings=args.tie_word_embeddings,
            legacy_config=args.legacy_config, mtp=args.mtp, chat_template=args.chat_template,
            vision=args.vision)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {args.arch} tiny checkpoint to {out}")
    return 0
