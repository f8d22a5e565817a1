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

WINDOW, FLOOR, IDLE = 30.0, 4096.0, 300.0  # the defaults
LOOPBACK_STEP = 66_560  # bytes, the acknowledgement step measured on loopback
SDK_STEP = 95_232  # the openai SDK's (httpx reads 64 KiB at a time), on loopback


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


def test_a_client_that_reads_nothing_is_cut_after_the_idle_bound_with_no_one_waiting():
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: False, idle_secs=IDLE))
    assert meter.look(0.0, 5000, 1 << 20) is None
    assert meter.look(31.0, 5000, 1 << 20) is None  # a window: not yet, nobody waits
    assert meter.look(299.0, 5000, 1 << 20) is None
    why = meter.look(301.0, 5000, 1 << 20)
    assert why is not None and "read nothing for 301 s" in why, why
    assert "timeouts.client_idle_secs" in why, why


def test_a_client_that_reads_nothing_is_cut_after_a_window_once_a_request_waits():
    waiting = [False]
    meter = PaceMeter(Pace(WINDOW, 0.0, pressed=lambda: waiting[0], idle_secs=IDLE))
    assert meter.look(0.0, 5000, 1 << 20) is None
    assert meter.look(29.0, 5000, 1 << 20) is None
    assert meter.look(40.0, 5000, 1 << 20) is None  # over a window, nobody waiting
    waiting[0] = True  # a request waits: taking nothing for a window is enough, at once
    why = meter.look(41.0, 5000, 1 << 20)
    assert why is not None and "timeouts.client_write_secs" in why, why


def test_a_steady_sdk_reader_whose_steps_are_over_a_window_apart_is_not_cut_unwaited():
    # The openai SDK on loopback: 95,232-byte steps 28-38 s apart at 3.4 KB/s. It was cut
    # at 31 s with nobody waiting when the window bounded taking nothing for everyone.
    for rate in (3400, 2500, 400):
        meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: False, idle_secs=IDLE))
        assert _run(meter, rate, SDK_STEP, secs=1200) is None, rate
    # slower than a step in the idle bound: its taking shows as nothing, and it is cut
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: False, idle_secs=IDLE))
    why = _run(meter, 250, SDK_STEP, secs=1200)
    assert why is not None and "read nothing" in why, why


def test_a_whole_replys_client_is_cut_after_a_window_of_nothing():
    # pressed=None (client_stream.send_whole): the router's memory holds it, so the window
    meter = PaceMeter(Pace(WINDOW, FLOOR, idle_secs=IDLE))
    assert meter.look(0.0, 5000, 1 << 20) is None
    why = meter.look(31.0, 5000, 1 << 20)
    assert why is not None and "timeouts.client_write_secs" in why, why


def test_taking_nothing_counts_only_while_something_waits():
    meter = PaceMeter(Pace(WINDOW, FLOOR, pressed=lambda: True, idle_secs=IDLE))
    assert meter.look(0.0, 5000, 1 << 20) is None
    assert meter.look(20.0, 5000, 0) is None  # it caught up: nothing waits
    assert meter.look(21.0, 5000, 100) is None  # a token, not taken yet
    assert meter.look(45.0, 5000, 100) is None  # 24 s of it: not a window
    why = meter.look(52.0, 5000, 100)
    assert why is not None and "read nothing for 31 s" in why, why


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
