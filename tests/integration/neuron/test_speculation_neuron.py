"""A real neuron with n-gram speculation: the same greedy tokens as a neuron without it,
the drafter and its figures in the status, Prometheus and a whole ledger."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb


def _tokens(proc: NeuronProcess, token: str, n: int) -> tuple[list[list[int]], pb.NeuronStatus]:
    async def run():
        async with NeuronClient(proc.address, token) as c:
            # one at a time: alone in the batch, the adaptive policy always drafts
            outs = [await c.generate(chat_request(
                f"spec-{i}", text=f"Repeat after me: one two three {i}", max_tokens=40,
                ignore_eos=True)) for i in range(n)]
            st = await c.watch_until(ledger_whole)
            return [[t for r in out for t in r.token_ids] for out in outs], st

    return asyncio.run(run())


def test_ngram_neuron_gives_the_tokens_of_a_plain_one(
        start_daemon: Callable[..., NeuronProcess], base_neuron_config: Callable[..., dict],
        tiny_model_dir: Path, neuron_main: NeuronProcess, neuron_token: str) -> None:
    cfg: dict[str, Any] = base_neuron_config("spec", tiny_model_dir,
                                             engine={"speculation": "ngram"})
    spec = start_daemon("spec", cfg)
    got, st = _tokens(spec, neuron_token, 3)
    want, plain = _tokens(neuron_main, neuron_token, 3)
    assert got == want
    m = model_of(st)
    assert m.drafter == "ngram" and m.spec_drafted_tokens > 0
    assert 0 <= m.spec_accepted_tokens <= m.spec_drafted_tokens
    assert model_of(plain).drafter == "off"
    body = urllib.request.urlopen(f"http://{spec.metrics_address}/metrics").read().decode()
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines()
                   if line and not line.startswith("#"))
    key = '{drafter="ngram",model="tiny"}'
    assert float(samples[f"helexa_spec_drafted_tokens_total{key}"]) == m.spec_drafted_tokens
    assert float(samples[f"helexa_spec_accepted_tokens_total{key}"]) == m.spec_accepted_tokens


def test_mtp_neuron_gives_the_tokens_of_a_plain_one(
        start_daemon: Callable[..., NeuronProcess], base_neuron_config: Callable[..., dict],
        tiny_checkpoint: Callable[..., Path], neuron_token: str) -> None:
    # A hybrid with an MTP head, planned from its config.json: the pool holds the head's
    # layer (the load would fail on a plan/pool mismatch), the head drafts, the tokens
    # are a plain neuron's, and the status names the drafter.
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    mtp = start_daemon("mtp", base_neuron_config("mtp", model_dir,
                                                 engine={"speculation": "mtp"}))
    plain = start_daemon("mtp-plain", base_neuron_config("mtp-plain", model_dir))
    got, st = _tokens(mtp, neuron_token, 2)
    want, _ = _tokens(plain, neuron_token, 2)
    assert got == want
    m = model_of(st)
    assert m.drafter == "mtp" and m.spec_drafted_tokens > 0


def test_a_draft_model_neuron_gives_the_tokens_of_a_plain_one(
        start_daemon: Callable[..., NeuronProcess], base_neuron_config: Callable[..., dict],
        tiny_model_dir: Path, neuron_main: NeuronProcess, neuron_token: str) -> None:
    """speculation = "draft:<id>" on the model's own entry: the draft (here the same
    checkpoint under another id, so nearly every draft is right) loads in the engine."""
    cfg: dict[str, Any] = base_neuron_config("draft", tiny_model_dir, models=[
        {"id": "tiny", "path": str(tiny_model_dir), "speculation": "draft:twin"},
        {"id": "twin", "path": str(tiny_model_dir), "preload": False}])
    proc = start_daemon("draft", cfg)
    got, st = _tokens(proc, neuron_token, 2)
    want, plain = _tokens(neuron_main, neuron_token, 2)
    assert got == want
    m = model_of(st)  # taken with the ledger whole: every block came back
    assert m.drafter == "draft:twin" and m.spec_drafted_tokens > 0
    assert m.spec_accepted_tokens >= 0.9 * m.spec_drafted_tokens
    # the pool's bytes per token are the target's and the draft's (the same: twice one)
    assert m.kv.bytes_per_token == 2 * model_of(plain).kv.bytes_per_token
