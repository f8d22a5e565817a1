"""`helexa up`: a neuron and a router on loopback, serving one model, for one machine.

With no arguments it serves the tiny default checkpoint (made on first run
with `helexa.fixtures.tiny.init_tiny` under $HELEXA_CACHE or ~/.cache/helexa, no
download), whose 128k-token context and KV pool fit a coding agent's prompt;
`--model DIR` serves any Hugging Face checkpoint folder instead (the banner
says so), or a .gguf file: a Qwen3.5 GGUF takes images with llama.cpp's vision
tower file, the `mmproj*.gguf` beside it or the one `--mmproj FILE` names.
On CPU the KV pool is `--kv-budget-mb`, else a share of the host's available
memory (printed). A request without a max_tokens may write UP_OUTPUT_TOKENS (what
an agent's turn needs: codex names no ceiling). It writes the configs it needs to a private run folder
(0700, removed on exit unless `--run-dir` names one), starts both daemons as
child processes (ports are picked by the OS unless `--port` says otherwise),
and prints the endpoint with a curl and a Python example only once the
model is ready and the router lists it; a model that cannot load is reported
with the neuron's reason and `up` exits 1. On Ctrl-C or SIGTERM both daemons
stop at once: the router stops taking connections, the neuron drains for a
few seconds and then ends what is left, so every open stream ends with
`[DONE]` or an error event before the router exits.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import signal
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w

from helexa.checkpoint.gguf import GgufError, find_gguf, model_path_error, read_config
from helexa.checkpoint.mmproj import MMPROJ_PREFIX, find_mmproj
from helexa.cli.daemons import (
    Child,
    Stopping,
    model_failure,
    stop_all,
    wait_listed,
    wait_started,
)
from helexa.config.schema import AdmissionConfig, ConfigError, parse_drafter

TINY_NAME = "tiny-qwen3"
ANON_IN_FLIGHT_NO_KEYS = AdmissionConfig().max_in_flight  # `up` configures no API keys
TINY_MODEL_ID = "helexa/tiny-qwen3"  # as asset/neuron/local.toml and asset/models.toml name it
ALIASES = ("helexa/balanced", "helexa/fast")
# How long in-flight streams may finish after Ctrl-C before the neuron ends them.
DRAIN_SECS = 3.0
# The CPU KV pool when --kv-budget-mb is not given: room for CPU_KV_CONTEXTS requests of the
# model's full context (capped at CPU_KV_CONTEXT_CAP tokens), but at most this share of
# available host memory and within these bounds (a pool is allocated whole at load).
CPU_KV_CONTEXTS = 4
CPU_KV_CONTEXT_CAP = 32768
CPU_KV_SHARE = 0.125
CPU_KV_MIN_MB, CPU_KV_MAX_MB = 16, 2048
# The tiny model's pool: 512 B a token, so 128 MiB holds two requests of its whole 128k
# context (an agent and its side requests), or eight of 32k.
TINY_KV_MB = 128
# The output budget of a request that names none (kv.default_output_tokens, capped by the
# context left). codex never sends max_output_tokens and fails a turn the budget cuts
# ("Incomplete response returned"), so 1024 would end its turns with a long thought or
# patch; Claude Code asks 32,000 of every request itself.
UP_OUTPUT_TOKENS = 32768


# The HF side files a GGUF model may have beside it (helexa/checkpoint/gguf.py reads them).
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "preprocessor_config.json")


def with_mmproj(model: Path, named: Path | None, run: Path) -> tuple[Path, Path | None]:
    """(the model path to serve, its mmproj): the mmproj* GGUF beside a GGUF model, or the
    one ``named``; a named one from elsewhere is linked beside the model (and its side
    files) in the run folder, where the neuron finds it as llama.cpp would. GgufError:
    the mmproj does not fit the model (the message names the file and field)."""
    gguf = find_gguf(model)
    if gguf is None:
        if named is not None:
            raise GgufError(f"--mmproj {named}: {model} is not a GGUF model (an mmproj holds "
                            "the vision tower of a .gguf model)")
        return model, None
    mmproj = find_mmproj(gguf, named)
    if mmproj is None or named is None or (
            mmproj.name.startswith(MMPROJ_PREFIX) and find_mmproj(gguf) == mmproj):
        read_config(model)  # an mmproj that does not fit: one line, before anything starts
        return model, mmproj  # the one the neuron finds beside the model
    beside = run / "model"
    beside.mkdir(exist_ok=True)
    for f in (gguf, *(gguf.parent / n for n in SIDE_FILES)):
        if f.is_file():
            (beside / f.name).symlink_to(f.resolve())
    name = mmproj.name if mmproj.name.startswith(MMPROJ_PREFIX) else f"{MMPROJ_PREFIX}-{mmproj.name}"
    (beside / name).symlink_to(mmproj.resolve())
    try:
        read_config(beside / gguf.name)
    except GgufError as e:  # named as the user named it, not as the link
        raise GgufError(str(e).replace(str(beside / name), str(mmproj))) from None
    return beside / gguf.name, mmproj


def tiny_model_dir() -> Path:
    """The default checkpoint, made once (atomically, so an interrupted first run is harmless)."""
    # imports torch: only when it is needed
    from helexa.fixtures.tiny import TINY_CONTEXT, cache_dir, init_tiny

    out = cache_dir() / TINY_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        if json.loads((out / "config.json").read_text()).get(
                "max_position_embeddings", 0) >= TINY_CONTEXT:
            return out
        shutil.rmtree(out, ignore_errors=True)  # made by an older helexa with a short context
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=out.parent))
    init_tiny(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another `up` made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out




def has_mtp_head(model_dir: Path) -> bool:
    """Whether a checkpoint's config.json declares a multi-token-prediction head."""
    from helexa.checkpoint.shape import read_model_shape

    try:
        return read_model_shape(model_dir / "config.json").mtp_layers > 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_configs(run: Path, model_dir: Path, model_id: str, port: int, device: str,
                  kv_budget_mb: int | None, speculation: str = "off",
                  draft_dir: Path | None = None, dtype: str = "auto") -> tuple[Path, Path]:
    """The neuron's and the router's config for one model; `draft_dir` (--draft-model) is a
    checkpoint that drafts for it: its own [[models]] entry, named by the model's
    speculation = "draft:<its id>" as any config names a draft model."""
    token = run / "neuron.token"
    token.write_text(secrets.token_urlsafe(24) + "\n")
    token.chmod(0o600)
    model: dict = {"id": model_id, "path": str(model_dir), "dtype": dtype}
    models = [model]
    if draft_dir is not None:
        draft_dir = draft_dir.resolve()
        draft_id = draft_dir.name if draft_dir.name != model_id else f"{model_id}-draft"
        model["speculation"] = f"draft:{draft_id}"
        models.append({"id": draft_id, "path": str(draft_dir), "preload": False})
    neuron = {"server": {"name": "local", "listen": "127.0.0.1:0", "token_file": str(token),
                         "address_file": str(run / "neuron.addr"), "devices": [device],
                         "drain_secs": DRAIN_SECS},
              "kv": {"default_output_tokens": UP_OUTPUT_TOKENS,
                     **({"kv_budget_mb": kv_budget_mb} if kv_budget_mb else {})},
              # no keys here: every caller is anonymous, so the anonymous cap would be the
              # whole batch's; they get the ordinary limits instead (max_in_flight, max_slots)
              "admission": {"anon_max_in_flight": ANON_IN_FLIGHT_NO_KEYS},
              "engine": {"speculation": speculation},
              "models": models}
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
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32,
    temperature=0)
