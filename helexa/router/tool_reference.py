"""Anthropic's `tool_reference` blocks: a tool search's result, as the prompt's text.

Claude Code (2.1.337, beta advanced-tool-use) lists some tools with `defer_loading: true`
and gives the model a `ToolSearch` tool; the search's `tool_result` holds one
`{"type": "tool_reference", "tool_name": ...}` block a match, and the next request lists
the matched tools in `tools`. Anthropic's API puts each referenced tool's definition in the
prompt where the block stands, in the encoding the ToolSearch tool's description promises
the model (one `<function>{"description", "name", "parameters"}</function>` line a tool,
inside a `<functions>` block). A reference to a tool the request does not list is a 400
naming its `tool_name` (docs/api.md, "`POST /v1/messages` (Anthropic)"). A deferred tool is
in the prompt only there, as Anthropic's API places it: `ParsedRequest.prompt_tools` leaves
it out of the prompt's tool list, so loading one changes no earlier token of the prompt and
the next request finds all of it in the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from helexa.router.errors import bad_request


def functions_block(refs: list[tuple[str | None, str]], tools: Sequence[Any]) -> str:
    """The `<functions>` text of consecutive references, each (tool_name, its block's param),
    from the tools the request lists (`name`, `description`, `input_schema`)."""
    lines = []
    for name, param in refs:
        if not name:
            raise bad_request(f"`{param}.tool_name` is required", f"{param}.tool_name")
        t = listed(tools, name, f"{param}.tool_name",
                   "a referenced tool must be listed (with `defer_loading`)")
        lines.append(function_line(t))
    return functions(lines)


def listed(tools: Sequence[Any], name: str, param: str, rule: str) -> Any:
    """The tool of `tools` named `name`, else a 400 naming `param` and the `rule` it broke."""
    t = next((t for t in tools if t.name == name), None)
    if t is None:
        raise bad_request(f"`{param}`: tool `{name}` is not in `tools`; {rule}", param)
    return t


def function_line(t: Any) -> str:
    """One tool (`name`, `description`, `input_schema`) as its `<function>` line."""
    fn = {"description": t.description or "", "name": t.name, "parameters": t.input_schema or {}}
    return f"<function>{json.dumps(fn, ensure_ascii=False)}</function>"


def functions(lines: list[str]) -> str:
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"
