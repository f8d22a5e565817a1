"""The peak bytes of tensors alive at once during some torch code (CPU): every op's outputs
tracked by their storage until it is freed. What a memory estimate is checked against."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes(module) as live:``, ``live.peak`` is the most bytes the
    tensors made inside held at once; views of ``module``'s weights (a transpose, a
    reshape) hold no bytes of their own and are not counted."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.held = {t.untyped_storage().data_ptr()
                     for t in [*module.parameters(), *module.buffers()]} if module else set()

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.held:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
                    self.peak = max(self.peak, self.now)
        return out
