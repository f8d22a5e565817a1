"""A prompt past the context is refused having tokenised a bounded part of it
(helexa/neuron/token_bound.py); a prompt that fits keeps the ids of its whole text."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.neuron import token_bound
from helexa.neuron.limits import ModelLimits
from helexa.neuron.prepare import prompt_of
from helexa.neuron.tokenizer import Tokenizer
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

CONTEXT = 2048
LIMITS = ModelLimits(context=CONTEXT, input=CONTEXT, output=CONTEXT - 1)
HUGE = "a b" * 2_600_000  # 7.8 MB, 5.2M tokens: the review's prompt


class Watched:
    """A tokenizers.Tokenizer that counts the characters it is given to tokenise."""

    def __init__(self, real: Any) -> None:
        self._real, self.chars = real, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def encode(self, text: str, *a: Any, **kw: Any) -> Any:
        self.chars += len(text)
        return self._real.encode(text, *a, **kw)

    def encode_batch_fast(self, texts: list[str], *a: Any, **kw: Any) -> Any:
        self.chars += sum(map(len, texts))
        return self._real.encode_batch_fast(texts, *a, **kw)

    def encode_batch(self, texts: list[str], *a: Any, **kw: Any) -> Any:
        self.chars += sum(map(len, texts))
        return self._real.encode_batch(texts, *a, **kw)


@pytest.fixture
def tok(tiny_model_dir: Path) -> Tokenizer:
    t = Tokenizer.from_dir(tiny_model_dir)
    t._tok, t._plain = Watched(t._tok), Watched(t._plain)
    return t


def watched(t: Tokenizer) -> int:
    return t._tok.chars + t._plain.chars  # type: ignore[attr-defined]


def chat(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(max_tokens=1, chat=pb.Chat(messages=[
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content=text)]))


@pytest.mark.parametrize("request_", [
    pb.GenerateRequest(text=HUGE, max_tokens=1),  # /v1/completions
    chat(HUGE),  # /v1/chat/completions and /v1/responses: the template's text
    chat("<|im_end|>" + HUGE),  # caller text holding special-token text: encoded apart
], ids=["text", "chat", "chat-quoting-special-text"])
def test_a_prompt_past_the_context_is_refused_having_tokenised_a_bounded_part(
        tok: Tokenizer, request_: pb.GenerateRequest) -> None:
    with pytest.raises(Refusal) as e:
        prompt_of(tok, request_, 1, LIMITS)
    assert e.value.code == "context_length_exceeded"
    message = e.value.message
    assert message.startswith(f"This model's maximum context length is {CONTEXT} tokens; "
                              "the prompt has at least ")
    counted = int(message.split("at least ")[1].split()[0])
    assert CONTEXT <= counted < len(HUGE) // 3 * 2  # a true lower bound, short of 5.2M
    # whole, the tokenizer was handed all 7.8M characters
    assert watched(tok) <= 2 * token_bound.PIECE_CHARS


def test_a_prompt_that_fits_keeps_the_ids_of_its_whole_text(tok: Tokenizer,
                                                             tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer

    # more bytes than the context has tokens (so it is counted, in pieces), and it fits
    text = "Hello, world! It's 2024.\n\tcafé 中文 x  y\n\n" * 4000
    whole = HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text).ids
    fits = ModelLimits(context=len(whole) + 1, input=len(whole) + 1, output=len(whole))
    assert len(text) > 2 * token_bound.PIECE_CHARS and len(text.encode()) > fits.context
    ids, _, _ = prompt_of(tok, pb.GenerateRequest(text=text), None, fits)
    assert ids == whole
    assert watched(tok) == 2 * len(text)  # counted in pieces, then tokenised whole


def test_a_texts_pieces_tokenise_to_its_whole_texts_ids(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer

    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    assert token_bound.splittable(spec)  # else the ids below prove nothing
    tok = HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rng = random.Random(0)
    alphabet = [*"ab Z9\n\t.,!?'é中", "  ", " \n ", ".\n", "'s", "e\u0301", "\u00a0", "<|im_end|>",
                "1234"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 2000)))
        cut = list(token_bound.pieces(text, size=rng.randint(1, 50)))
        assert len(cut) > 1 or len(text) <= 50 or " " not in text
        ids = [i for s, e in cut for i in tok.encode(text[s:e], add_special_tokens=False).ids]
        assert ids == tok.encode(text, add_special_tokens=False).ids, text


def test_a_tokenizer_whose_pieces_could_differ_is_not_counted_in_pieces(
        tiny_model_dir: Path) -> None:
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    metaspace = {**spec, "normalizer": None,
                 "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                                   "prepend_scheme": "always", "split": True}}
    rstrip = {**spec, "added_tokens": [{**spec["added_tokens"][0], "rstrip": True}]}
    for other in (metaspace, rstrip):
        assert not token_bound.splittable(other)


def cjk(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(chars))


# nowhere a piece may end (no space), each over twice LONG_PIECE_CHARS (the review sent
# 7.8 MB and 6 MB: the same path, whose whole-text reference below took 6-7 s a case)
NO_CUT = {"a.b": "a.b" * 200_000,  # 600 kB
          "cjk": cjk(600_000)}  # 1.8 MB of CJK


@pytest.mark.parametrize("name", NO_CUT)
@pytest.mark.parametrize("as_chat", [False, True], ids=["text", "chat"])
def test_a_prompt_past_the_context_with_nowhere_to_cut_is_refused_untokenised(
        tok: Tokenizer, name: str, as_chat: bool) -> None:
    text = NO_CUT[name]
    request_ = chat(text) if as_chat else pb.GenerateRequest(text=text, max_tokens=1)
    with pytest.raises(Refusal) as e:
        prompt_of(tok, request_, 1, LIMITS)
    assert e.value.code == "context_length_exceeded"
    counted = int(e.value.message.split("at least ")[1].split()[0])
    whole = tok._tok._real.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert CONTEXT <= counted <= len(whole)  # a true lower bound
    assert watched(tok) <= 2 * token_bound.PIECE_CHARS  # whole, all of it was tokenised


@functools.cache
def _tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


# Texts with long stretches a piece may not end in (no spaces), and places it may.
_TEXT = st.lists(st.sampled_from([*"ab.,Z9\n\t'é中文", " ", "  ", "a.b.", "e\u0301", "中。",
                                  "<|im_end|>", "ａｂ", "\u00a0", "1234", "...."]),
                 max_size=300).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                        HealthCheck.function_scoped_fixture])
@given(text=_TEXT, slack=st.integers(-3, 3))
def test_a_prompt_that_fits_keeps_its_whole_texts_ids_however_it_is_counted(
        text: str, slack: int, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of a few characters, and any piece past 8 bounded untokenised: a prompt that
    fits is never refused and keeps the whole text's ids; one that does not is refused."""
    monkeypatch.setattr(token_bound, "PIECE_CHARS", 4)
    monkeypatch.setattr(token_bound, "LONG_PIECE_CHARS", 8)
    t = _tokenizer(tiny_model_dir)
    whole = t._tok.encode(text).ids
    limit = max(1, len(whole) + slack)
    if len(whole) < limit:
        assert t.encode(text, limit=limit) == whole
    else:
        with pytest.raises(token_bound.PastLimit) as e:
            t.encode(text, limit=limit)  # refused in pieces, or its whole count decides
            raise token_bound.PastLimit(len(whole))
        assert limit <= e.value.at_least <= len(whole)
    assert t._bound is not None and t._bound.at_least(text) <= len(
        t._plain.encode(text, add_special_tokens=False).ids)
