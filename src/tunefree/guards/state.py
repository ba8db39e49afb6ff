"""The model changes only through the private step.

Between two private steps no parameter, buffer or module attribute of the model may change, except the
trainable parameters through the wrapped optimizer's update from the released gradient. Any other change
— a write during the forward or backward pass (an in-place renorm such as ``nn.Embedding(max_norm=...)``,
running statistics, a buffer filled from activations), a tensor or number a module keeps from one batch
for the next, a write between steps — can carry the examples of a batch into every later release and into
the published model, with no noise. :class:`StateGuard` refuses it before anything more is released.

What is compared: every parameter and buffer of every module, and every attribute that can hold data:
tensors and numbers, also inside lists, tuples and dicts (up to ``_CONTAINER_LIMIT`` items, ``_DEPTH_LIMIT``
levels deep; a longer or deeper one by its length). Flags (bools), strings and other objects are not
compared: libraries set them on models (``accelerate``'s ``_is_accelerate_prepared``, wrapped ``forward``
methods), and they rarely carry data.

A tensor is unchanged when it is the same object with the same version counter and memory. A write
through ``.data`` bumps no version counter, so where every write must be seen (before each release), and
after any in-place write or replacement, a tensor is unchanged only if its *fingerprint* is: its bytes
read as 64-bit words, their exact sum modulo 2⁶⁴ (any change of one word, or of a few, changes it) and the
words at ``POSITIONS`` positions drawn secretly from the OS's generator (a change of a sizeable fraction
of the tensor shows there with high probability). A value-equal rewrite (a buffer copied back, a
weight swap undone) is thus no change. Only a write that changes several words whose changes cancel
exactly in the sum, while avoiding the secret positions (e.g. swapping two rows), goes unseen.

When: the state is taken when the guard is built (``make_private``); it is checked quickly (identity,
version, memory) at the start of every forward pass the engine captures (grad enabled, train mode:
``no_grad`` and ``eval()`` forwards are not checked, whatever they write is caught at the next check),
fully (every fingerprint) before each release, quickly after the example-independence check (its own
forward passes) and before the wrapped optimizer's update (a step component's probes), and after the
update the trainable parameters' entries are renewed. Declared public writes renew the state:
``engine.public_writes()`` (a block of writes that depend on public values only, entered only from an
unchanged state) and ``engine.load_state_dict`` (the checkpoint's model). Buffers and attributes named in
``public_buffers`` are not compared (e.g. a cache a forward pass fills from shapes alone).

Integer buffers count too: InstanceNorm's ``num_batches_tracked`` counts training forward passes, whose
number follows the private batch size once batches are cut into physical micro-batches.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PrivacyError
from .base import Guard, ModelCall

POSITIONS = 4  # secret positions per tensor in its fingerprint
_CONTAINER_LIMIT = 64  # lists, tuples and dicts up to this size are compared item by item
_DEPTH_LIMIT = 3
_MODULE_MACHINERY = frozenset(vars(nn.Module()))  # hooks, flags and registries of nn.Module itself
_NUMBERS = (int, float, complex)


@dataclass(eq=False)
class _Tensor:
    """A tensor as last seen: the object (kept alive), its version counter, memory and layout, and its
    fingerprint: the sum of its 64-bit words and the words at its secret ``positions``. ``words`` views
    its memory as int64 (reused while the memory is the same; ``None`` when the words are a copy)."""

    tensor: torch.Tensor
    version: int
    address: int
    layout: tuple[Any, ...]
    positions: torch.Tensor
    words: torch.Tensor | None
    total: torch.Tensor
    picks: torch.Tensor

    def current(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``value``'s fingerprint at this entry's positions (``value`` has this entry's layout)."""
        words = self.words if self.words is not None and _address(value) == self.address else _words(value)
        return _fingerprint(words, self.positions)

    def adopt(self, value: torch.Tensor) -> None:
        """``value``, whose fingerprint is this entry's, is now the tensor seen here."""
        address = _address(value)
        if address != self.address:
            self.words = _view_or_none(_words(value), value)
        self.tensor, self.version, self.address = value, value._version, address

    def renew(self) -> None:
        """The tensor seen here holds new values (the optimizer's update)."""
        self.adopt(self.tensor)
        self.total, self.picks = self.current(self.tensor)


