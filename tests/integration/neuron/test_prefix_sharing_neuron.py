"""kv.prefix_sharing seen from outside, on real daemons: a principal guessing another's
prompt right gets `cached_tokens` 0 under "principal" (the default) while the owner's
repeat hits; under "global" the guess hits. Watch reports the mode."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from support.neuron import NeuronClient, NeuronProcess, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb

SECRET = ("Account 4417-2291: the quarterly figures for the northern depot are ready. "
          "Summarise them for the board in three sentences, quoting every number.") * 2


@pytest.fixture(scope="module")
def neuron_global(start_daemon: Callable[..., NeuronProcess], tiny_model_dir: Path) -> NeuronProcess:
    return start_daemon("globalprefix", {
        "server": {"name": "globalprefix", "listen": "127.0.0.1:0", "token_file": "token"},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 1, "prefix_sharing": "global"},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
    })


def ask(req_id: str, principal: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        req_id=req_id, model="tiny", principal=principal,
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=SECRET)]),
        sampling=pb.SamplingParams(temperature=0.0), max_tokens=2, ignore_eos=True)


async def cached_tokens(address: str, token: str, tag: str) -> tuple[list[int], pb.NeuronStatus]:
    """cached_tokens of alice, then bob guessing her prompt, then alice again."""
    async with NeuronClient(address, token) as c:
        out = [(await c.generate(ask(f"{tag}-{i}", who)))[-1].usage.cached_tokens
               for i, who in enumerate(["alice", "bob", "alice"])]
        return out, await c.watch_until(ledger_whole)


def test_a_guess_of_another_principals_prompt_reports_no_cached_tokens(
        neuron_main: NeuronProcess, neuron_token: str) -> None:
    (alice, bob, alice_again), st = asyncio.run(
        cached_tokens(neuron_main.address, neuron_token, "salted"))
    assert alice == 0 and bob == 0
    assert alice_again >= 16  # her own blocks are hers to reuse
    assert model_of(st).limits.prefix_sharing == "principal"


def test_global_sharing_lets_the_guess_hit(neuron_global: NeuronProcess,
                                           neuron_token: str) -> None:
    (alice, bob, alice_again), st = asyncio.run(
        cached_tokens(neuron_global.address, neuron_token, "global"))
    assert alice == 0 and bob >= 16 and alice_again >= 16
    assert model_of(st).limits.prefix_sharing == "global"
