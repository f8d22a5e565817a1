"""A chat template as transformers renders it: the sandboxed jinja2 environment of
apply_chat_template (`compile_template`), its `raise_exception` as TemplateError, and
continue_final_message's cut (`open_final`). helexa/neuron/tokenizer.py renders with them.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any


class TemplateError(Exception):
    """The chat template refused the messages (its raise_exception), or is missing."""


def open_final(text: str, final: dict) -> str:
    """The rendered chat cut right after its final message's text (transformers'
    continue_final_message): that message stays open, its end of turn dropped."""
    content = final.get("content")
    if isinstance(content, list):  # parts: the last text part
        content = next((p["text"] for p in reversed(content) if "text" in p), None)
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise TemplateError("the final message to continue has no text the template renders")
    at = text.rindex(content.strip())
    whole = text[at:at + len(content.lstrip())] == content  # its trailing space kept
    return text[:at + len(content.lstrip() if whole else content.strip())]


def compile_template(source: str) -> Any:
    """The jinja2 environment of transformers' apply_chat_template."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