@dataclass(frozen=True, eq=False)
class _Value:
    """A number as last seen (compared by equality), or a container's type and length."""

    value: Any
    length: int | None = None


class StateGuard(Guard):
    """Refuses any change of the model's state between private steps other than the optimizer's update.

    Args:
        model: the module the engine hooks (inside a DDP wrapper, the wrapped module).
        trainable: the parameters the wrapped optimizer updates (and nothing else may change).
        public_buffers: names of buffers or attributes (``"module.path.name"``, as ``named_buffers``
            spells them) that are written from public information only; they are not compared.
    """

    def __init__(self, model: nn.Module, trainable: Iterable[nn.Parameter],
                 public_buffers: Iterable[str] = ()):
        self.model = model
        self.trainable = list(trainable)
        self.public = _checked_public_names(model, public_buffers)
        self._generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._seen: dict[str, tuple[str, _Tensor | _Value]] = {}
        self.snapshot()

    # -- the guard's points of the step
    def before_forward(self, call: ModelCall) -> None:
        """The quick check, at the start of each captured (training) forward pass."""
        self.check("at the start of a training forward pass", full=False)

    def before_release(self, step: int) -> None:
        self.check("before the release of a step")

    def before_update(self, step: int) -> None:
        """Quick: the step components may have run the model (HyFreeDP's probes)."""
        self.check("before the optimizer's update", full=False, released=True)

    def after_update(self, step: int) -> None:
        self.updated()

    def after_probes(self, when: str) -> None:
        """Quick, after a check's own forward passes (``when``: which check's)."""
        self.check(when, full=False)

    # -- the checks and the renewals
    def check(self, when: str, *, full: bool = True, released: bool = False) -> None:
        """Raise if anything changed since the state was taken; ``full`` compares every fingerprint (sees
        writes through ``.data``), else identities and versions first. ``released``: the step's release
        was already made (and recorded); its update is not applied."""
        changes = self._changes(full)
        if changes:
            raise PrivacyError(_refusal(changes, when, released))

    def updated(self) -> None:
        """After the wrapped optimizer's update: renew the entries of the trainable parameters (and of any
        tensor sharing their memory, e.g. a transposed view kept as an attribute)."""
        with torch.no_grad():
            for entry in self._updated_by_the_optimizer:
                entry.renew()

    def snapshot(self) -> None:
        """Take the model's current state as the state every later check compares with."""
        with torch.no_grad():
            self._seen = {path: (kind, self._entry(value)) for path, kind, value in self._state()}
        storages = {_storage(p) for p in self.trainable}
        self._updated_by_the_optimizer = [
            entry for _, entry in self._seen.values()
            if isinstance(entry, _Tensor) and _storage(entry.tensor) in storages]

    @contextmanager
    def public_writes(self) -> Iterator[None]:
        """Writes inside the block are declared public (computed from public values only); the block
        is entered only from an unchanged state, so that no earlier private write is declared with it."""
        self.check("on entering engine.public_writes()")
        try:
            yield
        finally:
            self.snapshot()

    # -- the state and its comparison
    def _state(self) -> Iterator[tuple[str, str, Any]]:
        """(path, kind, value) of every parameter, buffer and attribute leaf of the model's modules."""
        for prefix, module in self.model.named_modules():
            dot = f"{prefix}." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    yield dot + name, "parameter", p
            for name, b in module._buffers.items():
                if b is not None and dot + name not in self.public:
                    yield dot + name, "buffer", b
            for name, value in vars(module).items():
                if name not in _MODULE_MACHINERY and dot + name not in self.public:
                    yield from _leaves(dot + name, value, 0)

    def _entry(self, value: Any) -> _Tensor | _Value:
        if not isinstance(value, torch.Tensor):
            return value if isinstance(value, _Value) else _Value(value)
        words = _words(value)
        positions = torch.randint(max(words.numel(), 1), (POSITIONS,), generator=self._generator)
        positions = positions.to(words.device)
        return _Tensor(value, value._version, _address(value), _layout(value), positions,
                       _view_or_none(words, value), *_fingerprint(words, positions))

    def _changes(self, full: bool) -> list[str]:
        changes: list[str] = []
        pending: list[tuple[str, str, _Tensor, torch.Tensor]] = []
        present = set()
        for path, kind, value in self._state():
            present.add(path)
            before = self._seen.get(path)
            if before is None:
                changes.append(f"{kind} '{path}' appeared")
                continue
            entry = before[1]
            if isinstance(value, torch.Tensor) and isinstance(entry, _Tensor):
                if not full and entry.tensor is value and entry.version == value._version \
                        and entry.address == _address(value):
                    continue
                if entry.layout != _layout(value):
                    changes.append(f"{kind} '{path}' was replaced by a tensor of another shape or type")
                else:
                    pending.append((path, kind, entry, value))
            elif isinstance(value, torch.Tensor) or isinstance(entry, _Tensor) \
                    or not _same_value(entry, value):
                changes.append(f"{kind} '{path}' was set to another value")
        changes += [f"{kind} '{path}' was removed" for path, (kind, _) in self._seen.items()
                    if path not in present]
        if pending:
            with torch.no_grad():
                same = _unchanged([(entry, entry.current(value)) for _, _, entry, value in pending])
            for (path, kind, entry, value), ok in zip(pending, same):
                if ok:  # the same values (a value-equal rewrite is no change)
                    entry.adopt(value)
                else:
                    changes.append(f"{kind} '{path}' was written")
        return changes


