"""System messages after the first on a template that takes a system turn only at the start
(helexa/neuron/system_turns.py): Qwen3.5's, the flagship's, refused them, so an OpenAI chat
with a mid-conversation system message failed; one that renders them keeps its own form."""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa.fixtures.qwen35_template import QWEN3_5_CHAT_TEMPLATE
from helexa.neuron import system_turns
from helexa.neuron.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Answer in French."},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "And now?"},
        {"role": "system", "content": "Plan mode is on."}]
# a template that drops every system message but the first, without a word
DROPS = ("{%- for m in messages %}{%- if m.role != 'system' or loop.first %}"
         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# a template that gathers every system message at the start (DeepSeek-V3's way)
HOISTS = ("{%- for m in messages if m.role == 'system' %}{{ m.content }}\n{% endfor %}"
          "{%- for m in messages if m.role != 'system' %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def with_template(base: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(base._tok, eos_token_ids=base.eos_token_ids,
                     special_tokens=base.special_tokens,
                     chat_template=template or base.chat_template)


def test_the_flagships_template_gets_later_system_messages_as_notes_where_they_stand(base):
    tok = with_template(base, QWEN3_5_CHAT_TEMPLATE)
    assert not tok.takes_later_system
    text = tok.apply_chat_template(CHAT)  # it raised "System message must be at the beginning."
    assert text.count("<|im_start|>system") == 1 and "Be brief." in text
    assert text.index("Hi.\n\n<system>\nAnswer in French.\n</system>") < text.index("Bonjour.")
    assert "And now?\n\n<system>\nPlan mode is on.\n</system>" in text
    # the prompt before a later note is the previous request's: the prefix cache holds it
    before = tok.apply_chat_template(CHAT[:5])
    assert text.startswith(before[:before.index("And now?") + len("And now?")])


def test_a_template_that_renders_them_keeps_its_own_form(base):
    tok = with_template(base, None)  # init-tiny's qwen3 template: a system turn in place
    assert tok.takes_later_system
    text = tok.apply_chat_template(CHAT)
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in text
    assert "<system>" not in text


@pytest.mark.parametrize("template", [DROPS, HOISTS], ids=["drops", "hoists"])
def test_a_template_that_drops_or_hoists_them_is_given_notes_where_they_stand(base, template):
    # dropped: the instruction lost; hoisted to the start: the prompt's first tokens change
    # with each new one, and the whole conversation is prefilled again
    tok = with_template(base, template)
    assert not tok.takes_later_system
    text = tok.apply_chat_template(CHAT)
    assert text.index("Answer in French.") > text.index("Hi.")
    assert text.index("Plan mode is on.") > text.index("And now?")


def test_fold_keeps_calls_with_their_outputs_and_each_note_where_it_stands():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}
    out = {"role": "tool", "content": "42", "tool_call_id": "a"}
    msgs = [{"role": "system", "content": "S"}, {"role": "system", "content": "T"},
            {"role": "user", "content": [{"type": "text", "text": "go"}]}, call,
            {"role": "system", "content": "Be careful."}, out,
            {"role": "user", "content": "next"}, {"role": "assistant", "content": "ok"},
            {"role": "system", "content": "Last."}]
    folded = system_turns.fold(msgs)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "tool", "user",
                                           "assistant", "user"]
    assert folded[0]["content"] == "S\n\nT"  # the leading ones: one system turn
    assert folded[3] == out  # the call's output follows the call
    assert folded[4]["content"] == "<system>\nBe careful.\n</system>\n\nnext"
    assert folded[6] == {"role": "user", "content": "<system>\nLast.\n</system>"}
    assert msgs[2]["content"] == [{"type": "text", "text": "go"}]  # the input is not changed
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert system_turns.fold(plain) is plain


def test_a_note_stays_put_when_the_conversation_grows_and_before_an_answer_begun(base):
    """The next request extends the conversation past a note: the note is where it was,
    not moved past the reply the model wrote after it (which reordered the conversation and
    changed the prompt before it); and an answer begun (continue_final_message) after a
    note is what continues, not the note."""
    tok = with_template(base, QWEN3_5_CHAT_TEMPLATE)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "a", "type": "function",
                            "function": {"name": "f", "arguments": {}}}]}
    out = {"role": "tool", "content": "42", "tool_call_id": "a"}
    k = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}, call, out,
         {"role": "system", "content": "Be careful."}]
    k1 = [*k, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "more"}]
    first = system_turns.fold(k)
    assert system_turns.fold(k1)[:len(first)] == first
    assert [m["role"] for m in system_turns.fold(k1)] == [
        "system", "user", "assistant", "tool", "user", "assistant", "user"]
    begun = tok.apply_chat_template([*k, {"role": "assistant", "content": "The answer is"}],
                                    continue_final_message=True)
    assert begun.endswith("The answer is")
    assert begun.index("Be careful.") < begun.index("The answer is")
