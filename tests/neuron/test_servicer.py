"""The daemon's request path over real gRPC, in-process, with a scripted engine stand-in.

The engine is `support.fake_engine.FakeEngineClient` (one scripted token per
step), so these tests check what the daemon itself does: tokenising,
the context check, detokenising and stop strings, usage, refusals as gRPC
statuses with their codes, auth, deadlines, cancellation and draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.fake_engine import run_fake_neuron
from support.neuron import write_neuron_config

from helexa.neuron.auth import bearer
from helexa.neuron.tokenizer import Tokenizer
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc
from helexa.responses import merge_responses

TOKEN = "s3cret"
ANSWER = "Hello world. STOP here and then more words follow"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("neuron-unit")
    (d / "token").write_text(TOKEN + "\n")
    return write_neuron_config(d / "neuron.toml", {
        "server": {"name": "unit", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 5.0},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
    })


def serve(config_path: Path, tok: Tokenizer, body: Any, *, step_secs: float = 0.001) -> Any:
    """Run `body(stub, daemon, engine)` against a fresh in-process daemon answering ANSWER."""
    answer = tok.encode(ANSWER, add_special_tokens=False)
    eos = tok.eos_token_ids[0]

    def script(_prompt: list[int], i: int) -> int:
        return answer[i] if i < len(answer) else eos

    return run_fake_neuron(config_path, body, script=script, step_secs=step_secs)


def chat(text: str = "Say hello", **kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(req_id=kw.pop("req_id", "r1"), model=kw.pop("model", "tiny"),
                              principal="alice",
                              chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
                              **kw)


async def collect(stub: neuron_pb2_grpc.NeuronStub, req: pb.GenerateRequest,
                  token: str = TOKEN) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(req, metadata=bearer(token))]


async def complete(stub: neuron_pb2_grpc.NeuronStub, req: pb.GenerateRequest,
                   token: str = TOKEN) -> pb.GenerateResponse:
    return await stub.Complete(req, metadata=bearer(token))


async def refusal(stub: neuron_pb2_grpc.NeuronStub, req: pb.GenerateRequest,
                  token: str = TOKEN, call: Any = collect
                  ) -> tuple[grpc.StatusCode, dict[str, str], str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(stub, req, token)
    return e.value.code(), dict(e.value.trailing_metadata() or ()), e.value.details()


def sample(daemon: Any, outcome: str) -> float:
    return daemon.metrics.registry.get_sample_value(
        "helexa_requests_total", {"model": "tiny", "outcome": outcome}) or 0.0


def test_streams_text_deltas_and_ends_with_usage(config_path: Path, tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        return await collect(stub, chat(max_tokens=5))

    out = serve(config_path, tok, body)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    assert [i for r in out for i in r.token_ids] == answer[:5]
    assert "".join(r.text for r in out) == tok.decode(answer[:5])
    last = out[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    prompt = tok.encode_chat([{"role": "user", "content": "Say hello"}])
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == 5
    assert last.usage.prefill_ms >= last.usage.queue_ms >= 0 and last.usage.decode_ms >= 0
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out[:-1])


def test_eos_ends_with_stop_and_is_a_stop_token_unless_ignored(config_path: Path,
                                                               tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        a = await collect(stub, chat(req_id="a"))
        b = await collect(stub, chat(req_id="b", ignore_eos=True, max_tokens=3))
        return a, b, engine.requests

    a, b, reqs = serve(config_path, tok, body)
    assert a[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(r.text for r in a) == ANSWER  # eos itself is not shown
    assert set(tok.eos_token_ids) <= set(reqs[0].stop_token_ids)
    assert not set(tok.eos_token_ids) & set(reqs[1].stop_token_ids)


def test_a_stop_string_ends_generation_before_it_and_aborts_the_engine_request(
        config_path: Path, tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        out = await collect(stub, chat(stop=["STOP"]))
        await asyncio.sleep(0.01)
        return out, dict(engine.aborts)

    out, aborts = serve(config_path, tok, body)
    text = "".join(r.text for r in out)
    assert text == ANSWER[:ANSWER.index("STOP")]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP and out[-1].stop_reason == "STOP"
    assert aborts == {"r1": "stop_string"}


def test_a_stop_string_does_not_cut_a_constrained_reply(config_path: Path,
                                                      tok: Tokenizer) -> None:
    """A forced call or a JSON answer ends where its grammar does: cut at a client's stop
    string it would be a half call reported whole, or JSON that does not parse (the
    scripted engine writes ANSWER whatever the grammar; the daemon's part is not to cut)."""
    async def body(stub, daemon, engine):
        out = await collect(stub, chat(stop=["STOP"],
                                       constraint=pb.Constraint(regex="[A-Za-z .]+")))
        await asyncio.sleep(0.01)
        return out, dict(engine.aborts)

    out, aborts = serve(config_path, tok, body)
    assert "".join(r.text for r in out) == ANSWER
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP and out[-1].stop_reason == ""
    assert aborts == {}


CALL_ANSWER = ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
               'It is noon UTC now.')
