"""OpenAI request validation: a JSON body in, a `ParsedRequest` out, or a clear 400.

The router has no tokenizer, so it checks syntax and ranges only; token
counts (and the context check) belong to the neuron. Every field we do not
implement is refused naming the param, never silently ignored; fields that
change nothing about the output (`user`, `metadata`, `store`, ...) are
accepted. `null` for any optional field means "not given", as the OpenAI
API treats it. Encoding responses lives in `encode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from helexa.router.errors import bad_request, unsupported

# Fields of both endpoints that we honour.
_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
    "presence_penalty", "frequency_penalty", "n", "user", "logprobs", "return_token_ids",
    # vLLM extensions the proto carries as they are.
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
}
# Accepted because they change nothing we produce.
_HARMLESS = {"metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
             "prompt_cache_key", "safety_identifier"}
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
_COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}
# Known OpenAI fields we refuse until implemented (named so the message says "not supported").
_UNSUPPORTED = {
    "tools", "tool_choice", "functions", "function_call", "logit_bias", "audio", "modalities",
    "prediction", "reasoning_effort", "web_search_options", "verbosity", "guided_json",
    "guided_regex", "guided_choice", "structured_outputs",
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_N = 16
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5


@dataclass
class ParsedRequest:
    """One validated chat or completion request, independent of the wire format."""

    kind: Literal["chat", "completion"]
    model: str
    messages: list[tuple[str, str]] | None = None  # (role, text) for chat
    prompt_text: str | None = None  # completion prompt as text ...
    prompt_ids: list[int] | None = None  # ... or as token ids
    max_tokens: int | None = None
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
    return_token_ids: bool = False
    user: str | None = None

    @property
    def prompt_chars(self) -> int:
        """Characters of prompt text, for the router's token estimate."""
        if self.messages is not None:
            return sum(len(text) for _, text in self.messages)
        return len(self.prompt_text or "")


def _present(body: dict, key: str) -> bool:
    return body.get(key) is not None


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"`{key}` must be a number", key)
    if not lo <= v <= hi:
        raise bad_request(f"`{key}` must be between {lo:g} and {hi:g}, got {v}", key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"`{key}` must be an integer", key)
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad_request(f"`{key}` must be {bound}, got {v}", key)
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"`{key}` must be a boolean", key)
    return v


def _token_ids(v: Any, param: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                          and x >= 0 for x in v):
        raise bad_request(f"`{param}` must be a list of non-negative token ids", param)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed or key in _HARMLESS:
            continue
        if value is None:
            continue  # an explicit null asks for nothing
        if key in _UNSUPPORTED:
            raise unsupported(key)
        raise bad_request(f"Unrecognized request argument supplied: {key}", key)


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"`{param}` must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"`{p}` must be an object with a `type`", p)
        if part["type"] != "text":
            raise unsupported(f"{p}.type", f"content parts of type `{part['type']}`")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"`{p}.text` must be a string", f"{p}.text")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[tuple[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("`messages` must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"`{p}` must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            if role in ("tool", "function"):
                raise unsupported(f"{p}.role", f"role `{role}`")
            raise bad_request(f"`{p}.role` must be one of system, user, assistant", f"{p}.role")
        for key in ("tool_calls", "function_call", "audio"):
            if m.get(key) is not None:
                raise unsupported(f"{p}.{key}")
        if m.get("content") is None:
            raise bad_request(f"`{p}.content` is required", f"{p}.content")
        out.append((_ROLES[role], _content_text(m["content"], f"{p}.content")))
    return out


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise bad_request("`stop` must be a non-empty string or a list of up to 16 of them", "stop")
    return v


def parse_request(body: Any, kind: Literal["chat", "completion"]) -> ParsedRequest:
    """Validate one request body; raises ApiError(400) naming the offending param."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    _check_fields(body, _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a string", "model")
    req = ParsedRequest(kind=kind, model=model)
    if kind == "chat":
        req.messages = _messages(body)
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise unsupported("response_format")
        req.logprobs = _bool(body, "logprobs")
        req.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT) or 0
        if req.top_logprobs and not req.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        mct = _int(body, "max_completion_tokens", 1)
        mt = _int(body, "max_tokens", 1)
        req.max_tokens = mct if mct is not None else mt
    else:
        _completion_prompt(body, req)
        lp = _int(body, "logprobs", 0, MAX_LOGPROBS_COMPLETION)
        req.logprobs, req.top_logprobs = lp is not None, lp or 0
        req.max_tokens = _int(body, "max_tokens", 1)
        if _bool(body, "echo"):
            raise unsupported("echo")
        if _present(body, "suffix"):
            raise unsupported("suffix")
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0)
    if req.top_p == 0.0:
        raise bad_request("`top_p` must be greater than 0", "top_p")
    top_k = _int(body, "top_k", -1)
    req.top_k = None if top_k in (None, -1) else top_k
    req.min_p = _number(body, "min_p", 0.0, 1.0)
    req.repetition_penalty = _number(body, "repetition_penalty", 0.01, 10.0)
    req.presence_penalty = _number(body, "presence_penalty", -2.0, 2.0) or 0.0
    req.frequency_penalty = _number(body, "frequency_penalty", -2.0, 2.0) or 0.0
    req.seed = _int(body, "seed", -(2**63), 2**63 - 1)
    req.stop = _stop(body)
    if _present(body, "stop_token_ids"):
        req.stop_token_ids = _token_ids(body["stop_token_ids"], "stop_token_ids")
    req.ignore_eos = _bool(body, "ignore_eos")
    req.n = _int(body, "n", 1, MAX_N) or 1
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != req.n:
        raise unsupported("best_of", "best_of must equal n")
    req.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("`stream_options` must be an object", "stream_options")
        if not req.stream:
            raise bad_request("`stream_options` is only allowed with `stream: true`",
                              "stream_options")
        req.include_usage = _bool(opts, "include_usage")
    req.return_token_ids = _bool(body, "return_token_ids")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("`user` must be a string", "user")
    req.user = user
    return req


def _completion_prompt(body: dict, req: ParsedRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the common client encoding
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        req.prompt_ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("prompt", "a batch of several prompts; send one request per prompt")
    else:
        raise bad_request("`prompt` must be a string or a non-empty list of token ids", "prompt")
