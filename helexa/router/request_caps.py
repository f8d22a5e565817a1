"""Per-request size caps on what the router compiles: tools, schema bytes, regex length,
grammar bytes.

A request's tools and schemas cost the router work that grows with them (the
grammar library compiles each schema, the reply is checked against it) and
cost the neuron template text; 30,000 tools or a 1 MB `pattern` took seconds.
The caps (the `[limits]` config section) are checked on the decoded body,
before any schema is compiled, and each refusal is a 400 naming the cap and
the value that broke it. All front ends check here: their agent fields all
pass through helexa/router/agent_request.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from helexa.config.router import LimitsConfig
from helexa.router.errors import bad_request


@dataclass(frozen=True)
class RequestCaps:
    """The caps one request is held to (from `[limits]`)."""

    max_tools: int = 128
    max_schema_bytes: int = 512 * 1024
    max_pattern_chars: int = 4096
    max_grammar_bytes: int = 64 * 1024

    @classmethod
    def of(cls, cfg: LimitsConfig) -> RequestCaps:
        return cls(cfg.max_tools, cfg.max_schema_bytes, cfg.max_pattern_chars,
                   cfg.max_grammar_bytes)


DEFAULT_CAPS = RequestCaps()


class SchemaBudget:
    """The schema bytes left to one part of a request (its tools together, or its response
    schema)."""

    def __init__(self, caps: RequestCaps) -> None:
        self.caps = caps
        self.used_bytes = 0

    def take(self, schema: Any, param: str) -> None:
        """Count `schema` (at `param`) against the caps; raises ApiError(400) naming the cap."""
        if schema is None:
            return
        # Encoding is C and linear; the walk below only runs once the bytes are known small.
        self.used_bytes += len(msgspec.json.encode(schema))
        if self.used_bytes > self.caps.max_schema_bytes:
            raise bad_request(
                f"`{param}`: the JSON schemas exceed {self.caps.max_schema_bytes} "
                f"bytes, the limit (limits.max_schema_bytes; {self.used_bytes} so far)", param)
        where, longest = longest_pattern(schema)
        if longest > self.caps.max_pattern_chars:
            at = f"{param}{where}"
            raise bad_request(
                f"`{at}`: a pattern of {longest} characters is longer than "
                f"{self.caps.max_pattern_chars}, the limit (limits.max_pattern_chars)", at)


def check_tool_count(count: int, caps: RequestCaps, param: str = "tools") -> None:
    if count > caps.max_tools:
        raise bad_request(f"`{param}`: {count} tools is more than {caps.max_tools}, the limit "
                          f"(limits.max_tools)", param)


def longest_pattern(schema: Any) -> tuple[str, int]:
    """(path, length) of the longest regex in a schema: a `pattern` string or a
    `patternProperties` key, at any depth; ("", 0) when it has none. Iterative, so a deep
    schema costs no recursion."""
    best_at, best = "", 0
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                here = f"{path}.{k}"
                if k == "pattern" and isinstance(v, str) and len(v) > best:
                    best_at, best = here, len(v)
                if k == "patternProperties" and isinstance(v, dict):
                    for p in v:
                        if isinstance(p, str) and len(p) > best:
                            best_at, best = f"{here}[key]", len(p)
                if isinstance(v, (dict, list)):
                    stack.append((here, v))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node)
                         if isinstance(v, (dict, list)))
    return best_at, best
