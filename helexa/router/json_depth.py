"""The nesting-depth limit of request bodies, checked on the raw bytes before decoding.

A body nested ~1000 levels in a free-form field (`metadata`, a tool's `parameters`,
`chat_template_kwargs`) decodes, then overflows Python's recursion in whatever walks it
next (schema checks, template rendering, the neuron's caller-text escaping): a 500 far from
the cause. Refusing it here, once, for every front end, makes it a 400 naming the limit.
"""

from __future__ import annotations

import json
from typing import Any

# Deeper than any real tool schema or message (a body's own structure is ~6 levels), far
# below Python's recursion limit of 1000 that the walkers downstream share.
MAX_JSON_DEPTH = 128

# Openers to `(`, closers to `)`, everything else deleted.
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_OTHER = bytes(b for b in range(256) if b not in b"[{]}")


def json_depth_error(raw: bytes | bytearray | memoryview) -> str | None:
    """Why `raw` nests too deep to accept, or None when it does not."""
    data = bytes(raw)
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return None  # cannot nest deeper than it has openers: the common case, in C
    # Strings out (escapes first, then every other piece between quotes), then only the
    # brackets left: bytes methods all, in C (a regex or a loop per byte took 0.4 s for 2 MB).
    unquoted = b"".join(data.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = unquoted.translate(_BRACKETS, _OTHER)
    too_deep = b"(" * (MAX_JSON_DEPTH + 1)
    # Each pass removes the innermost pairs, one level, which exposes runs of openers; a
    # pair left after MAX_JSON_DEPTH passes sat deeper than that.
    for _ in range(MAX_JSON_DEPTH):
        if too_deep in brackets:
            break
        shorter = brackets.replace(b"()", b"")
        if shorter == brackets:
            return None  # balanced and done, or unbalanced: the decoder names that
        brackets = shorter
    else:
        if b"()" not in brackets:
            return None
    return (f"The body nests JSON deeper than {MAX_JSON_DEPTH} levels, the limit "
            f"(arrays and objects inside one another)")


def loads(text: str, **kw: Any) -> Any:
    """json.loads for model output, which no body limit bounds: text nested past Python's
    recursion limit (json.loads recurses per level) is a ValueError too, as any other text
    that is no JSON, so the readers' unparsable path takes it, not a 500 mid-reply."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None
