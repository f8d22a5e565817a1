"""OpenAI request validation: a JSON body in, a `ParsedRequest` out, or a clear 400.

Types, ranges and unknown or unsupported fields are checked by decoding
into the structs of `request_model.py`; this module adds the rules between
fields and translates the struct into the internal request that `forward.py`
sends. The router has no tokenizer, so token counts (and the exact context
check) belong to the neuron. Every field we do not
implement is refused naming the param, never silently ignored; fields that
change nothing about the output (`user`, `metadata`, `store`, ...) are
accepted. `null` for any optional field means "not given", as the OpenAI
API treats it. Encoding responses lives in `encode.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from helexa.grammar import Constraint
from helexa.router import agent_request, images, tool_pairing
from helexa.router.errors import bad_request, unsupported
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps
from helexa.router.request_model import ChatBody, CompletionBody, Message, RequestBody, decode

Kind = Literal["chat", "completion", "messages", "responses"]  # the endpoint it came to

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


@dataclass
class Turn:
    """One chat message as the neuron's template takes it."""

    role: str
    content: str
    tool_calls_json: str = ""  # an assistant's calls, OpenAI's JSON list
    tool_call_id: str = ""  # a tool result: the call it answers
    name: str = ""
    reasoning: str = ""
    # A turn with images: its content in order, text and images (router/images.py);
    # `content` then holds its text joined. None: text only.
    parts: list[str | images.ImagePart] | None = None



@dataclass
class ParsedRequest:
    """One validated chat or completion request, independent of the wire format."""

    kind: Kind
    model: str
    messages: list[Turn] | None = None  # for chat
    prompt_text: str | None = None  # completion prompt as text ...
    prompt_ids: list[int] | None = None  # ... or as token ids
    prompt_batch: list[str | list[int]] = field(default_factory=list)  # several prompts
    echo: bool = False  # completions: the prompt text starts each choice's text
    max_tokens: int | None = None
    fit_max_tokens: bool = False  # max_tokens is a ceiling the neuron fits to the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output
    return_token_ids: bool = False
    user: str | None = None
    # The agent fields (agent_request.py).
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "none"  # none | auto | required | function
    tool_name: str | None = None  # tool_choice "function": which one
    custom_tools: dict[str, Any] = field(default_factory=dict)  # Responses: name -> the tool
    # Anthropic's tools listed with `defer_loading`: left out of the prompt's tool list, in
    # it only where a tool_reference places them (tool_reference.py); callable all the same
    deferred_tools: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None  # the grammar the output follows
    # The grammar work parsing left for the compile pool (agent_request.py): `compile()`.
    compiles: list[Callable[[], None]] = field(default_factory=list)
    response_schema_name: str | None = None
    response_schema: Any = None  # the whole schema of a json_schema output (checked after)
    unenforced: list[str] = field(default_factory=list)  # schema keywords the grammar dropped
    reasoning_effort: str = ""  # "" = the model's default; none | low | medium | high
    thinking_budget_tokens: int | None = None  # explicit (Anthropic's thinking.budget_tokens)
    reasoning_summary: bool = False  # Responses: the thought is returned as a summary
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final: bool = False  # the reply continues the final assistant message (a prefill)
    # Earlier calls cut short by max_tokens, read as the object they began (cut_calls.py):
    # the fields, as `messages[1].tool_calls[0].function.arguments`.
    repaired_calls: list[str] = field(default_factory=list)
    # Responses: what its response object repeats as the client sent it (responses_api.echoed)
    echoed: dict[str, Any] = field(default_factory=dict)
    cache_key: str | None = None  # the client's prompt_cache_key: the neuron choice's affinity

    def compile(self) -> ParsedRequest:
        """Compile the grammars parsing checked the caps of (agent_request.py): slow work the
        router runs on its compile pool, apart from body parsing; raises ApiError(400)."""
        todo, self.compiles = self.compiles, []
        for fn in todo:
            fn()
        return self

    def prompt_tools(self) -> list[dict[str, Any]]:
        """The tools the prompt lists: all but the deferred ones (all, where every one is:
        the template writes its tool-call instructions only beside a tool list)."""
        return [t for t in self.tools if t["function"]["name"] not in self.deferred_tools] \
            or self.tools

    def per_prompt(self) -> list[ParsedRequest]:
        """One request per prompt of a batch (itself when there is one prompt)."""
        return [replace(self, prompt_batch=[], prompt_text=p if isinstance(p, str) else None,
                        prompt_ids=None if isinstance(p, str) else list(p))
                for p in self.prompt_batch] or [self]

    @property
    def prompt_chars(self) -> int:
        """Characters of prompt text, for the router's token estimate."""
        if self.messages is not None:
            return sum(len(t.content) + len(t.tool_calls_json) for t in self.messages) + \
                sum(len(str(t)) for t in self.tools)
        return len(self.prompt_text or "")


