"""A real neuron on a tiny checkpoint: streaming generation, Watch, metrics, ctl."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb
from helexa.responses import merge_responses


def test_streams_a_chat_completion_with_usage(neuron_main: NeuronProcess,
                                              neuron_token: str) -> None:
    async def run() -> tuple[list[pb.GenerateResponse], list[pb.GenerateResponse]]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            a = await c.generate(chat_request("gen-1", max_tokens=12, ignore_eos=True,
                                              return_prompt_token_ids=True))
            b = await c.generate(chat_request("gen-2", max_tokens=12, ignore_eos=True))
            return a, b

    a, b = asyncio.run(run())
    assert len(a) >= 2  # streamed, not one blob
    last = a[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 12 == sum(len(r.token_ids) for r in a)
    assert last.usage.prompt_tokens == len(a[0].prompt_token_ids) > 5
    assert last.usage.prefill_ms > 0 and last.usage.decode_ms > 0
    assert "".join(r.text for r in a)  # some text came back
    # greedy: the same prompt gives the same tokens
    assert [t for r in a for t in r.token_ids] == [t for r in b for t in r.token_ids]
    done = neuron_main.wait_for_log("request.done", where=lambda r: r.get("req_id") == "gen-1")
    assert done["completion_tokens"] == 12 and done["finish_reason"] == "length"
    assert done["component"] == "neuron" and done["principal"] == "alice"


def test_complete_answers_the_greedy_stream_in_one_message(neuron_main: NeuronProcess,
                                                          neuron_token: str) -> None:
    async def run() -> tuple[list[pb.GenerateResponse], pb.GenerateResponse]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            reqs = [chat_request(f"both-{rpc}", max_tokens=16, ignore_eos=True,
                                 return_prompt_token_ids=True) for rpc in "gc"]
            for r in reqs:
                r.sampling.logprobs, r.sampling.top_logprobs = True, 2
            streamed = await c.generate(reqs[0])
            whole = await c.complete(reqs[1])
            await c.watch_until(ledger_whole)
            return streamed, whole

    streamed, whole = asyncio.run(run())
    merged = merge_responses(streamed)
    assert len(streamed) >= 2 and whole.usage.completion_tokens == 16
    assert list(whole.token_ids) == list(merged.token_ids)  # greedy: the same tokens
    assert whole.text == merged.text and whole.text
    assert list(whole.prompt_token_ids) == list(merged.prompt_token_ids)
    assert [(lp.token_id, [t.token_id for t in lp.top]) for lp in whole.logprobs] == \
        [(lp.token_id, [t.token_id for t in lp.top]) for lp in merged.logprobs]
    assert (whole.finish_reason, whole.stop_reason) == (merged.finish_reason, merged.stop_reason)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        merged.usage.prompt_tokens, merged.usage.completion_tokens)
    done = neuron_main.wait_for_log("request.done", where=lambda r: r.get("req_id") == "both-c")
    assert done["completion_tokens"] == 16 and done["finish_reason"] == "length"


def _metric_samples(neuron: NeuronProcess) -> tuple[str, dict[str, float]]:
    body = urllib.request.urlopen(f"http://{neuron.metrics_address}/metrics").read().decode()
    return body, {k: float(v) for k, v in (line.rsplit(" ", 1) for line in body.splitlines()
                                           if line and not line.startswith("#"))}


def test_watch_metrics_and_ctl_show_the_model_and_its_ledger(neuron_main: NeuronProcess,
                                                             neuron_token: str) -> None:
    """The counters move by this test's own two requests, whatever ran before it."""
    length, decoded = 'helexa_requests_total{model="tiny",outcome="length"}', \
        'helexa_decode_tokens_total{model="tiny"}'
    _, before = _metric_samples(neuron_main)

    async def run() -> pb.NeuronStatus:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            for i in range(2):
                await c.generate(chat_request(f"metered-{i}", max_tokens=12, ignore_eos=True))
            await c.watch_until(ledger_whole)
            return await c.status()

    st = asyncio.run(run())
    m = model_of(st)
    assert st.neuron == "main" and m.state == pb.MODEL_STATE_READY
    assert m.kv.total_bytes == m.kv.free_bytes > 0 and m.kv.bytes_per_token > 0
    assert m.limits.context == m.kv.total_bytes // m.kv.bytes_per_token
    body, samples = _metric_samples(neuron_main)
    assert samples['helexa_kv_total_bytes{model="tiny"}'] == m.kv.total_bytes
    assert "helexa_ttft_seconds_bucket" in body
    assert samples[length] - before.get(length, 0.0) == 2
    assert samples[decoded] - before.get(decoded, 0.0) == 24
    out = subprocess.run([sys.executable, "-m", "helexa.cli", "ctl", "--config",
                          str(neuron_main.config_path), "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "ready" in out.stdout


def test_a_watcher_sees_the_ledger_change_within_100_ms(neuron_main: NeuronProcess,
                                                        neuron_token: str) -> None:
    """Time from a request's admission (its first byte back) to Watch showing the ledger move."""
    async def run() -> float:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            watch = c.stub.Watch(pb.WatchRequest(heartbeat_ms=5000), metadata=c.md)
            first = await watch.read()
            assert model_of(first).in_flight == 0
            seen = asyncio.get_running_loop().create_future()

            async def read() -> None:
                while True:
                    st = await watch.read()
                    if model_of(st).kv.free_bytes < model_of(st).kv.total_bytes:
                        seen.set_result(time.monotonic())
                        return

            reader = asyncio.ensure_future(read())
            call = c.stub.Generate(chat_request("watched", max_tokens=900, ignore_eos=True),
                                   metadata=c.md)
            await call.read()  # admitted and prefilled: the pool has moved
            t_first = time.monotonic()
            t_seen = await asyncio.wait_for(seen, 5)
            call.cancel()
            watch.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await c.watch_until(ledger_whole)
            return t_seen - t_first

    lag = asyncio.run(run())
    assert lag < 0.1, lag


def test_logprobs_carry_each_tokens_raw_bytes(neuron_main: NeuronProcess, neuron_token: str,
                                              tiny_model_dir) -> None:
    from helexa.neuron.tokenizer import Tokenizer

    async def run() -> list[pb.GenerateResponse]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            req = chat_request("lp-bytes", max_tokens=48, ignore_eos=True)
            req.sampling.temperature, req.sampling.seed = 1.0, 3  # random bytes, split characters
            req.sampling.logprobs, req.sampling.top_logprobs = True, 3
            return await c.generate(req)

    tok = Tokenizer.from_dir(tiny_model_dir)
    lps = [lp for r in asyncio.run(run()) for lp in r.logprobs]
    assert len(lps) == 48
    for lp in lps:
        assert lp.token_bytes == tok.token_bytes(lp.token_id)
        assert all(t.token_bytes == tok.token_bytes(t.token_id) for t in lp.top)
    # a token holding part of a character: its text is U+FFFD, its bytes are its own
    split = [lp for lp in lps if lp.token == "\ufffd"]
    assert split and all(len(lp.token_bytes) == 1 and lp.token_bytes[0] >= 0x80 for lp in split)


def test_a_long_prompts_first_message_comes_at_admission(neuron_main: NeuronProcess,
                                                        neuron_token: str) -> None:
    # Over one prefill chunk (512 tokens), the prefill takes several engine steps: the first
    # message says at admission that the request is served (prompt_tokens, no token yet),
    # so the router can open its client's stream and keep it alive through the prefill.
    text = " ".join(f"w{i}" for i in range(400))  # unlike any other prompt: nothing cached

    async def run() -> list[pb.GenerateResponse]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            return await c.generate(chat_request("gen-long", text, max_tokens=2))

    msgs = asyncio.run(run())
    assert msgs[0].prompt_tokens > 512 and not msgs[0].token_ids and not msgs[0].text
    assert msgs[-1].usage.completion_tokens == 2 == sum(len(m.token_ids) for m in msgs)