TOOLS = '[{"type": "function", "function": {"name": "get_time", "parameters": {}}}]'


def _answer_with_and_without_tools(config_path: Path, tok: Tokenizer, **stop: Any
                                   ) -> tuple[list[pb.GenerateResponse],
                                              list[pb.GenerateResponse], dict[str, str]]:
    """CALL_ANSWER written by the model, asked with tools offered (req "t") and without
    (req "p"), each with the stop fields ``stop``: both replies and the engine's aborts."""
    answer = tok.encode(CALL_ANSWER, add_special_tokens=False)

    def script(_prompt: list[int], i: int) -> int:
        return answer[i] if i < len(answer) else tok.eos_token_ids[0]

    async def body(stub, daemon, engine):
        tools = pb.Chat(messages=[pb.ChatMessage(role="user", content="time?")],
                        tools_json=TOOLS)
        with_tools = await collect(stub, pb.GenerateRequest(
            req_id="t", model="tiny", principal="alice", chat=tools, **stop))
        without = await collect(stub, chat(req_id="p", **stop))
        await asyncio.sleep(0.01)
        return with_tools, without, dict(engine.aborts)

    return run_fake_neuron(config_path, body, script=script, step_secs=0.001)


def test_a_stop_string_does_not_cut_a_call_but_cuts_the_text_after_it(config_path: Path,
                                                                      tok: Tokenizer) -> None:
    """With tools offered, a client's stop string inside the model's call leaves the call
    whole (a call cut there reached clients as tool_calls with arguments that are not
    JSON); the text after the call ends at it as ever, and the engine is told to stop."""
    with_tools, without, aborts = _answer_with_and_without_tools(config_path, tok,
                                                                 stop=["UTC"])
    assert "".join(r.text for r in with_tools) == CALL_ANSWER[:CALL_ANSWER.index("noon UTC") + 5]
    assert with_tools[-1].stop_reason == "UTC"
    assert "".join(r.text for r in without) == CALL_ANSWER[:CALL_ANSWER.index("UTC")]  # no tools
    assert aborts == {"t": "stop_string", "p": "stop_string"}


def test_a_stop_id_does_not_cut_a_call_but_stops_the_text_after_it(config_path: Path,
                                                                   tok: Tokenizer) -> None:
    """With tools offered, a client's stop_token_ids inside the model's call leave the call
    whole, as its stop strings do; the same id after the call ends the reply there (its
    token the last, as the engine stops at one), and the engine is told to stop. Without
    tools the id cuts the call as before."""
    answer = tok.encode(CALL_ANSWER, add_special_tokens=False)
    stop_id = tok.encode("U", add_special_tokens=False)[0]  # in "UTC", inside and after
    after = CALL_ANSWER.index("noon UTC") + len("noon U")
    assert answer.count(stop_id) == 2
    with_tools, without, aborts = _answer_with_and_without_tools(config_path, tok,
                                                                 stop_token_ids=[stop_id])
    assert "".join(r.text for r in with_tools) == CALL_ANSWER[:after]
    ids = [i for r in with_tools for i in r.token_ids]
    assert ids == answer[:answer.index(stop_id, answer.index(stop_id) + 1) + 1]
    last = with_tools[-1]
    assert (last.finish_reason, last.stop_reason) == (pb.FINISH_REASON_STOP, str(stop_id))
    assert last.usage.completion_tokens == len(ids)
    assert "".join(r.text for r in without) == CALL_ANSWER[:CALL_ANSWER.index('"UTC') + 2]
    assert without[-1].stop_reason == str(stop_id)
    assert aborts == {"t": "stop_token"}  # "p" the engine stopped itself


