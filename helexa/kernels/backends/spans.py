"""A step's prefill spans ((start, end, slot) rows of the flat step) read out of and written
back into a step's tensors: the Gated DeltaNet layers' prefill paths (gdn.py)."""

from __future__ import annotations

import torch


def lengths(spans: list[tuple[int, int, int]]) -> list[int]:
    return [end - start for start, end, _ in spans]


def contiguous(spans: list[tuple[int, int, int]]) -> bool:
    """The spans follow one another with nothing between them (no verification row)."""
    return all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def rows(x: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """The spans' rows of x back to back: a view where they are contiguous, else one cat."""
    if contiguous(spans):
        return x[spans[0][0]:spans[-1][1]]
    return torch.cat([x[start:end] for start, end, _ in spans])


def put(dst: torch.Tensor, spans: list[tuple[int, int, int]], src: torch.Tensor) -> None:
    """The inverse of _rows: src's rows written back to the spans' rows of dst."""
    if contiguous(spans):
        dst[spans[0][0]:spans[-1][1]] = src
        return
    at = 0
    for start, end, _ in spans:
        dst[start:end] = src[at:at + end - start]
        at += end - start
