"""A model on another card than cuda:0 (a tensor-parallel rank r on cuda:r, a tp = 1 model
on cuda:1): helexa's CUDA calls name the device they act on, never leaving it to the
calling thread's current device. Backend selection makes the model's device current too
(test_cuda_backend_choice.py), for the libraries that launch on it (FlashInfer's CuTe and
fused all-reduce, Triton); these checks hold helexa's own calls to their device, and run
without a GPU: torch.cuda stood in, or the source read."""

from __future__ import annotations

import ast
import contextlib
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import helexa
from helexa.kernels import host_kv
from helexa.kernels.backends import base
from helexa.kernels.backends.cuda_graphs import GraphRuntime
from helexa.neuron.engine import sampler as sampler_module

CUDA1 = torch.device("cuda:1")
CURRENT = torch.device("cuda:0")  # the calling thread's current device, in these stand-ins

# torch.cuda calls that act on one device: each is given it (or its index, or a stream)
NAMES_DEVICE = {"synchronize", "mem_get_info", "memory_allocated", "max_memory_allocated",
                "reset_peak_memory_stats", "memory_reserved", "get_device_properties",
                "get_device_capability", "get_device_name", "current_stream", "Stream"}
# calls with no device to give, each for its reason
NO_DEVICE = {
    "is_available": "asks whether there is any",
    "device_count": "counts the cards (process.missing_cuda: a named index past the last)",
    "set_device": "it makes the model's device current (backends.select, join_group)",
    "is_current_stream_capturing": "the step's thread asks: its current device is the "
                                   "model's (select), and a wrong answer fails the capture",
    "graph_pool_handle": "a pool id, no device",
    "empty_cache": "every device's cache",
    "CUDAGraph": "captured on the stream torch.cuda.graph is given (stream=, below)",
    "can_device_access_peer": "names both devices",
    "stream": "takes a Stream, which has its device",
    "graph": "checked below: its stream= is given",
    "Event": "checked below: base.CopiesDone records it on its device's stream",
}
EVENT_HOME = Path("kernels/backends/base.py")


def _sources() -> list[tuple[Path, ast.Module]]:
    root = Path(helexa.__file__).parent
    texts = {p: p.read_text() for p in sorted(root.rglob("*.py"))}
    return [(p.relative_to(root), ast.parse(text, str(p)))  # each rule is about "cuda"
            for p, text in texts.items() if "cuda" in text]


def _cuda_attr(node: ast.AST) -> str | None:
    """``X`` where node is ``torch.cuda.X``."""
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cuda" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "torch"):
        return node.attr
    return None


def _bare_cuda(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cuda"


def test_helexas_cuda_calls_name_their_device() -> None:
    """Every torch.cuda call in helexa/ that acts on one device is given it; any other call
    is one of NO_DEVICE's (a new one is reviewed here); no tensor or device is a bare
    "cuda" (the current device's)."""
    wrong: list[str] = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
                wrong.append(f"{where}: from {node.module} import ... (call torch.cuda.X)")
            if not isinstance(node, ast.Call):
                continue
            name = _cuda_attr(node.func)
            keywords = {k.arg for k in node.keywords}
            if name in NAMES_DEVICE and not node.args and not keywords & {"device", "stream"}:
                wrong.append(f"{where}: torch.cuda.{name}() without its device")
            elif name == "graph" and "stream" not in keywords:
                wrong.append(f"{where}: torch.cuda.graph without stream= (its own is made on "
                             "the current device)")
            elif name == "Event" and path != EVENT_HOME:
                wrong.append(f"{where}: torch.cuda.Event outside base.CopiesDone (a bare "
                             "record() waits on the current device's stream)")
            elif name is not None and name not in NAMES_DEVICE and name not in NO_DEVICE:
                wrong.append(f"{where}: torch.cuda.{name}: not reviewed for the device it "
                             "acts on (add it to NAMES_DEVICE or NO_DEVICE)")
            bare = any(k.arg == "device" and _bare_cuda(k.value) for k in node.keywords)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "cuda" and not node.args:
                bare = True  # tensor.cuda(): the current device
            if isinstance(func, ast.Attribute) and func.attr in ("to", "device") \
                    and node.args and _bare_cuda(node.args[0]):
                bare = True  # .to("cuda"), torch.device("cuda")
            if bare:
                wrong.append(f"{where}: a bare \"cuda\" device (the current one)")
    assert wrong == []


class _Event:
    """torch.cuda.Event's stand-in: which stream each record was on (None: the current
    device's, as torch's record() takes it)."""

    made: list[_Event] = []

    def __init__(self) -> None:
        self.on: list[Any] = []
        _Event.made.append(self)

    def record(self, stream: Any = None) -> None:
        self.on.append(stream if stream is not None else ("stream", CURRENT))

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def cuda_events(monkeypatch: pytest.MonkeyPatch) -> list[_Event]:
    _Event.made = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: (
        "stream", CURRENT if device is None else torch.device(device)))
    return _Event.made


def test_a_steps_copies_are_waited_for_on_the_stream_they_queued_on(
        cuda_events: list[_Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled tokens on cuda:1 (their copy back queued on cuda:1's stream) with cuda:0
    current: the event read_back waits on is recorded on cuda:1's stream, where an event on
    cuda:0's would pass before the copy lands (the host reading stale pinned tokens). So
    are a plan's copies (copies_done_event) and the host tier's copy-out."""
    monkeypatch.setattr(sampler_module, "to_host", lambda t: t)
    tokens = types.SimpleNamespace(device=CUDA1)
    _, _, ready = sampler_module.copy_back(tokens, None)  # type: ignore[arg-type]
    assert ready is not None and [e.on for e in cuda_events] == [[("stream", CUDA1)]]
    plan = base.copies_done_event(CUDA1)
    assert plan is not None
    plan.record()
    assert cuda_events[-1].on == [("stream", CUDA1)]
    assert host_kv.copied_event(CUDA1) is not None
    assert cuda_events[-1].on == [("stream", CUDA1)]
    assert base.copies_done_event(torch.device("cpu")) is None  # nothing queued off a GPU


def test_a_decode_graph_is_captured_on_a_stream_of_its_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph of a model on cuda:1, cuda:0 current: the capture runs on a stream of cuda:1.
    torch.cuda.graph's own capture stream is made on the current device the first time it
    is used; a capture on it records none of cuda:1's kernels (an empty graph, whose
    replays leave stale logits)."""

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.device = CURRENT if device is None else torch.device(device)

        def wait_stream(self, other: Stream) -> None:
            pass

    captured_on: list[torch.device] = []

    class Graph:  # torch.cuda.graph's stand-in
        def __init__(self, graph: Any, pool: Any = None, stream: Stream | None = None,
                     capture_error_mode: str = "global") -> None:
            captured_on.append((stream or Stream()).device)

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    runs: list[int] = []
    runtime = GraphRuntime()
    for _ in range(2):
        runtime.capture(CUDA1, lambda: runs.append(1), pool=object())
    assert captured_on == [CUDA1, CUDA1] and len(runs) == 4  # a warm run, then the capture
    assert list(runtime._warm) == [CUDA1]  # one side stream for both, as for the warm runs
