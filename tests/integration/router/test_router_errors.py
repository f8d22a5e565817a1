"""Every row of docs/errors.md's table, as the official client sees it (typed errors,
Retry-After where due), against real processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2
import openai
import pytest
from router_procs import RouterProcess, key_of, router_over_fake, wait_for
from support.lazy_import import Lazy

anthropic = Lazy("anthropic")

MSG = [{"role": "user", "content": "hi"}]


def test_bad_json_and_unsupported_fields_are_400_naming_the_param(router):
    c = router.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSG, logit_bias={"1": 3})
    assert e.value.code == "invalid_request_error" and e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSG, temperature=9)
    assert e.value.param == "temperature"
    r = httpx2.post(router.url + "/v1/completions", content=b"{", headers={
        "Authorization": f"Bearer {key_of('alice')}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_an_image_detail_openai_does_not_know_is_400_naming_it(router):
    """OpenAI takes `detail` auto, low, high or original (its SDK's ImageDetail), on chat's
    image_url and Responses' input_image alike; anything else is its 400, not ignored."""
    pixel = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"
    part = {"type": "image_url", "image_url": {"url": pixel, "detail": "ultra"}}
    with pytest.raises(openai.BadRequestError) as e:
        router.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [part]}])
    assert e.value.code == "invalid_request_error"
    assert e.value.param == "messages[0].content[0].image_url.detail"
    assert "ultra" in e.value.message
    shot = {"type": "input_image", "image_url": pixel, "detail": "ultra"}
    with pytest.raises(openai.BadRequestError) as e:
        router.client().responses.create(model="tiny", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, shot]}])
    assert e.value.code == "invalid_request_error"
    assert e.value.param == "input[0].content[1].detail"
    assert "ultra" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a tool's output: the same rule
        router.client().responses.create(model="tiny", input=[
            {"role": "user", "content": "Look at a.png."},
            {"type": "function_call", "call_id": "c1", "name": "view", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [shot]}])
    assert e.value.param == "input[2].output[0].detail"


def test_json_nested_1000_deep_is_400_naming_the_limit_in_each_envelope(router):
    auth = {"Authorization": f"Bearer {key_of('alice')}", "Content-Type": "application/json"}
    deep = "[" * 1000 + "1" + "]" * 1000
    msg = '[{"role": "user", "content": "hi"}]'
    for path, body in (
            ("/v1/chat/completions", f'{{"model": "tiny", "messages": {msg}, "metadata": {deep}}}'),
            ("/tokenize", f'{{"model": "tiny", "messages": {msg}, '
                          f'"chat_template_kwargs": {{"k": {deep}}}}}'),
            ("/v1/messages", f'{{"model": "tiny", "max_tokens": 4, "messages": {msg}, '
                             f'"metadata": {{"user_id": {deep}}}}}')):
        r = httpx2.post(router.url + path, content=body.encode(), headers=auth)
        assert r.status_code == 400, (path, r.text[:300])
        err = r.json()["error"]
        assert "deeper than 128 levels" in err["message"] and err["type"] == "invalid_request_error"
        if path == "/v1/messages":
            assert r.json()["type"] == "error"  # Anthropic's envelope


def test_context_length_exceeded_states_both_numbers(router):
    with pytest.raises(openai.BadRequestError) as e:
        router.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=5000)
    assert e.value.code == "context_length_exceeded"
    assert "5000" in e.value.message and "2048" in e.value.message or "4096" in e.value.message


