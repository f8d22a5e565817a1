"""KV dtypes: what each one costs in quality and buys in context, side by side.

    .venv/bin/python bench/kv_dtypes.py [--model DIR] [--rows 4] [--positions 128]
                                        [--budget-mb 64] [--threads 1]

One ModelRunner is loaded once; for each kv_dtype its pool is re-planned
with `reset_kv` (the same path a profile switch takes) and a fixed text is
fed through it token by token (teacher forcing: every step is a decode step,
so every position attends over context read back from the cache in that
dtype). The next-token distribution at every position is compared with the
same run over a full-precision (fp32) cache:

- top-1 agreement: the share of positions whose argmax is the same;
- mean KL(full ‖ dtype) over positions, in nats;
- agree@1: top-1 agreement only where fp32's top two logits are ≥ 1 apart.
  init-tiny's random head leaves many near-ties (~10% of positions within
  0.1), which any small perturbation flips; this column shows whether a
  dtype also changes choices that were not close.

Bytes per token and pool tokens for a fixed budget come from helexa.plan
(what `helexa plan`, the ledger and the advertised limits use); the table
also checks them against the bytes the runner really allocated.

Without --model it builds (once, cached) an init-tiny qwen3 with hidden 128,
4 layers, 4 heads / 2 kv heads of 64 dims, vocab 512, fp32.
tests/kernels/test_kv_dtype_agreement.py imports `measure` from here.
Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

KV_DTYPES = ("fp16", "bf16", "fp8_e4m3", "int8", "int4")
REFERENCE = "fp32"
MARGIN = 1.0  # logit (nats) between fp32's top two: a position whose choice is not a near-tie
BLOCK_SIZE = 16
MODEL_ARGS = dict(arch="qwen3", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, intermediate_size=256, vocab_size=512, seed=0)


@dataclass(frozen=True)
class KvRow:
    kv_dtype: str
    bytes_per_token: int  # helexa.plan, per card
    runner_bytes_per_token: int  # what the runner's pool really takes
    pool_tokens: int  # for the fixed budget, helexa.plan's arithmetic
    positions: int
    top1_agreement: float  # vs the fp32 cache
    mean_kl: float  # KL(fp32 ‖ this), nats, mean over positions
    max_kl: float
    decided_agreement: float  # top-1 agreement where fp32's top two are ≥ MARGIN apart
    decided_share: float  # the share of positions that are
    secs: float


def default_model() -> Path:
    from helexa.fixtures.tiny import cache_dir, init_tiny

    out = cache_dir() / "bench" / "qwen3-h128-l4-d64-v512"
    if not (out / "model.safetensors").is_file():
        init_tiny(out, **MODEL_ARGS)
    return out


def fixed_text_tokens(model_dir: Path, rows: int, positions: int) -> list[list[int]]:
    """`rows` token sequences of `positions` tokens each, cut from the package's fixed text."""
    from helexa.neuron.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    data = resources.files("helexa") / "data"
    text = "\n".join((data / name).read_text() for name in ("prose.txt", "essays.txt",
                                                            "dialogue.txt", "code.txt"))
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < rows * positions:
        raise ValueError(f"the fixed text has {len(ids)} tokens, {rows} × {positions} wanted")
    return [ids[r * positions:(r + 1) * positions] for r in range(rows)]


def teacher_forced_logprobs(runner, rows: list[list[int]]) -> torch.Tensor:
    """Feed every row one token per step (one decode step for all rows together) through the
    runner's paged cache; log-softmax of the next-token logits: [rows, positions, vocab]."""
    from helexa.neuron.engine.model_runner import SeqInput

    positions = len(rows[0])
    per_row = -(-positions // runner.block_size)
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(len(rows))]
    out = []
    for p in range(positions):
        seqs = [SeqInput(token_ids=[row[p]], num_computed=p, block_table=tables[r],
                         need_logits=True) for r, row in enumerate(rows)]
        out.append(torch.log_softmax(runner.execute(seqs).float(), dim=-1))
    return torch.stack(out, dim=1)


