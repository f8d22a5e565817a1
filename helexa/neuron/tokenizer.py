"""A checkpoint's tokenizer and chat template, without transformers.

`Tokenizer.from_dir(DIR)` reads tokenizer.json (the `tokenizers` library; a GGUF
model without one: its metadata, helexa/neuron/formats/gguf/tokenizer.py),
the chat template (tokenizer_config.json `chat_template`, or the
chat_template.jinja file transformers 5 writes) and the eos ids
(`eos_token_ids`: generation_config.json, config.json, tokenizer_config.json
and a GGUF file's metadata together; the engine's grammars read the same).
The template is rendered in the same sandboxed jinja2 environment
transformers uses, so prompts are token-for-token what the model was
trained on.

Only the template's own markup may yield control (special) tokens: text a
caller sends in a message is tokenised with special tokens treated as
text, so `<|im_end|><|im_start|>system` inside a user message cannot forge
a turn. `encode_chat` does it by standing each special token's text found in
the messages in for a private sentinel character while the template renders,
splitting the rendered prompt at the (real) special tokens, and encoding the
text between them, sentinels turned back into their literal text, with the
special tokens disabled.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from helexa.neuron import system_turns, token_bound
from helexa.neuron.chat_template import TemplateError, compile_template, open_final


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


# Sentinels for special-token text inside messages: CJK Extension B ideographs, skipping any
# character a chat already holds. Printable on purpose: a template that renders a mapping
# with `{{ v }}` writes Python's repr, which would spell a private-use sentinel `\U00100000`
# and leave it unrestored.
_SENTINEL_FIRST = 0x20000
_SENTINEL_LAST = 0x2A6DF


def _strings(value: Any) -> list[str]:
    """Every string inside a message (content, parts, names, tool calls), depth first.

    Object keys are strings too: a template renders them (a tool parameter's name, a call
    argument's key, `arguments|items`), so a caller's key is caller text like any value.
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _replace_strings(value: Any, swap: Any) -> Any:
    """A copy of `value` with `swap` applied to every string in it, keys included."""
    if isinstance(value, str):
        return swap(value)
    if isinstance(value, dict):
        return {_replace_strings(k, swap): _replace_strings(v, swap) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace_strings(v, swap) for v in value]
    return value


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def eos_token_ids(model_dir: str | Path,
                  token_to_id: Callable[[str], int | None] | None = None) -> list[int]:
    """The ids that end a request: the one rule, for the daemon's stop ids (Tokenizer) and
    the tokens a finished grammar allows (helexa/neuron/engine/grammar.py).

    In this order, each id once: generation_config.json's `eos_token_id`, config.json's,
    the id of tokenizer_config.json's `eos_token`, and a GGUF file's
    `tokenizer.ggml.eos_token_id` and `eot_token_id` (llama.cpp's end of turn). A
    checkpoint may name its eos in any one of them alone. `token_to_id` (a loaded
    tokenizer's) turns eos_token's text into its id; without one, tokenizer_config.json's
    added_tokens_decoder, then tokenizer.json's added tokens and vocabulary are read.
    """
    from helexa.checkpoint.gguf import find_gguf, metadata, model_folder

    d = model_folder(model_dir)  # a GGUF model's path may be its file
    ids: list[int] = []

    def add(value: Any) -> None:
        ids.extend(i for i in _ids(value) if i not in ids)

    add(_read_json(d / "generation_config.json").get("eos_token_id"))
    add(_read_json(d / "config.json").get("eos_token_id"))
    tcfg = _read_json(d / "tokenizer_config.json")
    text = _token_text(tcfg.get("eos_token"))
    if text is not None:
        add(token_to_id(text) if token_to_id is not None else _id_of_text(d, tcfg, text))
    gguf = find_gguf(model_dir)
    if gguf is not None:
        add(metadata(gguf, "tokenizer.ggml.eos_token_id"))
        add(metadata(gguf, "tokenizer.ggml.eot_token_id"))
    return ids


def _id_of_text(folder: Path, tcfg: dict, text: str) -> int | None:
    """A token's id from the checkpoint's files, without building a tokenizer."""
    for i, token in (tcfg.get("added_tokens_decoder") or {}).items():
        if _token_text(token) == text:
            return int(i)
    spec = _read_json(folder / "tokenizer.json")
    for token in spec.get("added_tokens") or ():
        if token.get("content") == text:
            return int(token["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    i = vocab.get(text) if isinstance(vocab, dict) else None
    return None if i is None else int(i)


class Tokenizer:
    """Encode, decode and render chats for one checkpoint."""

    def __init__(self, tok: Any, *, chat_template: str | None, eos_token_ids: list[int],
                 special_tokens: dict[str, str | None]) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        self._tok = tok  # tokenizers.Tokenizer
        spec = tok.to_str()
        parsed = json.loads(spec)  # (a large vocabulary's JSON: parsed once)
        self._byte_level = '"ByteLevel"' in json.dumps(parsed.get("decoder"))
        self._pieces = token_bound.splittable(parsed)  # a long text counted in pieces
        # a piece with nowhere to cut: a count it has at least, from its bytes
        self._bound = token_bound.ByteBound.of(parsed) if self._pieces else None
        self._token_bytes: dict[int, bytes] = {}
        # The same vocabulary with special tokens read as plain text, for message content.
        self._plain = HfTokenizer.from_str(spec)
        self._plain.encode_special_tokens = True
        specials = {t.content: (i, t) for i, t in tok.get_added_tokens_decoder().items()
                    if t.special}
        self._special_ids = {text: i for text, (i, _) in specials.items()}
        # One alternation, longest first; lstrip / rstrip tokens take their whitespace along.
        alts = [("\\s*" if t.lstrip else "") + f"(?:{re.escape(text)})" + ("\\s*" if t.rstrip else "")
                for text, (_, t) in sorted(specials.items(), key=lambda kv: -len(kv[0]))]
        self._special_re = re.compile("|".join(alts)) if alts else None
        self._special_text_re = (re.compile("|".join(re.escape(t) for t in
                                                     sorted(specials, key=len, reverse=True)))
                                 if specials else None)
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.special_tokens = special_tokens  # bos_token, eos_token, pad_token, unk_token
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.vision: Any = None  # helexa.neuron.vision.prompt.VisionPrompt, if it takes images

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HfTokenizer

        from helexa.checkpoint.gguf import find_gguf, model_folder

        d = model_folder(model_dir)  # a GGUF model's path may be its file
        if not (d / "tokenizer.json").is_file():
            gguf = find_gguf(model_dir)
            if gguf is not None:  # no HF tokenizer beside it: the file's own metadata
                from helexa.neuron.formats.gguf.tokenizer import tokenizer_parts
                from helexa.neuron.vision.prompt import VisionPrompt  # an mmproj's, if any

                tok, template, special = tokenizer_parts(gguf)
                out = cls(tok, chat_template=template,
                          eos_token_ids=eos_token_ids(model_dir, tok.token_to_id),
                          special_tokens=special)
                out.vision = VisionPrompt.from_dir(model_dir)
                return out
        tok = HfTokenizer.from_file(str(d / "tokenizer.json"))
        tcfg = _read_json(d / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name", "template"}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        special = {k: _token_text(tcfg.get(k)) for k in
                   ("bos_token", "eos_token", "pad_token", "unk_token")}
        out = cls(tok, chat_template=template,
                  eos_token_ids=eos_token_ids(model_dir, tok.token_to_id),
                  special_tokens=special)
        from helexa.neuron.vision.prompt import VisionPrompt  # the checkpoint's, if it takes images

        out.vision = VisionPrompt.from_dir(model_dir)  # a GGUF's mmproj is found from its path
        return out

    # ---------------------------------------------------------------- tokens

    def encode(self, text: str, add_special_tokens: bool = True,
               limit: int | None = None) -> list[int]:
        """The text's ids; token_bound.PastLimit, the text not tokenised whole, when it has
        `limit` tokens or more (counted in pieces where the tokenizer allows)."""
        if limit is not None and self._pieces:
            token_bound.check(self._tok, text, add_special_tokens, limit, bound=self._bound)
        return token_bound.encode(self._tok, text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The token's own raw bytes (as OpenAI's logprobs `bytes`): part of a UTF-8
        character for some tokens, where decode([i]) gives U+FFFD."""
        raw = self._token_bytes.get(i)
        if raw is None:
            raw = self._token_bytes[i] = self._raw_bytes(int(i))
        return raw

    def _raw_bytes(self, i: int) -> bytes:
        piece = self._tok.id_to_token(i)
        if piece is None:
            return b""
        if i in self.special_token_ids:
            return piece.encode("utf-8")
        if self._byte_level:  # GPT-2 style: each character stands for one byte
            table = _byte_of_char()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece's word marker

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------------ chat

    @cached_property
    def _template(self) -> Any:
        if not self.chat_template:
            raise TemplateError("this model has no chat template; send a plain prompt instead")
        return compile_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text, rendered as transformers' apply_chat_template(tokenize=False) does.

        Extra keywords (tools, enable_thinking, …) are passed to the template, `self` among
        them (`self` and `messages` are positional only here, so no keyword clashes with
        them; the messages rendered are these, a `messages` keyword is ignored).
        continue_final_message: the last message is left open (cut after its text, no
        generation prompt) for the output to continue it, as transformers does.
        """
        if not self.takes_later_system:  # later system messages as notes (system_turns.py)
            messages = system_turns.fold(messages)
        text = self._render(messages, add_generation_prompt and not continue_final_message,
                            kwargs)
        return open_final(text, messages[-1]) if continue_final_message else text

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                kwargs: dict[str, Any] | None = None) -> str:
        ctx = {k: v for k, v in self.special_tokens.items() if v is not None}
        return self._template.render({**ctx, **(kwargs or {}), "messages": messages,
                                      "add_generation_prompt": add_generation_prompt})

    @cached_property
    def takes_later_system(self) -> bool:
        return system_turns.takes_later_system(lambda messages: self._render(messages, True))

    def encode_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """The prompt's ids; special tokens come only from the template's markup."""
        return self.encode_chat_within(None, messages, add_generation_prompt,
                                       continue_final_message, **kwargs)

    def encode_chat_within(self, limit: int | None, messages: list[dict], /,
                           add_generation_prompt: bool = True,
                           continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """encode_chat, raising token_bound.PastLimit as `encode` does past `limit` (an
        argument apart from the template's keywords: a client's chat_template_kwargs)."""
        # The template writes any bos itself, so the text is encoded without
        # adding special tokens (as transformers does for chat).
        pattern = self._special_text_re
        caller_text = _strings([messages, kwargs])  # tools and the like are caller text too
        # str.find per token text, not the regex: a megabyte prompt takes milliseconds
        if pattern is None or not any(t in s for s in caller_text for t in self._special_ids):
            text = self.apply_chat_template(messages, add_generation_prompt,
                                            continue_final_message, **kwargs)
            return self.encode(text, add_special_tokens=False, limit=limit)
        sentinel_of, text_of = self._sentinels("".join(caller_text))

        def quote(s: str) -> str:
            return pattern.sub(lambda m: sentinel_of[m.group(0)], s)

        text = self.apply_chat_template(_replace_strings(messages, quote), add_generation_prompt,
                                        continue_final_message,
                                        **_replace_strings(kwargs, quote))
        restore = re.compile("|".join(map(re.escape, text_of)))
        ids: list[int] = []
        pos = 0
        assert self._special_re is not None
        for m in self._special_re.finditer(text):
            ids += self._encode_plain(restore.sub(lambda x: text_of[x.group(0)],
                                                  text[pos:m.start()]), limit, len(ids))
            ids.append(self._special_ids[m.group(0).strip()])
            pos = m.end()
        return ids + self._encode_plain(restore.sub(lambda x: text_of[x.group(0)], text[pos:]),
                                        limit, len(ids))

    def _encode_plain(self, text: str, limit: int | None = None, before: int = 0) -> list[int]:
        if limit is not None and self._pieces and text:
            token_bound.check(self._plain, text, False, limit, before, self._bound)
        return token_bound.encode(self._plain, text, False) if text else []

    def _sentinels(self, caller_text: str) -> tuple[dict[str, str], dict[str, str]]:
        """special text -> sentinel char, and back; chars neither the caller nor the
        template uses."""
        seen = caller_text + (self.chat_template or "")
        sentinel_of: dict[str, str] = {}
        code = _SENTINEL_FIRST
        for special in self._special_ids:
            while chr(code) in seen:
                code += 1
            if code > _SENTINEL_LAST:
                raise TemplateError("messages: no private character is left to quote "
                                    "special-token text with")
            sentinel_of[special] = chr(code)
            code += 1
        return sentinel_of, {v: k for k, v in sentinel_of.items()}
