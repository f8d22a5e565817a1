"""A prompt past the context is refused having tokenised a bounded part of it
(helexa/neuron/token_bound.py); a prompt that fits keeps the ids of its whole text."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

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
