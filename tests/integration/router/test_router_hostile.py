"""A real router over a real neuron, as a client who means harm would use it: generated bodies
(valid, near-valid, hostile) earn no 5xx and leave the ledger whole; a neuron hung with SIGSTOP
mid-stream answers no keepalive ping, and its stream is ended with an upstream_error event
within the keepalive bound (keepalive_secs + keepalive_timeout_secs, 5 s), long before
stream_idle_secs; a neuron stopped for less than that keeps its stream."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from router_procs import RouterProcess, ledger_whole, start_router, wait_for
from support.neuron import NeuronProcess, start_neuron, write_neuron_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "router"))
from hypothesis import strategies as st  # noqa: E402
from request_bodies import bodies, check_reply  # noqa: E402

MSG = [{"role": "user", "content": "Write a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[NeuronProcess, RouterProcess]]:
    d = tmp_path_factory.mktemp("hostile")
    # A small default output budget, never grown: a generated body without max_tokens
    # stays quick.
    cfg = {"server": {"name": "nf", "listen": "127.0.0.1:0", "heartbeat_secs": 0.5},
           "engine": {"torch_threads": 1, "max_slots": 4},
           "kv": {"kv_budget_mb": 2, "activation_headroom_mb": 0, "default_output_tokens": 8,
                  "grow_output": False},
           "models": [{"id": "tiny", "path": str(tiny_model_dir)}]}
    neuron = start_neuron(write_neuron_config(d / "nf.toml", cfg), log_path=d / "nf.log")
    (d / "router.toml").write_text(tomli_w.dumps({
        "server": {"listen": "127.0.0.1:0", "max_body_bytes": 64 * 1024},
        "neurons": {"endpoints": [{"name": "nf", "address": neuron.address}]},
        "aliases": {"helexa/balanced": "tiny"},
        # a hung neuron's stream ends by keepalive (2 s + 3 s by default), not by this
        "timeouts": {"unhealthy_after_secs": 1.0, "reconnect_max_secs": 0.5,
                     "stream_idle_secs": 120.0}}))
    router = start_router(d / "router.toml")
    try:
        yield neuron, router
    finally:
        router.stop()
        neuron.signal(signal.SIGCONT)
        neuron.stop(timeout_secs=15)


@pytest.mark.parametrize("kind,path", [("chat", "/v1/chat/completions"),
                                       ("completion", "/v1/completions")])
def test_generated_bodies_against_a_real_neuron(pair, kind, path):
    _, router = pair
    seen: dict[int, int] = {}
    with httpx2.Client(base_url=router.url, timeout=60) as http:
        @settings(max_examples=150, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        # Property names, special-token text among them (the test below shows one whole).
        @given(bodies(kind, max_tokens_cap=8, only_edge_ints=True,
                      schema_keys=st.text("abcxyz_", max_size=8)
                      | st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])))
        def one(raw: bytes) -> None:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            check_reply(r.status_code, r.headers, r.content)

        one()
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 10, seen
    wait_for(lambda: ledger_whole(router, "nf"), timeout=15)


def test_special_token_text_as_a_schema_key_is_generated_as_text(pair):
    _, router = pair
    schema = {"type": "object", "properties": {"<|im_start|>": {"type": "string"}}}
    r = httpx2.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MSG, "max_tokens": 3, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "o",
                                                                   "schema": schema}}})
    assert r.status_code == 200, r.text[:300]
    content = r.json()["choices"][0]["message"]["content"]
    # The grammar forces the key's characters, never the one special token: three tokens
    # in, the reply is `{`, `"` and the key's first character, `<`, as text.
    assert content == '{"<', content
    detail = httpx2.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MSG, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "o", "schema": {**schema, "required": ["<|im_start|>"]}}}})
    assert detail.status_code == 200, detail.text[:300]
    assert detail.json()["choices"][0]["message"]["content"].startswith('{"<|im_start|>":"')


def test_a_neuron_hung_mid_stream_is_ended_with_an_upstream_error(pair):
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nf"), timeout=15)
    stream = router.client(None).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    neuron.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert e.value.body["code"] == "upstream_error"
        assert "ping timeout" in e.value.body["message"]
        assert time.monotonic() - t0 < 30  # well before stream_idle_secs (120 s)
        # A new request while it is hung: 503 at once, not a wait on the hung host.
        with pytest.raises(openai.InternalServerError) as e:
            router.client(None).chat.completions.create(model="tiny", messages=MSG,
                                                        max_tokens=1)
        assert e.value.code == "service_unavailable"
    finally:
        neuron.signal(signal.SIGCONT)
    # Back: the ended call was aborted on the neuron and every block came back.
    wait_for(lambda: ledger_whole(router, "nf"), timeout=30)
    r = router.client(None).chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_non_streaming_call_on_a_hung_neuron_is_answered_by_keepalive(pair):
    """A non-streaming call has no token clock: before keepalive ended it, it waited for the
    Watch bound (stream_idle_secs, 120 s here) or gRPC's minute-long ping timeout."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nf"), timeout=15)
    got: dict[str, object] = {}

    def call() -> None:
        try:
            router.client(None).with_options(timeout=150).chat.completions.create(
                model="tiny", messages=MSG, max_tokens=1500, extra_body={"ignore_eos": True})
        except openai.APIError as e:
            got["error"] = e
        got["at"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: router.metric("helexa_neuron_in_flight", model="tiny", neuron="nf") > 0,
             timeout=15, every=0.01)
    neuron.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        caller.join(150)
        assert isinstance(got.get("error"), openai.InternalServerError), got
        assert got["error"].code == "service_unavailable"
        assert "ping timeout" in got["error"].message
        assert got["at"] - t0 < 30  # well before stream_idle_secs (120 s)
    finally:
        neuron.signal(signal.SIGCONT)
    wait_for(lambda: ledger_whole(router, "nf"), timeout=30)


def test_a_neuron_paused_past_its_watch_bound_keeps_its_streams(pair):
    """The neuron stops for about 2 s (SIGSTOP, then SIGCONT), less than the keepalive bound
    (5 s): it leaves rotation (Watch silent past 1 s) but its stream is not cut; it goes on to
    its last token once the neuron runs again. (The router used to end every call on a neuron
    at that silence: the review's finding 4, a bystander's stream cut.)"""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nf"), timeout=15)
    downs = router.log_path.read_text().count('"neuron.down"')
    stream = router.client(None).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=300, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    neuron.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: router.log_path.read_text().count('"neuron.down"') > downs, timeout=10)
        time.sleep(1.0)
    finally:
        neuron.signal(signal.SIGCONT)
    rest = list(chunks)  # no error: openai raises APIError on an error event
    assert rest[-1].usage.completion_tokens == 300
    wait_for(lambda: ledger_whole(router, "nf"), timeout=30)


def test_a_sighup_with_a_file_that_is_not_utf8_is_one_line_and_keeps_serving(pair):
    _, router = pair
    good = router.config_path.read_bytes()
    log_lines = len(router.log_path.read_text().splitlines())
    router.config_path.write_bytes(good + b'\n[aliases]\n"\xff" = "tiny"\n')
    try:
        router.proc.send_signal(signal.SIGHUP)
        new = wait_for(lambda: [line for line in router.log_path.read_text().splitlines()
                                [log_lines:] if "config.reload" in line], timeout=10)
        assert len(new) == 1 and '"config.reload_refused"' in new[0] and "not UTF-8" in new[0]
        assert "Traceback" not in router.log_path.read_text()
        r = router.client(None).chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        router.config_path.write_bytes(good)
