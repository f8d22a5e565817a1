"""A neuron that stops answering: the router takes it out of rotation at once, and ends a
call in flight on it (an SSE upstream_error event, or a retry elsewhere before the first
byte) only on the call's own evidence: a stream with no message for stream_idle_secs, or a
call with no clock of its own whose neuron's Watch has been silent that long. A neuron that
is only busy (its Watch late, its streams flowing) keeps its calls."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
from router_fake_neuron import Behaviour
from support.stalled_client import post_to_a_small_window, until_flat

MSG = [{"role": "user", "content": "hello there"}]


def set_b(fl, **kw):
    def go():
        for n in (fl.n1, fl.n2):
            for k, v in kw.items():
                setattr(n.b, k, v)
            n.changed()
    fl.lt.call(go)


def stream_lines(fl, idle_secs: float, prompt: str = "x", max_tokens: int = 3,
                 **behaviour) -> list[str]:
    """A streamed completion's non-empty lines, the router's stream_idle_secs and the fake
    neurons' behaviour set for it (and put back)."""
    fl.state.registry.stream_idle_secs = idle_secs
    set_b(fl, **behaviour)
    try:
        with httpx2.stream("POST", fl.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "stream": True}) as r:
            return [line for line in r.iter_lines() if line]
    finally:
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs
        set_b(fl, **{k: getattr(Behaviour(), k) for k in behaviour})


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def serving(fl):
    """The fake with this test's call in flight (a late call of an earlier test, which the
    session's fleet may still get after its reset, is not in its fresh models' counts)."""
    return next(n for n in (fl.n1, fl.n2) if n.models["tiny"].in_flight)


def healthy(fl, fake) -> bool:
    return httpx2.get(fl.url + "/health").json()["neurons"][fake.name]["healthy"]


def test_a_neuron_out_of_rotation_keeps_its_streams_while_they_flow(fl):
    """Its Watch falls silent (a neuron whose loop is held for seconds looks so): no new work
    goes there, and its stream, still sending tokens, goes on to its end. (The router used to
    end every call on a neuron at 0.6 s of silence: this stream was cut.)"""
    set_b(fl, token_delay_secs=0.1)
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "[[tokens:25]] go"}],
            "max_tokens": 25, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = serving(fl)
        other = fl.n2 if busy is fl.n1 else fl.n1
        fl.lt.call(lambda: setattr(busy.b, "silent", True))  # its Watch falls silent
        wait_for(lambda: not healthy(fl, busy))  # out of rotation (0.6 s here)
        assert fl.client().completions.create(model="tiny", prompt="x", max_tokens=1)
        assert len(other.requests) == 1 and len(busy.requests) == 1  # new work: elsewhere
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    text = "".join(json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get(
        "content") or "" for line in rest[:-1])
    assert text.endswith("w23 w24 ")  # to its last token: 2.5 s, its neuron silent from 0.1


