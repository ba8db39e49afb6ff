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
through ``.data`` bumps no version counter, so where every write must be seen, and after any in-place
write or replacement, a tensor is unchanged only if its *fingerprint* is: its bytes read as 64-bit words,
their exact sum modulo 2⁶⁴ (any change of one word, or of a few, changes it) and the words at
``POSITIONS`` positions drawn secretly from the OS's generator (a change of a sizeable fraction of the
tensor shows there with high probability). A value-equal rewrite (a buffer copied back, a weight swap
undone) is thus no change. Only a write that changes several words whose changes cancel exactly in the
sum, while avoiding the secret positions (e.g. swapping two rows), goes unseen. The fingerprints of a
device's tensors are taken together (:class:`_Fingerprints`): the small tensors copied into a few packs,
each pack's running sum read at the tensors' ends, the large ones summed where they are (one reduction
each: packing them would copy them), every secret word of theirs gathered at once — a few operators, one
more per large tensor, compared on the device.

When: the state is taken when the guard is built (``make_private``). Every comparison of values runs on the
device, and its result travels to the host with the engine's one transfer at the end of each backward pass
(the per-sample norms' finite check, ``persample/engine.py``): a private step reads the host once.

- at the start of every forward pass the engine captures (grad enabled, train mode: ``no_grad`` and
  ``eval()`` forwards are not checked, whatever they write is caught at the next check): quickly (identity,
  version, memory, numbers); a tensor written in place is compared by value, read with the transfer;
- at the end of each backward pass: fully (every fingerprint: writes through ``.data`` too), read with the
  transfer; a change found there is refused at once, before anything of the step is released;
- before each release: quickly; fully, with a read of its own, when no transfer carried a full check since
  the last release (a step without a backward pass);
- after the example-independence check (its own forward passes) and before the wrapped optimizer's update
  (a step component's probes): quickly, with a read only where a tensor was written in place;
- before the update, the trainable parameters are also fingerprinted (a write through ``.data`` between the
  last backward pass and the update), read with the next step's transfer and refused there, before that
  step releases anything; after the update their fingerprints are renewed.

Declared public writes renew the state: ``engine.public_writes()`` (a block of writes that depend on public
values only, entered only from an unchanged state) and ``engine.load_state_dict`` (the checkpoint's model).
Buffers and attributes named in ``public_buffers`` are not compared (e.g. a cache a forward pass fills from
shapes alone).

Integer buffers count too: InstanceNorm's ``num_batches_tracked`` counts training forward passes, whose
number follows the private batch size once batches are cut into physical micro-batches.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PrivacyError
from .base import Guard, ModelCall

POSITIONS = 4  # secret positions per tensor in its fingerprint
_PACKED = 1 << 10  # a tensor of at most this many 64-bit words (8 KB: biases, norms) goes into a pack
_PACK = 1 << 16  # the most words in one pack (its copy and running sums: 1 MB at most)
_CONTAINER_LIMIT = 64  # lists, tuples and dicts up to this size are compared item by item
_DEPTH_LIMIT = 3
_MODULE_MACHINERY = frozenset(vars(nn.Module()))  # hooks, flags and registries of nn.Module itself
_NUMBERS = (int, float, complex)
_FORWARD = "at the start of a training forward pass"
_BACKWARD = "at the end of a backward pass"


@dataclass(eq=False)
class _Tensor:
    """A tensor as last seen: the object (kept alive), its version counter, memory and layout; where it is
    (``path``, ``kind``), its size in 64-bit words and the secret ``positions`` of its fingerprint's words."""

    path: str
    kind: str
    tensor: torch.Tensor
    version: int
    address: int
    layout: tuple[Any, ...]
    words: int
    positions: list[int]

    def same(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is this tensor, unwritten since (as far as version counters tell)."""
        return self.tensor is value and self.version == value._version and self.address == _address(value)

    def adopt(self, value: torch.Tensor) -> None:
        """``value`` (of this entry's layout) is the tensor seen here from now on."""
        self.tensor, self.version, self.address = value, value._version, _address(value)


@dataclass(frozen=True, eq=False)
class _Value:
    """A number as last seen (compared by equality), or a container's type and length."""

    value: Any
    length: int | None = None


@dataclass(eq=False)
class _Group:
    """The tensors of one device renewed together (the trainable parameters, or the rest), their
    fingerprints taken at once, and the fingerprint vector they must have (``reference``)."""

    entries: list[_Tensor]
    fingerprints: _Fingerprints
    reference: torch.Tensor

    def now(self) -> torch.Tensor:
        return self.fingerprints([entry.tensor for entry in self.entries])


@dataclass(eq=False)
class _Comparison:
    """A group's fingerprints (``now``) against its ``reference``, on the device, and whether any word
    differs (``flag``); ``when``: where it was taken, and whether the step was ``released`` then."""

    group: _Group
    now: torch.Tensor
    reference: torch.Tensor
    flag: torch.Tensor
    when: str
    released: bool = False

    def changes(self) -> list[str]:
        """The tensors that changed (reads the host: for the refusal)."""
        changed = self.group.fingerprints.changed(self.now, self.reference, self.group.entries)
        return [f"{entry.kind} '{entry.path}' was written" for entry in changed]


@dataclass(eq=False)
class _Pack:
    """Small tensors copied into one buffer of words: ``members`` (entry indices) with the zero padding
    that ends each at a whole word (``pads``), the last word of each (``ends``) and its secret positions
    (``positions``), as indices into the buffer."""

    members: list[int]
    pads: list[torch.Tensor | None]
    ends: torch.Tensor
    positions: torch.Tensor


class _Fingerprints:
    """The fingerprints of the tensors of a list of entries (one device), in a few operators: one vector of
    64-bit words holding, for each pack of small tensors, its running sum at each tensor's last word and
    the words at their secret positions, then the sum of each large tensor (one reduction each, where it
    is: no copy) and the words at their secret positions (one gather for all). A packed tensor's sum is the
    difference of two running sums (:meth:`changed`)."""

    def __init__(self, entries: list[_Tensor], device: torch.device):
        self.device = device
        self.packs: list[_Pack] = []
        self.large: list[tuple[int, list[int]]] = []  # entry, its secret positions
        self.slots: dict[int, tuple[int, int | None, int]] = {}  # entry: its sum, the sum before it, picks
        self._views: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # entry: value, address, view
        packed = [i for i, e in enumerate(entries) if 0 < e.words <= _PACKED]
        groups: list[list[int]] = []
        for i in packed:
            if not groups or sum(entries[j].words for j in groups[-1]) + entries[i].words > _PACK:
                groups.append([])
            groups[-1].append(i)
        out = 0
        for members in groups:
            starts = [0]
            for i in members:
                starts.append(starts[-1] + entries[i].words)
            k = len(members)
            for j, i in enumerate(members):
                self.slots[i] = (out + j, out + j - 1 if j else None, out + k + POSITIONS * j)
            out += k + POSITIONS * k
            pads = [None if _nbytes(entries[i].tensor) % 8 == 0 else
                    torch.zeros(8 - _nbytes(entries[i].tensor) % 8, dtype=torch.uint8, device=device)
                    for i in members]
            ends = torch.tensor([end - 1 for end in starts[1:]], device=device)
            positions = torch.tensor([start + p for start, i in zip(starts, members)
                                      for p in entries[i].positions], device=device)
            self.packs.append(_Pack(members, pads, ends, positions))
        self.large = [(i, entry.positions) for i, entry in enumerate(entries) if entry.words > _PACKED]
        for j, (i, _) in enumerate(self.large):
            self.slots[i] = (out + j, None, out + len(self.large) + POSITIONS * j)

    def __call__(self, values: list[torch.Tensor]) -> torch.Tensor:
        parts = []
        for pack in self.packs:
            pieces = []
            for i, pad in zip(pack.members, pack.pads):
                pieces.append(self._kept(i, values[i], _bytes))
                if pad is not None:
                    pieces.append(pad)
            words = torch.cat(pieces).view(torch.int64)
            parts += [words.cumsum(0).take(pack.ends), words.take(pack.positions)]
        if self.large:
            words = [self._kept(i, values[i], _words) for i, _ in self.large]
            picked = [w[q] for w, (_, positions) in zip(words, self.large) for q in positions]  # views
            parts.append(torch.stack([w.sum() for w in words] + picked))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.device)

    def _kept(self, i: int, value: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        """``read(value)`` (its bytes, or its words), a view kept while it is the same tensor in the same
        memory (a copy, of a tensor whose memory is not one block of whole words, is made again each
        time: it does not follow writes)."""
        kept = self._views.get(i)
        address = _address(value)
        if kept is not None and kept[0] is value and kept[1] == address:
            return kept[2]
        raw = read(value)
        if raw.untyped_storage().data_ptr() == _storage(value):
            self._views[i] = (value, address, raw)
        return raw

    def changed(self, now: torch.Tensor, reference: torch.Tensor, entries: list[_Tensor]) -> list[_Tensor]:
        """The entries whose fingerprints differ between two vectors (reads the host)."""
        now_words, reference_words = now.tolist(), reference.tolist()

        def fingerprint(words: list[int], slot: tuple[int, int | None, int]) -> tuple[int, list[int]]:
            end, before, picks = slot
            total = (words[end] - (words[before] if before is not None else 0)) % 2**64
            return total, words[picks:picks + POSITIONS]
        return [entries[i] for i, slot in sorted(self.slots.items())
                if fingerprint(now_words, slot) != fingerprint(reference_words, slot)]


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
        self._groups: list[_Group] = []
        self._renewed: list[_Group] = []  # the groups of the trainable parameters
        self._pending: list[_Comparison] = []  # compared on the device, not yet read
        self._refused: str | None = None  # a refusal a transfer found: raised from then on, until a snapshot
        self._verified = False  # a transfer read a full comparison since the last release
        self.snapshot()

    # -- the guard's points of the step
    def before_forward(self, call: ModelCall) -> None:
        """Quick, at the start of each captured (training) forward pass: tensors written in place are
        compared by value on the device, read with the engine's transfer."""
        written = self._quick(_FORWARD)
        self._pending += self._compare(written, _FORWARD)

    def carried(self, device: torch.device) -> torch.Tensor | None:
        """At the end of each backward pass: a full comparison, on the device; with the comparisons still
        pending, the flags the engine's transfer reads (:meth:`carried_read`). A model whose tensors are
        not where they were (FSDP2 holds its parameters unsharded until its own end of the backward) gets
        no full comparison here: the release's check makes it, with its own read."""
        changes, _ = self._walk()
        if not changes:
            self._pending += self._compare(self._groups, _BACKWARD)
        flags = [c.flag.to(device) for c in self._pending]
        return torch.stack(flags) if len(flags) > 1 else flags[0].reshape(1) if flags else None

    def carried_read(self, changed: list[bool]) -> None:
        """The transfer's values of the flags :meth:`carried` handed it. A change found is refused at the
        guard's next point (the next forward pass, or the release), and at every later one: a write the
        update's renewal absorbed would not be seen again."""
        read, self._pending = self._pending[:len(changed)], self._pending[len(changed):]
        failed = [c for c, f in zip(read, changed) if f]
        if self._refused is None and failed:
            self._refused = _failure(failed)
        self._verified = self._verified or any(c.when == _BACKWARD for c in read)

    def before_release(self, step: int) -> None:
        """Quick; fully, with a read, when no transfer carried a full comparison since the last release."""
        when = "before the release of a step"
        written = self._quick(when)
        self._settle(self._compare(self._groups if not self._verified or self._pending else written, when))
        self._verified = False

    def before_update(self, step: int) -> None:
        """Quick: the step components may have run the model (HyFreeDP's probes). The trainable parameters
        are compared too, read with the next transfer: a write through ``.data`` since the last backward
        pass is refused before the next step releases anything."""
        when = "before the optimizer's update"
        self._settle(self._compare(self._quick(when, released=True), when, released=True))
        self._pending += self._compare(self._renewed, "before the optimizer's update of the previous step "
                                       "(a write after its last backward pass)")

    def after_update(self, step: int) -> None:
        self.updated()

    def after_probes(self, when: str) -> None:
        """Quick, after a check's own forward passes (``when``: which check's)."""
        self._settle(self._compare(self._quick(when), when))

    # -- the checks and the renewals
    def check(self, when: str, *, full: bool = True, released: bool = False) -> None:
        """Raise if anything changed since the state was taken (one read of the host); ``full`` compares
        every fingerprint (sees writes through ``.data``), else the tensors written in place only.
        ``released``: the step's release was already made (and recorded); its update is not applied."""
        written = self._quick(when, released)
        self._settle(self._compare(self._groups if full else written, when, released))

    def updated(self) -> None:
        """After the wrapped optimizer's update: renew the fingerprints of the trainable parameters (and of
        any tensor sharing their memory, e.g. a transposed view kept as an attribute), on the device."""
        with torch.no_grad():
            for group in self._renewed:
                for entry in group.entries:
                    entry.adopt(entry.tensor)
                group.reference = group.now()

    def snapshot(self) -> None:
        """Take the model's current state as the state every later check compares with."""
        storages = {_storage(p) for p in self.trainable}
        with torch.no_grad():
            self._seen = {path: (kind, self._entry(path, kind, value)) for path, kind, value in self._state()}
            self._immutable = self._immutable_attributes()
            by_group: dict[tuple[torch.device, bool], list[_Tensor]] = {}
            for _, entry in self._seen.values():
                if isinstance(entry, _Tensor):
                    key = (entry.layout[2], _storage(entry.tensor) in storages)
                    by_group.setdefault(key, []).append(entry)
            self._groups, self._renewed = [], []
            for (device, renewed), entries in by_group.items():
                fingerprints = _Fingerprints(entries, device)
                group = _Group(entries, fingerprints, fingerprints([e.tensor for e in entries]))
                self._groups.append(group)
                if renewed:
                    self._renewed.append(group)
        self._pending, self._refused, self._verified = [], None, False

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
    def _state(self, unchanged: dict[int, dict[str, tuple[Any, int]]] | None = None
               ) -> Iterator[tuple[str, str, Any]]:
        """(path, kind, value) of every parameter, buffer and attribute leaf of the model's modules.
        ``unchanged``: for each module (by id), immutable attributes as last seen (the object and its
        number of leaves); one that is still the same object is skipped, its leaves counted in
        ``self._skipped``."""
        self._skipped = 0
        for prefix, module in self.model.named_modules():
            dot = f"{prefix}." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    yield dot + name, "parameter", p
            for name, b in module._buffers.items():
                if b is not None and dot + name not in self.public:
                    yield dot + name, "buffer", b
            kept = unchanged.get(id(module), {}) if unchanged is not None else {}
            for name, value in vars(module).items():
                if name in _MODULE_MACHINERY or (self.public and dot + name in self.public):
                    continue
                before = kept.get(name)
                if before is not None and before[0] is value:
                    self._skipped += before[1]
                else:
                    yield from _leaves(dot + name, value, 0)

    def _immutable_attributes(self) -> dict[int, dict[str, tuple[Any, int]]]:
        """For each module (by id), its attributes that cannot change while they are the same object
        (numbers, strings, tuples of them...), with their number of leaves."""
        found: dict[int, dict[str, tuple[Any, int]]] = {}
        for prefix, module in self.model.named_modules():
            dot = f"{prefix}." if prefix else ""
            found[id(module)] = {name: (value, sum(1 for _ in _leaves(dot + name, value, 0)))
                                 for name, value in vars(module).items()
                                 if name not in _MODULE_MACHINERY and _immutable(value)}
        return found

    def _entry(self, path: str, kind: str, value: Any) -> _Tensor | _Value:
        if not isinstance(value, torch.Tensor):
            return value if isinstance(value, _Value) else _Value(value)
        words = -(-_nbytes(value) // 8)
        positions = torch.randint(max(words, 1), (POSITIONS,), generator=self._generator).tolist()
        return _Tensor(path, kind, value, value._version, _address(value), _layout(value), words,
                       positions if words else [])

    def _walk(self) -> tuple[list[str], set[int]]:
        """The changes the host sees (paths that appeared, were removed or replaced by another layout,
        numbers set to other values), and the entries (ids) whose tensor was written in place or
        replaced since last seen: each adopts the tensor now at its path, to be compared by value."""
        changes: list[str] = []
        written: set[int] = set()
        present = 0
        for path, kind, value in self._state(self._immutable):
            before = self._seen.get(path)
            if before is None:
                changes.append(f"{kind} '{path}' appeared")
                continue
            present += 1
            entry = before[1]
            if isinstance(value, torch.Tensor) and isinstance(entry, _Tensor):
                if entry.layout != _layout(value):
                    changes.append(f"{kind} '{path}' was replaced by a tensor of another shape or type")
                elif not entry.same(value):
                    entry.adopt(value)
                    written.add(id(entry))
            elif isinstance(value, torch.Tensor) or isinstance(entry, _Tensor) \
                    or not _same_value(entry, value):
                changes.append(f"{kind} '{path}' was set to another value")
        if present + self._skipped < len(self._seen):  # some path is gone: which, by a walk of every leaf
            paths = {path for path, _, _ in self._state()}
            changes += [f"{kind} '{path}' was removed" for path, (kind, _) in self._seen.items()
                        if path not in paths]
        return changes, written

    def _quick(self, when: str, released: bool = False) -> list[_Group]:
        """Raise on a change the host sees; the groups holding a tensor written in place or replaced (to
        be compared by value: a value-equal rewrite is no change)."""
        if self._refused is not None:
            raise PrivacyError(self._refused)
        changes, written = self._walk()
        self._raise_certain(changes, when, released)
        return [g for g in self._groups if any(id(e) in written for e in g.entries)]

    @staticmethod
    def _raise_certain(changes: list[str], when: str, released: bool = False) -> None:
        if changes:
            raise PrivacyError(_refusal(changes, when, released))

    def _compare(self, groups: list[_Group], when: str, released: bool = False) -> list[_Comparison]:
        """Each group's fingerprints against its reference, on the device."""
        comparisons = []
        with torch.no_grad():
            for group in groups:
                now = group.now()
                comparisons.append(_Comparison(group, now, group.reference, (now != group.reference).any(),
                                               when, released))
        return comparisons

    def _settle(self, comparisons: list[_Comparison]) -> None:
        """Read ``comparisons`` and the pending ones (one transfer per device), and raise if any failed."""
        everything, self._pending = self._pending + comparisons, []
        if not everything:
            return
        by_device: dict[torch.device, list[int]] = {}
        for k, c in enumerate(everything):
            by_device.setdefault(c.flag.device, []).append(k)
        failed = [False] * len(everything)
        for indices in by_device.values():
            for k, value in zip(indices, torch.stack([everything[k].flag for k in indices]).cpu().tolist()):
                failed[k] = value
        refusal = _failure([c for c, f in zip(everything, failed) if f])
        if refusal is not None:
            raise PrivacyError(refusal)


def _failure(failed: list[_Comparison]) -> str | None:
    """The refusal of failed comparisons (``None``: none failed): the changes they found, seen where the
    first was taken."""
    if not failed:
        return None
    changes = list(dict.fromkeys(change for c in failed for change in c.changes()))
    return _refusal(changes, failed[0].when, failed[0].released)


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


def _immutable(value: Any) -> bool:
    """Whether ``value`` cannot change while it is the same object (a number, a string, a tuple of them)."""
    if isinstance(value, tuple):
        return all(_immutable(item) for item in value)
    return value is None or isinstance(value, (*_NUMBERS, str, bool, bytes))


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


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat: a view of its memory when it is one block, else a copy."""
    local = _local(t).detach()
    if local.layout != torch.strided:
        local = local.to_dense()
    return local.reshape(-1).view(torch.uint8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 64-bit words: a view of its memory when it is one block of whole words,
    else a zero-padded copy."""
    raw = _bytes(t)
    if raw.numel() % 8 == 0:
        try:
            return raw.view(torch.int64)
        except RuntimeError:  # memory not aligned to a word
            return raw.clone().view(torch.int64)
    return torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)]).view(torch.int64)


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