def compare(ref: torch.Tensor, test: torch.Tensor) -> tuple[float, float, float, float, float]:
    """Over all positions of log-probs: (top-1 agreement, mean KL(ref ‖ test), max KL,
    top-1 agreement where ref's top two are ≥ MARGIN apart, the share of such positions)."""
    same = ref.argmax(-1) == test.argmax(-1)
    kl = (ref.exp() * (ref - test)).sum(-1)
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) >= MARGIN
    decided_agree = same[decided].float().mean().item() if decided.any() else float("nan")
    return (same.float().mean().item(), kl.mean().item(), kl.max().item(), decided_agree,
            decided.float().mean().item())


def plan_figures(model_dir: Path, kv_dtype: str, budget_mb: int) -> tuple[int, int]:
    """(bytes per token, pool tokens) for `budget_mb` of KV, as helexa plan computes them."""
    from helexa.config.schema import load_neuron_config
    from helexa.plan import plan_model

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "n.toml"
        path.write_text(f'[kv]\nkv_budget_mb = {budget_mb}\nblock_size = {BLOCK_SIZE}\n'
                        f'[[models]]\nid = "m"\npath = "{model_dir}"\n')
        cfg = load_neuron_config(path)
        p = plan_model(cfg, cfg.models[0], path, kv_dtype=kv_dtype)
    return p.bytes_per_token, p.pool_tokens


def measure(model_dir: Path, kv_dtypes: tuple[str, ...] = KV_DTYPES, *, rows: int = 4,
            positions: int = 128, budget_mb: int = 64) -> list[KvRow]:
    """The fp32 reference first, then each kv_dtype on the same weights (reset_kv)."""
    from helexa.neuron.engine.model_runner import ModelRunner

    tokens = fixed_text_tokens(model_dir, rows, positions)
    num_blocks = rows * -(-positions // BLOCK_SIZE)
    runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                         kv_dtype=REFERENCE, max_num_seqs=rows, max_batched_tokens=rows)
    ref = teacher_forced_logprobs(runner, tokens)
    out = []
    for kv in (REFERENCE, *kv_dtypes):
        t0 = time.perf_counter()
        runner.reset_kv(num_blocks, kv)
        got = teacher_forced_logprobs(runner, tokens)
        secs = time.perf_counter() - t0
        agree, kl, kl_max, decided, share = compare(ref, got)
        bpt, pool = plan_figures(model_dir, kv, budget_mb)
        out.append(KvRow(kv, bpt, runner.kv_bytes_per_block // BLOCK_SIZE, pool,
                         rows * positions, agree, kl, kl_max, decided, share, secs))
    return out


def format_table(rows: list[KvRow], budget_mb: int) -> str:
    head = (f"{'kv_dtype':<10}{'B/token':>9}{'(runner)':>10}{f'pool@{budget_mb}MiB':>14}"
            f"{'top-1 agree':>13}{'mean KL':>11}{'max KL':>10}{f'agree@{MARGIN:g}':>11}{'secs':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kv_dtype:<10}{r.bytes_per_token:>9,}{r.runner_bytes_per_token:>10,}"
                     f"{r.pool_tokens:>14,}{r.top1_agreement:>12.2%} {r.mean_kl:>11.2e}"
                     f"{r.max_kl:>10.2e}{r.decided_agreement:>10.2%} {r.secs:>7.2f}")
    lines.append(f"agree@{MARGIN:g}: top-1 agreement at the {rows[0].decided_share:.0%} of positions "
                 f"where fp32's top two logits are at least {MARGIN:g} apart (not near-ties)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: a cached init-tiny)")
    ap.add_argument("--rows", type=int, default=4, help="sequences fed side by side")
    ap.add_argument("--positions", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--budget-mb", type=int, default=64, help="KV budget for the pool column")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    rows = measure(model, rows=args.rows, positions=args.positions, budget_mb=args.budget_mb)
    print(f"model {model}; {args.rows} × {args.positions} positions, teacher forced; "
          f"reference: {REFERENCE} KV")
    print(format_table(rows, args.budget_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
