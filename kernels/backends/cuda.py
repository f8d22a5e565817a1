"""The ``cuda`` attention backend: FlashInfer placeholder (filled in below)."""

from __future__ import annotations


def available() -> bool:
    return False


def import_error() -> str:
    return "not built yet"
