"""One GGUF file served by helexa (`helexa up`) and by llama.cpp's server (llama-cpp-python's
``llama_cpp.server``, the optional ``bench`` extra), the same greedy requests interleaved:
decode tok/s at 1 and N concurrent streams and the ratios, on this machine.

    .venv/bin/pip install -e '.[bench]'       # builds llama.cpp from source (minutes)
    .venv/bin/python bench/gguf_vs_llamacpp.py FILE.gguf [--dtype auto] [--threads 2]
                                               [--llama-server BIN]

``bench/llamacpp_files.py DIR`` writes the files of the issue's comparison: bench/engine.py's
29M qwen3 quantised to Q4_K_M and Q6_K by llama.cpp's own quantiser, and its F32 file.

``--llama-server BIN`` serves with llama.cpp's own C++ server instead (``llama-server``,
built from llama.cpp's tree: ``cmake --build build --target llama-server``), given
``--streams`` parallel slots so N streams decode as one batch there too; llama-cpp-python's
server runs one request at a time, so its N-stream figure is N requests in turn. On a CPU
with AMX, build either with ``-DGGML_NATIVE=OFF`` and the AVX flags named (AVX2, AVX512,
VNNI): the native build's AMX buffers crashed at the first decode on this machine.

Each stream is one ``/v1/completions`` request of ``--new-tokens`` tokens (ignore-EOS is
not in llama.cpp's OpenAI API, so tok/s counts the tokens each server reports); a repeat
runs helexa then llama.cpp at each stream count, and each ratio is the median of the
repeats' own ratios. Both servers get the same thread count. Benchmarks print figures;
they assert nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT = "Once upon a time, in a land of rivers and old stone bridges, there lived"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def streams_tok_s(url: str, model: str, n: int, new_tokens: int, rep: int) -> float:
    """n concurrent greedy completions; completion tokens of all over the wall time."""
    def one(i: int) -> int:
        body = {"model": model, "prompt": f"{PROMPT} {rep}-{i}", "max_tokens": new_tokens,
                "temperature": 0.0}
        return int(post(f"{url}/v1/completions", body)["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return tokens / (time.perf_counter() - t0)


def start_helexa(path: Path, dtype: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "helexa.cli", "up", "--model", str(path),
                             "--device", "cpu", "--dtype", dtype, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"HELEXA UP (\S+)/v1", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"helexa up ended before serving: see {log}")


def start_llamacpp(path: Path, threads: int, log: Path, server: str | None,
                   slots: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if server:  # llama.cpp's C++ server: `slots` parallel sequences, 4096 tokens each
        cmd = [server, "--model", str(path), "--host", "127.0.0.1", "--port", str(port),
               "--ctx-size", str(4096 * slots), "--parallel", str(slots), "--threads",
               str(threads), "--threads-batch", str(threads), "--cont-batching"]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host",
               "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads",
               str(threads), "--n_threads_batch", str(threads)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, ready(proc, f"http://127.0.0.1:{port}", "/v1/models", log, "llama.cpp's server")


def ready(proc: subprocess.Popen, url: str, probe: str, log: Path, name: str) -> str:
    """``url`` once a GET of ``probe`` there answers; RuntimeError, naming ``log``, if the
    server exits first or is not up within 300 s."""
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}{probe}", timeout=2).read()
            return url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: see {log}") from None
            time.sleep(0.5)
    raise RuntimeError(f"{name} did not start")


def against(helexa_args: tuple[Path, str, int, Path],
            start_other: Callable[[], tuple[subprocess.Popen, str]],
            models: tuple[str, str], other: str, counts: tuple[int, ...], new_tokens: int,
            repeats: int) -> tuple[dict[tuple[str, int], list[float]], dict]:
    """helexa (start_helexa's arguments) and the other server started, ``compare``d on
    ``models`` (helexa's, the other's), both stopped however it ends."""
    helexa, hurl = start_helexa(*helexa_args)
    try:
        proc, url = start_other()
    except BaseException:  # helexa up must not outlive the run (it would load later ones)
        helexa.terminate()
        helexa.wait(timeout=60)
        raise
    try:
        return compare({"helexa": (hurl, models[0]), other: (url, models[1])}, counts,
                       new_tokens, repeats)
    finally:
        for p in (helexa, proc):
            p.terminate()
            p.wait(timeout=60)


def compare(servers: dict[str, tuple[str, str]], counts: tuple[int, ...], new_tokens: int,
            repeats: int) -> tuple[dict[tuple[str, int], list[float]], dict]:
    """tok/s of each server (name -> (url, model)) at each stream count, every repeat
    running each count on each server in turn (after one warm-up request each); and
    helexa's model as its status page shows it (the first server is helexa)."""
    got: dict[tuple[str, int], list[float]] = {(s, n): [] for s in servers for n in counts}
    for url, model in servers.values():  # warm-up
        streams_tok_s(url, model, 1, 8, -1)
    with urllib.request.urlopen(f"{next(iter(servers.values()))[0]}/status.json",
                                timeout=10) as resp:
        (status,) = json.load(resp)["neurons"][0]["models"]
    for rep in range(repeats):
        for n in counts:
            for name, (url, model) in servers.items():
                got[name, n].append(streams_tok_s(url, model, n, new_tokens, rep))
    return got, status


def report(got: dict[tuple[str, int], list[float]], status: dict, counts: tuple[int, ...],
           other: str) -> None:
    """Each stream count's medians and the median of the repeats' own ratios."""
    print(f"  helexa activations: {status.get('activations', '?')}")
    for n in counts:
        h, c = (statistics.median(got[s, n]) for s in ("helexa", other))
        per = [a / b for a, b in zip(got["helexa", n], got[other, n], strict=True)]
        print(f"  {n} stream(s): helexa {h:7.1f} tok/s  {other} {c:7.1f} tok/s  "
              f"ratio {statistics.median(per):.2f}x [{' '.join(f'{x:.2f}' for x in per)}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--dtype", default="auto",
                    help="helexa's activation dtype (helexa up --dtype; auto: as a user gets it, "
                         "measured at load on CPU: docs/quantization.md)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--llama-server", default=None,
                    help="llama.cpp's llama-server binary (default: llama_cpp.server)")
    args = ap.parse_args(argv)
    counts = (1, args.streams)
    got, status = against(
        (args.gguf, args.dtype, args.threads, args.log_dir / "bench-helexa.log"),
        lambda: start_llamacpp(args.gguf, args.threads, args.log_dir / "bench-llamacpp.log",
                               args.llama_server, args.streams),
        (args.gguf.stem, str(args.gguf)), "llama.cpp", counts, args.new_tokens, args.repeats)
    print(f"bench/gguf_vs_llamacpp.py {args.gguf.name}  helexa --dtype {args.dtype}  "
          f"threads={args.threads}  new={args.new_tokens}  repeats={args.repeats}  "
          f"llama.cpp: {args.llama_server or 'llama_cpp.server'}  load {os.getloadavg()[0]:.1f}")
    report(got, status, counts, "llama.cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
