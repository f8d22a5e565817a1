"""`helexa up` from nothing: makes the tiny model, serves, the printed curl and Python work,
and Ctrl-C stops both daemons."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def _with_the_sessions_cpu_kernels(cache: Path) -> None:
    """An empty cache folder but for the compiled CPU kernels (test_cpu_native.py tests
    their build): the model is made from nothing without ~12 s of C compiling again."""
    from helexa.kernels.cpu import native

    built = native.library_path()  # in the default cache, where the other tests build it
    if native.load() is not None and built.exists():
        (cache / "kernels").mkdir(parents=True)
        shutil.copy2(built, cache / "kernels" / built.name)


def test_up_serves_the_printed_examples_and_ctrl_c_ends_a_stream_and_stops_both(tmp_path):
    """One `up` from nothing (the tiny default model made in an empty cache) serves what it
    prints; its neuron batches eight anonymous streams; Ctrl-C twice with a stream in flight
    ends the stream and stops both daemons gracefully."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    _with_the_sessions_cpu_kernels(cache)
    up = Up("--run-dir", str(run), env={"HELEXA_CACHE": str(cache)})
    try:
        text = up.read_until("Ctrl-C stops both.")
        assert "HELEXA UP http://127.0.0.1:" in text, text
        assert " model helexa/tiny-qwen3 " in text  # the id local.toml and models.toml use
        assert (cache / "tiny-qwen3" / "config.json").exists()
        assert "helexa up --model /path/to/checkpoint" in text  # how to serve a real one
        base = re.search(r"HELEXA UP (\S+)/v1", text).group(1)
        import httpx2

        limit = httpx2.get(base + "/v1/models/helexa/tiny-qwen3", timeout=10).json()["limit"]
        assert limit["context"] >= 32768  # a coding agent's prompt fits (opencode's is ~18k)
        # and its answer: codex sends no max_output_tokens and fails a turn cut at the
        # default budget (1024 for a fleet's neuron: codex 0.171 exited 1 after 1024 tokens)
        status = httpx2.get(base + "/status.json", timeout=10).json()
        model = status["neurons"][0]["models"][0]
        assert model["admission"]["default_output_tokens"] >= 32000  # Claude Code's ask
        if shutil.which("curl"):
            curl = re.search(r"^  (curl .*?)\n\n", text, re.S | re.M).group(1)
            r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
            assert '"object":"chat.completion"' in r.stdout, r.stdout + r.stderr
        script = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.S).group(1)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        host, port = re.search(r"HELEXA UP http://([\d.]+):(\d+)/v1", text).groups()
        assert _anonymous_streams_in_one_batch(run, "helexa/tiny-qwen3") == 8
        events = _ctrl_c_twice_with_a_stream_in_flight(up, host, int(port))
    finally:
        rc = up.stop()
    out = "".join(up.lines)
    # the client is told: [DONE], or an error event; never a stream cut off silently
    assert events[-1] == "[DONE]" or '"error"' in events[-1], events[-3:]
    assert rc == 0 and "killed" not in out, out
    assert "router.stopped" in (run / "router.log").read_text()  # stopped, not killed
    assert (run / "neuron.token").exists()  # --run-dir given: the folder stays
    assert run.stat().st_mode & 0o777 == 0o700
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
    neuron_addr = (run / "neuron.addr").read_text().strip()
    nhost, _, nport = neuron_addr.rpartition(":")
    with pytest.raises(OSError):
        socket.create_connection((nhost, int(nport)), timeout=1).close()


def _anonymous_streams_in_one_batch(run: Path, model: str) -> int:
    """Eight anonymous 2,000-token streams sent straight to `up`'s neuron: how many it runs
    at once. Every caller of `helexa up` is anonymous (it configures no API keys): the
    anonymous cap must not hold the batch to 4 of 8 streams."""
    import asyncio

    from support.neuron import NeuronClient, chat_request, model_of

    address = (run / "neuron.addr").read_text().strip()
    token = (run / "neuron.token").read_text().strip()

    async def streams() -> int:
        async with NeuronClient(address, token) as c:
            calls = [c.stub.Generate(chat_request(f"anon-{i}", model=model, principal="",
                                                  max_tokens=2000, ignore_eos=True),
                                     metadata=c.md)
                     for i in range(8)]
            try:
                st = await c.watch_until(
                    lambda st: model_of(st, model).running == 8
                    or model_of(st, model).queued > 0 and model_of(st, model).running >= 4,
                    timeout_secs=60)
                return model_of(st, model).running
            finally:
                for call in calls:
                    call.cancel()

    return asyncio.run(streams())


