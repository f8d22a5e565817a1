"""The prefix cache seen from outside: a real daemon with it (the default, `neuron_main`)
against one started with `kv.prefix_cache = false`, same tiny checkpoint.

A second chat turn reports the first turn's blocks as `cached_tokens`, and
greedy outputs are token for token those of the daemon that recomputes
everything — for a multi-turn chat and for concurrent chats sharing a long
system prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from support.neuron import NeuronClient, NeuronProcess, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb

BLOCK = 16  # kv.block_size default
SYSTEM = ("You are a careful assistant who answers in full sentences. "
          "The ledger of the pool is kept in blocks of sixteen tokens, and a block that "
          "holds the same tokens after the same prefix is the same block. ") * 3


@pytest.fixture(scope="module")
def neuron_noprefix(start_daemon: Callable[..., NeuronProcess],
                    tiny_model_dir: Path) -> NeuronProcess:
    return start_daemon("noprefix", {
        "server": {"name": "noprefix", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 10.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 1, "prefix_cache": False},
        "admission": {"max_in_flight": 2},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
    })


def chat(req_id: str, messages: list[tuple[str, str]], max_tokens: int = 12) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        req_id=req_id, model="tiny", principal="prefix",
        chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=pb.SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True)


def reply(out: list[pb.GenerateResponse]) -> tuple[str, list[int], pb.Usage]:
    return ("".join(r.text for r in out), [t for r in out for t in r.token_ids], out[-1].usage)


async def two_turns(address: str, token: str, tag: str) -> list[tuple[str, list[int], pb.Usage]]:
    first = [("system", SYSTEM), ("user", f"Conversation {tag}: tell me about the pool.")]
    async with NeuronClient(address, token) as c:
        one = reply(await c.generate(chat(f"{tag}-1", first)))
        second = [*first, ("assistant", one[0]), ("user", "And what happens to a freed block?")]
        two = reply(await c.generate(chat(f"{tag}-2", second)))
        await c.watch_until(ledger_whole)
    return [one, two]


def test_a_second_turn_reuses_the_first_turns_blocks_with_the_same_tokens(
        neuron_main: NeuronProcess, neuron_noprefix: NeuronProcess, neuron_token: str) -> None:
    on = asyncio.run(two_turns(neuron_main.address, neuron_token, "mt-on"))
    off = asyncio.run(two_turns(neuron_noprefix.address, neuron_token, "mt-on"))
    (_, ids1, use1), (_, ids2, use2) = on
    # greedy tokens of both turns are those of the daemon that recomputes every prompt
    assert [ids1, ids2] == [off[0][1], off[1][1]]
    assert len(ids1) == len(ids2) == 12
    assert use1.prompt_tokens == off[0][2].prompt_tokens and use2.prompt_tokens > use1.prompt_tokens
    # every full block of the first turn's prompt is served from the cache in the second
    assert use2.cached_tokens >= use1.prompt_tokens // BLOCK * BLOCK > 0
    assert use2.cached_tokens < use2.prompt_tokens  # its last token is always computed
    assert off[1][2].cached_tokens == 0


def test_concurrent_chats_sharing_a_system_prompt_match_the_uncached_daemon(
        neuron_main: NeuronProcess, neuron_noprefix: NeuronProcess, neuron_token: str) -> None:
    questions = ["What is a block?", "Who keeps the ledger?", "Why sixteen tokens?",
                 "Is a cached block free?", "What does eviction take first?"]

    async def run(address: str) -> tuple[list[tuple[str, list[int], pb.Usage]], pb.NeuronStatus]:
        async with NeuronClient(address, neuron_token) as c:
            outs = await asyncio.gather(*(
                c.generate(chat(f"sys-{i}", [("system", SYSTEM), ("user", q)], max_tokens=8))
                for i, q in enumerate(questions)))
            return [reply(o) for o in outs], await c.watch_until(ledger_whole)

    on, st_on = asyncio.run(run(neuron_main.address))
    off, _ = asyncio.run(run(neuron_noprefix.address))
    assert [o[1] for o in on] == [o[1] for o in off]
    # max_in_flight 2: the later chats are admitted after the system prompt's blocks are filed
    hits = [o[2].cached_tokens for o in on]
    assert sum(h > 0 for h in hits) >= len(questions) - 2, hits
    assert max(hits) >= BLOCK and all(o[2].cached_tokens == 0 for o in off)
    assert model_of(st_on).kv.cached_bytes > 0  # the shared blocks stay, reclaimable
