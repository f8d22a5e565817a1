"""Tool calls and their results must pair up: a 400 where a conversation's do not.

A result that answers no call, or a call left unanswered when the
conversation moves on, renders a prompt the model was never trained on (a
tool turn after a user turn, a call whose result never comes), so the
reference APIs refuse both and so does the router, each API in its own
envelope and, where a client may match on them, its reference's words
(docs/api.md, "Tool calls and their results"):

- chat (`check_chat`): the `tool` messages right after an assistant message
  with `tool_calls` answer each of its ids, once; a `tool` message anywhere
  else, or naming another id, is refused, as is a call left unanswered
  (at the end of the messages too);
- Anthropic Messages (`check_messages`): each `tool_use` of an assistant
  message has its `tool_result` in the next message, and each `tool_result`
  names a `tool_use` of the message before; consecutive messages of one role
  count as one, as Anthropic combines them (a final assistant message's
  calls are left to the prefill rule, `anthropic._prefill`, which refuses
  them). In the user turn that answers calls the `tool_result` blocks come
  first: a block of another kind (text, image), or a message whose content
  is a string, while a call is still unanswered is refused, as Anthropic
  refuses it ("the tool_result blocks must come FIRST in the content array");
- Responses (`check_input`): each `function_call_output` /
  `custom_tool_call_output` answers an earlier call item by `call_id`, once,
  and each call is answered before the next user message or the end of
  `input`. Other items may come between (codex echoes an assistant message
  the model wrote after its call before the call's output). The router keeps
  no state (`previous_response_id` is refused), so every call is in `input`.

A call id given twice while the first is unanswered is refused too: its
results could not be told apart. The same id in a later turn is not (some
servers number calls per turn).

One tracker (`_Open`) applies the rule; each API says where its turns
begin and end and words the refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helexa.router.errors import ApiError, bad_request

# (where the call was made: the client's path, the id) -> the refusal
Missing = Callable[[list[tuple[str, str]]], ApiError]


class _Open:
    """The calls waiting for their results, in the order they were made."""

    def __init__(self, missing: Missing) -> None:
        self.calls: dict[str, str] = {}  # id -> where it was made
        self.missing = missing

    def call(self, call_id: str, where: str, param: str) -> None:
        if call_id in self.calls:
            raise bad_request(f"`{param}`: tool call id `{call_id}` is given twice before its "
                              "result (each call needs its own id)", param)
        self.calls[call_id] = where

    def answer(self, call_id: str) -> bool:
        """Whether call_id was waiting (it no longer is)."""
        return self.calls.pop(call_id, None) is not None

    def close(self) -> None:
        """The conversation moves on: every call must have had its result."""
        if self.calls:
            raise self.missing(list((w, i) for i, w in self.calls.items()))


def check_chat(messages: list[Any]) -> None:
    """Chat's `messages` (request_model.Message): a 400 naming the message and the id."""
    def missing(open_: list[tuple[str, str]]) -> ApiError:
        where = open_[0][0]
        ids = ", ".join(i for w, i in open_ if w == where)
        return bad_request(f"`{where}`: An assistant message with 'tool_calls' must be followed "
                           "by tool messages responding to each 'tool_call_id'. The following "
                           f"tool_call_ids did not have response messages: {ids}", where)
    pending = _Open(missing)
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if m.role == "tool":
            if not pending.answer(m.tool_call_id or ""):
                # OpenAI's words, its spelling kept: clients match on them
                raise bad_request(
                    f"`{p}`: messages with role 'tool' must be a response to a preceeding "
                    f"message with 'tool_calls' (`tool_call_id` `{m.tool_call_id}` answers no "
                    "call of the assistant message before it, or one already answered)",
                    f"{p}.tool_call_id")
            continue
        pending.close()
        for j, c in enumerate(m.tool_calls or []):
            pending.call(c.id, p, f"{p}.tool_calls[{j}].id")
    pending.close()


def check_messages(messages: list[Any]) -> None:
    """Anthropic's `messages` (anthropic.AMessage): a 400 in Anthropic's words, which name
    the message (`messages.N`) and the ids."""
    def missing(open_: list[tuple[str, str]]) -> ApiError:
        where = open_[0][0]
        ids = ", ".join(i for w, i in open_ if w == where)
        return bad_request(f"{where.replace('[', '.').rstrip(']')}: `tool_use` ids were found "
                           f"without `tool_result` blocks immediately after: {ids}. Each "
                           "`tool_use` block must have a corresponding `tool_result` block in "
                           "the next message.", where)
    pending = _Open(missing)
    last, role = len(messages) - 1, ""
    for i, m in enumerate(messages):
        if m.role != role and (role, m.role) != ("assistant", "user"):
            pending.close()  # a new turn, not the results' (consecutive messages are one)
        role = m.role
        if m.role == "user" and pending.calls and isinstance(m.content, str):
            raise _results_first(missing, pending, f"messages[{i}].content", "text")
        for j, b in enumerate([] if isinstance(m.content, str) else m.content):
            if m.role == "user" and pending.calls and b.type != "tool_result":
                raise _results_first(missing, pending, f"messages[{i}].content[{j}]", b.type)
            if b.type == "tool_use" and i < last:  # a final message's: the prefill rule's
                pending.call(b.id, f"messages[{i}]", f"messages[{i}].content[{j}].id")
            elif b.type == "tool_result" and not pending.answer(b.tool_use_id):
                raise bad_request(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                                  f"`tool_result` blocks: {b.tool_use_id}. Each `tool_result` "
                                  "block must have a corresponding `tool_use` block in the "
                                  "previous message.", f"messages[{i}].content[{j}].tool_use_id")
    pending.close()


def _results_first(missing: Missing, pending: _Open, where: str, kind: str) -> ApiError:
    """A `kind` block at `where` before the results of the calls still open: Anthropic's
    refusal of unanswered calls, and the rule its documentation words, naming the block."""
    e = missing(list((w, i) for i, w in pending.calls.items()))
    block = where.replace("[", ".").replace("]", "")
    return bad_request(f"{e.message} In the user message containing tool results, the "
                       "tool_result blocks must come FIRST in the content array: "
                       f"{block} is a `{kind}` block before them.", where)


_OUTPUTS = {"function_call_output": "function call", "custom_tool_call_output": "custom tool call"}
_CALLS = {"function_call": "function call", "custom_tool_call": "custom tool call"}


def check_input(items: list[Any]) -> None:
    """Responses' `input` items (responses_input.Item): a 400 in OpenAI's words, naming the
    item (`input[N]`) and the call_id."""
    kinds: dict[str, str] = {}

    def missing(open_: list[tuple[str, str]]) -> ApiError:
        where, call_id = open_[0]
        return bad_request(f"`{where}`: No tool output found for {kinds[where]} {call_id}.",
                           where)
    pending = _Open(missing)
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if it.type in _CALLS:
            kinds[p] = _CALLS[it.type]
            pending.call(it.call_id, p, f"{p}.call_id")
        elif it.type in _OUTPUTS and not pending.answer(it.call_id):
            raise bad_request(f"`{p}`: No tool call found for {_OUTPUTS[it.type]} output with "
                              f"call_id {it.call_id}.", f"{p}.call_id")
        elif it.type == "message" and (it.role or "user") == "user":
            pending.close()
    pending.close()
