"""A tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata (no tokenizer.json).

Torch-free: the neuron daemon builds it (helexa/neuron/tokenizer.py), and so does the
engine's grammar (helexa/neuron/engine/grammar.py); nothing here loads weights.

llama.cpp keeps a GPT-2-style byte-level BPE as its token strings, their types and
its merges, plus the name of the pre-tokenizer (``tokenizer.ggml.pre``) whose split
pattern its converter matched. That is exactly a ``tokenizers`` BPE model with a
ByteLevel pre-tokenizer behind the named split; control and user-defined tokens are
the special (added) tokens. Only the pre-tokenizers listed below are known here: for
another, put the model's ``tokenizer.json`` beside the GGUF file (docs/quantization.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helexa.checkpoint.gguf import GgufError, metadata

# llama.cpp's pre-tokenizer names -> the split regex of transformers' tokenizer.json.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 (llama.cpp's "qwen35"): Qwen2's, with combining marks (\p{M}) kept in words.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = {"qwen2": _QWEN2, "qwen35": _QWEN35, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "gpt-2": None, "default": None}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType


def tokenizer_parts(path: Path) -> tuple[Any, str | None, dict[str, str | None]]:
    """(tokenizers.Tokenizer, chat template, special token texts) of ``path``. Its EOS ids
    come from helexa/neuron/tokenizer.py's eos_token_ids, the one place they are derived."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = metadata(path, "tokenizer.ggml.model")
    pre = metadata(path, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in SPLIT_PATTERNS:
        raise GgufError(
            f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not built from GGUF "
            f"metadata here (gpt2 BPE with {', '.join(SPLIT_PATTERNS)} is): put the model's "
            "tokenizer.json (and tokenizer_config.json) beside the file")
    tokens: list[str] = metadata(path, "tokenizer.ggml.tokens")
    types: list[int] = metadata(path, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata(path, "tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    split = SPLIT_PATTERNS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, typ in zip(tokens, types, strict=True)
                            if typ in (_CONTROL, _USER_DEFINED)])

    def text_of(key: str) -> str | None:
        i = metadata(path, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or i >= len(tokens) else tokens[int(i)]

    special = {f"{k}_token": text_of(k) for k in ("bos", "eos", "padding", "unknown")}
    special = {"bos_token": special["bos_token"], "eos_token": special["eos_token"],
               "pad_token": special["padding_token"], "unk_token": special["unknown_token"]}
    bos = special["bos_token"]
    if metadata(path, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, metadata(path, "tokenizer.chat_template"), special