def test_missing_or_unknown_key_is_401(router):
    with pytest.raises(openai.AuthenticationError) as e:
        router.client(None).chat.completions.create(model="tiny", messages=MSG)
    assert e.value.code == "invalid_api_key"
    r = httpx2.post(router.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    assert r.status_code == 401


def test_unknown_model_is_404(router):
    with pytest.raises(openai.NotFoundError) as e:
        router.client().chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.code == "model_not_found"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[RouterProcess]:
    """A router with keys and auth.require_auth off: callers without a key are anonymous."""
    with router_over_fake(tmp_path_factory.mktemp("keyed"), "keyed",
                          principals=["alice"]) as r:
        yield r


def test_a_wrong_key_is_401_naming_its_header_even_without_require_auth(keyed):
    """A key the router does not know is a 401, not an anonymous call: a typo'd key would
    lose its principal's limits and prefix cache unseen. No key at all stays anonymous."""
    def ask(key: str) -> str | None:
        oa = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0, timeout=60)
        return oa.chat.completions.create(model="tiny", messages=MSG,
                                          max_tokens=2).choices[0].finish_reason
    assert ask(key_of("alice")) is not None
    # no key at all is anonymous (the openai SDK refuses to send none: a raw request here)
    assert httpx2.post(keyed.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MSG, "max_tokens": 2}).status_code == 200
    with pytest.raises(openai.AuthenticationError) as e:
        ask(key_of("alice") + "x")
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "Incorrect API key provided in the Authorization header" in e.value.message
    a = anthropic.Anthropic(base_url=keyed.url, api_key=key_of("alice") + "x", max_retries=0,
                            timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as ae:
        a.messages.create(model="tiny", max_tokens=2, messages=MSG)
    assert ae.value.body["error"]["type"] == "authentication_error"
    r = httpx2.post(keyed.url + "/v1/messages", headers={"x-api-key": "sk-typo"},
                    json={"model": "tiny", "max_tokens": 2, "messages": MSG})
    assert r.status_code == 401 and r.json()["error"] == {
        "type": "authentication_error",
        "message": "invalid x-api-key: it matches no key of this router"}
    r = httpx2.post(keyed.url + "/tokenize", headers={"x-api-key": "sk-typo"},
                    json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]


def test_body_too_large_is_413(router):
    r = httpx2.post(router.url + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {key_of('alice')}"}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@contextlib.contextmanager
def holding_tight(router, principal: str = "alice"):
    """A long stream on `tight` (1 in flight, no queue), open until the block ends."""
    with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {key_of(principal)}"}, json={
            "model": "tight", "messages": MSG, "max_tokens": 1000, "stream": True,
            "temperature": 0, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: dropping it would close the stream
        next(lines)  # the neuron admitted it: its first chunk is here
        yield
    # Leaving cancels it; wait until the neuron has it back.
    wait_for(lambda: router.metric("helexa_neuron_in_flight", neuron="nt", model="tight") == 0)


def test_principal_over_its_cap_is_429_with_retry_after(router):
    with holding_tight(router, "alice"):
        with pytest.raises(openai.RateLimitError) as e:
            router.client("alice").chat.completions.create(model="tight", messages=MSG,
                                                           max_tokens=2)
    assert e.value.code == "rate_limit_exceeded"
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_queue_full_is_503_overloaded_with_retry_after(router):
    with holding_tight(router, "alice"):
        with pytest.raises(openai.InternalServerError) as e:
            router.client("bob").chat.completions.create(model="tight", messages=MSG, max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "overloaded"
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_on_demand_load_is_503_model_loading_then_serves(router, neurons):
    with pytest.raises(openai.InternalServerError) as e:
        router.client("bob").chat.completions.create(model="lazy", messages=MSG, max_tokens=2)
    assert e.value.code == "service_unavailable"  # bob may not cause loads
    with pytest.raises(openai.InternalServerError) as e:
        router.client("alice").chat.completions.create(model="lazy", messages=MSG, max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "model_loading"
    assert int(e.value.response.headers["retry-after"]) >= 1

    def served():
        try:
            return router.client("bob").chat.completions.create(model="lazy", messages=MSG,
                                                                max_tokens=2)
        except openai.InternalServerError as err:
            assert err.code == "model_loading"
            time.sleep(0.5)
            return None

    assert wait_for(served, timeout=60).choices[0].message.content is not None
    # leave the shared fleet as found: lazy unloaded, gone from the router's models
    nt = neurons["nt"]
    ctl = subprocess.run([sys.executable, "-m", "helexa.cli", "ctl", "--config",
                          str(nt.config_path), "--address", nt.address, "unload", "lazy"],
                         capture_output=True, text=True, timeout=120)
    assert ctl.returncode == 0, ctl.stderr
    wait_for(lambda: "lazy" not in {m.id for m in router.client().models.list()}, timeout=30)


def test_n_over_the_principal_cap_is_400_saying_why(router):
    # na and nb allow one request per principal at a time each: three choices never all run.
    with pytest.raises(openai.BadRequestError) as e:
        router.client("bob").chat.completions.create(model="tiny", messages=MSG, max_tokens=1,
                                                     n=3)
    assert e.value.param == "n" and "max_per_principal 2 in all" in e.value.message
    assert "retry-after" not in e.value.response.headers
