"""The after-generation schema check never runs a pattern that can backtrack without end."""

from __future__ import annotations

import time

import pytest

from helexa.router.schema_check import backtracks, violations


@pytest.mark.parametrize("pattern,risky", [
    ("(a+)+$", True), ("(a|aa)+", True), (r"(\w+\s?)*$", True), ("(?:a*)*", True),
    ("(a{2,})+", True), (r"^(\d+\.)+\d+$", True),
    ("^[a-z]+$", False), (r"^\d{3}-\d{4}$", False), ("(ab)+", False), ("(?:ab)+", False),
    ("(a?){3}", False), ("([a+]+)", False), ("x{2,}", False), (r"\(a+\)+", False)])
def test_backtracks_finds_repeated_groups_that_repeat_or_branch(pattern, risky):
    assert backtracks(pattern) is risky


def test_a_backtracking_pattern_is_not_run_and_says_so():
    t0 = time.monotonic()
    found = violations("a" * 40 + "b", {"type": "string", "pattern": "(a+)+$"})
    assert time.monotonic() - t0 < 0.5  # Python's re takes minutes on this
    assert found == ["$: the pattern was not checked (it can backtrack without end)"]
    assert violations("abc", {"type": "string", "pattern": "^[0-9]+$"}) == [
        "$: does not match the pattern"]
    # a key is matched against patternProperties the same way: not run, so not matched
    t0 = time.monotonic()
    assert violations({"a" * 40 + "b": 1}, {"type": "object",
                                             "patternProperties": {"(a+)+$": False}}) == []
    assert time.monotonic() - t0 < 0.5


def test_a_walk_too_deep_for_pythons_recursion_stops_and_says_so():
    from helexa.router.schema_check import json_violations

    assert violations([], {"anyOf": [{"$ref": "#"}]}) == [
        "$: not checked to its end (the reply and its schema nest too deeply to walk)"]
    assert json_violations("[" * 129 + "]" * 129, {"type": "array"}) == [
        "$: not checked (the JSON nests deeper than 128 levels)"]
