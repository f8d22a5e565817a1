"""How a config field declares itself: its meaning and whether a running daemon applies it on
SIGHUP (`reload`) or only at start (`restart`), read back by docs/config.md's generator."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

RELOAD = "reload"
RESTART = "restart"


def field_meta(doc: str, apply: str, **constraints: Any) -> msgspec.Meta:
    """Constraints plus the doc text and the reload/restart rule of a field."""
    return msgspec.Meta(description=doc, extra={"apply": apply}, **constraints)


def optional(tp: Any, **constraints: Any) -> Any:
    """`tp` with constraints, or None (msgspec constrains only the non-None arm)."""
    return Annotated[tp, msgspec.Meta(**constraints)] | None
