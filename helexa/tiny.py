"""Tiny Hugging Face checkpoints made here, for tests and the default local model.

`init_tiny(DIR)` writes a complete checkpoint folder in the formats
transformers reads: config.json, model.safetensors, generation_config.json,
tokenizer.json (a real byte-level BPE trained with `tokenizers` on the text
under helexa/data/) and tokenizer_config.json with a ChatML chat template.

The weights are random but deterministic for a seed. The output head is
scaled so that logits have a standard deviation of about LOGIT_STD: the top
two logits of a step are then rarely closer than 0.05, so greedy outputs of
two correct implementations agree token for token (numerical noise is
~1e-4), and a mismatch means a bug rather than a near-tie.

Trained tokenizers are cached per vocab size (in memory, and on disk under
$HELEXA_CACHE or ~/.cache/helexa/tokenizers) so repeated calls are fast.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

from helexa.tiny_hybrid import HYBRID_ARCHS, hybrid_config, hybrid_weights

ARCHS = ("llama", "qwen2", "qwen3", *HYBRID_ARCHS)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Logit std of the random head: gap between top two of ~500 normals is
# ~std/3.5 on average, so std 4 puts P(gap < 0.05) near 4% per step.
LOGIT_STD = 4.0
_TRANSFORMERS_VERSION = "5.24.0"  # the format written, not a runtime dependency

# ChatML as Qwen3's checkpoints render it, tools and thinking included; content may be a
# string or a list of OpenAI-style text parts. Tools go into the system turn, calls are
# <tool_call>{json}</tool_call>, results come back as <tool_response> in a user turn.
# enable_thinking=true opens a <think> block in the generation prompt (so even random
# weights think), false writes an empty one, as Qwen3 does; left out, neither.
_CONTENT = (
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = namespace(text='') %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{%- set content.text = content.text + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.text %}{%- endif %}"
)
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set message = messages[0] %}" + _CONTENT +
    "{{- content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}" + _CONTENT +
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# The pre-tokenizer split of Qwen2's tokenizer: words, single digits,
# punctuation runs, newlines, spaces. Bytes then map to printable chars.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
_tokenizer_cache: dict[tuple[int, str], str] = {}


# ------------------------------------------------------------------ tokenizer


def corpus_texts() -> list[str]:
    """The training text shipped with the package, in a fixed order."""
    data = resources.files("helexa") / "data"
    names = sorted(p.name for p in data.iterdir() if p.name.endswith(".txt"))
    return [(data / n).read_text(encoding="utf-8") for n in names]


def cache_dir() -> Path:
    """helexa's cache folder: $HELEXA_CACHE, else $XDG_CACHE_HOME/helexa or ~/.cache/helexa."""
    root = os.environ.get("HELEXA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "helexa")
    return Path(root)


# The ~30M-parameter qwen3 of issue 3's engine benchmark, shared by every benchmark.
BENCH_MODEL_ARGS: dict[str, Any] = dict(
    arch="qwen3", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
    intermediate_size=1536, vocab_size=8192, seed=0)


def bench_checkpoint() -> Path:
    """The benchmarks' checkpoint (BENCH_MODEL_ARGS), made once under the cache folder."""
    out = cache_dir() / "bench" / "qwen3-h512-l8-v8192"
    if not (out / "model.safetensors").is_file():
        init_tiny(out, **BENCH_MODEL_ARGS)
    return out


def tokenizer_json(vocab_size: int) -> str:
    """A trained byte-level BPE (tokenizer.json text) of at most vocab_size tokens."""
    import tokenizers

    texts = corpus_texts()
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
    key = (vocab_size, f"{digest}-{tokenizers.__version__}")
    if key in _tokenizer_cache:
        return _tokenizer_cache[key]
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key[1]}.json"
    try:
        text = path.read_text()
    except OSError:
        text = _train(texts, vocab_size)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # atomic: parallel test workers never see half a file
        except OSError:
            pass  # a read-only home only costs retraining
    _tokenizer_cache[key] = text
    return text


