"""EngineClient against a real spawned engine process (fake runner): streaming, early
close → abort, limits, drain refusals, a dead engine failing open requests, start errors."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import msgspec
import pytest
from support.fake_runner import FakeRunner, FakeRunnerFactory, fake_continuation
from support.neuron import spawned_children

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.client import EngineClient, EngineError
from helexa.neuron.engine.flow import PAUSE_TOKENS
from helexa.neuron.engine.spec import EngineSpec

VOCAB = 64
GREEDY = m.SamplingParams(temperature=0.0)


def spec(**kw) -> EngineSpec:
    fields = dict(model_id="fake", num_blocks=512, block_size=4, context=512, bytes_per_token=2,
                  torch_threads=1,
                  limits=m.Limits(max_in_flight=8, anon_max_in_flight=8))
    fields.update(kw)
    return EngineSpec(**fields)


def expected(prompt: list[int], n: int) -> list[int]:
    return fake_continuation(prompt, n, VOCAB)


def fake(step_secs: float = 0.0) -> FakeRunnerFactory:
    """The fake model in the engine process, `step_secs` a step."""
    return FakeRunnerFactory(VOCAB, step_secs)


async def collect(client: EngineClient, req: m.NewRequest) -> tuple[list[int], m.RequestUpdate]:
    tokens: list[int] = []
    async for upd in client.generate(req):
        tokens += upd.new_token_ids
        last = upd
    return tokens, last


async def until(pred, timeout: float = 30.0) -> None:  # generous: the machine may be loaded
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def falls_behind(client: EngineClient) -> None:
    """Flow control (flow.py): a stream nobody reads stops growing at about PAUSE_TOKENS
    unread, the engine reports it paused and makes nothing for it while another stream
    goes on; read again, it resumes and every token comes, in order."""
    told: list[tuple[bool, int]] = []
    slow = client.generate(m.NewRequest(req_id="slow", prompt_token_ids=[3, 4, 5],
                                        max_tokens=400, sampling=GREEDY),
                           on_flow=lambda paused, unread: told.append((paused, unread)))
    tokens = list((await anext(slow)).new_token_ids)  # admitted; then read nothing
    await until(lambda: client.status is not None and client.status.paused == 1)
    assert client.flow.num_paused == 1 and told[0][0] is True
    unread = client.flow._unread["slow"]
    # a step or two past the word on an idle machine; the word crosses a process boundary,
    # so on a loaded one (load 10 on 2 cores: 273-292 seen) more steps run before it lands.
    # Still well short of the 400 an unpaused stream would leave unread.
    assert PAUSE_TOKENS <= unread < PAUSE_TOKENS + 96
    other, _ = await collect(client, m.NewRequest(req_id="other", prompt_token_ids=[9],
                                                  max_tokens=100, sampling=GREEDY))
    assert other == expected([9], 100)  # it ran meanwhile
    assert client.flow._unread["slow"] == unread  # and the paused one made nothing
    async for upd in slow:
        tokens += upd.new_token_ids
        last = upd
    assert tokens == expected([3, 4, 5], 400) and last.finished == m.FinishReason.LENGTH
    assert [p for p, _ in told][:2] == [True, False] and told[-1][0] is False
    await until(lambda: client.status.in_flight == 0 and client.status.paused == 0
                and client.status.kv.free_bytes == client.status.kv.total_bytes)


def test_streams_aborts_limits_and_shutdown():
    statuses: list[m.EngineStatus] = []

    async def main() -> None:
        client = await EngineClient.start(spec(), runner_factory=fake(0.002), on_status=statuses.append)
        assert client.alive and client.pid
        # concurrent streams, each token for token what the fake model gives alone
        prompts = [[i, i + 1, i + 2] * (i + 1) for i in range(10)]
        results = await asyncio.gather(*[
            collect(client, m.NewRequest(req_id=f"g{i}", prompt_token_ids=p, max_tokens=12,
                                         sampling=GREEDY))
            for i, p in enumerate(prompts)])
        for p, (tokens, last) in zip(prompts, results, strict=True):
            assert tokens == expected(p, 12) and last.finished == m.FinishReason.LENGTH
        await until(lambda: client.status.in_flight == 0)
        assert statuses and client.status.kv.free_bytes == client.status.kv.total_bytes

        # closing a stream early aborts the request in the engine
        stream = client.generate(m.NewRequest(req_id="long", prompt_token_ids=[1, 2],
                                              max_tokens=400, sampling=GREEDY))
        got = 0
        async for upd in stream:
            got += len(upd.new_token_ids)
            if got >= 3:
                break
        await stream.aclose()
        await until(lambda: client.status.in_flight == 0
                    and client.status.kv.free_bytes == client.status.kv.total_bytes)

        # 40 callers, a random half of them going away at random moments: the ledger is whole
        rng = random.Random(4)
        tasks = [asyncio.ensure_future(collect(client, m.NewRequest(
            req_id=f"c{i}", prompt_token_ids=[i % VOCAB] * (1 + i % 13), max_tokens=rng.randrange(1, 60),
            sampling=GREEDY, principal=f"p{i % 3}"))) for i in range(40)]
        for task in rng.sample(tasks, 20):
            await asyncio.sleep(rng.random() * 0.02)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: client.status.in_flight == client.status.queued == 0
                    and client.status.kv.free_bytes == client.status.kv.total_bytes)
        assert client.num_open_requests == 0

        await falls_behind(client)

        # limits at runtime: one in flight at a time, the second waits in the queue
        client.set_limits(msgspec.structs.replace(client.spec.limits, max_in_flight=1))
        # 400 steps: s1 is still running when s2 is seen queued, however loaded the machine
        slow = asyncio.ensure_future(collect(client, m.NewRequest(
            req_id="s1", prompt_token_ids=[3], max_tokens=400, sampling=GREEDY)))
        await until(lambda: client.status.in_flight == 1)
        second = asyncio.ensure_future(collect(client, m.NewRequest(
            req_id="s2", prompt_token_ids=[4], max_tokens=5, sampling=GREEDY, principal="p")))
        await until(lambda: client.status.queued == 1)
        assert (await slow)[1].finished == m.FinishReason.LENGTH
        assert (await second)[0] == expected([4], 5)

        # draining: new requests are refused shutting_down, then admitted again
        client.stop_admitting(True, refuse_queued=True)
        _, last = await collect(client, m.NewRequest(req_id="d", prompt_token_ids=[1]))
        assert last.refused_code == "shutting_down" and last.retry_after_ms > 0
        client.stop_admitting(False)
        # a switch's stop: a newcomer waits queued and is served once admission resumes
        client.stop_admitting(True)
        held = asyncio.ensure_future(collect(client, m.NewRequest(
            req_id="h", prompt_token_ids=[1], max_tokens=2, sampling=GREEDY)))
        await until(lambda: client.status.queued == 1)
        client.stop_admitting(False)
        assert (await held)[1].finished == m.FinishReason.LENGTH
        tokens, last = await collect(client, m.NewRequest(req_id="d2", prompt_token_ids=[1],
                                                          max_tokens=2, sampling=GREEDY))
        assert last.finished == m.FinishReason.LENGTH

        # the pool is re-planned in place while nothing is in flight
        await client.reset_kv(num_blocks=100, kv_dtype="int8", bytes_per_token=1, context=400)
        await until(lambda: client.status.kv.total_bytes == 100 * 4)
        tokens, last = await collect(client, m.NewRequest(req_id="r", prompt_token_ids=[2],
                                                          max_tokens=3, sampling=GREEDY))
        assert tokens == expected([2], 3)

        # shutdown aborts what is open and the process exits 0
        open_one = asyncio.ensure_future(collect(client, m.NewRequest(
            req_id="o", prompt_token_ids=[5], max_tokens=300, sampling=GREEDY)))
        await until(lambda: client.status.running == 1)
        await client.shutdown(timeout_secs=10)
        assert (await open_one)[1].finished == m.FinishReason.ABORT
        assert client.process.exitcode == 0 and not client.alive
        _, last = await collect(client, m.NewRequest(req_id="after", prompt_token_ids=[1]))
        assert last.finished == m.FinishReason.ERROR

    asyncio.run(main())


def test_dead_engine_fails_open_requests_and_calls_on_fatal():
    fatal: list[str] = []

    async def main() -> None:
        client = await EngineClient.start(spec(), runner_factory=fake(0.005), on_fatal=fatal.append)
        streams = [asyncio.ensure_future(collect(client, m.NewRequest(
            req_id=f"k{i}", prompt_token_ids=[i + 1], max_tokens=400, sampling=GREEDY)))
            for i in range(3)]
        await until(lambda: client.status is not None and client.status.running == 3)
        os.kill(client.pid, signal.SIGKILL)
        for fut in streams:
            tokens, last = await asyncio.wait_for(fut, 5)
            assert last.finished == m.FinishReason.ERROR and "exit" in last.error
        assert not client.alive and len(fatal) == 1
        await client.shutdown(timeout_secs=1)
        assert len(fatal) == 1

    asyncio.run(main())


def test_start_failure_raises_with_the_engines_reason(tmp_path):
    async def main() -> None:
        with pytest.raises(EngineError, match="loading fake failed"):
            await EngineClient.start(spec(model_dir=str(tmp_path / "missing")))

    asyncio.run(main())


@pytest.mark.parametrize("built,cards,devices,said", [
    (None, 0, ["cuda:0"], "cuda:0 is a CUDA device, but this host's torch 9.9 is built without CUDA"),
    ("12.4", 0, ["cuda"], "cuda is a CUDA device, but torch 9.9 sees no card on this host"),
    ("12.4", 2, ["cuda:0", "cuda:2"], "cuda:2: torch sees 2 CUDA card(s) on this host "
                                      "(cuda:0 to cuda:1)"),
    ("12.4", 1, ["cuda:0"], ""),
    (None, 0, ["cpu", "cpu"], ""),
], ids=["cpu-build", "no-card", "index-past-the-cards", "fits", "cpu"])
def test_what_the_engine_says_of_cuda_cards_this_host_lacks(monkeypatch, built, cards, devices,
                                                           said):
    # the GPU host's branches without one (test_residency runs the real process on this host)
    import torch

    from helexa.neuron.engine.process import missing_cuda

    monkeypatch.setattr(torch, "__version__", "9.9")
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cards)
    assert missing_cuda(devices).startswith(said) and bool(said) == bool(missing_cuda(devices))


def test_engine_loop_gives_up_after_repeated_step_failures():
    """The process loop (run in a thread here): steps that keep failing end the engine, so
    the daemon can mark the model failed; each failed step's requests come back ERROR."""
    import multiprocessing
    import threading

    import msgspec

    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.process import MAX_CONSECUTIVE_FAILED_STEPS, EngineGaveUp, run_loop

    class Broken(FakeRunner):
        def run_step(self, seqs, *, keep_hidden=False):
            raise RuntimeError("device lost")

    core = EngineCore(spec(), Broken(64, 512, 4))
    here, there = multiprocessing.Pipe()
    raised: list[BaseException] = []

    def loop() -> None:
        try:
            run_loop(core, there, msgspec.msgpack.Encoder())
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=loop)
    thread.start()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.FromEngine)
    errors = 0
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
        here.send_bytes(enc.encode(m.ToEngine(new=[m.NewRequest(req_id=f"x{i}", prompt_token_ids=[1],
                                                                max_tokens=2)])))
        while True:
            out = dec.decode(here.recv_bytes())
            done = [u for u in out.updates if u.finished == m.FinishReason.ERROR]
            if done:
                assert "device lost" in done[0].error
                errors += 1
                break
    thread.join(5)
    assert errors == MAX_CONSECUTIVE_FAILED_STEPS
    assert len(raised) == 1 and isinstance(raised[0], EngineGaveUp)
    assert f"{MAX_CONSECUTIVE_FAILED_STEPS} steps failed in a row" in str(raised[0])
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_tensor_parallel_engine_process_matches_one_rank(tiny_model_dir):
    """tp = 2 on CPU: the engine process starts its second rank (so it must not be daemonic)
    and streams the greedy tokens an in-process tp = 1 engine gives."""
    from helexa.neuron.engine.engine_core import EngineCore

    def tiny(tp: int) -> EngineSpec:
        return EngineSpec(model_id="tiny", model_dir=str(tiny_model_dir), num_blocks=64,
                          block_size=16, context=512, tp=tp, devices=["cpu"] * tp, torch_threads=1)

    prompts = [list(range(3, 20 + 9 * i)) for i in range(3)]
    reqs = [m.NewRequest(req_id=f"t{i}", prompt_token_ids=p, max_tokens=8, sampling=GREEDY)
            for i, p in enumerate(prompts)]
    want: dict[str, list[int]] = {}
    core = EngineCore(tiny(1))
    inbound: m.ToEngine | None = m.ToEngine(new=reqs)
    while inbound is not None or core.has_work:
        for u in core.step(inbound).updates:
            want.setdefault(u.req_id, []).extend(u.new_token_ids)
        inbound = None

    async def main() -> None:
        client = await EngineClient.start(tiny(2))
        try:
            got = await asyncio.gather(*[collect(client, r) for r in reqs])
        finally:
            await client.shutdown(timeout_secs=10)
        assert [tokens for tokens, _ in got] == [want[r.req_id] for r in reqs]
        assert client.process.exitcode == 0

    asyncio.run(main())


