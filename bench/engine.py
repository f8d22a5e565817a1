"""Engine benchmark: helexa's decode and prefill against transformers and the
weight-streaming roofline, measured side by side in one run.

    .venv/bin/python bench/engine.py [--threads 1] [--repeats 5] [--model DIR]
                                     [--backend cpu,torch] [--quant int8|int4]
                                     [--gguf FILE]

Without --model it builds (once, cached) the issue's checkpoint: an init-tiny
qwen3 with hidden 512, 8 layers, 8 heads / 4 kv heads, intermediate 1536,
vocab 8192 (~30M parameters), fp32. Contenders run interleaved, each once per
repeat; medians are reported with the ratios the engine issue asks for. Each
ratio is the median over repeats of that repeat's own ratio: a repeat runs the
contenders back to back, so the slow drifts of a shared machine (everything 20%
faster or slower for a minute) cancel within a pair. The CPU roofline is a chain
of the model's own matrix-vector products, fused and laid out as helexa runs
them (q|k|v, gate|up; column-major on CPU), each an F.linear of one row. helexa figures come through EngineCore
(the engine's own step loop, greedy sampling, prefix cache off so repeats cannot
reuse a prompt);
``--driver runner`` drives the ModelRunner directly instead, to show what the
engine loop costs. ``--backend`` lists attention backends (helexa/kernels/backends/),
each run as its own helexa contender in the same interleaved repeats, so their
figures print side by side (default: auto, the one the engine would pick); a
``:sync`` or ``:lookahead`` suffix sets the engine's lookahead decode
(helexa/neuron/engine/lookahead.py: on by default on CUDA, where
``--backend cuda:sync,cuda:lookahead`` prints its gain; on the CPU nothing overlaps).

``--gguf FILE`` runs helexa on a GGUF file at fp32 activations (the native quantised
kernels, helexa/kernels/cpu/kquant.py) and at bf16 (torch's weight-only ops), and on the
float checkpoint ``--model`` when given, interleaved.

Agent-sized prompts (4k-32k tokens) have their own TTFT ratios: bench/long_prefill.py.

Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

TARGETS = [  # (label, numerator, denominator, op, bound)
    ("single-stream decode vs transformers generate", "helexa_1", "hf_1", ">=", 1.4),
    ("single-stream decode vs weight-streaming roofline", "helexa_1", "roofline", ">=", 0.8),
    ("8-stream aggregate vs own single stream", "helexa_8", "helexa_1", ">=", 4.0),
    ("8-stream aggregate vs transformers generate b8", "helexa_8", "hf_8", ">=", 1.4),
    ("TTFT of the long prompt vs transformers prefill", "helexa_ttft", "hf_ttft", "<=", 1.2),
]


def default_model() -> Path:
    from helexa.fixtures.tiny import bench_checkpoint

    return bench_checkpoint()


Secs = tuple[float, float]  # (wall, process CPU) — seconds or rates


class Clock:
    """Wall time and this process's CPU time together. On a shared machine the
    CPU-time figures are far less disturbed by neighbours (one torch thread)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        now_wall, now_cpu = time.perf_counter(), time.process_time()
        out = (now_wall - self.wall, now_cpu - self.cpu)
        self.wall, self.cpu = now_wall, now_cpu
        return out


def prompts(rep: int, n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + rep)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


# --- helexa ---------------------------------------------------------------------------