def _leaves(path: str, value: Any, depth: int) -> Iterator[tuple[str, str, Any]]:
    """An attribute's leaves that can hold data: tensors, numbers, and the items of small containers (a
    longer or deeper container by its length). Flags, strings and other objects are not compared."""
    if isinstance(value, torch.Tensor) or (isinstance(value, _NUMBERS) and not isinstance(value, bool)):
        yield path, "attribute", value
    elif isinstance(value, (list, tuple, dict)):
        if len(value) > _CONTAINER_LIMIT or depth >= _DEPTH_LIMIT:
            yield path, "attribute", _Value(None, len(value))
            return
        yield path, "attribute", _Value(type(value), len(value))
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _leaves(f"{path}[{key!r}]", item, depth + 1)


def _same_value(entry: _Value, value: Any) -> bool:
    if isinstance(value, _Value):  # a container: its type and length
        return entry.value is value.value and entry.length == value.length
    old = entry.value
    return type(value) is type(old) and (value == old or (value != value and old != old))  # NaN stays NaN


def _checked_public_names(model: nn.Module, names: Iterable[str]) -> frozenset[str]:
    """``public_buffers`` must name buffers or attributes of existing modules, never a parameter or a
    module (a module's parameters change only through the optimizer)."""
    if isinstance(names, str):
        raise TypeError("public_buffers must be a list of names, e.g. ['rotary.cos_cached'], not a string")
    checked = set()
    for name in names:
        owner_path, _, attribute = str(name).rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            raise ValueError(f"public_buffers names {name!r}, but the model has no module "
                             f"{owner_path!r}; use the names of model.named_buffers()") from None
        if attribute in owner._parameters or attribute in owner._modules:
            kind = "a parameter" if attribute in owner._parameters else "a module"
            raise ValueError(f"public_buffers names {name!r}, which is {kind}: parameters change only "
                             "through the private optimizer; name buffers or attributes only")
        checked.add(str(name))
    return frozenset(checked)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The values this process holds: a sharded (FSDP2) DTensor's local shard, else the tensor itself. A
    model holds DTensors only once ``torch.distributed.tensor`` is imported, so the guard never imports it
    (it brings sympy: a second and ~50 MB to every ``import tunefree``)."""
    distributed = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if distributed is not None and isinstance(t, distributed.DTensor) else t


def _address(t: torch.Tensor) -> int:
    local = _local(t)
    return local.data_ptr() if local.layout == torch.strided else id(t)


def _storage(t: torch.Tensor) -> int:
    local = _local(t)
    return local.untyped_storage().data_ptr() if local.layout == torch.strided else id(t)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    local = _local(t)
    return tuple(local.shape), local.dtype, local.device, local.layout


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 64-bit words: a view of its memory when it is contiguous and whole words,
    else a zero-padded copy."""
    local = _local(t).detach()
    if local.layout != torch.strided:
        local = local.to_dense()
    raw = local.reshape(-1).view(torch.uint8)
    if raw.numel() % 8 == 0:
        try:
            return raw.view(torch.int64)
        except RuntimeError:  # memory not aligned to a word
            return raw.clone().view(torch.int64)
    return torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)]).view(torch.int64)


