"""A dispatch mode that fails the first op which would make the host wait for a CUDA
device: a scalar read (.item, .tolist, a bool of a tensor) or an op whose output size
depends on the data (nonzero, unique, masked_select, indexing by a bool mask, whose
nonzero runs inside the index op, below what a dispatch mode sees). A CUDA graph cannot
capture either, so a path meant for capture runs under it in CPU tests."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten._unique2, aten.unique_dim,
                 aten.unique_consecutive, aten.masked_select, aten.item}


class NoHostSync(TorchDispatchMode):
    """Raises AssertionError("host sync: <op>") at the first op of HOST_SYNC_OPS, or at a
    ``Tensor.tolist`` (which reads a CPU tensor's memory without any op a dispatch mode
    sees; of a GPU tensor, it copies to the host and waits). (``Tensor.numpy`` of a GPU
    tensor raises on its own, so a CPU-only path may call it.)"""

    def __init__(self, tolist: bool = False) -> None:
        """``tolist``: let Tensor.tolist through (a test that counts them itself)."""
        super().__init__()
        self._reads = () if tolist else ("tolist",)

    def __enter__(self) -> NoHostSync:
        self._saved = {name: getattr(torch.Tensor, name) for name in self._reads}
        for name in self._reads:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if func.overloadpacket in HOST_SYNC_OPS:
            raise AssertionError(f"host sync: {func}")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if len(args) > 1 else ()) if i is not None):
            raise AssertionError(f"host sync: {func} by a bool mask")
        return func(*args, **(kwargs or {}))


def _refuse(name: str) -> Any:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"host sync: Tensor.{name}")
    return read


class CountReads(TorchDispatchMode):
    """Counts what would make the host wait for a CUDA device, in ``reads``: each op of
    HOST_SYNC_OPS (int(), .item(), a bool of a tensor ...) and each ``Tensor.tolist`` of a
    tensor not in ``host`` (copies the code made to the host without waiting, read after an
    event's wait, which the test counts itself). Nothing is counted while ``paused`` (a
    fake runner reading what a real one keeps on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.host: list[torch.Tensor] = []
        self.paused = False

    def __enter__(self) -> CountReads:
        real = self._tolist = torch.Tensor.tolist

        def tolist(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.paused and not any(t is h for h in self.host):
                self.reads.append(f"tolist {tuple(t.shape)}")
            return real(t, *args, **kwargs)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if not self.paused and func.overloadpacket in HOST_SYNC_OPS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))
