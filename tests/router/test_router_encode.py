"""router.encode: OpenAI logprobs from the neuron's messages."""

from __future__ import annotations

from helexa.proto import neuron_pb2 as pb
from helexa.router.encode import _chat_logprobs


def test_chat_logprobs_bytes_are_the_tokens_own_bytes():
    # "ż" is c5 bc: a byte-level model may emit it as two tokens, each shown as U+FFFD
    lps = [pb.TokenLogprob(token_id=1, token="\ufffd", token_bytes=b"\xc5", logprob=-0.5,
                           top=[pb.TopLogprob(token_id=2, token="\ufffd", token_bytes=b"\xc4",
                                              logprob=-1.0)]),
           pb.TokenLogprob(token_id=3, token="\ufffd", token_bytes=b"\xbc", logprob=-0.1),
           pb.TokenLogprob(token_id=4, token=" hi", logprob=-0.2)]  # an older neuron: no bytes
    content = _chat_logprobs(lps)["content"]
    assert [c["bytes"] for c in content] == [[0xC5], [0xBC], list(b" hi")]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "ż"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xC4]


def test_a_stream_whose_prompt_opened_the_thought_streams_it_as_reasoning():
    # Qwen3.5's template opens <think> in the prompt: the neuron's first message (at
    # admission, before any token) says so and holds nothing else. The thought that follows
    # is reasoning_content, never content with a stray </think>.
    from helexa.router import encode
    from helexa.router.agent_output import OutputParser
    from helexa.router.openai_api import ParsedRequest

    env = encode.Envelope(id="c", created=0, model="m",
                          req=ParsedRequest(kind="chat", model="m", messages=[], stream=True))
    choice = encode.Choice(index=0, prompt_index=0, echo="",
                           parser=OutputParser(reasoning_parser="think"))
    msgs = [pb.GenerateResponse(thought_open=True, prompt_tokens=9),
            pb.GenerateResponse(text="Let me see.", token_ids=[1]),
            pb.GenerateResponse(text="</think>\n\nHi.", token_ids=[2],
                                finish_reason=pb.FINISH_REASON_STOP)]
    deltas = []
    for i, m in enumerate(msgs):
        chunk = encode.delta_chunk(env, choice, m, first=i == 0)
        encode.add_delta(choice, m, streamed=True)
        deltas += [chunk["choices"][0]["delta"]] if chunk else []
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "Hi."


def test_a_whole_reply_with_logprobs_costs_little_more_than_its_json():
    """16 choices with 20 top logprobs a token: the reply is built a token at a time into
    one buffer, its peak about 1.6 times the JSON (the buffer's growth). A dict for every
    entry of every token at once peaked at 6.4 times (in the router, with the neuron's
    reply and aiohttp's copies: 81 MB of JSON, 680 MB more memory)."""
    import tracemalloc

    import msgspec

    from helexa.router import encode
    from helexa.router.openai_api import parse_request

    n, tokens, top = 16, 150, 20

    def tok(i: int) -> pb.TopLogprob:
        return pb.TopLogprob(token_id=i, token=f" w{i}\u00e9", logprob=-i / 7)
    for kind, extra in (("chat", {"messages": [{"role": "user", "content": "x"}],
                                  "logprobs": True, "top_logprobs": top}),
                        ("completion", {"prompt": "x", "logprobs": 5})):
        req = parse_request(msgspec.json.encode({"model": "m", "n": n, **extra}), kind)
        env = encode.Envelope(id="c", created=0, model="m", req=req)
        choices = [encode.Choice(index=i) for i in range(n)]
        for c in choices:
            encode.add_delta(c, pb.GenerateResponse(
                text="w" * tokens, token_ids=list(range(tokens)),
                finish_reason=pb.FINISH_REASON_LENGTH,
                logprobs=[pb.TokenLogprob(token_id=i, token=f" t{i}", logprob=-0.5,
                                          top=[tok(i + j) for j in range(top)])
                          for i in range(tokens)]))
        tracemalloc.start()
        body = encode.json_body(encode.full_body(env, choices))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 2.5 * len(body), (kind, peak, len(body))
        got = msgspec.json.decode(body)["choices"]
        assert [c["logprobs"] for c in got] == [
            msgspec.json.decode(msgspec.json.encode(encode._logprobs(env, c.logprobs, 0)))
            for c in choices]
        assert got[0]["finish_reason"] == "length" and list(got[0])[:3] == [
            "index", "message" if kind == "chat" else "text", "logprobs"]


