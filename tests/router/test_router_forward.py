"""Neuron refusals → the client-facing error of docs/errors.md's table; requests → GenerateRequest."""

from __future__ import annotations

import grpc
import pytest

from helexa.proto import neuron_pb2 as pb
from helexa.router.forward import generate_request
from helexa.router.openai_api import parse_request
from helexa.router.rpc_errors import map_rpc_error


def rpc_error(code: grpc.StatusCode, helexa_code: str | None = None,
              retry_ms: int | None = None) -> grpc.aio.AioRpcError:
    md = []
    if helexa_code:
        md.append(("helexa-code", helexa_code))
    if retry_ms is not None:
        md.append(("helexa-retry-after-ms", str(retry_ms)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*md), "details")


@pytest.mark.parametrize("status,code,retry_ms,http,want_code,retry_after", [
    ("RESOURCE_EXHAUSTED", "rate_limit_exceeded", 2500, 429, "rate_limit_exceeded", "3"),
    ("RESOURCE_EXHAUSTED", "overloaded", 400, 503, "overloaded", "1"),
    ("UNAVAILABLE", "overloaded", None, 503, "overloaded", "1"),
    ("UNAVAILABLE", "shutting_down", 10_000, 503, "shutting_down", "10"),
    ("UNAVAILABLE", "model_loading", None, 503, "model_loading", "1"),
    ("UNAVAILABLE", None, None, 503, "service_unavailable", "1"),
    ("INVALID_ARGUMENT", "context_length_exceeded", None, 400, "context_length_exceeded", None),
    ("INVALID_ARGUMENT", None, None, 400, "invalid_request_error", None),
    ("NOT_FOUND", "model_not_found", None, 404, "model_not_found", None),
    ("UNAUTHENTICATED", None, None, 503, "service_unavailable", "1"),
    ("INTERNAL", None, None, 502, "upstream_error", None),
])
def test_error_table(status, code, retry_ms, http, want_code, retry_after):
    err = map_rpc_error(rpc_error(grpc.StatusCode[status], code, retry_ms), "chat")
    assert (err.status, err.code) == (http, want_code)
    assert err.headers().get("Retry-After") == retry_after
    assert err.body()["error"]["code"] == want_code


def test_context_length_names_the_prompt_param():
    e = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "context_length_exceeded")
    assert map_rpc_error(e, "chat").param == "messages"
    assert map_rpc_error(e, "completion").param == "prompt"


def test_generate_request_carries_everything():
    req = parse_request({"model": "alias", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 5, "seed": 7, "stop": ["x"], "logprobs": True,
                         "top_logprobs": 3, "return_token_ids": True, "temperature": 0.5}, "chat")
    g = generate_request(req, model="real", principal="alice", req_id="r1",
                         deadline_unix_ms=123, choice=2)
    assert (g.model, g.principal, g.req_id, g.max_tokens, g.deadline_unix_ms) == (
        "real", "alice", "r1", 5, 123)
    assert g.WhichOneof("prompt") == "chat" and g.chat.messages[0].content == "hi"
    assert g.sampling.seed == 9 and g.sampling.top_logprobs == 3 and g.sampling.logprobs
    assert abs(g.sampling.temperature - 0.5) < 1e-6 and list(g.stop) == ["x"]
    assert g.return_prompt_token_ids
    # Defaults are OpenAI's (temperature 1, top_p 1), and no max_tokens means unset.
    g = generate_request(parse_request({"model": "m", "prompt": [1, 2]}, "completion"),
                         model="m", principal="", req_id="r", deadline_unix_ms=0)
    assert g.sampling.temperature == 1.0 and g.sampling.top_p == 1.0
    assert not g.HasField("max_tokens") and not g.sampling.HasField("seed")
    assert list(g.token_ids.ids) == [1, 2]
    assert pb.GenerateRequest.FromString(g.SerializeToString()) == g


def test_engine_failure_before_any_token_is_502_upstream_error():
    err = map_rpc_error(rpc_error(grpc.StatusCode.INTERNAL, "upstream_error"))
    assert (err.status, err.code, err.retry_after_secs) == (502, "upstream_error", None)


@pytest.mark.parametrize("status", ["UNKNOWN", "INTERNAL"])
def test_a_fault_in_the_neuron_reaches_the_client_without_its_words(status):
    """An exception the neuron did not expect (gRPC's own words for it, no helexa code) is
    a 502 naming the status, not the exception's text; a refusal keeps its message."""
    words = "Unexpected <class 'AttributeError'>: 'str' object has no attribute 'get'"
    fault = grpc.aio.AioRpcError(grpc.StatusCode[status], grpc.aio.Metadata(),
                                 grpc.aio.Metadata(), words)
    err = map_rpc_error(fault)
    assert (err.status, err.code) == (502, "upstream_error")
    assert "AttributeError" not in err.message and status in err.message
    refusal = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(("helexa-code", "upstream_error")),
                                   "the engine failed on this request; see req_id r1")
    assert map_rpc_error(refusal).message == "the engine failed on this request; see req_id r1"
