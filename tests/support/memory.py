"""Counting the memory a step allocates on a CPU: a tracker of the storages operators return."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Allocations(TorchDispatchMode):
    """Bytes of the storages operators allocate while it is active: alive now, and at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def _collect(self) -> None:
        for key, (ref, nbytes) in list(self.alive.items()):
            if ref.expired():
                del self.alive[key]
                self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        self._collect()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in known and storage._cdata not in self.alive:
                    self.alive[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out
