"""structlog set-up: one JSON object per line on stderr.

Every line carries `event` and `component` (`router`, `neuron`, `engine` or
`kernels`: docs/observability.md); request
events add `req_id`, `model` and `principal` (bind them with
`log.bind(...)`). Request spans are `request.start` → `request.done` or
`request.rejected`; `helexa journal concurrency` reads them back.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec
import structlog

_ENCODER = msgspec.json.Encoder(enc_hook=str)


def _encode_json(obj: Any, **_: Any) -> str:
    return _ENCODER.encode(obj).decode()


def setup_logging(component: str, level: str = "info", stream: Any = None) -> structlog.BoundLogger:
    """Configure structlog for this process and return a logger bound to `component`."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            # msgspec encodes a line in about half of json.dumps' time.
            structlog.processors.JSONRenderer(serializer=_encode_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger(component=component)


def get_logger(component: str) -> structlog.BoundLogger:
    """A logger bound to `component`; lazy, so a module-level logger created
    before `setup_logging` still follows the configuration set later."""
    return structlog.get_logger(component=component)
