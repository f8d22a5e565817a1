"""The read-rate floor's verdicts on a client's taking, as its TCP shows it (PaceMeter).

The router sees what a client took in its kernel's acknowledgements, which move only when
the client's receive window reopens: on loopback in 66,560-byte steps for a reader of
3.4 KB/s (measured; a window of 30 s saw one such step, or none), so a steady reader shows
one step less than it read in many a window. And the floor is asked only while requests
wait for admission behind the stream's (stream_pressure.py)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from helexa.proto import neuron_pb2 as pb
from helexa.router.client_stream import Pace, PaceMeter
from helexa.router.stream_pressure import pressed

WINDOW, FLOOR = 30.0, 4096.0  # the defaults
LOOPBACK_STEP = 66_560  # bytes, the acknowledgement step measured on loopback


def _run(meter: PaceMeter, rate: float, step: int, secs: float = 600.0) -> str | None:
    """Look each second at a client that reads `rate` bytes a second, its taking showing
    in whole `step`s, with a megabyte always waiting: the first verdict, if any."""
    for t in range(int(secs) + 1):
        taken = int(rate * t) // step * step
        if (why := meter.look(float(t), taken, 1 << 20)) is not None:
            return why
    return None


def test_a_steady_reader_at_the_floor_is_not_cut_for_its_steps():
    # 4.2 KB/s is over the floor; most 30 s windows see one 66,560-byte step of it, under
    # the 122,880 bytes a window asks. Before, it was cut at the first such window.
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: True))
    assert _run(meter, 4200, LOOPBACK_STEP) is None


def test_a_trickle_is_cut_while_requests_wait():
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: True))
    why = _run(meter, 1500, 1448)  # a real network's step, 45 KB a window
    assert why is not None and "timeouts.client_min_bytes_per_sec" in why, why


def test_a_slow_reader_nobody_waits_behind_is_left_alone():
    # The same trickle, and the 3.2 KB/s of an SDK client doing 50 ms of work a chunk:
    # with no request waiting, neither is cut. Before, both were, at the first window.
    waiting = [False]
    for rate in (1500, 3200):
        meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: waiting[0]))
        assert _run(meter, rate, 1448) is None
    # and once a request waits, the floor applies at once to what the last window saw
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: waiting[0]))
    assert _run(meter, 1500, 1448, secs=60) is None
    waiting[0] = True
    assert meter.look(61.0, int(1500 * 61) // 1448 * 1448, 1 << 20) is not None


def test_a_client_that_reads_nothing_is_cut_with_no_one_waiting():
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: False))
    assert meter.look(0.0, 5000, 1 << 20) is None
    assert meter.look(29.0, 5000, 1 << 20) is None  # not a window yet
    why = meter.look(31.0, 5000, 1 << 20)
    assert why is not None and "read nothing" in why, why


def test_a_client_that_took_all_that_waited_is_not_cut():
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: True))
    assert meter.look(0.0, 0, 100) is None
    assert meter.look(40.0, 100, 0) is None  # it took the 100 bytes; nothing waits


def test_a_client_that_keeps_up_with_a_slow_model_is_not_cut_while_requests_wait():
    # 1 KB/s made, all of it taken at once: under the floor, but never behind
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: True))
    for t in range(121):
        assert meter.look(float(t), 1000 * t, 1000 if t % 3 else 0) is None


def test_requests_wait_when_queued_on_the_streams_neuron_or_held_by_the_router():
    def link(queued: int) -> NS:
        return NS(model_status=lambda m: pb.ModelStatus(model=m, queued=queued))
    registry: Any = NS(links={"a": link(0), "b": link(2)})
    held = {"tiny": 0}
    on_a, on_b = [NS(neuron="a")], [NS(neuron="b")]
    assert not pressed(registry, held.__getitem__, "tiny", on_a)
    assert pressed(registry, held.__getitem__, "tiny", on_b)  # queued where it runs
    on_a[0].neuron = "b"  # a stream moved (lost before its first token)
    assert pressed(registry, held.__getitem__, "tiny", on_a)
    held["tiny"] = 1  # the router holds one for the model (a load, a switch)
    assert pressed(registry, held.__getitem__, "tiny", [NS(neuron="gone")])
