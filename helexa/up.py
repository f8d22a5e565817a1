"""`helexa up`: a neuron and a router on loopback, serving one model, for one machine.

With no arguments it serves the tiny default checkpoint (made on first run
with `helexa.tiny.init_tiny` under $HELEXA_CACHE or ~/.cache/helexa, no
download); `--model DIR` serves any Hugging Face checkpoint folder instead.
It writes the configs it needs to a run folder, starts both daemons as child
processes (each waits for the other's readiness line, ports are picked by
the OS unless `--port` says otherwise), prints the endpoint with a curl and
a Python example, and on Ctrl-C or SIGTERM stops the router, then the
neuron (which drains), and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import tomli_w

TINY_NAME = "tiny-qwen3"
TINY_MODEL_ID = "helexa/tiny-qwen3"  # as asset/neuron/local.toml and asset/models.toml name it
ALIASES = ("helexa/balanced", "helexa/fast")


def tiny_model_dir() -> Path:
    """The default checkpoint, made once (atomically, so an interrupted first run is harmless)."""
    from helexa.tiny import cache_dir, init_tiny  # imports torch: only when it is needed

    out = cache_dir() / TINY_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=out.parent))
    init_tiny(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another `up` made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def stop_process(proc: subprocess.Popen, timeout_secs: float) -> int:
    """SIGTERM (a helexa daemon drains on it) and wait; SIGKILL if it does not exit in time.
    Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_secs)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Child:
    """A daemon child process and the address it announced on stdout."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ready_prefix: str) -> None:
        self.name = name
        self.log_path = log_path
        log = open(log_path, "w")  # noqa: SIM115 - the child owns it for its life
        # Its own session: Ctrl-C reaches `up` only, which stops the children in order.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.address = ""
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready_prefix,), daemon=True).start()

    def _pump(self, prefix: str) -> None:
        for line in self.proc.stdout:  # keep reading so the child never blocks on a full pipe
            if line.startswith(prefix) and not self.address:
                self.address = line.split()[-1]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_secs: float) -> bool:
        return self._ready.wait(timeout_secs) and bool(self.address)

    def stop(self, timeout_secs: float) -> None:
        stop_process(self.proc, timeout_secs)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def write_configs(run: Path, model_dir: Path, model_id: str, port: int, device: str,
                  kv_budget_mb: int | None) -> tuple[Path, Path]:
    token = run / "neuron.token"
    token.write_text(secrets.token_urlsafe(24) + "\n")
    token.chmod(0o600)
    model: dict = {"id": model_id, "path": str(model_dir)}
    neuron = {"server": {"name": "local", "listen": "127.0.0.1:0", "token_file": str(token),
                         "address_file": str(run / "neuron.addr"), "devices": [device],
                         "drain_secs": 5.0},
              "kv": {"kv_budget_mb": kv_budget_mb} if kv_budget_mb else {},
              "models": [model]}
    router = {"server": {"listen": f"127.0.0.1:{port}", "address_file": str(run / "router.addr")},
              "neurons": {"token_file": str(token)},
              # one machine, one model, one user: anyone may (re)load it after a failure
              "auth": {"load_principals": ["*"]},
              "aliases": {a: model_id for a in ALIASES}}
    (run / "neuron.toml").write_text(tomli_w.dumps(neuron))
    (run / "router.toml").write_text(tomli_w.dumps(router))
    return run / "neuron.toml", run / "router.toml"


def examples(url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return f"""
  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="none")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32)
print(reply.choices[0].message.content)
EOF
"""


def _default_device() -> str:
    try:
        import torch
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="helexa up", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the tiny model)")
    p.add_argument("--model-id", help="id clients ask for (default: the folder's name)")
    p.add_argument("--port", type=int, default=8080, help="router port (0 = any free port)")
    p.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 if present)")
    p.add_argument("--kv-budget-mb", type=int, default=None,
                   help="KV pool size (default: 16 MiB for the tiny model, else derived)")
    p.add_argument("--run-dir", type=Path, help="where configs and logs go (default: a temp dir)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)

    if args.model is None:
        print("helexa up: preparing the tiny default model ...", flush=True)
        model_dir, kv = tiny_model_dir(), args.kv_budget_mb or 16
    else:
        model_dir, kv = args.model.resolve(), args.kv_budget_mb
        if not (model_dir / "config.json").exists():
            print(f"helexa up: {model_dir}: no config.json (expected a checkpoint folder)",
                  file=sys.stderr)
            return 2
    model_id = args.model_id or (TINY_MODEL_ID if args.model is None else model_dir.name)
    run = args.run_dir or Path(tempfile.mkdtemp(prefix="helexa-up-"))
    run.mkdir(parents=True, exist_ok=True)
    neuron_cfg, router_cfg = write_configs(run, model_dir, model_id, args.port,
                                           args.device or _default_device(), kv)
    cli = [sys.executable, "-m", "helexa.cli"]
    children: list[Child] = []
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        neuron = Child("neuron", [*cli, "neuron", "--config", str(neuron_cfg)],
                       run / "neuron.log", "NEURON LISTENING")
        children.append(neuron)
        if not _wait(neuron, args.start_timeout, stopping):
            return 1
        # The router learns the neuron's bound address from its config, written now.
        _add_endpoint(router_cfg, neuron.address)
        router = Child("router", [*cli, "router", "--config", str(router_cfg)],
                       run / "router.log", "ROUTER LISTENING")
        children.append(router)
        if not _wait(router, 60, stopping):
            return 1
        url = router.address
        print(f"HELEXA UP {url}/v1  model {model_id} (aliases: {', '.join(ALIASES)})", flush=True)
        print(f"run folder: {run}  (configs; logs neuron.log, router.log)")
        print(examples(url, ALIASES[0]), flush=True)
        print("Ctrl-C stops both.", flush=True)
        while not stopping.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"helexa up: the {dead[0].name} exited ({dead[0].proc.returncode});"
                      f" log tail:\n{dead[0].log_tail()}", file=sys.stderr)
                return 1
        return 0
    finally:
        for child in reversed(children):  # router first: no new work reaches the neuron
            child.stop(15.0)
        if children:
            print("helexa up: stopped.", flush=True)


def _add_endpoint(router_cfg: Path, address: str) -> None:
    raw = tomllib.loads(router_cfg.read_text())
    raw["neurons"]["endpoints"] = [{"name": "local", "address": address}]
    router_cfg.write_text(tomli_w.dumps(raw))


def _wait(child: Child, timeout_secs: float, stopping: threading.Event) -> bool:
    end = time.monotonic() + timeout_secs
    while time.monotonic() < end and not stopping.is_set():
        if child.wait_ready(0.2):
            return True
        if child.proc.poll() is not None:
            break
    if stopping.is_set():
        return False
    print(f"helexa up: the {child.name} did not start; log tail ({child.log_path}):\n"
          f"{child.log_tail()}", file=sys.stderr)
    return False