def _ctrl_c_twice_with_a_stream_in_flight(up: Up, host: str, port: int) -> list[str]:
    """A long stream started and flowing, then Ctrl-C twice at once (an impatient user, or
    `timeout` forwarding its own beside the terminal's): one stop, not a deadlock. The
    stream's data events, read to its end."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=120)
    # long enough that the stream is still going whatever the machine's speed
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "helexa/balanced", "stream": True, "max_tokens": 60000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count forever."}]}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events: list[str] = []
    while not any('"content"' in e for e in events):  # tokens are flowing
        line = resp.readline().decode()
        assert line, events
        if line.startswith("data: "):
            events.append(line[6:].strip())
    up.proc.send_signal(signal.SIGINT)
    up.proc.send_signal(signal.SIGINT)
    while line := resp.readline().decode():
        if line.startswith("data: "):
            events.append(line[6:].strip())
    return events


def test_up_configs_are_valid_and_bad_model_dirs_are_refused(tmp_path, capsys):
    from helexa.cli.up import main, write_configs
    from helexa.config.schema import NeuronConfig, RouterConfig, load_config

    (tmp_path / "m").mkdir()
    neuron, router = write_configs(tmp_path, tmp_path / "m", "my/model", 0, "cpu", 16)
    n = load_config(neuron, NeuronConfig)
    r = load_config(router, RouterConfig)
    assert n.models[0].id == "my/model" and n.kv.kv_budget_mb == 16
    assert r.aliases["helexa/balanced"] == "my/model" and r.server.listen == "127.0.0.1:0"
    assert r.auth.load_principals == ["*"]  # its one local model; the default is named only
    assert (tmp_path / "neuron.token").stat().st_mode & 0o077 == 0  # the token is private
    assert main(["--model", str(tmp_path / "m")]) == 2  # no config.json there
    assert "no config.json" in capsys.readouterr().err
    assert n.engine.speculation == "off"
    ngram, _ = write_configs(tmp_path, tmp_path / "m", "my/model", 0, "cpu", 16, "ngram")
    assert load_config(ngram, NeuronConfig).engine.speculation == "ngram"
    assert main(["--speculation", "mtp"]) == 2  # the tiny default model has no MTP head
    assert "has no MTP head" in capsys.readouterr().err
    (tmp_path / "small").mkdir()
    drafted, _ = write_configs(tmp_path, tmp_path / "m", "my/model", 0, "cpu", 16,
                               draft_dir=tmp_path / "small")
    d = load_config(drafted, NeuronConfig)
    assert d.models[0].speculation == "draft:small" and d.engine.speculation == "off"
    assert (d.models[1].id, d.models[1].path, d.models[1].preload) == (
        "small", str(tmp_path / "small"), False)
    assert main(["--draft-model", str(tmp_path / "small")]) == 2  # no config.json
    assert "draft model's checkpoint folder" in capsys.readouterr().err
    # draft: names a model id in a config, so on the command line a folder has its own flag
    with pytest.raises(SystemExit):
        main(["--speculation", f"draft:{tmp_path / 'small'}"])
    assert "--draft-model DIR" in capsys.readouterr().err


# ---------------------------------------------------------------- any checkpoint, failures


def _hf_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A random tiny Qwen3 written by transformers' save_pretrained, with the tiny tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)
    out = tmp_path / "my-qwen3"
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / f, out / f)
    return out


class Up:
    """`helexa up` as a user runs it, its output read line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "helexa.cli", "up", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []

    def read_until(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(prefix):
                break
        return "".join(self.lines)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"helexa up did not stop on SIGINT:\n{''.join(self.lines)}")
        self.lines += self.proc.stdout.readlines()
        return rc


def test_up_knows_which_checkpoints_carry_an_mtp_head(tiny_checkpoint, tiny_model_dir):
    from helexa.cli.up import has_mtp_head

    assert has_mtp_head(tiny_checkpoint("qwen3_5", mtp=True))
    assert not has_mtp_head(tiny_checkpoint("qwen3_5")) and not has_mtp_head(tiny_model_dir)