def test_a_request_right_after_the_routers_own_loop_was_held_finds_its_neurons(fl):
    """The router's loop held past unhealthy_after_secs (0.6 s here: a burst of work on it, a
    host short of CPU) read no Watch report meanwhile: that silence is the router's, not the
    neurons'. Counted as theirs, a request run first after the hold, before the Watch
    readers took the reports waiting for them, found no neuron in rotation: a 503 "no neuron
    is reachable" (with one out, a 400 for an `n` the other alone could not hold)."""
    import concurrent.futures

    def held() -> list[str]:  # hold the loop, then look as the next request on it does
        time.sleep(1.0)
        return sorted(c.neuron for c in fl.state.registry.candidates("tiny"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hold = pool.submit(fl.lt.call, held)
        time.sleep(0.1)  # the request comes while the loop is held
        r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        assert hold.result() == ["n1", "n2"]
    assert r.choices[0].message.content == "w0 "


def test_a_non_streaming_call_outlives_a_brief_silence_not_a_long_one(fl):
    """A Complete call has no messages to time it: its neuron's Watch does. Silent for 1.5 s
    (out of rotation at 0.6 s), the neuron answers it itself; silent past stream_idle_secs
    (1 s here), the call is ended and served elsewhere, the client none the wiser."""
    import concurrent.futures

    def sent() -> int:
        return len(fl.n1.requests) + len(fl.n2.requests)

    fl.state.registry.stream_idle_secs = 2.0
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            set_b(fl, first_delay_secs=1.5)
            reply = pool.submit(fl.client().chat.completions.create, model="tiny",
                                messages=MSG, max_tokens=2)
            wait_for(lambda: sent() == 1)
            busy = serving(fl)
            fl.lt.call(lambda: setattr(busy.b, "silent", True))
            assert reply.result(timeout=20).choices[0].message.content == "w0 w1 "
            assert len(busy.requests) == 1 and sent() == 1  # its own answer, not a retry
            fl.lt.call(lambda: setattr(busy.b, "silent", False))
            wait_for(lambda: healthy(fl, busy))

            fl.state.registry.stream_idle_secs = 1.0
            set_b(fl, first_delay_secs=30.0)
            reply = pool.submit(fl.client().chat.completions.create, model="tiny",
                                messages=MSG, max_tokens=2)
            wait_for(lambda: sent() == 2)
            hung = next(n for n in (fl.n1, fl.n2) if n.models["tiny"].in_flight)
            other = fl.n2 if hung is fl.n1 else fl.n1
            fl.lt.call(lambda: setattr(other.b, "first_delay_secs", 0.0))
            fl.lt.call(lambda: setattr(hung.b, "silent", True))
            assert reply.result(timeout=20).choices[0].message.content == "w0 w1 "
            assert other.requests and other.requests[-1].req_id == hung.requests[-1].req_id
    finally:
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs


def test_a_call_on_a_neuron_in_rotation_is_not_ended_for_its_watchs_silence(fl):
    """A call with no clock of its own is ended for its neuron's Watch silence only once the
    neuron left rotation too: a neuron the router still sends work to is not hung. With
    stream_idle_secs under the heartbeat (here 0.1 s; beats every 0.25 s), every such call
    on a healthy neuron was cut between two beats (and its retry, then a 503)."""
    def sent() -> int:
        return len(fl.n1.requests) + len(fl.n2.requests)

    fl.state.registry.stream_idle_secs = 0.1
    set_b(fl, first_delay_secs=1.0)
    try:
        r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    finally:
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs
        set_b(fl, first_delay_secs=0.0)
    assert r.choices[0].message.content == "w0 w1 " and sent() == 1  # answered, no retry


def test_a_stream_silent_past_the_idle_bound_ends_with_an_error_event(fl):
    # the first token comes, then nothing (a wedged engine)
    lines = stream_lines(fl, 0.5, max_tokens=5, token_delay_secs=60.0)
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "no message from neuron" in err["message"]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "w0 "


def test_the_idle_bound_waits_for_the_first_token_then_knows_about_prefill(fl):
    # a thinking model's first message comes at admission; its prefill then takes longer
    # than the idle bound: the stream must not be cut before its first token
    lines = stream_lines(fl, 0.3, "x" * 400, admission_message_secs=1.0)
    assert lines[-1] == "data: [DONE]"  # 1 s of prefill: within 0.3 + 4 x 101 / 100 s


def test_a_request_waiting_for_a_batch_row_is_not_cut_as_a_slow_prefill(fl):
    # more requests in flight than max_slots: one admitted (its stream open, kept alive)
    # waits for a row while the others run, far past any prefill deadline of its prompt;
    # the clock starts when the neuron says its prefill began
    lines = stream_lines(fl, 0.3, admission_message_secs=0.1, row_wait_secs=2.0)
    assert lines[-1] == "data: [DONE]", lines[-1]  # 2 s > 0.3 + 4 x 1 / 100 s


def test_a_stream_whose_neuron_says_it_waits_for_a_row_is_not_cut_and_one_silent_is(fl):
    # a request paused while its client did not read, resumed with every batch row held:
    # the neuron says it waits for a row, and the silence until its next token is not the
    # neuron's; the same silence unsaid (a hung neuron, or one older than the field) is
    lines = stream_lines(fl, 0.3, max_tokens=3, row_lost_secs=1.5)
    assert lines[-1] == "data: [DONE]", lines[-1]  # 1.5 s > the 0.3 s idle bound
    text = "".join(json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                   for line in lines[:-1])
    assert text == "w0 w1 w2 "
    t0 = time.monotonic()
    lines = stream_lines(fl, 0.3, max_tokens=3, row_lost_secs=1.5, row_lost_said=False)
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "no message from neuron" in err["message"]
    assert time.monotonic() - t0 < 1.5


def test_a_client_that_stops_reading_longer_than_the_idle_bound_is_not_cut(fl):
    # the client stops reading for 1.5 s (within client_write_secs): the router's buffers
    # fill and it stops reading the neuron, whose silence then is the client's doing, not a
    # hung neuron's, however short stream_idle_secs is
    fl.state.registry.stream_idle_secs = 0.5
    body = json.dumps({"model": "tiny", "max_tokens": 1000, "stream": True, "logprobs": True,
                       "top_logprobs": 20, "messages": [
                           {"role": "user", "content": "[[tokens:1000]] go"}]}).encode()
    sock = post_to_a_small_window(fl.url, body)
    try:
        got = sock.recv(256)
        assert got.startswith(b"HTTP/1.1 200")
        req_id = fl.lt.call(lambda: (fl.n1.requests + fl.n2.requests)[-1].req_id)
        # the buffers fill, then the router's reads stop
        last = until_flat(lambda: fl.lt.call(
            lambda: fl.n1.sent.get(req_id, 0) + fl.n2.sent.get(req_id, 0)))
        assert 0 < last < 1000  # the neuron's writes wait for the router's reads
        time.sleep(1.5)  # three idle bounds
        chunks = [got]
        sock.settimeout(10)
        while not (data := b"".join(chunks[-2:])).endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        sock.close()
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs
    data = b"".join(chunks)
    assert b"upstream_error" not in data and b"data: [DONE]" in data
    assert data.count(b'"finish_reason":"length"') == 1


def test_a_wait_for_a_row_stops_the_idle_clock_until_the_next_token():
    from helexa.proto import neuron_pb2 as pb
    from helexa.router.inflight import Flight

    f = Flight("n", streaming=True)
    f.heard(pb.GenerateResponse(token_ids=[1], prefill_started=True))
    f.heard(pb.GenerateResponse(waiting_for_row=True))
    assert f.overdue(f.last_at + 3600, 30) is None  # bounded by the deadline, not here
    f.heard(pb.GenerateResponse())  # a message with nothing: the wait goes on
    assert f.overdue(f.last_at + 3600, 30) is None
    f.heard(pb.GenerateResponse(token_ids=[2]))  # a row again: the idle bound from here
    f.reading()
    assert f.overdue(f.last_at + 31, 30).startswith("no message from neuron")
    f.heard(pb.GenerateResponse(token_ids=[3], waiting_for_row=True))  # tokens, then a wait
    f.reading()
    assert f.overdue(f.last_at + 3600, 30) is None


def test_a_prefill_past_its_deadline_is_still_caught(fl):
    t0 = time.monotonic()  # admitted, then never a token: a wedged engine
    lines = stream_lines(fl, 0.3, admission_message_secs=60.0)
    took = time.monotonic() - t0
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "within" in err["message"]
    assert "1 prompt tokens" in err["message"] and took < 10


def test_the_prefill_deadline_grows_with_the_prompt_and_the_measured_rate():
    from helexa.router.inflight import Flight

    class Msg:
        token_ids: list[int] = []
        finish_reason = 0
        prefill_started = True  # a row was free at admission

        def __init__(self, prompt_tokens: int) -> None:
            self.prompt_tokens = prompt_tokens

    slow, fast = Flight("n", streaming=True, prefill_tokens_per_sec=1000.0), \
        Flight("n", streaming=True, prefill_tokens_per_sec=10_000.0)
    for f in (slow, fast):
        f.heard(Msg(100_000))
    assert slow.prefill_deadline_secs(30) == 30 + 4 * 100
    assert fast.prefill_deadline_secs(30) == 30 + 4 * 10
    now = slow.first_at + 200  # 200 s of prefill: the slow host is in time, the fast is not
    assert slow.overdue(now, 30) is None and fast.overdue(now, 30) is not None
    slow.heard(None)  # tokens flow: the idle bound from here on, while the router asks
    slow.reading()
    assert slow.overdue(slow.last_at + 31, 30).startswith("no message from neuron")
    # admitted with no row free: no prefill clock until the neuron says it began
    waiting = Flight("n", streaming=True, prefill_tokens_per_sec=1000.0)
    admitted = Msg(10)
    admitted.prefill_started = False
    waiting.heard(admitted)
    assert waiting.overdue(waiting.first_at + 3600, 30) is None
    began = Msg(0)
    began.prefill_started = True
    waiting.heard(began)
    assert waiting.overdue(waiting.started_at + 30, 30) is None
    assert "within 30 s of prefill" in waiting.overdue(waiting.started_at + 31, 30)


def test_the_idle_bound_counts_while_the_router_waits_not_while_its_client_does():
    """A client whose socket stayed full for 100 s (the router read nothing meanwhile: the
    neuron paused the request) reads again: the stream is not overdue for the neuron's
    silence the client caused, only for one that follows the router's next read."""
    from helexa.proto import neuron_pb2 as pb
    from helexa.router.forward import OpenStream
    from helexa.router.inflight import Flight

    class Call:
        def __init__(self) -> None:
            self.go = asyncio.Event()

        async def read(self) -> pb.GenerateResponse:
            await self.go.wait()
            return pb.GenerateResponse(token_ids=[2])

        def done(self) -> bool:
            return False

    async def main() -> None:
        flight, call = Flight("n", streaming=True), Call()
        first = pb.GenerateResponse(token_ids=[1])
        flight.heard(first)
        it = OpenStream("n", call, first, flight).messages()  # type: ignore[arg-type]
        assert (await anext(it)).token_ids == [1]
        flight.last_at -= 100  # the client held the router that long before reading again
        nxt = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0)  # the router now waits for the neuron
        now = time.monotonic()
        assert flight.overdue(now, 30) is None
        assert flight.overdue(now + 31, 30) is not None  # the neuron's own silence counts
        call.go.set()
        assert (await nxt).token_ids == [2]

    asyncio.run(main())


def test_a_silent_prefill_keeps_the_client_alive_with_pings(fl, monkeypatch):
    # Agents time out per event (Claude Code after 300 s, codex after its
    # stream_idle_timeout) and start over, prefill and all: while the neuron is silent,
    # Anthropic's ping events and Responses' response.in_progress go out, events a client's
    # SSE parser yields (never comments, which it drops); chat streams get SSE comments
    from openai._streaming import SSEDecoder

    from helexa.router import event_replies

    monkeypatch.setattr(event_replies, "PING_SECS", 0.2)
    set_b(fl, admission_message_secs=1.0)

    def raw(path: str, body: dict) -> bytes:
        with httpx2.stream("POST", fl.url + path, timeout=30, json=body) as r:
            return b"".join(r.iter_bytes())
    try:
        anthropic = raw("/v1/messages", {"model": "tiny", "max_tokens": 3, "stream": True,
                                         "messages": MSG})
        responses = raw("/v1/responses", {"model": "tiny", "input": "hi", "stream": True,
                                          "max_output_tokens": 3})
        chat = raw("/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "stream": True,
                                            "messages": MSG})
    finally:
        set_b(fl, admission_message_secs=None)
    names = [e.event for e in SSEDecoder().iter_bytes(iter([anthropic]))]
    assert names[0] == "message_start" and names[1] == "ping" and names[-1] == "message_stop"
    events = [e.json() for e in SSEDecoder().iter_bytes(iter([responses]))]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # from 0, as OpenAI
    assert chat.count(b"\n: ping\n\n") >= 2 and chat.endswith(b"data: [DONE]\n\n")
