"""Rank 0's part of the KV pool's measurement on every tensor-parallel rank (helexa/
neuron/engine/pool_probe.py): TpWorkers' TpMeasure round (every rank runs the probe's
steps of its own in lockstep and answers its fit), and what a rank lost in a probe step
said before it left the group."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import msgspec

from helexa.neuron.engine.tp_messages import TpError, TpMeasure, TpMeasured

if TYPE_CHECKING:
    from helexa.neuron.engine.tp_worker import TpWorkers


def measure(tp: TpWorkers, msg: TpMeasure, own: Callable[[], int]) -> list[int]:
    """The pool's measurement on every rank: sent to the others, which run the probe's
    steps of their own, while ``own`` runs the same steps here in lockstep (their
    collectives; rank 0's steps are not sent meanwhile); each rank's fitted blocks,
    rank 0's first. A rank whose fit failed after the steps (memory_plan.KvPlanError:
    the context does not fit) raises KvPlanError naming it, and the group goes on; one
    that failed inside the steps (out of memory, a lost rank) leaves the group out of
    step: TpError naming every rank's failure, the ranks ended."""
    from helexa.neuron.engine.memory_plan import KvPlanError

    tp.check()
    tp._send(msg)
    tp._lockstep, mine, failed = True, 0, ""
    try:
        mine = own()
    except KvPlanError as e:  # after every collective: the group is in step
        failed = f"rank 0: {e}"
    except TpError:
        raise
    except Exception as e:  # noqa: BLE001 - the group is out of step: ended below
        failed = f"rank 0: {type(e).__name__}: {e}"
        lost_in_step(tp, failed)
    finally:
        tp._lockstep = False
    doing = ("measure its KV pool", "measuring its KV pool")
    answers: list[TpMeasured] = tp._wait_all(TpMeasured, tp.timeout_secs, doing)
    errors = [failed] * bool(failed) + [f"rank {rank}: {a.error}" for rank, a in
                                         enumerate(answers, start=1) if a.error]
    if any(a.broken for a in answers):
        tp.fail("measuring the KV pool failed on tensor-parallel " + "; ".join(errors))
    if errors:
        raise KvPlanError("tensor-parallel " + "; ".join(errors))
    return [mine] + [a.blocks for a in answers]


def lost_in_step(tp: TpWorkers, failed: str) -> NoReturn:
    """Rank 0's probe failed inside its steps: the other ranks' answers already in (a
    rank that failed first answered before it left), then the group fails with them."""
    errors = [failed]
    for rank in range(1, len(tp.conns) + 1):
        try:
            answer = tp.answer(rank, 1.0)
            if isinstance(answer, TpMeasured) and answer.error:
                errors.append(f"rank {rank}: {answer.error}")
        except (EOFError, OSError):
            errors.append(f"rank {rank} exited while measuring its KV pool (exit code "
                          f"{tp.procs[rank - 1].exitcode})")
    tp.fail("measuring the KV pool failed on tensor-parallel " + "; ".join(errors))


def last_words(tp: TpWorkers, rank: int) -> str:
    """Why a dead rank left, where it said so before it went: a probe step of the
    pool's measurement that failed on it (TpMeasured, broken). On NCCL the other ranks
    only wait on its collectives, so its death, not its answer, is what they see first."""
    if rank > len(tp.conns):  # the ranks ended: nothing left to read
        return ""
    try:
        answer = tp.answer(rank, 0.0, keep=True)
    except (EOFError, OSError, msgspec.DecodeError):
        return ""
    return answer.error if isinstance(answer, TpMeasured) and answer.broken else ""