class HelexaEngine:
    """EngineCore in-process; greedy requests, timing the steps."""

    def __init__(self, model_dir: Path, threads: int, device: str, dtype: str,
                 backend: str = "auto", *, cuda_graphs: bool = True, streams: int = 8,
                 tokens: int = 4096, shuffle: bool = False, quantize: str = "none",
                 lookahead: bool | None = None) -> None:
        from helexa.neuron.engine import messages
        from helexa.neuron.engine.engine_core import EngineCore
        from helexa.neuron.engine.spec import EngineSpec

        self.messages = messages
        limits = messages.Limits(
            max_in_flight=16, anon_max_in_flight=16, max_slots=8, max_batched_tokens=1024,
            prefill_chunk_tokens=512)
        # as before for the default sizes (320 blocks, 4096-token context), more for longer ones
        blocks = max(320, streams * (-(-tokens // 16) + 1) + 8)
        spec = EngineSpec(model_id="bench", model_dir=str(model_dir), num_blocks=blocks,
                          block_size=16, context=max(4096, tokens), prefix_cache=False,
                          devices=[device],
                          dtype=dtype, torch_threads=threads, limits=limits,
                          attention_backend=backend, cuda_graphs=cuda_graphs, quantize=quantize)
        self.core = EngineCore(spec)
        if lookahead is not None:  # else the engine's default (engine/lookahead.py: CUDA on)
            self.core.lookahead = lookahead
        self.runner = self.core.runner
        self.vocab = self.core.runner.vocab_size
        self.n = 0

    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[Secs, Secs]:
        """(time to every stream's first token, time from then to the last token)."""
        m = self.messages
        greedy = m.SamplingParams(temperature=0.0)
        reqs = []
        for p in batch:
            self.n += 1
            reqs.append(m.NewRequest(req_id=f"b{self.n}", prompt_token_ids=p, sampling=greedy,
                                     max_tokens=new_tokens))
        pending = {r.req_id for r in reqs}
        got_first: set[str] = set()
        clock = Clock()
        out = self.core.step(m.ToEngine(new=reqs))
        t_first = None
        while True:
            for u in out.updates:
                if u.new_token_ids:
                    got_first.add(u.req_id)
                if u.finished is not None:
                    pending.discard(u.req_id)
                    if u.refused_code:
                        raise RuntimeError(f"refused: {u.refused_code} {u.refused_message}")
            if t_first is None and len(got_first) == len(reqs):
                t_first = clock.lap()
            if not pending:
                break
            out = self.core.step()
        return t_first, clock.lap()


class HelexaRunner:
    """ModelRunner driven directly with greedy argmax (no engine loop): prompts prefilled a
    chunk of up to 1024 tokens per step, then decoded together. ``shuffle`` draws each
    stream's blocks from a shuffled pool (no two consecutive), as a long-running pool is."""

    CHUNK = 1024

    def __init__(self, model_dir: Path, threads: int, device: str, dtype: str,
                 backend: str = "auto", *, cuda_graphs: bool = True, streams: int = 8,
                 tokens: int = 4096, shuffle: bool = False, quantize: str = "none",
                 lookahead: bool | None = None) -> None:
        import random

        from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

        self.SeqInput = SeqInput
        self.per = -(-tokens // 16) + 1  # blocks per stream
        num_blocks = streams * self.per + 1
        self.blocks = list(range(num_blocks))
        if shuffle:
            random.Random(0).shuffle(self.blocks)
        self.runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=16,
                                  max_num_seqs=max(8, streams), max_batched_tokens=self.CHUNK,
                                  device=device, dtype=dtype, backend=backend,
                                  cuda_graphs=cuda_graphs, quantize=quantize,
                                  num_state_slots=max(8, streams))
        self.vocab = self.runner.vocab_size

    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[Secs, Secs]:
        per = self.per
        tables = [self.blocks[i * per : (i + 1) * per] for i in range(len(batch))]
        clock = Clock()
        last = []
        for i, (p, t) in enumerate(zip(batch, tables, strict=True)):
            for c in range(0, len(p), self.CHUNK):
                chunk = p[c : c + self.CHUNK]
                logits = self.runner.execute(
                    [self.SeqInput(chunk, c, t, c + len(chunk) == len(p), i)])
            last.append(int(logits[0].argmax()))
        t_first = clock.lap()
        for k in range(new_tokens - 1):
            n = len(batch[0]) + k
            logits = self.runner.execute(
                [self.SeqInput([x], n, t, True, i)
                 for i, (x, t) in enumerate(zip(last, tables, strict=True))])
            last = logits.argmax(-1).tolist()
        return t_first, clock.lap()


# --- transformers and the roofline ---------------------------------------------------


def hf_generate(model, batch: list[list[int]], new_tokens: int) -> Secs:
    ids = torch.tensor(batch, device=model.device)
    clock = Clock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=0)
    _sync(ids.device)
    return clock.lap()


def hf_prefill(model, prompt: list[int]) -> Secs:
    ids = torch.tensor([prompt], device=model.device)
    clock = Clock()
    with torch.inference_mode():
        model(ids, use_cache=True).logits[:, -1].argmax(-1).tolist()
    return clock.lap()


def matvec_chain(weights: list[torch.Tensor], steps: int = 32) -> Secs:
    """Steps/s of the model's own matrix-vector products in model order: the speed a
    decode step would have if it did nothing but stream the weights once."""
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    with torch.inference_mode():
        clock = Clock()
        for _ in range(steps):
            for w in weights:
                F.linear(xs[w.shape[1]], w)
        _sync(weights[0].device)
        wall, cpu = clock.lap()
        return steps / wall, steps / cpu


def copy_roofline(weights: list[torch.Tensor], steps: int = 20) -> Secs:
    """Steps/s if a step only read the weights once at the device's copy bandwidth
    (a copy reads and writes each byte: read bandwidth = 2 × bytes / copy time)."""
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    src = torch.empty(weight_bytes // 4, dtype=torch.float32, device=weights[0].device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(src.device)
    clock = Clock()
    for _ in range(steps):
        dst.copy_(src)
    _sync(src.device)
    wall, cpu = clock.lap()
    read_bytes_per_sec = 2 * src.numel() * 4 * steps / wall
    return read_bytes_per_sec / weight_bytes, read_bytes_per_sec / weight_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_matrices(hf_model: torch.nn.Module, column_major: bool) -> list[torch.Tensor]:
    """Every weight matrix a helexa decode step multiplies by, in order, with helexa's
    fusions (q|k|v, gate|up), built from the reference model's plain tensors (helexa's own
    may be in a packed CPU layout); the embedding is a lookup, not a matmul. column_major:
    stored as helexa stores its CPU fp32 weights (transposed in memory), which one-row
    matmuls stream faster, so the roofline is the faster chain too."""
    mats = model_matrices_plain(hf_model)
    return [m.t().contiguous().t() for m in mats] if column_major else mats


def model_matrices_plain(hf_model: torch.nn.Module) -> list[torch.Tensor]:
    mats = []
    with torch.no_grad():
        for layer in hf_model.model.layers:
            at, mlp = getattr(layer, "self_attn", None), layer.mlp
            if at is None or not hasattr(mlp, "gate_proj"):
                # hybrid / MoE layers: every plain matrix in module order (experts' stacked
                # tensors are left out: only k of them run per token anyway)
                mats += [m.weight.detach().clone() for m in layer.modules()
                         if isinstance(m, torch.nn.Linear)]
                continue
            mats += [torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
                     at.o_proj.weight.clone(),
                     torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                     mlp.down_proj.weight.clone()]
        return mats + [hf_model.lm_head.weight.clone()]


# --- main ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: the issue's tiny qwen3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every contender")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ttft-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--driver", choices=["engine", "runner"], default="engine")
    ap.add_argument("--backend", default="auto",
                    help="attention backends to run side by side, comma-separated "
                         "(auto, torch, cpu, cuda; cuda:nographs without CUDA graphs; "
                         "a :sync or :lookahead suffix sets the engine's lookahead decode, "
                         "e.g. cuda:sync,cuda:lookahead)")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="leave transformers' generate and prefill out (big models, long "
                         "contexts: the roofline and helexa's own ratios remain)")
    ap.add_argument("--shuffle-pool", action="store_true",
                    help="--driver runner: draw each stream's blocks from a shuffled pool")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="weights (and KV) dtype for both sides")
    ap.add_argument("--roofline", choices=["chain", "copy"], default=None,
                    help="chain of mat-vecs (default on CPU) or weight bytes / copy bandwidth "
                         "(default on GPU)")
    ap.add_argument("--quant", choices=["int8", "int4"], default=None,
                    help="instead: the float checkpoint against itself quantised at load "
                         "(decode tok/s and weight bytes side by side; bench_quant below)")
    ap.add_argument("--quant-dtype", default="bfloat16",
                    help="activation dtype of the quantised contender (the CPU ops are "
                         "vectorised for bf16 only: docs/quantization.md)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="a GGUF file: helexa on it at fp32 and bf16 activations (and on the "
                         "float --model when given), decode tok/s side by side")
    ap.add_argument("--image", action="store_true",
                    help="the prefill of a request with one 1024 x 768 image against "
                         "transformers (bench/vision.py; --model, --threads, --repeats)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.image:
        import vision  # bench/vision.py, beside this script

        vision.main([*(["--model", str(args.model)] if args.model else []),
                     "--threads", str(args.threads), "--repeats", str(args.repeats)])
        return 0
    if args.gguf:
        return bench_gguf(args)
    model_dir = args.model or default_model()
    if args.quant:
        return bench_quant(args, model_dir)
    from transformers import AutoModelForCausalLM

    from helexa.neuron.models.config import parse_dtype

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(args.dtype))
    hf = hf.to(args.device).eval()
    driver = HelexaEngine if args.driver == "engine" else HelexaRunner
    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    tokens = max(args.prompt_tokens, args.ttft_tokens) + args.new_tokens
    engines = {b: driver(model_dir, args.threads, args.device, args.dtype, b.split(":")[0],
                         cuda_graphs=":nographs" not in b, streams=args.streams,
                         tokens=tokens, shuffle=args.shuffle_pool,
                         lookahead=True if ":lookahead" in b else False if ":sync" in b
                         else None)
               for b in names}
    first = engines[names[0]]
    model = (first.core.runner if args.driver == "engine" else first.runner).model
    helexa_weight = model.attention_layers[0].qkv_proj.weight
    column_major = helexa_weight.stride(0) == 1 and helexa_weight.shape[1] > 1
    mats = model_matrices(hf, column_major)
    roofline_kind = args.roofline or ("chain" if args.device == "cpu" else "copy")
    roofline = matvec_chain if roofline_kind == "chain" else copy_roofline
    params = sum(p.numel() for p in hf.parameters())
    new, plen, vocab = args.new_tokens, args.prompt_tokens, first.vocab

    # Warm up every path once (allocator, MKL, first-call overheads).
    for helexa in engines.values():
        helexa.run(prompts(-1, 1, plen, vocab), 8)
        helexa.run(prompts(-1, args.streams, plen, vocab), 8)
    if not args.skip_transformers:
        hf_generate(hf, prompts(-1, 1, plen, vocab), 4)
    roofline(mats, 4)

    def helexa_decode(helexa, n: int) -> Callable[[int], Secs]:
        def run(rep: int) -> Secs:
            _, (wall, cpu) = helexa.run(prompts(rep, n, plen, vocab), new)
            return n * (new - 1) / wall, n * (new - 1) / cpu
        return run

    def hf_decode(n: int) -> Callable[[int], Secs]:
        def run(rep: int) -> Secs:
            batch = prompts(rep, n, plen, vocab)
            first = hf_generate(hf, batch, 1)
            total = hf_generate(hf, batch, new)
            # a run too short to see past its own first token reports nan, not infinity
            return tuple(n * (new - 1) / (t - f) if t > f else float("nan")
                         for t, f in zip(total, first, strict=True))
        return run

    def ttft(helexa) -> Callable[[int], Secs]:
        return lambda rep: helexa.run(prompts(rep + 50, 1, args.ttft_tokens, vocab), 1)[0]

    contenders: dict[str, Callable[[int], Secs]] = {
        "hf_1": hf_decode(1),
        "roofline": lambda rep: roofline(mats),
        "hf_8": hf_decode(args.streams),
        "hf_ttft": lambda rep: hf_prefill(hf, prompts(rep + 50, 1, args.ttft_tokens, vocab)[0]),
    }
    labels = {
        "hf_1": ("transformers generate, batch 1", "tok/s"),
        "roofline": (f"{roofline_kind} roofline", "steps/s"),
        "hf_8": (f"transformers generate, batch {args.streams}", "tok/s"),
        "hf_ttft": (f"transformers prefill, {args.ttft_tokens} tokens", "s"),
    }
    for b, helexa in engines.items():
        runner = helexa.core.runner if args.driver == "engine" else helexa.runner
        print(f"backend {b}: {runner.backend.describe()}")
        contenders[f"helexa_1@{b}"] = helexa_decode(helexa, 1)
        contenders[f"helexa_8@{b}"] = helexa_decode(helexa, args.streams)
        contenders[f"helexa_ttft@{b}"] = ttft(helexa)
        labels[f"helexa_1@{b}"] = (f"helexa[{b}] decode, 1 stream", "tok/s")
        labels[f"helexa_8@{b}"] = (f"helexa[{b}] decode, {args.streams} streams", "tok/s")
        labels[f"helexa_ttft@{b}"] = (f"helexa[{b}] TTFT, {args.ttft_tokens}-token prompt", "s")
    if args.skip_transformers:
        for key in ("hf_1", "hf_8", "hf_ttft"):
            del contenders[key], labels[key]
    results: dict[str, list[Secs]] = {k: [] for k in contenders}
    for rep in range(args.repeats):
        for name, fn in contenders.items():
            results[name].append(fn(rep))

    print(f"bench/engine.py  model={model_dir}  params={params / 1e6:.1f}M  {args.dtype}  "
          f"device={args.device}  threads={args.threads}  repeats={args.repeats}  "
          f"driver={args.driver}  roofline={roofline_kind}")
    print(f"prompt={plen} new={new} streams={args.streams} ttft_prompt={args.ttft_tokens}")
    if roofline_kind == "chain":
        layout = "column-major" if column_major else "row-major"
        print(f"roofline: the model's {len(mats)} weight matrices as helexa multiplies them "
              f"(q|k|v and gate|up fused, lm_head; {layout} as helexa holds them), one "
              "F.linear of one row each, in model order")
    med = {}
    # CPU time says nothing about GPU work: wall clock only there.
    clocks = [(0, "wall clock"), (1, "process CPU time")][: 2 if args.device == "cpu" else 1]
    for which, title in clocks:
        med[which] = {k: statistics.median(r[which] for r in v) for k, v in results.items()}
        print(f"{title}: median [runs]")
        for key, (label, unit) in labels.items():
            runs = " ".join(f"{r[which]:.4g}" for r in results[key])
            print(f"  {label:<40} {med[which][key]:>10.4g} {unit:<8} [{runs}]")
    print("ratios, median of per-repeat ratios (" + " | ".join(
        t.split()[-2] if "CPU" in t else "wall" for _, t in clocks) + ") [wall, each repeat]:")
    targets = [(f"{label} [{b}]", num.replace("helexa_1", f"helexa_1@{b}")
                .replace("helexa_8", f"helexa_8@{b}").replace("helexa_ttft", f"helexa_ttft@{b}"),
                den.replace("helexa_1", f"helexa_1@{b}"), op, bound)
               for b in engines for label, num, den, op, bound in TARGETS]
    targets = [t for t in targets if t[1] in results and t[2] in results]
    for label, num, den, op, bound in targets:
        cells = []
        for which, _ in clocks:
            per_rep = [a[which] / b[which] for a, b in zip(results[num], results[den], strict=True)]
            r = statistics.median(per_rep)
            ok = r >= bound if op == ">=" else r <= bound
            cells.append(f"{r:5.2f}x {'ok' if ok else 'MISS':<4}")
            if which == 0:
                runs = " ".join(f"{x:.2f}" for x in per_rep)
        print(f"  {label:<60} {' | '.join(cells)} (target {op} {bound}) [{runs}]")
    return 0


QUANT_SHRINK = {"int8": 1.9, "int4": 3.5}  # the targets, weights vs the float checkpoint


def interleaved_decode(engines: dict, args: argparse.Namespace) -> dict[tuple[str, int], list[float]]:
    """Decode tok/s of each engine at 1 and --streams streams, per repeat, the contenders
    interleaved within each repeat (a shared machine's drift falls on all of them)."""
    vocab = next(iter(engines.values())).vocab
    plen, new = args.prompt_tokens, args.new_tokens
    for e in engines.values():  # warm-up
        e.run(prompts(-1, 1, plen, vocab), 8)
        e.run(prompts(-1, args.streams, plen, vocab), 8)
    streams = (1, args.streams)
    results: dict[tuple[str, int], list[float]] = {(k, n): [] for k in engines for n in streams}
    for rep in range(args.repeats):
        for k, e in engines.items():
            for n in streams:
                _, (wall, _cpu) = e.run(prompts(rep, n, plen, vocab), new)
                results[k, n].append(n * (new - 1) / wall)
    return results


def bench_quant(args: argparse.Namespace, model_dir: Path) -> int:
    """--quant: helexa on the float checkpoint (at --dtype, and at bf16 when that differs)
    against helexa quantising it at load (at --quant-dtype), interleaved in one run."""
    driver = HelexaEngine if args.driver == "engine" else HelexaRunner
    kinds = {f"float {args.dtype}": (args.dtype, "none")}
    if args.dtype != "bfloat16":
        kinds["float bfloat16"] = ("bfloat16", "none")
    kinds[f"{args.quant} {args.quant_dtype}"] = (args.quant_dtype, args.quant)
    engines = {k: driver(model_dir, args.threads, args.device, dt, args.backend,
                         streams=args.streams, quantize=q)
               for k, (dt, q) in kinds.items()}
    plen, new, streams = args.prompt_tokens, args.new_tokens, (1, args.streams)
    results = interleaved_decode(engines, args)
    print(f"bench/engine.py --quant {args.quant}  model={model_dir}  device={args.device}  "
          f"threads={args.threads}  repeats={args.repeats}  prompt={plen} new={new}")
    base = next(iter(engines))
    base_bytes = engines[base].runner.weight_bytes
    print(f"  {'contender':<22} {'weights':>12} {'vs float':>9} {'1-stream tok/s':>15} "
          f"{f'{args.streams}-stream tok/s':>15}  (median of wall-clock repeats)")
    for k, e in engines.items():
        wb = e.runner.weight_bytes
        t1, t8 = (statistics.median(results[k, n]) for n in streams)
        print(f"  {k:<22} {wb / 2**20:>9.1f} MiB {base_bytes / wb:>8.2f}x {t1:>15.1f} {t8:>15.1f}")
    q = f"{args.quant} {args.quant_dtype}"
    shrink = base_bytes / engines[q].runner.weight_bytes
    print("ratios, median of per-repeat ratios [each repeat]:")
    print(f"  weights shrink vs {base}: {shrink:.2f}x (target >= {QUANT_SHRINK[args.quant]})")
    for other in engines:
        if other == q:
            continue
        for n in streams:
            per = [a / b for a, b in zip(results[q, n], results[other, n], strict=True)]
            print(f"  {n}-stream decode {q} vs {other}: {statistics.median(per):.2f}x "
                  f"[{' '.join(f'{x:.2f}' for x in per)}]")
    return 0


def bench_gguf(args: argparse.Namespace) -> int:
    """--gguf: decode tok/s at 1 and --streams streams of the GGUF at fp32 (native
    kernels) and bf16 activations, and of the float --model if given, interleaved."""
    driver = HelexaEngine if args.driver == "engine" else HelexaRunner
    kinds = {"gguf float32": (args.gguf, "float32"), "gguf bfloat16": (args.gguf, "bfloat16")}
    if args.model:
        kinds["float checkpoint"] = (args.model, args.dtype)
    engines = {k: driver(path, args.threads, args.device, dt, args.backend, streams=args.streams)
               for k, (path, dt) in kinds.items()}
    plen, new, streams = args.prompt_tokens, args.new_tokens, (1, args.streams)
    results = interleaved_decode(engines, args)
    print(f"bench/engine.py --gguf {args.gguf}  device={args.device}  threads={args.threads}  "
          f"repeats={args.repeats}  prompt={plen} new={new}")
    print(f"  {'contender':<18} {'weights':>12} {'1-stream tok/s':>15} "
          f"{f'{args.streams}-stream tok/s':>15}  (median of wall-clock repeats)")
    for k, e in engines.items():
        t1, tn = (statistics.median(results[k, n]) for n in streams)
        print(f"  {k:<18} {e.runner.weight_bytes / 2**20:>8.1f} MiB {t1:>15.1f} {tn:>15.1f}")
    print("ratios, median of per-repeat ratios [each repeat]:")
    for other in list(engines)[1:]:
        for n in streams:
            per = [a / b for a, b in zip(results["gguf float32", n], results[other, n],
                                         strict=True)]
            print(f"  {n}-stream decode gguf float32 vs {other}: {statistics.median(per):.2f}x "
                  f"[{' '.join(f'{x:.2f}' for x in per)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
