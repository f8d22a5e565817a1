"""The neuron's work pool (helexa/neuron/work.py), through the daemon's gRPC edge: a call's
prompt work (chat template, tokens, images) is one task of its principal's, so another
key's heavy prompts queued by the dozen never keep a bystander's Generate or Tokenize
waiting; a call whose caller left while its work waited never runs it; a principal over its
share is 429 and a full pool 503, each naming its key; and every count returns to zero.

The heavy prompts block on an event in a stand-in tokenizer instead of taking seconds, so
nothing here depends on timing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.fake_engine import run_fake_neuron
from support.neuron import write_neuron_config

from helexa.config.neuron import ServerConfig
from helexa.neuron.auth import bearer
from helexa.neuron.tokenize_work import check_size
from helexa.neuron.work import work_threads
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

TOKEN = "s3cret"
MD = bearer(TOKEN)


class Gated:
    """The model's tokenizer, but a text holding "heavy" waits for `release` first; every
    text tokenised is noted (`seen`), and how many wait now (`waiting`)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.release = threading.Event()
        self.seen: list[str] = []
        self.waiting = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _gate(self, text: str) -> None:
        with self._lock:
            self.seen.append(text)
            self.waiting += "heavy" in text
        if "heavy" in text:
            assert self.release.wait(20), "never released"
            with self._lock:
                self.waiting -= 1

    def encode_chat(self, messages: list[dict], *a: Any, **kw: Any) -> list[int]:
        self._gate(str(messages[-1]["content"]))
        return self._real.encode_chat(messages, *a, **kw)

    def encode_chat_within(self, limit: int | None, messages: list[dict], *a: Any,
                           **kw: Any) -> list[int]:
        self._gate(str(messages[-1]["content"]))
        return self._real.encode_chat_within(limit, messages, *a, **kw)

    def encode(self, text: str, *a: Any, **kw: Any) -> list[int]:
        self._gate(text)
        return self._real.encode(text, *a, **kw)


def config(d: Path, tiny: Path, **server: Any) -> Path:
    (d / "token").write_text(TOKEN + "\n")
    return write_neuron_config(d / "neuron.toml", {
        "server": {"name": "unit", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 2.0, **server},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny)}],
    })


