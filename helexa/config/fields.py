"""What every config schema is made of: a field's doc text and reload/restart rule.

Every field of every schema (helexa/config/neuron.py, router.py, catalogue.py,
speculation.py) is declared with `field_meta(...)`, which records its meaning and
whether a running daemon applies it on SIGHUP (`reload`) or only at start
(`restart`); docs/config.md is generated from these declarations (doc.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

RELOAD = "reload"
RESTART = "restart"

KvDtype = Literal["auto", "fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4"]


def field_meta(doc: str, apply: str, **constraints: Any) -> msgspec.Meta:
    """Constraints plus the doc text and the reload/restart rule of a field."""
    return msgspec.Meta(description=doc, extra={"apply": apply}, **constraints)


def optional(tp: Any, **constraints: Any) -> Any:
    """`tp` with constraints, or None (msgspec constrains only the non-None arm)."""
    return Annotated[tp, msgspec.Meta(**constraints)] | None
