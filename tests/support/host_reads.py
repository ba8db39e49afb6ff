"""Counting a step's reads of tensor values by the host: what would each be a device→host copy, and a
synchronisation, on a GPU.

On a CPU nothing is copied and ``.cpu()``/``.tolist()`` dispatch no operator, so the reads are counted
where the code asks for them: the ``Tensor`` methods that hand values to Python or to the host
(``item``, ``tolist``, ``numpy``, ``cpu``) and, below them, every dispatched
``aten::_local_scalar_dense`` (``bool(t)``, ``float(t)``, ``if t.any():``) and operator whose output size
depends on the values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``), which a GPU
must wait for. A tensor returned by a counted ``.cpu()`` is on the host: reading it again is free. Each
read is recorded with the innermost tunefree source line that asked for it.

Tensors known to be on the host are not counted: those a counted ``.cpu()`` returned, the sampling draws
of the run's randomness (``inclusion``: CPU by contract), and whatever an operator computes from host
tensors only. The count is still an upper bound — a tensor the code makes on the host otherwise (a
CPU-side count) is read for free on a GPU too — and ``.to(device)`` copies are not counted (on a CPU the
device cannot be told from the host).
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tunefree.privacy import randomness

_SOURCE = str(Path(__import__("tunefree").__file__).parent)
_VALUE_SIZED = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
                torch.ops.aten._unique2, torch.ops.aten.unique_dim, torch.ops.aten.unique_consecutive}
_METHODS = ("item", "tolist", "numpy", "cpu")


def _site() -> str:
    """The innermost tunefree line on the stack (or the caller's, outside tunefree)."""
    frames = [f for f in traceback.extract_stack()[:-3] if f.filename.startswith(_SOURCE)]
    if not frames:
        return "outside tunefree"
    frame = frames[-1]
    return f"{Path(frame.filename).relative_to(_SOURCE)}:{frame.lineno}"


class HostReads:
    """The reads of one run: ``sites`` (source line → count) and ``total``."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self._on_host: dict[int, weakref.ref] = {}
        self._depth = 0  # inside a counted method: the operators it dispatches are that one read

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._on_host.get(id(tensor))
        return ref is not None and ref() is tensor

    def mark_on_host(self, out: object) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._on_host[id(t)] = weakref.ref(t)

    def count(self, tensor: torch.Tensor | None) -> None:
        if self._depth == 0 and (tensor is None or not self.on_host(tensor)):
            self.sites[_site()] += 1

    def _method(self, name: str, original):
        reads = self

        def counted(tensor, *args, **kwargs):
            reads.count(tensor)
            reads._depth += 1
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                reads._depth -= 1
            if name == "cpu":
                reads.mark_on_host(out)
            return out
        return counted


class _Dispatched(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        value_sized = func.overloadpacket in _VALUE_SIZED or (
            func.overloadpacket is torch.ops.aten.index
            and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if value_sized:
            self.reads.count(args[0] if args and isinstance(args[0], torch.Tensor) else None)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if inputs and all(self.reads.on_host(t) for t in inputs):
            self.reads.mark_on_host(out)
        return out


def _sampling_sources() -> list[type]:
    """The randomness classes that define ``inclusion`` (the sampling's draws, on the host)."""
    return [c for c in vars(randomness).values()
            if isinstance(c, type) and "inclusion" in vars(c) and c is not randomness.NoiseSource]


def _marked(reads: HostReads, inclusion):
    def on_host(self, *args, **kwargs):
        flags = inclusion(self, *args, **kwargs)
        reads.mark_on_host(flags)
        return flags
    return on_host


@contextmanager
def counted_host_reads():
    """``with counted_host_reads() as reads:`` counts the host reads of the code inside."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}
    sources = {c: vars(c)["inclusion"] for c in _sampling_sources()}
    for name, original in originals.items():
        setattr(torch.Tensor, name, reads._method(name, original))
    for source, inclusion in sources.items():
        source.inclusion = _marked(reads, inclusion)
    try:
        with _Dispatched(reads):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for source, inclusion in sources.items():
            source.inclusion = inclusion
