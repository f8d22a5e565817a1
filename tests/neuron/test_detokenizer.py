"""Incremental detokenisation never splits a character; stop strings span tokens and are cut."""

from __future__ import annotations

import random
import time

import pytest

from helexa.neuron.detokenizer import CallTracker, IncrementalDetokenizer, StopChecker
from helexa.neuron.tokenizer import Tokenizer

TEXTS = [
    " The harbour at dawn, 7 boats.",
    " emoji 🙂🚀👨‍👩‍👧 flags 🇵🇱🇯🇵 and CJK 日本語のテキスト",
    " def f(x):\n    return {'é': x ** 2}  # ∑ ≈ π\n",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_emits_half_a_character(tok, text):
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()  # really split
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add([i]) for i in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text and d.flush() == ""


def test_several_tokens_per_step_and_special_tokens(tok):
    ids = tok.encode(TEXTS[1]) + [tok.token_to_id("<|im_end|>")]
    d = IncrementalDetokenizer(tok, tok.encode("<|im_start|>assistant\n"))
    out = "".join(d.add(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert out == TEXTS[1]  # the eos is skipped
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert keep.add(ids) == TEXTS[1] + "<|im_end|>"


def test_random_tokens_match_a_full_decode(tok):
    rng = random.Random(0)
    prompt = tok.encode("Some context.")
    base = tok.decode(prompt)
    for _ in range(20):
        out = [rng.randrange(tok.vocab_size - 3) for _ in range(rng.randrange(1, 30))]
        d = IncrementalDetokenizer(tok, prompt)
        text = "".join(d.add([i]) for i in out) + d.flush()
        assert text == tok.decode(prompt + out)[len(base):]


def feed_all(checker: StopChecker, pieces: list[str]) -> tuple[str, str | None]:
    emitted, matched = "", None
    for p in pieces:
        text, m = checker.feed(p)
        emitted += text
        matched = matched or m
    return emitted + checker.flush(), matched


def test_stop_string_spanning_pieces_is_cut_and_not_emitted():
    c = StopChecker(["STOP"])
    assert c.feed("Hello S") == ("Hello ", None)  # "S" may start STOP: held
    assert c.feed("T") == ("", None)
    assert c.feed("OP and more") == ("", "STOP")
    assert c.feed("later") == ("", None) and c.flush() == ""


def test_held_text_that_is_not_a_stop_is_released():
    c = StopChecker(["</answer>"])
    assert c.feed("a </ans") == ("a ", None)
    assert c.feed("wer is here") == ("</answer is here", None)
    assert c.feed("</") == ("", None)
    assert c.flush() == "</"  # the stream ended: it never became a stop


def test_earliest_of_several_stops_wins():
    assert feed_all(StopChecker(["world", "lo w"]), ["hel", "lo", " wor", "ld"]) == ("hel", "lo w")
    assert feed_all(StopChecker([]), ["no", " stops"]) == ("no stops", None)
    assert feed_all(StopChecker(["\n\n"]), ["a\n", "\nb"]) == ("a", "\n\n")


def test_stop_over_detokenized_stream(tok):
    text = " Result: 42 🙂 and then ### more text"
    ids = tok.encode(text)
    d, c = IncrementalDetokenizer(tok, []), StopChecker(["###", "🙂 an"])
    emitted, matched = feed_all(c, [d.add([i]) for i in ids])
    assert (emitted, matched) == (" Result: 42 ", "🙂 an")


CALLS = ("<tool_call>", "</tool_call>")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_stop_string_inside_a_call_does_not_end_the_text_and_after_it_does(size):
    """Where the request offers tools, a stop string within <tool_call>…</tool_call> leaves
    the call whole (cut, its arguments would not be JSON); the text around the calls is
    cut at it as ever, however the text arrives in pieces."""
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
            '</tool_call>\nDone: UTC it is.\nmore')
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    emitted, matched = feed_all(StopChecker(["UTC", "\n"], CALLS), pieces)
    assert emitted == "Let me check."  # the "\n" before the call ends the text there
    emitted, matched = feed_all(StopChecker(["UTC"], CALLS), pieces)
    assert matched == "UTC"
    assert emitted == text[:text.index("Done: UTC") + len("Done: ")]  # the call whole
    assert feed_all(StopChecker(["UTC"]), pieces) == (text[:text.index("UTC")], "UTC")


def test_a_stop_string_that_starts_where_a_call_does_is_the_call():
    c = StopChecker(["<tool"], CALLS)
    emitted, matched = feed_all(c, ["a <to", "ol_call>x<tool</tool_", "call> b <tool c"])
    assert (emitted, matched) == ("a <tool_call>x<tool</tool_call> b ", "<tool")


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_call_tracker_says_whether_the_text_so_far_ends_inside_a_call(size):
    """Inside from a call's whole open tag to its whole close tag, however the tags are
    split over the pieces."""
    text = 'a <tool_call>\n{"x": "<tool"}\n</tool_call> b </tool_call <tool_call>{"y"'
    tracker, seen = CallTracker(CALLS), ""
    for i in range(0, len(text), size):
        tracker.feed(text[i:i + size])
        seen = text[:i + size]
        assert tracker.inside == (seen.rfind(CALLS[0]) > seen.rfind(CALLS[1])), seen
    assert tracker.inside


def test_each_prompt_tokens_offset_is_where_its_text_begins(tiny_model_dir) -> None:
    """decode_with_offsets: the prompt decoded as an output is, and each token's start in
    it; the tokens of a character split over several begin where the character does, and
    a lone byte that is no character's reads U+FFFD where it stands."""
    from helexa.neuron.detokenizer import decode_with_offsets
    from helexa.neuron.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = tok.encode("a café ☕ b")
    text, offsets = decode_with_offsets(tok, ids)
    assert text == "a café ☕ b" and len(offsets) == len(ids)
    pieces = [tok.token_bytes(i) for i in ids]
    starts = [len(b"".join(pieces[:k]).decode("utf-8", errors="ignore")) for k in range(len(ids))]
    # a token's start: the characters its bytes before it complete (a split one's start)
    assert offsets == starts
    lone = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x9c"][0]
    text, offsets = decode_with_offsets(tok, [ids[0], lone, ids[0]])
    assert (text, offsets) == ("a\ufffda", [0, 1, 2])

def test_stop_strings_end_the_text_where_one_is_first_written_however_it_arrives():
    """Against the whole text searched at once: the text ends where a stop string is first
    written whole (of two ending there, the longer), whatever the pieces; with none, it all
    comes out."""
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice("aab") for _ in range(rng.randrange(0, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6)))
                 for _ in range(rng.randrange(1, 4))]
        ends = [(i + len(s), -len(s), s) for s in stops if (i := text.find(s)) >= 0]
        want = (text, None)
        if ends:
            end, neg, s = min(ends)
            want = (text[:end + neg], s)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(4))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed_all(StopChecker(stops), pieces) == want, (text, stops, pieces)


def test_long_stop_strings_cost_what_the_text_does_not_their_length_squared():
    """Two stop strings of 64k characters that the text follows almost to the end, three
    times over (the model writes them but for their last character): 6,000 pieces of 32
    characters read in 0.03 CPU s; comparing each prefix of the stop strings with the held
    tail at each piece took 0.32 s (the quadratic review finding: 3.2 s a step at n = 16
    with 16k-character stops)."""
    rng = random.Random(0)
    body = "".join(rng.choice("abcdefgh ") for _ in range(65536))
    stops = [body + "Z", body + "Q"]
    text = (body + "y") * 3
    checker = StopChecker(stops)
    t0 = time.thread_time()
    emitted = [checker.feed(text[i:i + 32])[0] for i in range(0, len(text), 32)]
    cpu = time.thread_time() - t0
    assert "".join(emitted) + checker.flush() == text
    assert cpu < 0.15, f"{cpu:.3f} CPU s"
