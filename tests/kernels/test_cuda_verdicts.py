"""A CUDA kernel's verdicts (helexa/kernels/cuda/__init__.py Verdicts): each kind probed
once whatever the threads asking, a failure sticking, and the status line per card."""

from __future__ import annotations

import threading
import time

import pytest
import structlog
import torch

from helexa.kernels.cuda import Verdicts

CARD0, CARD1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _group(key: tuple) -> dict:
    return {"group": key[1]}


def test_each_kind_is_probed_once_however_many_threads_ask() -> None:
    named: list[tuple] = []  # the log's fields are made only when something is logged
    verdicts = Verdicts("kernels.k", "kernel", "fallback", lambda key: named.append(key) or {})
    probes: list[int] = []

    def probe() -> str:
        probes.append(1)
        time.sleep(0.05)  # the others ask while this one probes
        return ""

    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(
        verdicts.decide((CARD0, 128), probe))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert probes == [1] and answers == [""] * 8 and named == [(CARD0, 128)]
    assert verdicts.decide((CARD0, 64), lambda: "off by 2") == "off by 2"
    assert len(probes) == 1 and len(verdicts) == 2
    assert verdicts.decide((CARD0, 128), probe) == "" and len(named) == 2  # asked: none made


@pytest.fixture
def every_level():
    """Loggers at every level, whatever an earlier test in this process configured (a
    setup_logging at warning drops an info line before capture_logs sees it)."""
    before = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
    yield
    structlog.configure(wrapper_class=before)


def test_a_failed_kind_stays_failed_and_each_event_is_logged(every_level) -> None:
    verdicts = Verdicts("kernels.k", "kernel", "fallback", _group)
    with structlog.testing.capture_logs() as logs:
        assert verdicts.record((CARD0, 128), "", outputs=64) == ""
        assert verdicts.record((CARD0, 128), "") == ""  # proved again: said once
        assert verdicts.record((CARD0, 128), "it raised") == "it raised"
        assert verdicts.record((CARD0, 128), "") == "it raised"  # not cleared
    assert [(e["event"], e.get("reason")) for e in logs] == [
        ("kernels.k_chosen", None), ("kernels.k_fallback", "it raised")]
    assert (logs[0]["group"], logs[0]["outputs"], logs[1]["group"]) == (128, 64, 128)


def test_the_status_line_names_each_cards_verdicts() -> None:
    verdicts = Verdicts("kernels.k", "routed", "copies", _group)
    assert verdicts.describe(CARD0, "") == ""  # nothing proved yet
    verdicts.record((CARD0, "int8"), "")
    verdicts.record((CARD0, "int4"), "off by 0.3")
    verdicts.record((CARD1, "int8"), "")
    assert verdicts.describe(CARD0, "") == "routed; copies (off by 0.3)"
    assert verdicts.describe(CARD1, "") == "routed"
    assert verdicts.describe(torch.device("cuda"), "") == "routed; copies (off by 0.3)"
    assert verdicts.describe(CARD0, "HELEXA_X=0") == "copies (HELEXA_X=0)"
