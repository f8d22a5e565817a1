"""Decode tok/s of a GPTQ 8-bit checkpoint (the grouped int8 op) on CPU, side by side in one
run: its native decode kernel as measured at load vs the plain-torch tiles forced, and the
float checkpoint it was quantised from.

    python bench/int8g_decode.py [--hidden 1024] [--layers 4] [--dtype float32]
                                 [--streams 8] [--new 32] [--repeats 5] [--threads N]

Builds a random llama (helexa.fixtures.tiny.init_tiny) of the given size and a GPTQ 8-bit copy of
it (AutoGPTQ's v1 layout, asymmetric, groups of --group), then decodes greedily with each
contender in turn, interleaved per repeat. ``HELEXA_CPU_INT8G`` is read at every product
(helexa/kernels/cpu/int8g.py), so one process serves both settings of the quantised model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(values: torch.Tensor) -> torch.Tensor:
    """0..255 [R, C] -> int32 [R, C / 4], value j of a word at bits 8j (AutoGPTQ's pack)."""
    v = values.to(torch.int64).view(values.shape[0], -1, 4)
    words = sum(v[..., j] << (8 * j) for j in range(4))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq8_copy(src: Path, dst: Path, group: int) -> Path:
    """``src``'s linears as GPTQ 8-bit: min/max per group, zero >= 1 (v1 stores it minus one)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        for name, w in load_file(str(f)).items():
            if not (name.endswith(".weight") and name.split(".")[-2] in QUANTISED):
                out[name] = w
                continue
            n, k = w.shape
            g = w.float().view(n, k // group, group)
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            s = ((hi - lo) / 255).clamp_min(1e-8).half()
            z = torch.round(-lo / s.float()).clamp(1, 255)
            q = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, 255).view(n, k)
            base = name[: -len("weight")]
            out[base + "qweight"] = _pack(q).t().contiguous()  # packed along K: [K/4, N]
            out[base + "qzeros"] = _pack((z - 1).t()).contiguous()  # [G, N/4]
            out[base + "scales"] = s.t().contiguous()
            out[base + "g_idx"] = (torch.arange(k) // group).to(torch.int32)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": group,
                                  "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def decode_tok_s(runner, streams: int, prompt_len: int, new: int, seed: int) -> float:
    """Greedy decode of ``streams`` random prompts together; decode tokens a second."""
    from helexa.neuron.engine.model_runner import SeqInput

    g = torch.Generator().manual_seed(seed)
    per = -(-(prompt_len + new) // 16)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(streams)]
    last = []
    for i in range(streams):
        p = torch.randint(10, runner.vocab_size - 10, (prompt_len,), generator=g).tolist()
        last.append(int(runner.execute([SeqInput(p, 0, tables[i], True)])[0].argmax()))
    t0 = time.perf_counter()
    for step in range(new):
        logits = runner.execute([SeqInput([x], prompt_len + step, t, True)
                                 for x, t in zip(last, tables, strict=True)])
        last = logits.argmax(-1).tolist()
    return streams * new / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from helexa.fixtures.tiny import init_tiny
    from helexa.neuron.engine.model_runner import ModelRunner

    tmp = Path(tempfile.mkdtemp(prefix="int8g-bench-"))
    src = init_tiny(tmp / "float", arch="llama", hidden_size=args.hidden, num_layers=args.layers,
                    num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                    intermediate_size=args.intermediate, vocab_size=2048)
    q8 = gptq8_copy(src, tmp / "gptq8", args.group)
    per = -(-(args.prompt + args.new) // 16)

    def runner(path: Path) -> ModelRunner:
        return ModelRunner(path, num_blocks=args.streams * per + 1, block_size=16,
                           max_num_seqs=max(8, args.streams), max_batched_tokens=512,
                           dtype=args.dtype)

    runs = {"float": (runner(src), "measure"), "gptq8 native (measured)": (runner(q8), "measure"),
            "gptq8 tiles": (None, "tile")}
    results: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats + 1):  # the first repeat warms up (and measures kernels)
        for name, (r, mode) in runs.items():
            os.environ["HELEXA_CPU_INT8G"] = mode
            run = r if r is not None else runs["gptq8 native (measured)"][0]
            for n in (1, args.streams):
                tok_s = decode_tok_s(run, n, args.prompt, args.new, rep)
                if rep:
                    results.setdefault((name, n), []).append(tok_s)
    os.environ.pop("HELEXA_CPU_INT8G")
    print(f"bench/int8g_decode.py  llama hidden={args.hidden} layers={args.layers} "
          f"group={args.group} dtype={args.dtype} threads={args.threads} "
          f"repeats={args.repeats} new={args.new}")
    for (name, n), v in results.items():
        print(f"  {name:<26} {n:>2} streams {statistics.median(v):9.1f} tok/s "
              f"[{' '.join(f'{x:.1f}' for x in v)}]")
    print("ratios, median of per-repeat ratios:")
    for n in (1, args.streams):
        nat = results["gptq8 native (measured)", n]
        for other in ("gptq8 tiles", "float"):
            per_rep = [a / b for a, b in zip(nat, results[other, n], strict=True)]
            print(f"  {n}-stream decode gptq8 native vs {other}: {statistics.median(per_rep):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
