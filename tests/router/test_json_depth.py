"""The nesting-depth limit counts arrays and objects, never brackets inside strings."""

from __future__ import annotations

import json

from helexa.router.json_depth import MAX_JSON_DEPTH, json_depth_error


def test_the_limit_is_exact_and_strings_do_not_count():
    at, over = MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1
    assert json_depth_error(("[" * at + "]" * at).encode()) is None
    assert "deeper than 128 levels" in json_depth_error(("[" * over + "]" * over).encode())
    # siblings at every level (no long run of openers) are counted as deep as they go
    assert json_depth_error(("[[]," * at + "1" + "]" * at).encode()) is not None
    assert json_depth_error(("[[]," * (at - 1) + "1" + "]" * (at - 1)).encode()) is None
    # brackets in strings, escaped quotes and backslashes included, are text
    text = json.dumps({"a": '\\"' + "[" * 1000, "b": "{" * 1000 + "\\", "c": [{}] * 500})
    assert json_depth_error(text.encode()) is None
    assert json_depth_error(b"") is None and json_depth_error(b"[" * 1000) is not None
