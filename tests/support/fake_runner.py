"""A deterministic stand-in for ModelRunner, for tests and the serving path's benchmarks.

Token ids are stored in a paged "KV cache" and read back through the block
tables, so a wrong block table (any misplaced token) changes the output.
In-process: `EngineCore(spec, runner=FakeRunner(...))`. In a spawned engine
process: `EngineClient.start(spec, runner_factory=FakeRunnerFactory(...))`,
which the child unpickles by reference (it inherits this process's sys.path).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from helexa.neuron.engine.runner import Runner, StepOutput


def fake_next_token(context: list[int], vocab_size: int) -> int:
    """The fake model: one past the last token, nudged by a hash of the whole context,
    so that a wrong block table (any misplaced token) changes what comes next."""
    return (context[-1] + 1 + hash(tuple(context)) % 3) % vocab_size


def fake_continuation(prompt: list[int], n: int, vocab_size: int,
                      stop: int | None = None) -> list[int]:
    """The fake model's greedy reply to `prompt`: n tokens, or up to and including `stop`."""
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(fake_next_token(ctx, vocab_size))
        ctx.append(out[-1])
        if out[-1] == stop:
            break
    return out


class FakeRunner:
    """A ModelRunner stand-in (helexa/neuron/engine/runner.py's Runner): token ids stored
    in a paged "KV cache", read back through the block tables, and logits peaked at
    fake_next_token(context). It has no model: no hidden states, no MTP head, no
    linear-attention state."""

    num_state_slots = 0
    num_snapshot_slots = 0
    mtp_kv_layers = 0
    fixed_bytes_per_request = 0
    kv_bytes_per_block = 0
    attention_backend = ""
    has_mtp_head = False
    failed = ""

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int, *,
                 step_secs: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_secs = step_secs
        self.kv = [[-1] * block_size for _ in range(num_blocks)]
        self.kv_dtype = "auto"
        self.num_steps = 0

    def reset_kv(self, num_blocks: int, kv_dtype: str = "auto", context: int = 0,
                 num_state_slots: int = 0, max_num_seqs: int = 0,
                 max_batched_tokens: int = 0) -> None:
        self.num_blocks = num_blocks
        self.kv = [[-1] * self.block_size for _ in range(num_blocks)]
        self.kv_dtype = kv_dtype

    def run_step(self, seqs: list[Any], *, keep_hidden: bool = False,
                 tokens: torch.Tensor | None = None) -> StepOutput:
        """`execute`, with each sequence's first row laid out as ModelRunner lays a step
        out (decode rows first, then the rest); no hidden states. ``tokens`` replace the
        rows' placeholder tokens, as ModelRunner takes them (a lookahead step)."""
        if tokens is not None:
            if any(len(s.token_ids) != 1 for s in seqs) or len(tokens) != len(seqs):
                raise ValueError("device tokens are for pure decode steps")
            seqs = [replace(s, token_ids=[t]) for s, t in zip(seqs, tokens.tolist(), strict=True)]
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        rest = [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
        row_starts, at = [0] * len(seqs), 0
        for i in decode + rest:
            row_starts[i] = at
            at += len(seqs[i].token_ids)
        return StepOutput(self.execute(seqs), row_starts)

    def allocate_host(self, num_blocks: int, num_snapshots: int) -> None:
        """The host tier: host "blocks" of token ids (a hybrid's snapshots: none here)."""
        self.host = [[-2] * self.block_size for _ in range(num_blocks)]
        self.num_moves = 0

    def move_kv(self, moves: Any) -> None:
        """Out, then in, as ModelRunner's copies (a wrong pairing changes the output)."""
        for device, host in moves.blocks_out:
            self.host[host] = list(self.kv[device])
        for host, device in moves.blocks_in:
            self.kv[device] = list(self.host[host])
        self.num_moves += 1

    def execute_mtp(self, seqs: list[Any], hidden: Any, tokens: Any = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("the fake runner has no MTP head")

    def mtp_logits(self, hidden: Any, rows: int = 0) -> torch.Tensor:
        raise NotImplementedError("the fake runner has no MTP head")

    def save_held(self, saves: list[tuple[int, int, int]]) -> None:
        raise NotImplementedError("the fake runner has no linear-attention states")

    def close(self) -> None:
        return None

    def execute(self, seqs: list[Any]) -> Any:
        bs = self.block_size
        rows: list[int] = []
        for seq in seqs:
            end = seq.num_computed + len(seq.token_ids)
            if len(seq.block_table) * bs < end:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks for {end} tokens")
            table = seq.block_table
            for pos, token in enumerate(seq.token_ids, start=seq.num_computed):
                self.kv[table[pos // bs]][pos % bs] = token
            if seq.need_logits:  # one row per asked position: the last num_logits tokens,
                context = [self.kv[table[p // bs]][p % bs] for p in range(end)]
                # or every token's (all_logits: a prompt-logprobs chunk, seq_input.logits_count)
                n = len(seq.token_ids) if getattr(seq, "all_logits", False) \
                    else getattr(seq, "num_logits", 1)
                for cut in range(end - n + 1, end + 1):
                    rows.append(fake_next_token(context[:cut], self.vocab_size))
        if self.step_secs:
            time.sleep(self.step_secs)
        self.num_steps += 1
        # logits fall off with the (circular) distance from the chosen token
        ids = torch.arange(self.vocab_size)
        target = torch.tensor(rows, dtype=torch.long).unsqueeze(1)
        dist = (ids.unsqueeze(0) - target).remainder(self.vocab_size)
        dist = torch.minimum(dist, self.vocab_size - dist)
        return -dist.to(torch.float32)


def _is_a_runner(runner: FakeRunner) -> Runner:
    return runner  # tests/typecheck.py: mypy holds FakeRunner to the Runner protocol


@dataclass(frozen=True)
class FakeRunnerFactory:
    """Makes a FakeRunner for an EngineSpec inside the engine process."""

    vocab_size: int = 512
    step_secs: float = 0.0  # sleep per step, so that work is observably in flight

    def __call__(self, spec: Any) -> FakeRunner:
        return FakeRunner(self.vocab_size, spec.num_blocks, spec.block_size,
                          step_secs=self.step_secs)