def test_eos_inside_a_call_ends_the_reply(config_path: Path, tok: Tokenizer) -> None:
    """The model's own end of turn ends the reply inside an open call too, as vLLM and SGLang
    end it: nothing would close the call after it (docs/api.md)."""
    cut = CALL_ANSWER.index('"arguments"')
    answer = tok.encode(CALL_ANSWER[:cut], add_special_tokens=False)

    def script(_prompt: list[int], i: int) -> int:
        return answer[i] if i < len(answer) else tok.eos_token_ids[0]

    async def body(stub, daemon, engine):
        tools = pb.Chat(messages=[pb.ChatMessage(role="user", content="time?")],
                        tools_json=TOOLS)
        # a stop id too: the engine is then given the eos ids alone, the daemon the id
        return await collect(stub, pb.GenerateRequest(
            req_id="t", model="tiny", principal="alice", chat=tools,
            stop_token_ids=[answer[-1]]))

    out = run_fake_neuron(config_path, body, script=script, step_secs=0.001)
    assert "".join(r.text for r in out) == CALL_ANSWER[:cut]
    assert (out[-1].finish_reason, out[-1].stop_reason) == (pb.FINISH_REASON_STOP, "")


def test_prompt_over_the_context_is_refused_400_stating_both_numbers(config_path: Path,
                                                                     tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        context = daemon.residency.models["tiny"].limits.context
        too_long = pb.GenerateRequest(req_id="x", model="tiny",
                                      token_ids=pb.TokenIds(ids=[5] * context))
        fits_not = pb.GenerateRequest(req_id="y", model="tiny", max_tokens=10,
                                      token_ids=pb.TokenIds(ids=[5] * (context - 5)))
        return context, await refusal(stub, too_long), await refusal(stub, fits_not)

    context, (code, md, msg), (code2, md2, msg2) = serve(config_path, tok, body)
    assert code == code2 == grpc.StatusCode.INVALID_ARGUMENT
    assert md["helexa-code"] == md2["helexa-code"] == "context_length_exceeded"
    assert str(context) in msg and str(context) in msg2 and str(context + 5) in msg2


def test_without_the_token_every_call_is_unauthenticated(config_path: Path,
                                                         tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        gen = await refusal(stub, chat(), token="wrong")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Models(pb.ModelsRequest())
        return gen, e.value.code(), len(engine.requests)

    (code, md, _), models_code, seen = serve(config_path, tok, body)
    assert code == models_code == grpc.StatusCode.UNAUTHENTICATED
    assert md["helexa-code"] == "invalid_api_key"
    assert seen == 0


def test_engine_refusals_and_unknown_models_map_to_statuses_with_codes(config_path: Path,
                                                                       tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        engine.refuse = ("overloaded", "queue full", 1234)
        over = await refusal(stub, chat())
        engine.refuse = ("rate_limit_exceeded", "too many", 50)
        rate = await refusal(stub, chat())
        missing = await refusal(stub, chat(model="nope"))
        return over, rate, missing

    over, rate, missing = serve(config_path, tok, body)
    assert over[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert over[1] == {"helexa-code": "overloaded", "helexa-retry-after-ms": "1234"}
    assert rate[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rate[1]["helexa-code"] == "rate_limit_exceeded"
    assert missing[0] == grpc.StatusCode.NOT_FOUND and missing[1]["helexa-code"] == "model_not_found"


def test_an_engine_failure_after_admission_is_one_failed_request_not_a_refusal(
        config_path: Path, tok: Tokenizer) -> None:
    """The first message (admission) went out, then the engine failed before a token: the
    call ends INTERNAL upstream_error, counted once as an error, never as a refusal."""
    async def body(stub, daemon, engine):
        engine.fail_before_token = "RuntimeError: device lost"
        got: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for r in stub.Generate(chat(), metadata=bearer(TOKEN)):
                got.append(r)
        return got, e.value, sample(daemon, "error"), sample(daemon, "rejected"), \
            daemon.metrics.registry.get_sample_value(
                "helexa_refusals_total", {"model": "tiny", "code": "upstream_error"})

    got, err, errors, rejected, refused = serve(config_path, tok, body)
    assert len(got) == 1 and got[0].prompt_tokens > 0 and got[0].prefill_started
    assert err.code() == grpc.StatusCode.INTERNAL
    assert dict(err.trailing_metadata() or ())["helexa-code"] == "upstream_error"
    assert (errors, rejected, refused or 0.0) == (1.0, 0.0, 0.0)


def test_a_request_past_its_deadline_is_aborted(config_path: Path, tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        deadline = int((time.time() + 0.15) * 1000)
        t0 = time.monotonic()
        out = await collect(stub, chat(deadline_unix_ms=deadline, ignore_eos=True,
                                       max_tokens=1000))
        return out, time.monotonic() - t0, dict(engine.aborts)

    out, secs, aborts = serve(config_path, tok, body, step_secs=0.01)
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT and out[-1].stop_reason == "deadline"
    # ended by the deadline, long before its 1000 tokens (10 s at this pace) were done
    assert out[-1].usage.completion_tokens < 1000 and secs < 10.0
    assert aborts == {"r1": "deadline"}


@pytest.mark.parametrize("rpc", ["Generate", "Complete"])
def test_a_caller_that_goes_away_aborts_its_request(config_path: Path, tok: Tokenizer,
                                                    rpc: str) -> None:
    async def body(stub, daemon, engine):
        req = chat(ignore_eos=True, max_tokens=1000)
        if rpc == "Generate":
            call = stub.Generate(req, metadata=bearer(TOKEN))
            async for _ in call:
                break
        else:  # nothing comes back before the end: leave once the engine is producing
            call = stub.Complete(req, metadata=bearer(TOKEN))
            for _ in range(100):
                if engine.active:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
        call.cancel()
        for _ in range(100):
            if not engine.active and daemon.residency.models["tiny"].active == 0:
                break
            await asyncio.sleep(0.01)
        return (dict(engine.aborts), engine.active, daemon.residency.models["tiny"].active,
                sample(daemon, "client_gone"))

    aborts, active, daemon_active, gone = serve(config_path, tok, body, step_secs=0.01)
    assert aborts == {"r1": "client_gone"} and not active and daemon_active == 0
    assert gone == 1


@pytest.mark.parametrize("call", [collect, complete], ids=["Generate", "Complete"])
def test_draining_refuses_new_work_and_lets_running_work_finish(config_path: Path,
                                                                tok: Tokenizer, call: Any) -> None:
    async def body(stub, daemon, engine):
        # 200 steps of 10 ms: still running when the new call comes, however loaded the machine
        running = asyncio.ensure_future(call(stub, chat(req_id="old", ignore_eos=True,
                                                        max_tokens=200)))
        while "old" not in engine.active:  # admitted: the engine is producing it
            await asyncio.sleep(0.005)
        drain = asyncio.ensure_future(daemon.drain())
        while not daemon.servicer.draining:
            await asyncio.sleep(0.005)
        refused = await refusal(stub, chat(req_id="new"), call=call)
        out = await running
        await drain
        return refused, out

    (code, md, _), out = serve(config_path, tok, body, step_secs=0.01)
    last = out[-1] if isinstance(out, list) else out  # Complete answers with one message
    assert code == grpc.StatusCode.UNAVAILABLE and md["helexa-code"] == "shutting_down"
    assert int(md["helexa-retry-after-ms"]) > 0
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 200


def test_watch_shows_the_model_ready_with_its_ledger_and_limits(config_path: Path,
                                                                tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        watch = stub.Watch(pb.WatchRequest(), metadata=bearer(TOKEN))
        first = await watch.read()
        gen = asyncio.ensure_future(collect(stub, chat(ignore_eos=True, max_tokens=30)))
        busy = None
        for _ in range(20):
            st = await watch.read()
            if st.models[0].in_flight == 1:
                busy = st
                break
        await gen
        watch.cancel()
        return first, busy

    first, busy = serve(config_path, tok, body, step_secs=0.01)
    m = first.models[0]
    assert first.neuron == "unit" and list(first.catalogue) == ["tiny"]
    assert m.state == pb.MODEL_STATE_READY and m.kv.total_bytes == m.kv.free_bytes > 0
    assert m.limits.context > 0 and m.limits.input == m.limits.context - 1
    assert m.admission.max_in_flight == 16
    assert busy is not None and busy.models[0].kv.free_bytes < busy.models[0].kv.total_bytes
    assert busy.seq > first.seq


def test_malformed_prompts_are_400_naming_the_param(config_path: Path, tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        empty_ids = await refusal(stub, pb.GenerateRequest(req_id="e", model="tiny",
                                                           token_ids=pb.TokenIds(ids=[])))
        outside = await refusal(stub, pb.GenerateRequest(req_id="o", model="tiny",
                                                         token_ids=pb.TokenIds(ids=[1, 10**6])))
        no_prompt = await refusal(stub, pb.GenerateRequest(req_id="n", model="tiny"))
        return empty_ids, outside, no_prompt, len(engine.requests)

    *refusals, seen = serve(config_path, tok, body)
    for code, md, msg in refusals:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert md["helexa-code"] == "invalid_request_error" and msg.startswith("prompt")
    assert seen == 0


def test_stop_strings_and_ids_past_the_caps_are_400_naming_the_field(config_path: Path,
                                                                     tok: Tokenizer) -> None:
    """The neuron checks the router's stop caps itself: a caller that is not a router (or a
    router of another version) cannot hand it 3.9M stop ids or a megabyte stop string."""
    from helexa.stop_caps import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

    async def body(stub, daemon, engine):
        ids = await refusal(stub, chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))))
        long = await refusal(stub, chat(stop=["a", "x" * (MAX_STOP_CHARS + 1)]))
        many = await refusal(stub, chat(stop=[str(i) for i in range(MAX_STOP + 1)]))
        seen = len(engine.requests)  # none of them reached the engine
        at_caps = await collect(stub, chat(stop=["y" * MAX_STOP_CHARS] * MAX_STOP,
                                           stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                                           max_tokens=2))
        return ids, long, many, at_caps, seen

    ids, long, many, at_caps, seen = serve(config_path, tok, body)
    for (code, md, msg), field in ((ids, "stop_token_ids:"), (long, "stop[1]:"),
                                   (many, "stop:")):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
        assert md["helexa-code"] == "invalid_request_error" and msg.startswith(field), msg
    assert at_caps[-1].finish_reason, at_caps[-1]  # at the caps: served to its end
    assert seen == 0


def test_max_tokens_0_without_prompt_logprobs_needs_no_engine(config_path: Path,
                                                              tok: Tokenizer) -> None:
    """max_tokens 0 asking no prompt logprobs (an echo: the prompt's text and count) is
    answered without the engine, as it would have ended after its prefill; one asking for
    them runs it (they are computed)."""
    async def body(stub, daemon, engine):
        alone = await collect(stub, chat(req_id="a", max_tokens=0, return_prompt_text=True))
        sent = [r.req_id for r in engine.requests]
        scored = chat(req_id="s", max_tokens=0, sampling=pb.SamplingParams(prompt_logprobs=1))
        with contextlib.suppress(grpc.aio.AioRpcError):  # (the fake engine scores none)
            await collect(stub, scored)
        return alone, sent, [r.req_id for r in engine.requests]

    alone, sent, after = serve(config_path, tok, body)
    prompt = tok.encode_chat([{"role": "user", "content": "Say hello"}])
    assert sent == [] and after == ["s"]
    assert alone[0].prompt_text and alone[0].prompt_tokens == len(prompt)
    last = alone[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and not any(r.token_ids for r in alone)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 0)


# ------------------------------------------------------------------ Complete


def without_timings(msg: pb.GenerateResponse) -> pb.GenerateResponse:
    out = pb.GenerateResponse()
    out.CopyFrom(msg)
    for f in ("queue_ms", "prefill_ms", "decode_ms"):
        out.usage.ClearField(f)
    return out


def test_complete_answers_what_generate_streams_in_one_message(config_path: Path,
                                                               tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        pairs = []
        for i, kw in enumerate([{"max_tokens": 5, "return_prompt_token_ids": True},
                                {"stop": ["STOP"]}, {}]):
            streamed = await collect(stub, chat(req_id=f"g{i}", **kw))
            pairs.append((streamed, await complete(stub, chat(req_id=f"c{i}", **kw))))
        return pairs, sample(daemon, "length"), sample(daemon, "stop")

    pairs, lengths, stops = serve(config_path, tok, body)
    for streamed, whole in pairs:
        assert len(streamed) > 2  # so the merge had something to do
        assert without_timings(whole) == without_timings(merge_responses(streamed))
    (_, a), (_, b), (_, c) = pairs
    assert a.finish_reason == pb.FINISH_REASON_LENGTH and a.usage.completion_tokens == 5
    assert list(a.prompt_token_ids) == tok.encode_chat([{"role": "user", "content": "Say hello"}])
    assert b.text == ANSWER[:ANSWER.index("STOP")] and b.stop_reason == "STOP"
    assert c.text == ANSWER and c.finish_reason == pb.FINISH_REASON_STOP
    assert c.usage.prefill_ms >= c.usage.queue_ms >= 0 and c.usage.decode_ms > 0
    assert (lengths, stops) == (2, 4)  # counted once per call, as for Generate


def test_complete_refuses_with_the_statuses_and_metadata_of_generate(config_path: Path,
                                                                     tok: Tokenizer) -> None:
    async def body(stub, daemon, engine):
        context = daemon.residency.models["tiny"].limits.context
        too_long = pb.GenerateRequest(req_id="x", model="tiny",
                                      token_ids=pb.TokenIds(ids=[5] * context))
        got = {}
        for rpc, call in (("Generate", collect), ("Complete", complete)):
            engine.refuse = ("overloaded", "queue full", 1234)
            got[rpc] = [await refusal(stub, req, token, call) for req, token in (
                (chat(), TOKEN), (chat(model="nope"), TOKEN), (too_long, TOKEN),
                (chat(), "wrong"))]
        return got, len(engine.requests)

    got, seen = serve(config_path, tok, body)
    assert got["Complete"] == got["Generate"]
    codes = [(code, md.get("helexa-code")) for code, md, _ in got["Complete"]]
    assert codes == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
                     (grpc.StatusCode.NOT_FOUND, "model_not_found"),
                     (grpc.StatusCode.INVALID_ARGUMENT, "context_length_exceeded"),
                     (grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key")]
    assert got["Complete"][0][1]["helexa-retry-after-ms"] == "1234"
    assert seen == 2  # only the engine's own refusals reached it


def test_a_huge_prompt_is_tokenised_off_the_event_loop(config_path: Path, tok: Tokenizer) -> None:
    import threading

    # 1.1 MB, then context_length_exceeded; its tokenising is held until the small request
    # has streamed (had it run on the event loop, nothing would stream meanwhile)
    huge = "many.words." * 100_000
    order: list[str] = []
    started, go = threading.Event(), threading.Event()

    class Observed:
        """The model's tokenizer, saying when the huge prompt's tokenising starts and ends."""

        def __init__(self, real: Tokenizer) -> None:
            self._real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def encode_chat_within(self, limit: int | None, messages: list[dict], *a: Any,
                               **kw: Any) -> list[int]:
            is_huge = len(messages[0]["content"]) > 100_000
            if is_huge:
                started.set()
                go.wait(30)
            try:  # (past the context: token_bound.PastLimit)
                return self._real.encode_chat_within(limit, messages, *a, **kw)
            finally:
                if is_huge:
                    order.append("huge tokenised")

    async def body(stub: Any, daemon: Any, engine: Any) -> tuple[Any, dict[str, str]]:
        r = daemon.residency.models["tiny"]
        r.tokenizer = Observed(r.tokenizer)
        watch = stub.Watch(pb.WatchRequest(), metadata=bearer(TOKEN))
        await watch.read()
        big = asyncio.ensure_future(refusal(stub, chat(huge, req_id="huge")))
        while not started.is_set():  # the loop runs this only while it is free
            await asyncio.sleep(0.005)
        small = await collect(stub, chat(req_id="small"))
        order.append("small streamed")
        assert small[-1].finish_reason == pb.FINISH_REASON_STOP
        await watch.read()  # the small request's own changes reach Watch
        order.append("watch")
        go.set()
        code, md, _ = await big
        watch.cancel()
        return code, md

    code, md = serve(config_path, tok, body)
    assert order == ["small streamed", "watch", "huge tokenised"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and md["helexa-code"] == "context_length_exceeded"


def test_a_refused_request_is_freed_without_the_cycle_collector(config_path: Path,
                                                                tok: Tokenizer) -> None:
    # grpc keeps an abort's AbortError on the call, whose traceback holds the frames that
    # hold the call: a cycle that kept each refused request (its prompt, the refusal's frames)
    # until the collector's rare full pass; the neuron's RSS grew ~10 MB a refused 7.8 MB prompt
    import gc
    from types import FrameType

    too_long = "many words " * 1000

    async def body(stub: Any, daemon: Any, engine: Any) -> list[str]:
        await complete(stub, chat())  # the first call's own set-up is not the refusal's
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for call in (collect, complete):
                code, md, _ = await refusal(stub, chat(too_long), call=call)
                assert md["helexa-code"] == "context_length_exceeded"
            await asyncio.sleep(0.2)  # the calls' done callbacks
            gc.collect()
            # the neuron's frames (which hold the request) in cycles; the client's are its own
            return sorted({o.f_code.co_qualname for o in gc.garbage if isinstance(o, FrameType)
                           and "/helexa/" in o.f_code.co_filename})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    assert serve(config_path, tok, body) == []


def test_a_paced_requests_pauses_are_logged_once_at_info_and_counted_at_its_end(monkeypatch):
    # a reader slower than the model pauses its request every ~192 tokens: the log says
    # the first pause and resume at info, the rest at debug, and request.done sums them
    from types import SimpleNamespace

    from helexa.neuron import servicer
    from helexa.neuron.servicer import _Pauses

    now = [100.0]
    monkeypatch.setattr(servicer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    said: list[tuple[str, str, int, object]] = []

    class Blog:
        def info(self, event: str, **kw: object) -> None:
            said.append(("info", event, kw["pause"], kw.get("paused_ms")))

        def debug(self, event: str, **kw: object) -> None:
            said.append(("debug", event, kw["pause"], kw.get("paused_ms")))

    class Counter:
        n = 0

        def inc(self) -> None:
            Counter.n += 1

    pauses = _Pauses(Blog(), Counter())
    assert pauses.summary() == {}
    for held in (0.5, 0.25, 0.125):  # paused this long, then 0.5 s reading again
        pauses(True, 256)
        now[0] += held
        pauses(False, 64)
        now[0] += 0.5
    pauses(True, 256)  # ends paused: that pause counts to the end
    now[0] += 0.0625
    assert [s for s in said if s[0] == "info"] == [("info", "request.paused", 1, None),
                                                    ("info", "request.resumed", 1, 500.0)]
    assert [s[3] for s in said if s[1] == "request.resumed"] == [500.0, 250.0, 125.0]
    assert len([s for s in said if s[0] == "debug"]) == 5
    assert pauses.summary() == {"pauses": 4, "paused_ms": 937.5} and Counter.n == 4