def test_wedged_engine_is_killed_and_reported():
    fatal: list[str] = []

    async def main() -> None:
        # every step "hangs" for 30 s; the client gives up on it after 1 s of silence
        client = await EngineClient.start(spec(), runner_factory=fake(30.0), on_fatal=fatal.append,
                                          stall_secs=1.0)
        started = time.monotonic()
        tokens, last = await collect(client, m.NewRequest(req_id="w", prompt_token_ids=[1],
                                                          max_tokens=5, sampling=GREEDY))
        assert last.finished == m.FinishReason.ERROR and "wedged" in last.error
        assert time.monotonic() - started < 10
        assert fatal and "wedged" in fatal[0] and not client.alive
        await client.shutdown(timeout_secs=2)
        assert client.process.exitcode is not None

    asyncio.run(main())


@pytest.mark.slow  # test_tp.py's killed rank and the daemon's (test_neuron_tp.py) run by default
def test_a_dead_rank_fails_the_model_at_once(tiny_model_dir):
    """tp = 2: killing rank 1 fails the request in the step that finds it with an error,
    and the engine goes down at once (on_fatal), rather than failing step after step."""
    fatal: list[str] = []

    async def main() -> None:
        client = await EngineClient.start(
            EngineSpec(model_id="tiny", model_dir=str(tiny_model_dir), num_blocks=64,
                       block_size=16, context=512, tp=2, devices=["cpu"] * 2, torch_threads=1),
            on_fatal=fatal.append)
        try:
            [rank] = spawned_children(client.pid)
            os.kill(rank, signal.SIGKILL)
            tokens, last = await collect(client, m.NewRequest(
                req_id="r", prompt_token_ids=list(range(3, 20)), max_tokens=8, sampling=GREEDY))
            assert last.finished == m.FinishReason.ERROR and tokens == []
            await until(lambda: bool(fatal), timeout=10)  # the engine said why it went down
            assert "tensor-parallel" in fatal[0] and "rank 1" in fatal[0]
        finally:
            await client.shutdown(timeout_secs=10)
        assert not client.alive

    asyncio.run(main())


def test_a_step_that_ends_with_the_group_failed_sends_nothing():
    """A tensor-parallel step can return normally after its group was aborted (NCCL's kernels
    leave early on the abort flag): its tokens may come from cut-short all-reduces, so the
    loop gives up before sending them, with the reason, and the daemon fails the requests."""
    import multiprocessing

    import msgspec

    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.process import EngineGaveUp, run_loop

    class LostRank(FakeRunner):
        def run_step(self, seqs, *, keep_hidden=False, tokens=None):
            out = super().run_step(seqs, keep_hidden=keep_hidden, tokens=tokens)
            self.failed = "tensor-parallel rank 1 died (exit code -9)"  # found mid-step
            return out

    core = EngineCore(spec(), LostRank(64, 512, 4))
    here, there = multiprocessing.Pipe()
    here.send_bytes(msgspec.msgpack.Encoder().encode(m.ToEngine(new=[m.NewRequest(
        req_id="x", prompt_token_ids=[1, 2, 3], max_tokens=4)])))
    with pytest.raises(EngineGaveUp, match="rank 1 died"):
        run_loop(core, there, msgspec.msgpack.Encoder())
    assert not here.poll(0.1)  # no update, no token, left the loop