def chat(principal: str, text: str, req_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(req_id=req_id, model="tiny", principal=principal, max_tokens=2,
                              chat=pb.Chat(messages=[pb.ChatMessage(role="user",
                                                                    content=text)]))


def tokenize(principal: str, text: str) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(model="tiny", principal=principal, text=text)


async def generate(stub: Any, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(req, metadata=MD)]


def run(cfg: Path, body: Any) -> Any:
    """body(stub, daemon, gated) against an in-process daemon whose tokenizer is Gated."""
    async def wrapped(stub: Any, daemon: Any, engine: Any) -> Any:
        r = daemon.residency.models["tiny"]
        r.tokenizer = gated = Gated(r.tokenizer)
        try:
            return await body(stub, daemon, gated)
        finally:
            gated.release.set()  # nothing left blocked past the test, pass or fail

    return run_fake_neuron(cfg, wrapped, script=lambda _p, i: 7 + i)


def gauge(daemon: Any, name: str) -> float:
    return daemon.metrics.registry.get_sample_value(name) or 0.0


async def until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


def test_a_bystander_is_served_while_another_key_has_dozens_of_heavy_prompts_queued(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    # 40 is more than any default thread pool runs at once (asyncio's takes at most 32)
    cfg = config(tmp_path, tiny_model_dir, work_threads=2)

    async def body(stub: Any, daemon: Any, gated: Gated) -> None:
        arrived: list[str] = []
        serving = daemon.residency.serving
        daemon.residency.serving = lambda model: (arrived.append(model), serving(model))[1]
        heavy = [asyncio.ensure_future(generate(stub, chat("alice", f"heavy {i}", f"a{i}")))
                 for i in range(36)]
        heavy += [asyncio.ensure_future(stub.Tokenize(tokenize("alice", f"heavy t{i}"),
                                                      metadata=MD)) for i in range(4)]
        await until(lambda: len(arrived) == 40 and gated.waiting >= 1)
        # bob's chat and his count: each while every one of alice's calls is still held
        out = await asyncio.wait_for(generate(stub, chat("bob", "hi", "b1")), 10)
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        count = await asyncio.wait_for(stub.Tokenize(tokenize("bob", "hi"), metadata=MD), 10)
        assert len(count.token_ids) > 0
        assert all(not f.done() for f in heavy)  # alice's are all still waiting
        assert gated.waiting == 1  # alice runs on one thread of two: the other was bob's
        gated.release.set()
        done = await asyncio.gather(*heavy)
        assert all(r[-1].finish_reason == pb.FINISH_REASON_LENGTH for r in done[:36])
        await until(lambda: daemon.servicer.work.tasks == 0)
        assert daemon.servicer.work.principals == 0
        assert gauge(daemon, "helexa_work_tasks") == gauge(daemon, "helexa_work_principals") == 0

    run(cfg, body)


def test_a_call_whose_caller_left_while_it_waited_never_runs(tmp_path: Path,
                                                             tiny_model_dir: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, work_threads=2)

    async def body(stub: Any, daemon: Any, gated: Gated) -> None:
        first = asyncio.ensure_future(generate(stub, chat("alice", "heavy first", "a1")))
        await until(lambda: gated.waiting == 1)
        # alice's next calls wait for her thread; she gives up on them
        left = [stub.Generate(chat("alice", "heavy gone g", "a2"), metadata=MD),
                stub.Tokenize(tokenize("alice", "heavy gone t"), metadata=MD),
                stub.Complete(chat("alice", "heavy gone c", "a3"), metadata=MD)]
        await until(lambda: daemon.servicer.work.tasks == 4)
        for call in left:
            call.cancel()
        await until(lambda: daemon.servicer.work.tasks == 1)  # out of the queue at once
        gated.release.set()
        await first
        # her own calls run in order: one sent now runs after any of those left behind
        after = await stub.Tokenize(tokenize("alice", "after"), metadata=MD)
        assert len(after.token_ids) > 0
        assert [t for t in gated.seen if "gone" in t] == []
        await until(lambda: daemon.servicer.work.tasks == 0)
        assert daemon.servicer.work.principals == 0
        assert gauge(daemon, "helexa_work_tasks") == 0

    run(cfg, body)


def test_past_its_share_a_key_is_429_and_a_full_pool_503_each_naming_its_key(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, work_threads=2, work_queue_depth=1,
                 work_per_principal=2)

    async def refused(call: Any) -> tuple[grpc.StatusCode, dict[str, str], str]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        return e.value.code(), dict(e.value.trailing_metadata() or ()), e.value.details()

    async def body(stub: Any, daemon: Any, gated: Gated) -> None:
        held = [asyncio.ensure_future(stub.Tokenize(tokenize("alice", f"heavy {i}"),
                                                    metadata=MD)) for i in range(2)]
        await until(lambda: daemon.servicer.work.tasks == 2)
        code, md, msg = await refused(generate(stub, chat("alice", "x", "a3")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert md["helexa-code"] == "rate_limit_exceeded" and md["helexa-retry-after-ms"]
        assert "server.work_per_principal" in msg and "(2," in msg
        held.append(asyncio.ensure_future(stub.Tokenize(tokenize("bob", "heavy b"),
                                                        metadata=MD)))
        await until(lambda: daemon.servicer.work.tasks == 3)  # 2 threads + 1 waiting
        code, md, msg = await refused(stub.Tokenize(tokenize("", "x"), metadata=MD))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md["helexa-code"] == "overloaded"
        assert "server.work_threads + server.work_queue_depth" in msg
        refusals = daemon.metrics.registry.get_sample_value
        assert refusals("helexa_work_refusals_total", {"reason": "principal_share"}) == 1
        assert refusals("helexa_work_refusals_total", {"reason": "pool_full"}) == 1
        gated.release.set()
        await asyncio.gather(*held)
        # the share follows a reload; the threads and the queue wait for a restart
        text = cfg.read_text().replace("work_per_principal = 2", "work_per_principal = 5")
        cfg.write_text(text)
        daemon.reload()
        assert daemon.servicer.work.per_principal == 5
        await until(lambda: daemon.servicer.work.tasks == 0)

    run(cfg, body)


async def refused(call: Any) -> tuple[grpc.StatusCode, dict[str, str], str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code(), dict(e.value.trailing_metadata() or ()), e.value.details()


def test_a_call_whose_prompt_is_being_made_keeps_its_model_until_it_is_answered(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A Generate whose prompt is on the work pool counts as the model's work: an unload is
    refused model_busy, and a drain waits for it rather than stopping the engine under it;
    made once the drain began, it is refused shutting_down (which the router retries
    elsewhere), and every count returns to zero."""
    cfg = config(tmp_path, tiny_model_dir, work_threads=2)

    async def body(stub: Any, daemon: Any, gated: Gated) -> None:
        r = daemon.residency.models["tiny"]
        held = asyncio.ensure_future(refused(generate(stub, chat("alice", "heavy h", "h1"))))
        await until(lambda: gated.waiting == 1)
        assert r.busy
        with pytest.raises(Refusal) as e:
            await daemon.residency.unload("tiny")
        assert e.value.code == "model_busy"
        drain = asyncio.ensure_future(daemon.drain())
        await until(lambda: daemon.servicer.draining)
        assert not await daemon.residency.wait_idle(r, 0.2)  # the drain waits for it too
        assert r.client.alive and "tiny" in daemon.residency.models and not drain.done()
        gated.release.set()
        code, md, _ = await held
        assert code == grpc.StatusCode.UNAVAILABLE and md["helexa-code"] == "shutting_down"
        assert [q.req_id for q in r.client.requests] == []  # never reached the engine
        await drain
        assert r.active == 0 and daemon.servicer._open == {}

    run(cfg, body)


def test_a_req_id_is_held_from_the_start_so_a_duplicate_is_refused_at_once(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A second call with the req_id of one whose prompt is still being made is refused at
    once, naming the id, and leaves the first one's call as it was: it is answered whole,
    and its id stays held (a third duplicate is refused too) until it ends."""
    cfg = config(tmp_path, tiny_model_dir, work_threads=2)

    async def body(stub: Any, daemon: Any, gated: Gated) -> None:
        first = asyncio.ensure_future(generate(stub, chat("alice", "heavy one", "dup")))
        await until(lambda: gated.waiting == 1)
        code, md, msg = await asyncio.wait_for(
            refused(generate(stub, chat("bob", "two", "dup"))), 5)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert md["helexa-code"] == "invalid_request_error" and "`dup`" in msg
        code, _, _ = await asyncio.wait_for(refused(generate(stub, chat("carol", "3", "dup"))),
                                            5)
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # the refused one took no id away
        gated.release.set()
        out = await first
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert daemon.servicer._open == {}
        assert daemon.residency.models["tiny"].active == 0

    run(cfg, body)


def test_the_pool_is_sized_from_the_cpus_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, threads in [(1, 3), (2, 3), (8, 5), (64, 9)]:
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert work_threads(ServerConfig()) == threads
    assert work_threads(ServerConfig(work_threads=1)) == 1


def test_a_tokenize_call_over_the_byte_cap_is_refused_naming_the_key() -> None:
    with pytest.raises(Refusal) as e:
        check_size(tokenize("alice", "x" * 2000), 1000)
    assert e.value.code == "invalid_request_error"
    assert "server.max_tokenize_bytes" in e.value.message and "at most 1000" in e.value.message


def test_work_already_running_is_told_its_caller_left():
    # Generate's and Tokenize's prompt work (its images: seconds each) learns that its
    # caller went away and stops at the next image, instead of finishing for nobody.
    from helexa.neuron.work import NeuronWork

    work = NeuronWork(ServerConfig())
    started, saw = threading.Event(), []

    def long_work(x: int, gone: threading.Event) -> int:
        started.set()
        saw.append(gone.wait(30))  # True once told
        return x

    async def main() -> None:
        assert await work.run_stoppable("alice", lambda x, gone: x + 1, 1) == 2
        call = asyncio.ensure_future(work.run_stoppable("alice", long_work, 1))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        call.cancel()  # the caller leaves while its work runs
        with pytest.raises(asyncio.CancelledError):
            await call
    try:
        asyncio.run(main())
        for _ in range(300):
            if saw:
                break
            threading.Event().wait(0.1)
        assert saw == [True]
    finally:
        work.close()