def _view_or_none(words: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s words if they view its memory (then they follow every write), else ``None``."""
    return words if words.untyped_storage().data_ptr() == _storage(t) else None


def _fingerprint(words: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sum of the words (modulo 2⁶⁴: any change of one word changes it) and the words at
    ``positions``. Summing int64 words is as fast as summing floats."""
    if words.numel() == 0:
        return words.new_zeros(()), words.new_zeros(len(positions))
    return words.sum(), words.take(positions)


def _unchanged(seen: list[tuple[_Tensor, tuple[torch.Tensor, torch.Tensor]]]) -> list[bool]:
    """For each (entry, fingerprint now): whether the fingerprint is the entry's, with one transfer per
    device."""
    result = [False] * len(seen)
    by_device: dict[torch.device, list[int]] = {}
    for i, (entry, _) in enumerate(seen):
        by_device.setdefault(entry.total.device, []).append(i)
    for indices in by_device.values():
        entries, now = [seen[i][0] for i in indices], [seen[i][1] for i in indices]
        totals = torch.stack([total for total, _ in now]), torch.stack([e.total for e in entries])
        picks = torch.stack([picks for _, picks in now]), torch.stack([e.picks for e in entries])
        if torch.equal(*totals) and torch.equal(*picks):  # the usual case, in one transfer
            same = [True] * len(indices)
        else:
            same = ((totals[0] == totals[1]) & (picks[0] == picks[1]).all(1)).tolist()
        for i, ok in zip(indices, same):
            result[i] = ok
    return result


def _refusal(changes: list[str], when: str, released: bool) -> str:
    listed = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    outcome = "the step, already released and recorded, is not applied" if released \
        else "nothing of this step is released"
    return (
        f"the model's state changed outside the private step (seen {when}): {listed}. Between two "
        "private steps only the optimizer's update from the released gradient may change the model: "
        "such a change can carry the examples of a batch (running statistics, an in-place renorm such as "
        "nn.Embedding(max_norm=...), a tensor or number a module keeps from one batch for the next) into "
        f"every later release and into the published model with no noise, so {outcome}. Remove the "
        "write (nn.Embedding without max_norm, norms with track_running_stats=False, no batch values kept "
        "on modules) and start the run again. A write that depends on public values only goes inside "
        "`with engine.public_writes():` between steps (e.g. a weight projection after step()); a buffer "
        "or attribute that forward passes fill from public information alone (e.g. a cache that depends "
        "only on the sequence length) is declared with make_private(..., public_buffers=[its name])"
    )
