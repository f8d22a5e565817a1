"""What tensor-parallel ranks are built from and the messages on their pipes.

Rank 0 (helexa/neuron/engine/tp_worker.py) sends each extra rank
(helexa/neuron/engine/tp_rank.py) one `ToRank` message per step (after its tower work's,
TpEncode, where it has any) or MTP pass
over a dedicated pipe, msgpack-encoded, never through the compute group; a
rank answers only while starting (with the kernel kinds its card refused, which
rank 0 then has every rank refuse: `TpAgree`), after the host tier's copies and after
measuring its pool (`FromRank`). A step carries only what changed: each sequence's new tokens
and the blocks appended to its table since rank 0 last sent it, under a
handle both sides know it by.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import msgspec

from helexa.neuron.engine.encoder_steps import EncodeSlice
from helexa.neuron.engine.host_tier import KvMoves
from helexa.neuron.engine.images import ImageSpan

DEFAULT_TIMEOUT_SECS = float(os.environ.get("HELEXA_TP_TIMEOUT_SECS", "20"))


class TpSeq(msgspec.Struct, array_like=True):
    handle: int  # rank 0's name for this sequence's block table
    token_ids: list[int]
    num_computed: int
    new_blocks: list[int]  # appended to the rank's copy of the table
    fresh: bool  # the table starts here (new_blocks is all of it)
    need_logits: bool
    state_slot: int = -1  # hybrid models' linear-attention state slot
    num_logits: int = 1  # speculative verification rows want k + 1
    restore_from: int = -1  # hybrid models' prefix snapshots (SeqInput's)
    save_to: int = -1
    rope_delta: int = 0  # vision-language prompts: as SeqInput (every rank runs the tower)
    images: list[ImageSpan] = []
    all_logits: bool = False  # SeqInput's: a prompt-logprobs chunk, logits at every row


class TpStep(msgspec.Struct, tag=True):
    seqs: list[TpSeq]
    dropped: list[int] = []  # handles rank 0 no longer tracks
    # a lookahead step (engine/lookahead.py): the seqs' tokens are placeholders, the real
    # ones follow as a broadcast over the group from rank 0's device
    device_tokens: bool = False
    # how rank 0's executor runs the step (executor.py decide: "" eagerly, "capture",
    # "replay"), as every rank then runs it: the graphs' collectives in step by construction
    graph: str = ""


class TpRefused(msgspec.Struct, array_like=True):
    # a kernel kind a rank's card refused at load (helexa/kernels/cuda Verdicts), free of
    # the device: refused on every rank (helexa/neuron/engine/tp_kernels.py)
    rank: int
    kernel: str  # the kernel's event (kernels.cuda_grouped_matmul, ...)
    kind: list[Any]  # the kind's key past its device (dtypes as "torch.<name>")
    why: str


class TpAgree(msgspec.Struct, tag=True):
    refused: list[TpRefused]  # every rank's, once the group formed: each rank refuses them


class TpEncode(msgspec.Struct, tag=True):
    slices: list[EncodeSlice]  # a step's tower work, before its TpStep (encoder_steps.py)


class TpMtp(msgspec.Struct, tag=True):
    seqs: list[TpSeq]  # the hidden states follow as a broadcast over the group
    device_tokens: bool = False  # as TpStep's: the tokens are broadcast before them


class TpMtpLogits(msgspec.Struct, tag=True):
    rows: int  # the head's outputs follow as a broadcast over the group


class TpResetKv(msgspec.Struct, tag=True):
    num_blocks: int
    kv_dtype: str
    num_state_slots: int = 0  # a hybrid's state slots carved anew (0: as they are)
    # rank 0's decode rows and step tokens (pool_probe.set_width: a wider profile, or the
    # width restored where it failed); 0: as they are
    max_num_seqs: int = 0
    max_batched_tokens: int = 0


class TpMeasure(msgspec.Struct, tag=True):
    # every rank measures its own card (pool_probe.measure_as_rank), running the same probe
    # steps as rank 0 in lockstep (their collectives); each answers TpMeasured, then rank 0
    # sends the pool the group takes (a TpResetKv of the least rank's blocks)
    num_blocks: int  # the plan's: the ceiling
    kv_dtype: str
    context: int  # one request of it must fit (memory_plan.fit_blocks; 0: unchecked)
    num_state_slots: int = 0  # a hybrid's state slots carved anew (0: as they are)
    max_num_seqs: int = 0  # the probe's decode rows and step tokens (as TpResetKv's)
    max_batched_tokens: int = 0


class TpAllocHost(msgspec.Struct, tag=True):
    num_blocks: int  # the prefix cache's host tier (host_tier.py): host twins to allocate
    num_snapshots: int


class TpMoveKv(msgspec.Struct, tag=True):
    moves: KvMoves  # copies between the pool and the host tier, before the next step
    # (each rank answers TpMoved: a rank whose copies failed says so instead of ending)


class TpSaveHeld(msgspec.Struct, tag=True):
    # after a step, once rank 0 judged its drafts: (state slot, snapshot slot, positions)
    # of verification rows whose accepted positions reach a block boundary (no answer)
    saves: list[tuple[int, int, int]]


class TpAskGraphs(msgspec.Struct, tag=True):
    pass  # can this rank's graphs run over its pool? (each answers TpGraphs, rank 0 captures)


class TpStop(msgspec.Struct, tag=True):
    pass


class TpJoin(msgspec.Struct, tag=True):
    pass


class TpLoaded(msgspec.Struct, tag=True):
    pass


class TpReady(msgspec.Struct, tag=True):
    kv_bytes_per_block: int
    refused: list[TpRefused] = []  # the kernel kinds its card refused at load


class TpFailed(msgspec.Struct, tag=True):
    error: str


class TpMoved(msgspec.Struct, tag=True):
    error: str = ""  # the rank's host-tier copies failed: why ("" when they were made)


class TpGraphs(msgspec.Struct, tag=True):
    refused: str = ""  # why this rank's graphs cannot run over its pool ("" when they can)


class TpMeasured(msgspec.Struct, tag=True):
    blocks: int = 0  # what fits this rank's card
    error: str = ""  # why it could not measure ("" when it did)
    # it failed inside the probe's steps: its collectives are out of step with the other
    # ranks' for good, so it leaves the group after answering (rank 0 fails the group)
    broken: bool = False


ToRank = (TpStep | TpEncode | TpMtp | TpMtpLogits | TpResetKv | TpMeasure | TpAllocHost | TpMoveKv
          | TpStop | TpJoin | TpAgree | TpAskGraphs | TpSaveHeld)
FromRank = TpLoaded | TpReady | TpFailed | TpMoved | TpMeasured | TpGraphs


@dataclass
class RunnerArgs:
    """What every rank's ModelRunner is built from (rank 0's own arguments)."""

    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_dtype: str
    max_num_seqs: int
    max_batched_tokens: int
    devices: list[str]
    timeout_secs: float = DEFAULT_TIMEOUT_SECS
    init_file: str = ""
    backend: str = "auto"  # attention backend (helexa/kernels/backends/__init__.py)
    cuda_graphs: bool = True
    quantize: str = "none"  # helexa/neuron/formats/quantise.py
    quant_group_size: int = 128
    num_state_slots: int = 0  # hybrid models: linear-attention state slots
    mtp_kv_layers: int | None = None  # pool layers of the MTP head (ModelRunner)
    num_snapshot_slots: int = 0  # hybrid models: prefix snapshot slots after the state slots
    measure_pool: bool = True  # CUDA: every rank measures its pool (TpMeasure), loading a
    # probe-sized one until then
    memory_meter: Any = None  # device_memory.MeterFactory (None: the device's own)
    spec_k: int = 0  # the most drafts a verification row checks (the probe's verification)


class TpError(RuntimeError):
    """A tensor-parallel rank died, failed or timed out: the model must be restarted."""
