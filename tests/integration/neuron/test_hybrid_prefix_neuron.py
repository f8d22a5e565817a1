"""Prefix reuse on a hybrid model seen from outside: two real daemons serving a tiny
Qwen3.5 (Gated DeltaNet + gated attention, its own chat template), one with the prefix
cache and one with `kv.prefix_cache = false`. A 10-turn agent session, each turn the last
one, its reply and a tool result, gets the same greedy tokens on both, reuses at least 0.9
of the last turn's prompt from turn 2 on, and leaves the ledger whole."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.neuron import NeuronClient, NeuronProcess, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb

SYSTEM = "You are a coding agent. Call the tools you are given, then say what you found."


def config(name: str, model_dir: Path, prefix_cache: bool) -> dict[str, Any]:
    return {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 10.0},
        "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 4, "prefix_cache": prefix_cache},
        "admission": {"max_in_flight": 2},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    }


@pytest.fixture(scope="module")
def hybrids(start_daemon: Callable[..., NeuronProcess], tiny_checkpoint: Callable[..., Path]
            ) -> tuple[NeuronProcess, NeuronProcess]:
    model_dir = tiny_checkpoint("qwen3_5", chat_template="qwen3_5")
    return (start_daemon("hybrid-on", config("hybrid-on", model_dir, True)),
            start_daemon("hybrid-off", config("hybrid-off", model_dir, False)))


def chat(req_id: str, messages: list[tuple[str, str]]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        req_id=req_id, model="tiny", principal="agent",
        chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=pb.SamplingParams(temperature=0.0), max_tokens=12, ignore_eos=True)


async def session(address: str, token: str, turns: int) -> tuple[list[tuple], pb.NeuronStatus]:
    messages = [("system", SYSTEM), ("user", "List the files of the repository, then read "
                                             "the README and summarise it for me.")]
    out = []
    async with NeuronClient(address, token) as c:
        for t in range(turns):
            got = await c.generate(chat(f"turn-{t}", messages))
            text, ids = "".join(r.text for r in got), [i for r in got for i in r.token_ids]
            out.append((ids, got[-1].usage))
            messages += [("assistant", text),
                         ("tool", f"result {t}: " + f"src/module_{t}.py " * (4 + t % 3))]
        return out, await c.watch_until(ledger_whole)


def test_an_agent_session_reuses_each_turn_with_a_cold_daemons_tokens(
        hybrids: tuple[NeuronProcess, NeuronProcess], neuron_token: str) -> None:
    on, off = hybrids
    warm, st = asyncio.run(session(on.address, neuron_token, 10))
    cold, _ = asyncio.run(session(off.address, neuron_token, 10))
    assert [ids for ids, _ in warm] == [ids for ids, _ in cold]
    for t in range(1, 10):
        previous, usage = warm[t - 1][1].prompt_tokens, warm[t][1]
        assert usage.cached_tokens >= 0.9 * previous, (t, usage.cached_tokens, previous)
        assert cold[t][1].cached_tokens == 0
    assert model_of(st).limits.prefix_cache and model_of(st).kv.cached_bytes > 0
