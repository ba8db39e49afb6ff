"""Counting a step's synchronisations: its reads of tensor values by the host, and the copies to a device
that make the host wait for it — on a GPU each waits for every kernel queued before it.

On a CPU nothing is copied and ``.cpu()``/``.tolist()`` dispatch no operator, so the reads are counted
where the code asks for them: the ``Tensor`` methods that hand values to Python or to the host
(``item``, ``tolist``, ``numpy``, ``cpu``, ``to("cpu")``) and, below them, every dispatched operator
that makes the host wait for the device (:data:`SYNCHRONISING`): ``aten::_local_scalar_dense``
(``bool(t)``, ``float(t)``, ``int(t)``, ``if t.any():``, an f-string of a tensor), ``equal`` and
``allclose`` (a Python bool), and the operators whose output size depends on the values (``nonzero``,
boolean-mask indexing and assignment, ``masked_select``, ``unique``, ``bincount``, ``histc``,
``repeat_interleave`` without its output size). Copies to a device count too where they wait for it: a
host tensor moved without ``non_blocking=True`` (``.to(device)``, ``t.copy_(host)``) and
``torch.tensor(data, device=...)`` (not the secret noise's move to the CPU from the host, where it is drawn
for a CPU only). Each is recorded with the innermost tunefree source line that asked
for it.

Tensors on the host are read for free: those a counted ``.cpu()`` returned, those made by a factory
(``torch.tensor``, ``torch.arange``, ``torch.zeros``…) on the host (no device named, the default device
being the CPU, or ``device="cpu"``), the sampling draws of the run's randomness (``inclusion``: CPU by
contract), and whatever an operator computes from host tensors only. A host tensor moved with
``.to(device)`` is on the device from there on (on a CPU the move is a no-op: the counter hands out an
alias it treats as on the device). The count is still an upper bound — a tensor the code makes on the
host otherwise is read for free on a GPU too, and ``torch.tensor(data, device=p.device)`` is on the host
when ``p`` is — and copies the CPU cannot tell from no-ops are not counted: ``.to(p.device)`` of a device
tensor (``cpu`` here) and ``host.copy_(t)``. Counting starts when the block is entered: tensors made
before it are on the device unless a counted ``.cpu()`` made them (``reads.sites.clear()`` inside the
block counts the reads of a later part only).
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tunefree.privacy import chacha20, randomness

_SOURCE = str(Path(__import__("tunefree").__file__).parent)
aten = torch.ops.aten
# Operators that make the host wait for the device: a value handed to Python, or an output whose size
# depends on the values (boolean indices: see :func:`_synchronising`).
SYNCHRONISING = frozenset({
    aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
    aten.argwhere, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
    aten.bincount, aten.histc})
_BOOLEAN_INDEXED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
_METHODS = ("item", "tolist", "numpy", "cpu", "to")
# Factories that make a tensor on the default device (the host) unless a device is named.
_FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.from_numpy, torch.arange, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.logspace,
    torch.eye})
_UPLOADS = frozenset({torch.tensor, torch.as_tensor})  # with a device named: data copied to it


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

    def unmark(self, tensor: torch.Tensor) -> None:
        self._on_host.pop(id(tensor), None)

    def count(self, tensor: torch.Tensor | None) -> None:
        if self._depth == 0 and (tensor is None or not self.on_host(tensor)):
            self.sites[_site()] += 1

    def _method(self, name: str, original):
        reads = self

        def counted(tensor, *args, **kwargs):
            if name == "to" and not _to_the_host(args, kwargs):
                uploaded = reads.on_host(tensor) and _names_a_device(args, kwargs)
                if uploaded and not _non_blocking(args, kwargs):
                    reads.count(None)  # a copy to the device that waits for it
                reads._depth += 1
                try:
                    out = original(tensor, *args, **kwargs)
                finally:
                    reads._depth -= 1
                if out is tensor and uploaded:
                    alias = tensor.view_as(tensor)  # on a GPU a copy on the device: not on the host
                    reads.unmark(alias)
                    return alias
                return out
            reads.count(tensor)
            reads._depth += 1
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                reads._depth -= 1
            if name in ("cpu", "to"):
                reads.mark_on_host(out)
            return out
        return counted


class _Dispatched(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(self.reads.on_host(t) for t in inputs)
        if (_synchronising(func, args, kwargs) and not on_host) or \
                _blocking_upload(self.reads, func, args, kwargs):
            self.reads.count(None)
        out = func(*args, **kwargs)
        if on_host:
            self.reads.mark_on_host(out)
        return out


def _synchronising(func, args: tuple, kwargs: dict) -> bool:
    """Whether the operator makes the host wait for the device: one of :data:`SYNCHRONISING`, indexing
    or assignment with a boolean index, or ``repeat_interleave`` without its output size."""
    packet = func.overloadpacket
    if packet in SYNCHRONISING:
        return True
    if packet in _BOOLEAN_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None and not (len(args) > 3 and args[3] is not None)
    return False


class _Factories(TorchFunctionMode):
    """Marks the tensors that factories make without a device named (on the host)."""

    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if func in _FACTORIES and (_is_host(device) or device is None and
                                   torch.get_default_device().type == "cpu"):
            self.reads.mark_on_host(out)
        elif func in _UPLOADS and device is not None:
            self.reads.count(None)  # Python's data copied to the device, which the host waits for
        return out


def _blocking_upload(reads: HostReads, func, args: tuple, kwargs: dict) -> bool:
    """Whether the operator copies a host tensor into a device's without ``non_blocking``."""
    return func.overloadpacket is aten.copy_ and reads.on_host(args[1]) and not reads.on_host(args[0]) \
        and not kwargs.get("non_blocking", len(args) > 2 and args[2])


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False))


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether ``.to(*args, **kwargs)`` names a device (or a tensor whose device it takes)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device, torch.Tensor))


def _to_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``.to(*args, **kwargs)`` names the host as a string (``.to("cpu")``)."""
    return _is_host(kwargs.get("device", args[0] if args else None))


def _is_host(device: object) -> bool:
    """Whether ``device`` names the host as a string (``"cpu"``); a device object (``p.device``) cannot be
    told from a device's on a CPU."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _sampling_sources() -> list[type]:
    """The randomness classes that define ``inclusion`` (the sampling's draws, on the host)."""
    return [c for c in vars(randomness).values()
            if isinstance(c, type) and "inclusion" in vars(c) and c is not randomness.NoiseSource]


def _noise_on_the_device(reads: HostReads, normals_by):
    """The secret noise drawn on the host (``chacha20.OPENSSL``: the path for a CPU; a GPU draws on the
    device, ``KERNEL``/``TORCH_OPS``) and moved to the CPU, a no-op: not counted."""
    def drawn(self, path, *args, **kwargs):
        if path != chacha20.OPENSSL:
            return normals_by(self, path, *args, **kwargs)
        reads._depth += 1
        try:
            return normals_by(self, path, *args, **kwargs)
        finally:
            reads._depth -= 1
    return drawn


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
    normals_by = chacha20.ChaCha20Generator.normals_by
    chacha20.ChaCha20Generator.normals_by = _noise_on_the_device(reads, normals_by)
    try:
        with _Factories(reads), _Dispatched(reads):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for source, inclusion in sources.items():
            source.inclusion = inclusion
        chacha20.ChaCha20Generator.normals_by = normals_by