def parse_request(body: bytes | Any, kind: Kind,
                  caps: RequestCaps = DEFAULT_CAPS) -> ParsedRequest:
    """Validate one request body (raw JSON bytes or decoded JSON data); raises ApiError(400)
    naming the offending param or the cap (request_caps.py) it is over."""
    b = decode(body, kind)
    req = ParsedRequest(kind=kind, model=b.model)
    if isinstance(b, ChatBody):
        _chat(b, req, caps)
    elif isinstance(b, CompletionBody):
        _completion(b, req)
    _common(b, req)
    return req


def _chat(b: ChatBody, req: ParsedRequest, caps: RequestCaps) -> None:
    req.messages = [_message(m, i, req.repaired_calls) for i, m in enumerate(b.messages)]
    tool_pairing.check_chat(b.messages)
    add_prompt, continue_final_message = agent_request.apply(b, req, caps)
    req.logprobs = bool(b.logprobs)
    req.top_logprobs = b.top_logprobs or 0
    if req.top_logprobs and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    req.max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None \
        else b.max_tokens
    # the flag as the client sent it: chat_template_kwargs' wins over the field (vLLM's rule)
    agp = ("chat_template_kwargs.add_generation_prompt" if "add_generation_prompt" in
           (b.chat_template_kwargs or {}) else "add_generation_prompt")
    if continue_final_message:
        if add_prompt:
            raise bad_request("`continue_final_message` and `add_generation_prompt` cannot "
                              "both be true", agp)
        continue_final(req, f"messages[{len(b.messages) - 1}]")
    elif add_prompt is False:
        raise unsupported(agp, "`false` without `continue_final_message`")


def continue_final(req: ParsedRequest, param: str) -> None:
    """The reply continues the final message, the assistant's answer begun (a prefill:
    vLLM's continue_final_message, Anthropic's final assistant message), or a 400 where it
    cannot: param names that message."""
    last = (req.messages or [Turn(role="", content="")])[-1]
    if last.role != "assistant":
        raise bad_request(f"`{param}`: only a final assistant message can be continued", param)
    if last.tool_calls_json:
        raise bad_request(f"`{param}`: a final assistant message the reply continues can hold "
                          "text only, no tool calls", param)
    if not last.content.strip():
        raise bad_request(f"`{param}`: the final assistant message to continue is empty", param)
    if req.constraint is not None:  # the grammar starts at the output's start
        raise bad_request(f"`{param}`: a final assistant message cannot be continued under "
                          "constrained output (a schema or a forced tool choice)", param)
    req.continue_final = True