def test_an_echo_with_logprobs_starts_with_the_prompts_whole_or_streamed():
    """A completion echoing its prompt with logprobs: the prompt's tokens first (the first
    one's logprob and alternatives null, -inf as -9999.0, their offsets the neuron's into
    the echo), then the generated ones after the echo; streamed, the echo and the prompt's
    entries ride with the first token, and the chunks add up to the whole reply."""
    from types import SimpleNamespace

    import msgspec

    from helexa.responses import merge_responses
    from helexa.router import completion_logprobs, encode
    from helexa.router.openai_api import parse_request

    req = parse_request({"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 1,
                         "max_tokens": 2, "stream": True}, "completion")

    def entry(i: int, token: str, lp: float, offset: int) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=i, token=token, logprob=lp, text_offset=offset,
                               top=[pb.TopLogprob(token_id=i, token=token, logprob=lp)])
    prompt = [pb.TokenLogprob(token_id=1, token="ab"), entry(2, "\ufffd", float("-inf"), 2),
              entry(3, "\ufffd", -1.0, 2)]  # "é" split over two tokens
    msgs = [pb.GenerateResponse(prompt_text="abé", prompt_tokens=3),
            pb.GenerateResponse(text="x", token_ids=[9], logprobs=[entry(9, "x", -0.5, 0)],
                                prompt_logprobs=prompt),
            pb.GenerateResponse(text="yz", token_ids=[10], finish_reason=pb.FINISH_REASON_LENGTH,
                                logprobs=[pb.TokenLogprob(  # sampled outside its top k
                                    token_id=10, token="yz", logprob=-2.5, top=[pb.TopLogprob(
                                        token_id=11, token="w", logprob=-0.125)])])]
    env = encode.Envelope(id="c", created=0, model="m", req=req)
    whole = SimpleNamespace(reply=merge_responses(msgs))
    choice = encode.Choice(index=0, echo=completion_logprobs.echo_text(req, whole))
    encode.add_delta(choice, whole.reply)
    body = msgspec.json.decode(encode.json_body(encode.full_body(env, [choice])))["choices"][0]
    assert body["text"] == "abéxyz"
    assert body["logprobs"] == {
        "tokens": ["ab", "\ufffd", "\ufffd", "x", "yz"],
        "token_logprobs": [None, -9999.0, -1.0, -0.5, -2.5],
        "top_logprobs": [None, {"\ufffd": -9999.0}, {"\ufffd": -1.0}, {"x": -0.5},
                         {"w": -0.125, "yz": -2.5}],  # the token itself beside its top k
        "text_offset": [0, 2, 2, 3, 4]}
    streamed = encode.Choice(index=0, echo=completion_logprobs.echo_text(
        req, SimpleNamespace(first=msgs[0])))
    assert encode.first_chunk(env, streamed) is None  # the echo waits for its logprobs
    chunks = []
    for i, msg in enumerate(msgs):
        chunk = encode.delta_chunk(env, streamed, msg, first=i == 0)
        encode.add_delta(streamed, msg, streamed=True)
        chunks += [msgspec.json.decode(msgspec.json.encode(chunk))["choices"][0]] if chunk else []
    assert [c["text"] for c in chunks] == ["abéx", "yz"]
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0, 2, 2, 3], [4]]
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks), []) == \
        body["logprobs"]["token_logprobs"]


def test_a_chat_completion_and_its_chunks_name_the_tier_that_served_it():
    """OpenAI's chat completion says which service_tier served it; a client that asked for
    `flex` reads `default`, the one tier here. A legacy completion has no such field."""
    from helexa.router import encode
    from helexa.router.openai_api import parse_request

    for kind, body in (("chat", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("completion", {"prompt": "hi"})):
        req = parse_request({"model": "m", "service_tier": "flex", **body}, kind)
        env = encode.Envelope(id="c", created=0, model="m", req=req)
        choice = encode.Choice(index=0, echo="")
        msg = pb.GenerateResponse(text="x", token_ids=[1], finish_reason=pb.FINISH_REASON_STOP)
        chunk = encode.delta_chunk(env, choice, msg, first=True)
        encode.add_delta(choice, msg)
        whole = encode.full_body(env, [choice])
        if kind == "chat":
            assert whole["service_tier"] == chunk["service_tier"] == "default"
        else:
            assert "service_tier" not in whole and "service_tier" not in chunk