def test_up_serves_any_checkpoint_on_cpu_at_once_and_cleans_its_run_folder(tmp_path,
                                                                           tiny_model_dir):
    model = _hf_checkpoint(tmp_path, tiny_model_dir)
    up = Up("--model", str(model), "--device", "cpu")
    try:
        text = up.read_until("Ctrl-C stops both.")
        assert "HELEXA UP http://127.0.0.1:" in text, text
        assert "KV pool" in text and "MiB of host memory" in text
        run = Path(re.search(r"^run folder: (\S+), removed on exit", text, re.M).group(1))
        assert run.stat().st_mode & 0o777 == 0o700  # it holds the neuron token
        url = re.search(r"HELEXA UP (\S+)/v1", text).group(1)
        # the printed endpoint works the moment it is printed: no 503 model_loading
        body = json.dumps({"model": "helexa/balanced", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hello!"}]}).encode()
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.load(r)
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            assert "my-qwen3" in {m["id"] for m in json.load(r)["data"]}
    finally:
        rc = up.stop()
    assert rc == 0, "".join(up.lines)
    assert not run.exists()  # no token left behind


def test_up_serves_a_gguf_file_alone(tmp_path, tiny_checkpoint):
    # a .gguf with no HF files beside it: config, tokenizer and chat template from its metadata
    sys.path.insert(0, str(Path(__file__).parents[2] / "neuron" / "models"))
    from support.gguf_reference import write_gguf

    src = tiny_checkpoint("qwen3", hidden_size=256, num_heads=4, num_kv_heads=2,
                          intermediate_size=512, num_layers=2)
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "tiny-q4.gguf"
    write_gguf(src, path, lambda name: "Q6_K" if name.startswith("output") else "Q4_K")
    up = Up("--model", str(path), "--device", "cpu")
    try:
        text = up.read_until("Ctrl-C stops both.")
        assert "HELEXA UP http://127.0.0.1:" in text, text
        url = re.search(r"HELEXA UP (\S+)/v1", text).group(1)
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert "tiny-q4" in {m.id for m in client.models.list().data}
        reply = client.chat.completions.create(
            model="tiny-q4", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
            temperature=0)
        assert reply.usage.completion_tokens >= 1 and isinstance(reply.choices[0].message.content, str)
        assert reply.usage.prompt_tokens > 5  # the chat template from the metadata wrapped it
        # constrained decoding runs on the tokenizer built from the metadata too
        shaped = client.chat.completions.create(
            model="tiny-q4", messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=6, temperature=0, response_format={"type": "json_object"})
        assert shaped.choices[0].message.content.lstrip().startswith("{")
        # dtype auto on CPU: fp32 against bf16 measured on this CPU, and the model planned
        # and loaded in the winner (its kv_dtype auto follows it); the status page says so
        with urllib.request.urlopen(f"{url}/status.json", timeout=10) as resp:
            (m,) = json.load(resp)["neurons"][0]["models"]
        dtype, _, why = m["activations"].partition(" ")
        assert dtype in ("fp32", "bf16") and why.startswith("(measured on this CPU, a decode "
                                                              "step at 1 row: fp32 "), m
        assert m["kv_dtype"] == dtype, m
    finally:
        rc = up.stop()
    assert rc == 0, "".join(up.lines)


def _break_weights(model: Path) -> None:
    """Weights whose header reads (the plan's checks pass) but that hold none of the model's
    tensors: the model fails at load, in the engine. (A corrupt header is refused before
    the neuron starts: tests/test_checkpoint_failfast.py.)"""
    import torch
    from safetensors.torch import save_file

    save_file({"unrelated": torch.zeros(1)}, str(model / "model.safetensors"))


def test_up_with_a_model_that_cannot_load_says_why_and_exits_1(tmp_path, tiny_model_dir):
    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    _break_weights(model)
    (tmp_path / "tmp").mkdir()
    up = Up("--model", str(model), "--device", "cpu", "--kv-budget-mb", "16",
            env={"TMPDIR": str(tmp_path / "tmp")})
    try:
        rc = up.proc.wait(300)
    finally:
        up.stop()
    text = "".join(up.lines)
    assert rc == 1, text
    assert "HELEXA UP" not in text
    assert "could not be loaded" in text and "broken" in text, text
    assert not list((tmp_path / "tmp").iterdir())  # its run folder is gone


def test_a_failed_model_is_503_model_failed_at_once_and_never_retried_in_a_loop(
        tmp_path, tiny_model_dir):
    from helexa.cli.daemons import Child
    from helexa.cli.up import _add_endpoint, write_configs

    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    _break_weights(model)
    run = tmp_path / "run"
    run.mkdir()
    neuron_cfg, router_cfg = write_configs(run, model, "broken", 0, "cpu", 16)
    cli = [sys.executable, "-m", "helexa.cli"]
    children = [Child("neuron", [*cli, "neuron", "--config", str(neuron_cfg)], run / "neuron.log",
                      "NEURON LISTENING")]
    try:
        assert children[0].wait_ready(300), children[0].log_tail()
        _add_endpoint(router_cfg, children[0].address)
        children.append(Child("router", [*cli, "router", "--config", str(router_cfg)],
                              run / "router.log", "ROUTER LISTENING"))
        assert children[1].wait_ready(60), children[1].log_tail()
        url = children[1].address

        def neuron_reported() -> bool:  # the router has the neuron's first Watch report
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                    return "broken" in json.load(r)["neurons"]["local"]["models"]
            except urllib.error.HTTPError:  # 503 until a neuron reported
                return False

        deadline = time.monotonic() + 60
        while not neuron_reported():
            assert time.monotonic() < deadline, children[1].log_tail()
            time.sleep(0.1)
        body = json.dumps({"model": "broken", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        for _ in range(5):
            req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=50)  # the router's load wait is 60 s
            err = json.loads(e.value.read())["error"]
            assert e.value.code == 503 and err["code"] == "model_failed", err
            assert "safetensors" in err["message"].lower() or "header" in err["message"], err
            assert int(e.value.headers["Retry-After"]) >= 10
    finally:
        for child in reversed(children):
            child.stop(30)
    failed = [ln for ln in (run / "neuron.log").read_text().splitlines() if "model.failed" in ln]
    assert len(failed) == 1, failed  # the preload's failure, remembered: no retry storm


def test_up_serves_a_tiny_model_of_beasts_family_on_cpu(tmp_path):
    # Qwen/Qwen3.5-27B's layout (the multimodal wrapper, Gated DeltaNet + gated attention)
    # at tiny size, through `helexa up --model` with no KV budget given.
    from openai import OpenAI

    from helexa.fixtures.tiny import init_tiny

    model_dir = init_tiny(tmp_path / "tiny-qwen3_5", arch="qwen3_5")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForConditionalGeneration"]
    up = Up("--model", str(model_dir), "--device", "cpu")
    try:
        text = up.read_until("Ctrl-C stops both.")
        url = re.search(r"HELEXA UP (\S+/v1)", text).group(1)
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        # ignore_eos: a random-weight model samples its end token now and then (1 in 512 a
        # token here), which ended this reply early in one CI run
        reply = client.chat.completions.create(
            model="tiny-qwen3_5", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
            extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        with urllib.request.urlopen(f"{url}/models/tiny-qwen3_5", timeout=30) as r:
            entry = json.load(r)
        # its state per request is advertised, and that it serves with the prefix cache
        assert entry["limit"]["fixed_bytes_per_request"] > 0 and entry["prefix_cache"] is True
        # an agent's next turn (the last one, its reply and more) reuses the last prompt
        turn = [{"role": "user", "content": "Please list the files here. " * 12}]
        first = client.chat.completions.create(model="tiny-qwen3_5", messages=turn,
                                               max_tokens=8, temperature=0)
        turn += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the next step?"}]
        second = client.chat.completions.create(model="tiny-qwen3_5", messages=turn,
                                                max_tokens=8, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= 0.9 * first.usage.prompt_tokens, (cached, first.usage)
    finally:
        rc = up.stop()
    assert rc == 0, "".join(up.lines)


def test_the_stop_flag_wakes_on_signals_that_land_while_it_wakes():
    """`up`'s stop flag is set from its SIGINT/SIGTERM handler. A threading.Event deadlocks
    there: its set() takes the lock its wait() holds while waking, so a second signal
    landing in that window (seen once: `timeout` forwarding a SIGINT beside the user's)
    froze `up` with both daemons running. Here the handler sets it, and while the flag's
    wait is waking a second signal is raised from inside the first's handling: the wait
    returns at once, set."""
    import threading

    from helexa.cli.daemons import Stopping

    stopping = Stopping()
    raised: list[int] = []

    def handler(signum, frame):
        stopping.set()
        if len(raised) < 2:  # the second lands while the first is being handled
            raised.append(signum)
            signal.raise_signal(signal.SIGINT)

    old = signal.signal(signal.SIGINT, handler)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        t = time.monotonic()
        assert stopping.wait(10.0) is True
        assert time.monotonic() - t < 2.0 and len(raised) == 2
    finally:
        signal.signal(signal.SIGINT, old)
