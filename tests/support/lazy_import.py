"""Client libraries a few test files use, imported when a test first uses them rather than
when pytest collects the file. Under `make test` both xdist workers collect every file:
anthropic, openai-agents, langchain-openai and compressed-tensors imported at the top of
theirs cost each worker ~6.5 s of CPU before its first test (collection 10.1 s with
them, 4.0 s without), the worker that never runs those files included."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest


class Lazy:
    """Stands for module ``name``: its first read of a public attribute imports it (pytest
    reads private ones, ``__test__`` and such, of everything a test module holds)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def needs(name: str, why: str = "") -> pytest.MarkDecorator:
    """Skip a file's tests where module ``name`` is not installed (``pytest.importorskip``
    without importing it at collection)."""
    return pytest.mark.skipif(importlib.util.find_spec(name) is None,
                              reason=f"{name} is not installed{why}")
