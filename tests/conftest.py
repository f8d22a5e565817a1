"""Shared fixtures: tiny checkpoints made once per test session.

`tiny_model_dir` is the default qwen3 tiny checkpoint (hidden 64, 2 layers,
vocab 512). `tiny_checkpoint(arch, **kw)` makes any other (the keywords of
`helexa.fixtures.tiny.init_tiny`), once per distinct set of arguments.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
import torch
from support.cpu_matmul_once import measure_once_per_shape

from helexa.fixtures.tiny import init_tiny
from helexa.neuron.engine import start_method

# Triton's interpreter runs helexa's Triton kernels on CPU tensors (tests/kernels/
# test_int8g_triton.py, test_conv_decode_triton.py); it must be chosen before Triton is
# first imported, which is here. Not on a CUDA host: there every Triton kernel (fla's, and
# the probes of helexa's) would run interpreted too; those tests then skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from support.triton_interp import faster_device_calls

    faster_device_calls()  # its repeated work skipped, nothing it computes changed
measure_once_per_shape()  # tests/support/cpu_matmul_once.py says why
# Under xdist (`make test`: -n 2 on a 2-core machine) each worker has its share of the cores,
# not all of them: torch's default of a thread per core gave each worker, and each process a
# test starts (which inherit OMP_NUM_THREADS), OpenMP threads that spin waiting for a core
# the other worker holds (the GPU check's dry-run parity stage: 160 s at torch's default,
# 66 s at one thread, side by side on the loaded box). A test wanting more threads sets them.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The engine processes and tensor-parallel ranks the tests start themselves fork from a
# server that imported torch once (helexa/neuron/engine/start_method.py): a rank starts in
# under a second, not the seconds a spawned interpreter takes. Daemons the tests run start
# theirs as a user's would (spawn), and `HELEXA_ENGINE_START=spawn make test` runs all of
# them so; tests/neuron/engine/test_start_method.py checks both.
start_method.set_default("forkserver")


def _print_logger(*args: object) -> structlog.PrintLogger:
    """structlog's default logger, printing to the current stdout (which a test's capsys
    reads), but only for the main thread: a session's in-process router
    (tests/router/conftest.py) logs from its own thread a neuron's health whenever it
    changes, into whichever test's captured stdout was current then (a CLI's printed
    paths, read with capsys, once got a `neuron.up` line among them). Other threads print
    to the process's standard error."""
    main = threading.current_thread() is threading.main_thread()
    return structlog.PrintLogger(sys.stdout if main else sys.__stderr__)


# Tracebacks plain, as the daemons' JSON lines have them (helexa/log.py): structlog's default
# renders them with rich and every frame's locals, which the in-process router
# (tests/router/conftest.py) did on its event loop: 0.2-0.7 s a traceback on this 2-core
# host, 3.2 s under load, long enough for its Watch readers to give up on both fakes and
# for a client's 5 s read timeout to pass.
structlog.configure(logger_factory=_print_logger, processors=[
    *structlog.get_config()["processors"][:-1],
    structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)])


@pytest.fixture(autouse=True)
def _structlog_as_it_was():
    """structlog's configuration back as it was after each test: one that configures it in
    process (`helexa generate`'s main sets warning) left later tests' info lines unlogged,
    so what they read with capture_logs depended on which tests their worker ran first."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


# Folders whose files share session daemons (their conftest.py starts them): under `make
# test`'s `-n 2 --dist loadfile` their files run on one worker, in order, as one unit, so
# the daemons start once, not once on each worker (tests/integration/router's three
# neurons and their checkpoints took 13 s of each worker's time, ~35 s when it was busy).
SHARED_DAEMONS = ("tests/integration/neuron/", "tests/integration/ops/",
                  "tests/integration/router/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedDaemonsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((d for d in SHARED_DAEMONS if path.startswith(d)), path)

    return SharedDaemonsTogether(config, log)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[str, Path] = {}

    def make(arch: str = "qwen3", **kw) -> Path:
        key = json.dumps({"arch": arch, **kw}, sort_keys=True, default=str)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = init_tiny(out, arch=arch, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path to a headless-capable chromium (Debian's package, installed here when we are root);
    skips, saying why, where there is none."""
    from browser_cdp import find_chromium  # tests/ is on sys.path (rootdir conftest)

    path, why = find_chromium()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture
def one_torch_thread():
    """torch at one thread for the test (tests comparing numbers or stepping engines on a
    machine whose other cores are busy); mark a module with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
