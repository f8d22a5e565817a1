"""`helexa up` from nothing: makes the tiny model, serves, the printed curl and Python work,
and Ctrl-C stops both daemons."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest


def test_up_serves_the_printed_examples_and_stops_on_ctrl_c(tmp_path):
    env = {**os.environ, "HELEXA_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", "up", "--port", "0", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("Ctrl-C stops both."):
                break
        text = "".join(out)
        assert "HELEXA UP http://127.0.0.1:" in text, text
        assert " model helexa/tiny-qwen3 " in text  # the id local.toml and models.toml use
        assert (tmp_path / "cache" / "tiny-qwen3" / "config.json").exists()
        if shutil.which("curl"):
            curl = re.search(r"^  (curl .*?)\n\n", text, re.S | re.M).group(1)
            r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
            assert '"object":"chat.completion"' in r.stdout, r.stdout + r.stderr
        script = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.S).group(1)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        port = int(re.search(r"127\.0\.0\.1:(\d+)/v1", text).group(1))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("helexa up did not stop on SIGINT")
    assert rc == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    neuron_addr = (tmp_path / "run" / "neuron.addr").read_text().strip()
    host, _, nport = neuron_addr.rpartition(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(nport)), timeout=1).close()


def test_up_configs_are_valid_and_bad_model_dirs_are_refused(tmp_path, capsys):
    from helexa.config import NeuronConfig, RouterConfig, load_config
    from helexa.up import main, write_configs

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
