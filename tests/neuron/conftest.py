"""Reference greedy decoding with transformers, shared by the model tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import pytest
import torch

# bench/gpu_engine.sh runs these same checks on a GPU: HELEXA_TEST_DEVICE=cuda.
DEVICE = os.environ.get("HELEXA_TEST_DEVICE", "cpu")

# The rule: outputs must agree up to the first step where the
# reference's top-two logits are closer than this (a near-tie).
NEAR_TIE = 0.02


@cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()


def hf_greedy(model_dir: Path, prompt: Sequence[int], max_new: int) -> tuple[list[int], int]:
    """transformers' greedy continuation and the first near-tie step (max_new if none)."""
    ref = _reference(str(model_dir), tuple(prompt))
    ref.extend(max_new)
    return ref.tokens[:max_new], ref.first_tie(max_new)


class _Reference:
    """transformers' greedy decode of one prompt, run only as far as it was asked and
    continued from where it stopped (its KV cache kept): a prompt picked at one length and
    compared at another decodes each step once. Step i's token and top-two gap are the
    same however far the decode goes (one token a forward, the cache fed back)."""

    def __init__(self, model_dir: str, prompt: tuple[int, ...]) -> None:
        self.model = _hf_model(model_dir)
        self.tokens: list[int] = []
        self.gaps: list[float] = []  # each step's top-two logit gap
        self.past = None
        self.x = torch.tensor([list(prompt)], device=DEVICE)

    def extend(self, steps: int, until_tie: bool = False) -> None:
        """Decode up to ``steps`` tokens in all; with ``until_tie``, stop at a near-tie."""
        with torch.inference_mode():
            while len(self.tokens) < steps:
                if until_tie and self.first_tie(len(self.gaps)) < len(self.gaps):
                    return
                out = self.model(self.x, past_key_values=self.past, use_cache=True)
                self.past = out.past_key_values
                logits = out.logits[0, -1].float()
                top2 = logits.topk(2).values
                self.gaps.append(float(top2[0] - top2[1]))
                self.tokens.append(int(logits.argmax()))
                self.x = torch.tensor([[self.tokens[-1]]], device=DEVICE)

    def first_tie(self, steps: int) -> int:
        """The first of the first ``steps`` steps (decoded) whose gap is a near-tie, else
        ``steps``."""
        return next((i for i, gap in enumerate(self.gaps[:steps]) if gap < NEAR_TIE), steps)


@cache
def _reference(model_dir: str, prompt: tuple[int, ...]) -> _Reference:
    return _Reference(model_dir, prompt)


def assert_greedy_matches(model_dir: Path, prompt: Sequence[int], ours: list[int],
                          min_agree: int = 8) -> None:
    ref, tie = hf_greedy(model_dir, prompt, len(ours))
    assert tie >= min_agree, f"reference near-tie at step {tie}: test would prove little"
    assert ours[:tie] == ref[:tie], (
        f"greedy tokens diverge from transformers before the first near-tie (step {tie}):\n"
        f"ours {ours[:tie]}\nref  {ref[:tie]}")


def pick_prompt(model_dir: Path, seed: int, length: int, max_new: int = 64,
                min_agree: int = 24, vocab: int = 500) -> list[int]:
    """A random prompt whose reference continuation has no near-tie in its first
    min_agree steps (chosen from the reference alone), so a comparison proves something."""
    for attempt in range(50):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        # the reference's first near-tie within max_new steps is at min_agree or later:
        # decoded only until a near-tie rules the prompt out (the rest when compared)
        ref = _reference(str(model_dir), tuple(prompt))
        ref.extend(min(min_agree, max_new), until_tie=True)
        if min_agree <= max_new and ref.first_tie(min_agree) >= min_agree:
            return prompt
    raise AssertionError(f"{model_dir}: every prompt tried hits a near-tie early")


@pytest.fixture(scope="session")
def prompt_picker() -> Callable[..., list[int]]:
    return pick_prompt


@pytest.fixture(scope="session")
def greedy_reference() -> Callable[..., None]:
    return assert_greedy_matches


def assert_batch_and_alone_match(run, reference_dir: Path, prompts: list[list[int]],
                                 max_new: int | list[int], **generate: object) -> None:
    """Greedy output of ``run`` (closed after) in one batch of ``prompts`` and for the first
    alone matches transformers on ``reference_dir`` up to the first near-tie, each."""
    from support.greedy import greedy_generate

    try:
        outs = greedy_generate(run, prompts, max_new, **generate)
        alone = greedy_generate(run, prompts[:1], max_new if isinstance(max_new, int)
                                else max_new[0])[0]
    finally:
        run.close()
    for prompt, got in zip(prompts, outs, strict=True):
        assert_greedy_matches(reference_dir, prompt, got)
    assert_greedy_matches(reference_dir, prompts[0], alone)


@pytest.fixture(scope="session")
def batch_and_alone() -> Callable[..., None]:
    return assert_batch_and_alone_match