def _message(m: Message, i: int, repaired: list[str]) -> Turn:
    p = f"messages[{i}]"
    if m.role not in _ROLES:
        raise unsupported(f"{p}.role", f"role `{m.role}`")
    turn = Turn(role=_ROLES[m.role], content="", name=m.name or "",
                reasoning=m.reasoning_content or "")
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(f"`{p}.tool_calls` is only allowed on assistant messages",
                              f"{p}.tool_calls")
        turn.tool_calls_json = agent_request.tool_calls_json(m.tool_calls, p, repaired)
    if m.role == "tool":
        if not m.tool_call_id:
            raise bad_request(f"`{p}.tool_call_id` is required for role tool",
                              f"{p}.tool_call_id")
        turn.tool_call_id = m.tool_call_id
    if m.content is None:
        if turn.tool_calls_json:
            return turn  # an assistant turn that only called tools
        raise bad_request(f"`{p}.content` is required", f"{p}.content")
    if isinstance(m.content, str):
        turn.content = m.content
        return turn
    texts = []
    parts: list[str | images.ImagePart] = []
    for j, part in enumerate(m.content):
        q = f"{p}.content[{j}]"
        if part.type == "image_url":
            if part.image_url is None:
                raise bad_request(f"`{q}.image_url` is required", f"{q}.image_url")
            parts.append(images.from_url(part.image_url.url, f"{q}.image_url"))
            continue
        if part.type in images.VIDEO_PART_TYPES:
            raise unsupported(f"{q}.type", f"video content parts (`{part.type}`)")
        if part.type != "text":
            raise unsupported(f"{q}.type", f"content parts of type `{part.type}`")
        if part.text is None:
            raise bad_request(f"`{q}.text` must be a string", f"{q}.text")
        texts.append(part.text)
        parts.append(part.text)
    turn.content = "".join(texts)
    if len(texts) < len(parts):  # it holds images
        if m.role not in ("user", "tool"):  # a tool's screenshot, as Anthropic's tool_result
            article = "an" if m.role[0] in "aeiou" else "a"
            raise unsupported(f"{p}.content", f"images in {article} {m.role} message (user "
                              "and tool messages take them)")
        turn.parts = parts
    return turn


def _completion(b: CompletionBody, req: ParsedRequest) -> None:
    prompt: str | list[int] | list[str | int | list[int]] = b.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the common client encoding
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif prompt and all(isinstance(x, int) for x in prompt):
        req.prompt_ids = list(prompt)  # type: ignore[arg-type]
    elif len(prompt) > 1 and (all(isinstance(x, str) for x in prompt) or all(
            isinstance(x, list) and x for x in prompt)):
        # a batch: each prompt its own choices, one neuron call each (serve.py)
        req.prompt_batch = list(prompt)  # type: ignore[arg-type]
        first = prompt[0]
        req.prompt_text, req.prompt_ids = (first, None) if isinstance(first, str) \
            else (None, list(first))  # type: ignore[arg-type]
    else:
        raise bad_request("`prompt` must be a string, a non-empty list of token ids, or a "
                          "list of several of one of those", "prompt")
    req.logprobs, req.top_logprobs = b.logprobs is not None, b.logprobs or 0
    req.max_tokens = b.max_tokens
    # echo: the prompt starts each choice's text (as the neuron decodes it, where it is
    # token ids or logprobs are asked), with logprobs its tokens' logprobs start the
    # choice's (encode.py); max_tokens 0 generates nothing past it, as OpenAI's and vLLM's
    req.echo = bool(b.echo)
    if b.max_tokens == 0 and not req.echo:
        raise bad_request("`max_tokens` 0 is only served with `echo: true` (the prompt alone, "
                          "and with `logprobs` its tokens' logprobs)", "max_tokens")
    if b.suffix is not None:
        raise unsupported("suffix")
    if b.best_of is not None and b.best_of != (b.n or 1):
        raise unsupported("best_of", "best_of must equal n")


def _common(b: RequestBody, req: ParsedRequest) -> None:
    req.cache_key = b.prompt_cache_key
    req.temperature = b.temperature
    req.top_p = b.top_p
    req.top_k = None if b.top_k in (None, -1) else b.top_k
    req.min_p = b.min_p
    req.repetition_penalty = b.repetition_penalty
    req.presence_penalty = b.presence_penalty or 0.0
    req.frequency_penalty = b.frequency_penalty or 0.0
    req.seed = b.seed
    req.stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req.stop_token_ids = list(dict.fromkeys(b.stop_token_ids or []))  # each once, in order
    req.ignore_eos = bool(b.ignore_eos)
    req.n = b.n or 1
    req.stream = bool(b.stream)
    if b.stream_options is not None:
        if not req.stream:
            raise bad_request("`stream_options` is only allowed with `stream: true`",
                              "stream_options")
        req.include_usage = bool(b.stream_options.include_usage)
        # as vLLM: per-chunk usage rides on include_usage
        req.continuous_usage = req.include_usage and bool(b.stream_options.continuous_usage_stats)
    req.include_stop_str = bool(b.include_stop_str_in_output)
    req.return_token_ids = bool(b.return_token_ids)
    req.user = b.user