def _train(texts: list[str], vocab_size: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: expected at least {256 + len(SPECIAL_TOKENS)} "
                         f"(256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    # Special tokens after the learned vocab, as Qwen's checkpoints place them.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


# --------------------------------------------------------------------- config


def _config(arch: str, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
            head_dim: int, intermediate_size: int, vocab_size: int,
            max_position_embeddings: int, dtype: str, tie: bool, rope_theta: float,
            rope_scaling: dict | None, legacy_config: bool, special: dict[str, int]) -> dict:
    cfg: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special[EOS_TOKEN],
        "pad_token_id": special[PAD_TOKEN],
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "head_dim": head_dim,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(layer_types=["full_attention"] * num_layers, max_window_layers=num_layers,
                   sliding_window=None, use_sliding_window=False)
        if arch == "qwen3":
            cfg["attention_bias"] = False
    if legacy_config:
        # transformers < 5: rope_theta / rope_scaling at top level, torch_dtype.
        cfg.update(rope_theta=rope_theta, rope_scaling=dict(rope_scaling) if rope_scaling else None,
                   torch_dtype=dtype, transformers_version="4.51.3")
    else:
        rope = {"rope_theta": rope_theta, "rope_type": "default"}
        if rope_scaling:
            rope.update({k: v for k, v in rope_scaling.items() if k != "type"})
            rope.setdefault("rope_type", rope_scaling.get("type", "default"))
        cfg.update(rope_parameters=rope, dtype=dtype, transformers_version=_TRANSFORMERS_VERSION)
    return dict(sorted(cfg.items()))


def _tokenizer_config(special: dict[str, int], max_len: int) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in special.items()
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "extra_special_tokens": [],
        "model_max_length": max_len,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# -------------------------------------------------------------------- weights


def _weights(arch: str, cfg: dict, seed: int) -> dict[str, Any]:
    """Named tensors in HF layout; drawn in a fixed order from one generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        # std 1/sqrt(fan_in) keeps activations O(1) through the layers.
        return torch.randn(out_f, in_f, generator=g) * (scale / math.sqrt(in_f))

    # Projections back into the residual stream are scaled by 1/sqrt(2 × layers)
    # (GPT-2's init): each layer nudges the stream rather than replacing it, as
    # in trained models, so small KV errors (quantised KV) move the logits about
    # as much as they would in a real model instead of several times more.
    residual = 1.0 / math.sqrt(2 * cfg["num_hidden_layers"])

    def norm(n: int) -> torch.Tensor:
        # Not all ones, so a loader that skips a norm weight is caught.
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    # Logits = head @ rmsnorm(h): rmsnorm output has unit rms, so std
    # LOGIT_STD/sqrt(h) per weight gives logits of std ~LOGIT_STD. The
    # embedding uses the same scale so a tied head behaves alike.
    head_std = LOGIT_STD / math.sqrt(h)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g) * head_std}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = linear(nq * hd, h)
        t[p + "self_attn.k_proj.weight"] = linear(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = linear(nkv * hd, h)
        if arch == "qwen2":
            for name, n in (("q", nq), ("k", nkv), ("v", nkv)):
                t[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n * hd, generator=g)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "self_attn.o_proj.weight"] = linear(h, nq * hd, residual)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = linear(inter, h)
        t[p + "mlp.up_proj.weight"] = linear(inter, h)
        t[p + "mlp.down_proj.weight"] = linear(h, inter, residual)
    t["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = torch.randn(vocab, h, generator=g) * head_std
    dtype = getattr(torch, cfg.get("dtype") or cfg["torch_dtype"])
    return {k: v.to(dtype).contiguous() for k, v in t.items()}


# ----------------------------------------------------------------------- main


def init_tiny(out_dir: str | Path, *, arch: str = "qwen3", hidden_size: int = 64,
              num_layers: int | None = None, num_heads: int = 4, num_kv_heads: int = 2,
              head_dim: int | None = None, intermediate_size: int = 128,
              vocab_size: int = 512, max_position_embeddings: int = 4096, seed: int = 0,
              dtype: str = "float32", tie_word_embeddings: bool | None = None,
              rope_scaling: dict | None = None, rope_theta: float | None = None,
              legacy_config: bool = False, mtp: bool = False) -> Path:
    """Write a complete tiny checkpoint folder; returns its path.

    `legacy_config` writes config.json as transformers 4.x did (top-level
    rope_theta / rope_scaling, torch_dtype) instead of today's
    rope_parameters / dtype. `tie_word_embeddings` None = untied. `mtp` adds a
    multi-token-prediction head (hybrid archs with full attention: qwen3_next,
    qwen3_5, qwen3_5_moe).
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}")
    head_dim = head_dim or hidden_size // num_heads
    # A hybrid's every fourth layer is full attention: four layers hold one of each kind.
    num_layers = num_layers or (4 if arch in HYBRID_ARCHS else 2)
    tok_text = tokenizer_json(vocab_size)
    tok = Tokenizer.from_str(tok_text)
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    # A small corpus may learn fewer merges than asked; the model keeps the
    # asked vocab (spare rows, as Qwen's checkpoints have beyond their tokenizer).
    model_vocab = max(vocab_size, tok.get_vocab_size(with_added_tokens=True))
    if mtp and arch not in HYBRID_ARCHS[:2] + HYBRID_ARCHS[3:]:
        raise ValueError(f"mtp: {arch} checkpoints carry no MTP head (qwen3_next, qwen3_5 and"
                         " qwen3_5_moe do)")
    if arch in HYBRID_ARCHS:
        if legacy_config or rope_scaling:
            raise ValueError(f"{arch}: legacy_config and rope_scaling apply to the dense archs only")
        cfg = hybrid_config(arch, hidden_size=hidden_size, num_layers=num_layers,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            intermediate_size=intermediate_size, vocab_size=model_vocab,
                            max_position_embeddings=max_position_embeddings,
                            dtype=_DTYPES[dtype], tie=bool(tie_word_embeddings),
                            rope_theta=float(rope_theta or 10000000.0), special=special,
                            eos=EOS_TOKEN, pad=PAD_TOKEN, version=_TRANSFORMERS_VERSION,
                            mtp=mtp)
        weights = hybrid_weights(arch, cfg, seed, LOGIT_STD)
    else:
        cfg = _config(arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim,
                      intermediate_size=intermediate_size, vocab_size=model_vocab,
                      max_position_embeddings=max_position_embeddings, dtype=_DTYPES[dtype],
                      tie=bool(tie_word_embeddings),
                      rope_theta=float(rope_theta or (500000.0 if arch == "llama" else 1000000.0)),
                      rope_scaling=rope_scaling, legacy_config=legacy_config, special=special)
        weights = _weights(arch, cfg, seed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": [special[EOS_TOKEN], special["<|endoftext|>"]],
        "pad_token_id": special[PAD_TOKEN],
        "transformers_version": cfg["transformers_version"],
    })
    (out / "tokenizer.json").write_text(tok_text)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(special, max_position_embeddings))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