print(reply.choices[0].message.content)
EOF
"""


def available_memory_mb() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_kv_budget_mb(model_dir: Path) -> int:
    """The CPU KV pool `up` uses by default (MiB): what CPU_KV_CONTEXTS full-context requests
    need, within a share of available host memory and the bounds above. Raises PlanError
    (a ConfigError) when the checkpoint's config.json cannot be read."""
    from helexa.checkpoint.gguf import read_config
    from helexa.checkpoint.memory import kv_bytes_per_token
    from helexa.checkpoint.shape import max_positions, read_model_shape

    raw = read_config(model_dir)
    per_token = kv_bytes_per_token(read_model_shape(raw), 1, "auto")
    tokens = min(max_positions(raw) or CPU_KV_CONTEXT_CAP, CPU_KV_CONTEXT_CAP)
    wanted = -(-CPU_KV_CONTEXTS * tokens * per_token // (1024 * 1024))
    avail = available_memory_mb()
    share = int(avail * CPU_KV_SHARE) if avail is not None else CPU_KV_MAX_MB
    return max(CPU_KV_MIN_MB, min(CPU_KV_MAX_MB, share, wanted))


def _default_device() -> str:
    try:
        import torch
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _speculation(value: str) -> str:
    """--speculation as the config reads it (helexa/config/speculation.py parse_drafter);
    a draft model is a folder here, so it has its own flag."""
    try:
        parse_drafter(value, "--speculation", per_model=False)
    except ValueError as e:
        hint = "; a draft model: --draft-model DIR" if value.startswith("draft:") else ""
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="helexa up", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder, or a .gguf file (default: the "
                                              "tiny model)")
    p.add_argument("--mmproj", type=Path, metavar="FILE",
                   help="llama.cpp's vision tower file for a .gguf model, so it takes images "
                        "(default: the mmproj*.gguf beside the model, if there is one)")
    p.add_argument("--model-id", help="id clients ask for (default: the folder's name)")
    p.add_argument("--port", type=int, default=8080, help="router port (0 = any free port)")
    p.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 if present)")
    p.add_argument("--kv-budget-mb", type=int, default=None,
                   help=f"KV pool size (default: {TINY_KV_MB} MiB for the tiny model; on CPU "
                        "room for "
                        f"{CPU_KV_CONTEXTS} full contexts within {CPU_KV_SHARE:g} of available "
                        f"memory and {CPU_KV_MIN_MB}..{CPU_KV_MAX_MB} MiB; on a GPU derived "
                        "from its memory)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weights' and activations' dtype (auto: the checkpoint's; a GGUF says "
                        "bf16: fp32 runs its quantised layers on helexa's native CPU kernels)")
    p.add_argument("--speculation", type=_speculation, default="off",
                   metavar="{ngram,mtp,off}",
                   help="speculative decoding drafter of the model (docs/speculation.md): mtp "
                        "drafts with the checkpoint's MTP head")
    p.add_argument("--draft-model", type=Path, metavar="DIR",
                   help="draft with the checkpoint folder DIR (a smaller model of the same "
                        "tokenizer; speculation = \"draft:<its id>\" in the neuron config)")
    p.add_argument("--run-dir", type=Path, help="where configs and logs go (default: a temp dir)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    draft = args.draft_model
    if draft is not None and not (draft / "config.json").exists():
        print(f"helexa up: --draft-model {draft}: no config.json there (expected the "
              "draft model's checkpoint folder)", file=sys.stderr)
        return 2
    if draft is not None and args.speculation != "off":
        print(f"helexa up: --draft-model drafts for the model; --speculation "
              f"{args.speculation} names another drafter", file=sys.stderr)
        return 2

    device = args.device or _default_device()
    if args.model is None:
        print("helexa up: preparing the tiny default model ...", flush=True)
        model_dir, kv = tiny_model_dir(), args.kv_budget_mb or TINY_KV_MB
    else:
        model_dir, kv = args.model.resolve(), args.kv_budget_mb
        problem = model_path_error(model_dir)
        if problem is not None:
            print(f"helexa up: {problem}", file=sys.stderr)
            return 2
        if kv is None and device == "cpu":
            try:
                kv = cpu_kv_budget_mb(model_dir)
            except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
                print(f"helexa up: {model_dir / 'config.json'}: unreadable model config ({e})",
                      file=sys.stderr)
                return 2
            print(f"helexa up: KV pool {kv} MiB of host memory (--kv-budget-mb to change)",
                  flush=True)
    if args.speculation == "mtp" and not has_mtp_head(model_dir):  # else refused after a load
        print(f"helexa up: --speculation mtp: {model_dir} has no MTP head (config.json "
              "mtp_num_hidden_layers; docs/speculation.md); use ngram or off", file=sys.stderr)
        return 2
    model_id = args.model_id or (TINY_MODEL_ID if args.model is None else model_dir.stem)
    own_run = args.run_dir is None
    run = Path(tempfile.mkdtemp(prefix="helexa-up-")) if own_run else args.run_dir  # 0700
    if not own_run:
        run.mkdir(mode=0o700, parents=True, exist_ok=True)  # the token lives here
    stopping = Stopping()  # set by the handler: no lock (daemons.Stopping says why)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        if args.model is not None:
            try:
                model_dir, mmproj = with_mmproj(model_dir, args.mmproj, run)
            except GgufError as e:
                print(f"helexa up: {e}", file=sys.stderr)
                return 2
            if mmproj is not None:
                print(f"helexa up: images: the vision tower of {mmproj}", flush=True)
        elif args.mmproj is not None:
            print("helexa up: --mmproj goes with --model FILE.gguf", file=sys.stderr)
            return 2
        return _serve(run, model_dir, model_id, device, kv, args, stopping)
    finally:
        if own_run:
            shutil.rmtree(run, ignore_errors=True)


def _serve(run: Path, model_dir: Path, model_id: str, device: str, kv: int | None,
           args: argparse.Namespace, stopping: Stopping) -> int:
    neuron_cfg, router_cfg = write_configs(run, model_dir, model_id, args.port, device, kv,
                                             args.speculation, args.draft_model,
                                             args.dtype)
    cli = [sys.executable, "-m", "helexa.cli"]
    children: list[Child] = []
    try:
        neuron = Child("neuron", [*cli, "neuron", "--config", str(neuron_cfg)],
                       run / "neuron.log", "NEURON LISTENING")
        children.append(neuron)
        if not wait_started(neuron, args.start_timeout, stopping):
            return 1
        # The neuron announces after its preload, ready or failed: ask which.
        failure = model_failure(neuron.address, (run / "neuron.token").read_text().strip(),
                                 model_id)
        if failure is not None:
            print(f"helexa up: the model {model_id} could not be loaded: {failure}",
                  file=sys.stderr)
            return 1
        # The router learns the neuron's bound address from its config, written now.
        _add_endpoint(router_cfg, neuron.address)
        router = Child("router", [*cli, "router", "--config", str(router_cfg)],
                       run / "router.log", "ROUTER LISTENING")
        children.append(router)
        if not wait_started(router, 60, stopping):
            return 1
        url = router.address
        if not wait_listed(router, model_id, 60, stopping):
            return 1
        print(f"HELEXA UP {url}/v1  model {model_id} (aliases: {', '.join(ALIASES)})", flush=True)
        where = f"{run}" if args.run_dir else f"{run}, removed on exit"
        print(f"run folder: {where}  (configs; logs neuron.log, router.log)")
        print(examples(url, ALIASES[0]), flush=True)
        if args.model is None:
            print(TINY_NOTE, flush=True)
        print("Ctrl-C stops both.", flush=True)
        while not stopping.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"helexa up: the {dead[0].name} exited ({dead[0].proc.returncode});"
                      f" log tail:\n{dead[0].log_tail()}", file=sys.stderr)
                return 1
        return 0
    finally:
        stop_all(children, DRAIN_SECS)





TINY_NOTE = ("This is the tiny random-weight model (its replies are noise; it tests the "
             "plumbing). To serve a real checkpoint: helexa up --model /path/to/checkpoint "
             "(a Hugging Face folder with config.json and *.safetensors, or a .gguf file).")


def _add_endpoint(router_cfg: Path, address: str) -> None:
    raw = tomllib.loads(router_cfg.read_text())
    raw["neurons"]["endpoints"] = [{"name": "local", "address": address}]
    router_cfg.write_text(tomli_w.dumps(raw))


