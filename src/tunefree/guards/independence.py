"""The example-independence check: each example's activations and output gradients at every trainable
unit depend on that example alone.

Per-sample clipping bounds one example's contribution only if nothing mixes examples: a batch statistic,
a time-major layout, a custom ``autograd.Function`` or hook that combines examples or scales their
gradients by a value computed over the batch. The check watches what the model does, on the whole batch
(``guards/probe.py``: probe passes that release nothing, restore the RNG state and write no ``.grad``):

- **Backward, certain for every pair.** One forward, then backward passes from a fixed loss whose weight
  on example i is multiplied by a power of two r_i that differs between any two examples in at least one
  pass (⌈log₆₄ n⌉ passes besides the first: one up to 64 examples, two up to 4,096; ⌈log₈ n⌉ for float16
  parameters, :func:`ratio_base`). Where nothing mixes, example i's gradient at every unit tensor
  is its own loss weight times its own Jacobian, so it scales by exactly r_i, bit for bit (a power of two
  changes no rounding). Any dependence of one example's gradient on another's loss weight or activations
  — a backward that mixes, a forward that mixes along a path with gradients, a scale computed over the
  batch (a gradient divided by the batch's norm) — breaks the proportion. A backward that is not linear
  in the loss but mixes nothing (a hook that clamps each gradient) breaks it too: then the check (again
  at base 8 where it used 64, in case a float16 value inside the model overflowed) confirms
  with one backward per mask of a code (:func:`probe.row_codes`) that silences the mask's examples, and
  refuses if some other example's gradient changed — and under ``loss_reduction="mean"`` in any case:
  the loss weighs each example by 1/B, so a gradient not proportional to it depends on the batch's size.
- **Forward.** Passes that change examples (floats get a pattern added, integers take another
  example's values), each example in one of a few ways (levels) per pass: an example's activations at
  every unit must be bit-identical in any two passes that give it the same input. This sees mixing along
  paths without gradients too (``x + x[perm].detach()``, gates decided by a comparison). In the run's
  first check each example's levels over the k passes are a distinct partition of the passes into m
  blocks (:func:`probe.row_levels`): no two such partitions refine each other, so for every ordered pair
  (j, i) two passes give i the same input and j two different ones — every pair is seen, with k − 1 = 5
  extra forwards for 64 examples, 6 for 256, 7 for 1,024 (a code of masks against the first pass needs
  8, 11, 13). A later check changes one random half, and sees a pair (j reaching i) when j is in it and
  i is not: probability ≥ ¼.

A private run checks the first step's every physical batch with the partitions, then each step with
probability 1/``verify_every`` with one random half (:class:`ProbeSchedule`), each check before the
step's release.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PrivacyError
from ..persample.layout import layout_hint
from ..privacy.randomness import NoiseSource
from ..rules.layout import Dim
from . import probe
from .base import Guard, ModelCall
from .probe import Call, Fingerprint, Flags, Slot, Tape

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples or scales their gradients "
        "by a value computed over the batch (e.g. the batch's gradient norm).")

# The powers of two 1, 2, …, 2^(base − 1) scale the examples' loss weights in a backward: base 64 (a gradient
# of float32, bfloat16 or float64 overflows only beyond 10¹⁹ times its size), 8 where a unit's parameters
# are float16 (whose largest value is 65,504) and where base 64 found a disproportion (a float16 value
# inside the model may have overflowed: the backward is then checked again at base 8).
WIDE_BASE, HALF_BASE = 64, 8


def ratio_base(units: Sequence) -> int:
    """:data:`HALF_BASE` where a trainable unit's parameters are float16, else :data:`WIDE_BASE`."""
    half = any(p.dtype == torch.float16 for u in units for p in u.direct.values())
    return HALF_BASE if half else WIDE_BASE


def ratio_digits(n: int, base: int = WIDE_BASE) -> int:
    """The backward passes after the first that tell ``n`` examples apart: ⌈log_base n⌉, at least 1."""
    return max(1, math.ceil(math.log(max(n, 2), base) - 1e-9))


def ratio_exponents(n: int, digits: int | None = None, base: int = WIDE_BASE) -> torch.Tensor:
    """[d, n]: example i's exponent in each backward after the first, the digits of i in ``base``, so that
    any two examples differ in some backward (d = ``digits``, at least :func:`ratio_digits`)."""
    d = ratio_digits(n, base) if digits is None else digits
    index = torch.arange(n)
    return torch.stack([(index // base ** k) % base for k in range(d)])


def ratio_factors(factors: torch.Tensor, exponents: torch.Tensor) -> list[torch.Tensor]:
    """The backward passes' loss factors: ``factors`` as they are, then times 2^exponent per pass."""
    return [factors] + [factors * 2.0 ** e.double() for e in exponents]


def perturbed(args: tuple, kwargs: dict, n: int, levels: torch.Tensor, dim: int = 0, cyclic: bool = True
              ) -> tuple[tuple, dict]:
    """Change each example by its level (``levels``: [n], 0 leaves it as it is) in every batched tensor
    input (``n`` in dimension ``dim``): floats get the pattern plus the level added (each level another
    value everywhere); integers take example i + level's values, ``cyclic``ally (one level, one value in
    every pass). Not ``cyclic`` (levels 0 and 1, a batch whose integer rows are in order, e.g. sorted
    lengths, which must stay in order): each changed example takes the next one's values, the last one
    its predecessor's unless that one changes too."""
    index = torch.arange(n)
    if cyclic:
        source = torch.where(levels > 0, (index + levels) % n, index)
    else:
        source = torch.where(levels > 0, (index + 1).clamp(max=n - 1), index)
        if levels[-1] and n > 1 and not levels[-2]:
            source[-1] = n - 2

    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != n:
            return t
        if not t.is_floating_point():
            return t.detach().index_select(dim, source.to(t.device, non_blocking=True))
        rows = t.detach().movedim(dim, 0)
        out = rows
        for level in levels.unique().tolist():  # the levels are on the host
            if level:
                chosen = (levels == level).to(t.device, non_blocking=True)
                chosen = chosen.reshape(-1, *[1] * (rows.dim() - 1))
                out = torch.where(chosen, out + probe.row_pattern(rows[0], float(level)), out)
        return (out if out is not rows else rows.clone()).movedim(0, dim)
    return tuple(change(a) for a in args), {key: change(v) for key, v in kwargs.items()}


def first_levels(n: int, ordered: bool, passes: int | None = None) -> torch.Tensor:
    """The first check's levels for a batch of ``n`` (at least ``passes`` passes): the partitions of
    :func:`probe.row_levels`, or, when an integer input is ``ordered`` along the examples (sorted lengths,
    which only the next example's values keep in order), one pass per mask of a code, each compared with
    the first pass only."""
    if ordered:
        return levels_of(code_masks(n, None if passes is None else passes - 1))
    return probe.row_levels(n, passes)


def first_passes(n: int, ordered: bool) -> int:
    """The passes of :func:`first_levels` for a batch of ``n``."""
    return probe.code_bits(n) + 1 if ordered else probe.level_design(n)[0]


def ordered_integers(args: tuple, kwargs: dict, n: int, dim: int = 0) -> bool:
    """Whether an integer input of one value per example (lengths) is in order along the ``n`` > 2
    examples (dimension ``dim``); reads the host where such an input is on a device."""
    flag = ordered_flag(args, kwargs, n, dim)
    return bool(flag.item()) if isinstance(flag, torch.Tensor) else flag


def ordered_flag(args: tuple, kwargs: dict, n: int, dim: int = 0) -> torch.Tensor | bool:
    """:func:`ordered_integers` without reading the host: a flag on the device, or ``False`` where no
    input could be such (known from the inputs' shapes and types)."""
    flags = []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() == dim + 1 and not t.is_floating_point() and \
                t.shape[dim] == n > 2:
            steps = t[1:] - t[:-1]
            flags.append((steps >= 0).all() | (steps <= 0).all())
    if len(flags) > 1:
        return torch.stack([f.to(flags[0].device) for f in flags]).any()
    return flags[0] if flags else False


def code_masks(n: int, bits: int | None = None) -> tuple[torch.Tensor, ...]:
    """The masks of the code of ``n`` examples (of ``bits`` masks, at least as many as it needs): for every
    ordered pair (j, i), one holds j and not i."""
    codes = probe.row_codes(n, bits)
    return tuple(codes[:, bit].clone() for bit in range(codes.shape[1]))


def levels_of(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n, 1 + len(masks)] levels: a pass as it is, then one per mask, changing its examples."""
    return torch.stack([torch.zeros_like(masks[0], dtype=torch.int64)] + [m.long() for m in masks], 1)


def verify_example_independence(model: nn.Module, engine, args: tuple, kwargs: dict | None = None,
                                seed: int = 0, examples: int | None = None,
                                levels: torch.Tensor | None = None) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    the dimension declared for the model's inputs (``engine.declared.root``, 0 by default; at least 2).
    Each unit's tensors are read where its calls' layout puts their examples. ``examples``: the batch's
    count by provenance (the private loader's); without it, that of the first input tensor. ``levels``:
    [n, k], how the forward check changes each example in each of k passes (pass 0 as it is; default:
    the first check's, :func:`first_levels`, which see every pair; a private run's later checks change
    one random half, :meth:`ProbeSchedule.levels`). Costs, on the whole batch, one forward with
    gradients and 1 + ⌈log₆₄ n⌉ backward passes to the units' tensors (no parameter gradient), plus k − 1
    forwards."""
    kwargs = kwargs or {}
    root = engine.declared.root
    n = examples if examples is not None else examples_in(args, kwargs, root)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension "
                         f"{root} of the model's inputs")
    ordered = ordered_integers(args, kwargs, n, root)
    check(model, engine, args, kwargs, n, first_levels(n, ordered) if levels is None else levels,
          seed=seed, cyclic=not ordered)


def examples_in(args: tuple, kwargs: dict, root: int = 0) -> int:
    """Examples in a model call's inputs: dimension ``root`` of its first tensor with that dimension."""
    leaves = tree_flatten((args, kwargs))[0]
    return next((t.shape[root] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > root), 0)


def check(model: nn.Module, engine, args: tuple, kwargs: dict, n: int, levels: torch.Tensor,
          seed: int = 0, agree: Callable[[bool], bool] | None = None, cyclic: bool = True,
          verdicts: list[Verdict] | None = None, alerts: list[str] | None = None) -> None:
    """:func:`verify_example_independence` on a batch of ``n`` ≥ 2 examples with the forward check's
    ``levels`` (``cyclic``: see :func:`perturbed`; if not, each pass is compared with the first only).
    ``agree`` (processes whose passes are collectives, FSDP2): whether a flag holds on every
    process; the processes run as many passes as the one that needs most, and the confirmation if any
    needs it. Every comparison stays on the device; the whole check reads the host once, at the end
    (:func:`settle`; ``verdicts``: append the check's :class:`Verdict` there instead, for the caller to
    settle with others). A failure the host sees (a call missing or reshaped) stops the passes: the
    flags before it are read then, and the first failure refused. ``alerts``: the kernels without a
    deterministic version that probe passes ran, kept across checks (:func:`probe.deterministic_kernels`)."""
    root = engine.declared.root
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > root]
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    inputs = {probe.storage(t) for t in tensors if t.shape[root] == n}
    base = ratio_base(units)
    exponents = ratio_exponents(n, agreed(ratio_digits(n, base), agree), base)
    base_factors = probe.example_factors(n)
    factors = ratio_factors(base_factors, exponents)
    earlier = [] if verdicts is None else verdicts
    alerts = [] if alerts is None else alerts
    with probe.probing(engine, alerts):
        tapes = [probe.record(model, units, args, kwargs, examples=n, root=root, seed=seed, factors=factors,
                              model_inputs=inputs)]
        forward: list[Flags] = []
        masks = _DeviceMasks()
        for column in levels.unbind(1)[1:]:
            changed = perturbed(args, kwargs, n, column, root, cyclic)
            tapes.append(probe.record(model, units, *changed, examples=n, root=root, seed=seed,
                                      like=tapes[0]))
            forward.append(_forward_flags(tapes if cyclic else [tapes[0], tapes[-1]],
                                          levels if cyclic else levels[:, [0, len(tapes) - 1]], masks))
            if forward[-1].certain is not None:  # refused whatever the device says: no more passes
                settle(earlier, agree)
                failure = next(f for f in probe.failures(forward) if f is not None)
                raise PrivacyError(_forward_mixing(*failure))
        verdict = Verdict(forward, _disproportion_flags(tapes[0], exponents),
                          _Confirmation(model, engine, units, args, kwargs, n, seed, base_factors, base),
                          alerts)
    earlier.append(verdict)
    if verdicts is None:
        settle(earlier, agree)


@dataclass
class Verdict:
    """A check of one batch whose comparisons are on the device, not read yet: the forward passes' flags
    (one :class:`probe.Flags` per pass), the backward's proportion flags, and the confirmation a
    disproportion calls for."""

    forward: list[Flags]
    disproportion: Flags
    confirmation: _Confirmation
    alerts: list[str]  # kernels with no deterministic implementation that the passes ran


def settle(verdicts: list[Verdict], agree: Callable[[bool], bool] | None = None) -> None:
    """Read the flags of ``verdicts`` at once (one host read) and refuse the first failure, in the order
    the checks ran: a batch's forward passes, then its backward (a disproportion runs the confirmation,
    with a read of its own), then the next batch's."""
    if not verdicts:
        return
    failures = iter(probe.failures([f for v in verdicts for f in (*v.forward, v.disproportion)]))
    for verdict in verdicts:
        forward = [next(failures) for _ in verdict.forward]
        failure = next((f for f in forward if f is not None), None)
        if failure is not None:
            raise PrivacyError(_forward_mixing(*failure) + probe.nondeterminism(verdict.alerts))
        disproportion = next(failures)
        confirm = _on_any(disproportion, agree)
        if confirm and verdict.confirmation.base != HALF_BASE:  # again at base 8, in case of an overflow
            disproportion = verdict.confirmation.disproportion(agree, verdict.alerts)
            confirm = _on_any(disproportion, agree)
        if confirm:
            alerts = verdict.alerts
            verdict.confirmation.run(agreed(probe.code_bits(verdict.confirmation.n), agree), alerts)
            if verdict.confirmation.engine.loss_reduction == "mean":
                raise PrivacyError(_not_linear_under_mean(disproportion) + probe.nondeterminism(alerts))
    verdicts.clear()


@dataclass
class _Confirmation:
    """What the backward's confirmation needs (:func:`_confirm_backward_mixing`)."""

    model: nn.Module
    engine: object
    units: list
    args: tuple
    kwargs: dict
    n: int
    seed: int
    factors: torch.Tensor
    base: int  # of the exponents the check's backward passes used

    def disproportion(self, agree: Callable[[bool], bool] | None, alerts: list[str]) -> object | None:
        """The backward's proportions checked again at :data:`HALF_BASE`: the first unit tensor whose
        gradients do not scale (``None``: all do; one host read)."""
        exponents = ratio_exponents(self.n, agreed(ratio_digits(self.n, HALF_BASE), agree), HALF_BASE)
        root = self.engine.declared.root
        with probe.probing(self.engine, alerts):
            tape = probe.record(self.model, self.units, self.args, self.kwargs, examples=self.n, root=root,
                                seed=self.seed, factors=ratio_factors(self.factors, exponents))
        return next(iter(probe.failures([_disproportion_flags(tape, exponents)])))

    def run(self, bits: int, alerts: list[str]) -> None:
        with probe.probing(self.engine, alerts):
            failure = _confirm_backward_mixing(self.model, self.units, self.args, self.kwargs, self.n,
                                               self.engine.declared.root, self.seed, self.factors, bits)
        if failure is not None:
            raise PrivacyError(failure + probe.nondeterminism(alerts))


class _DeviceMasks:
    """Host masks of examples moved to a device once each (without waiting for it)."""

    def __init__(self) -> None:
        self._moved: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
        kept = self._moved.get((id(mask), device))
        if kept is None or kept[0] is not mask:
            kept = self._moved[id(mask), device] = (mask, mask.to(device, non_blocking=True))
        return kept[1]


def _on_any(failure: object | None, agree: Callable[[bool], bool] | None) -> bool:
    """Whether some process found ``failure`` (one process: this one)."""
    return failure is not None if agree is None else not agree(failure is None)


def agreed(local: int, agree: Callable[[bool], bool] | None) -> int:
    """The largest of the processes' ``local`` counts (one process: its own), by a few collectives."""
    if agree is None:
        return local
    return next(k for k in itertools.count(1) if agree(local <= k))


# ------------------------------------------------------------------------------------------ forward
def _forward_flags(tapes: list[Tape], levels: torch.Tensor, masks: _DeviceMasks) -> Flags:
    """The last of ``tapes`` against each earlier one: every unit call must match where an example's
    level is the same in both passes (flags on the device, not read)."""
    flags = Flags()
    p = len(tapes) - 1
    changed = tapes[p]
    for q, base in enumerate(tapes[:p]):
        mask = levels[:, q] != levels[:, p]  # the examples whose inputs differ between the two passes
        # whether a call's structure (hence the kernels' grouping of examples) changed: on the host, or a
        # flag on the device where the structures' values decide it
        regrouped: bool | torch.Tensor = False
        for name, calls in changed.calls.items():
            before = base.calls.get(name, [])
            for index, call in enumerate(calls):
                if index >= len(before) or len(call.values) != len(before[index].values):
                    flags.certain = flags.certain or (call, None, None, None, mask)
                    continue
                old = before[index]
                regrouped = _regrouped(regrouped, call.structure, old.structure)
                for slot, a, b in zip(call.slots, old.values, call.values):
                    rows = probe.changed_rows(a, b)
                    if rows is None:
                        flags.certain = flags.certain or (call, slot, a, b, mask)
                        continue
                    if regrouped is True:
                        rows = probe.changed_rows(a, b, True)
                    elif regrouped is not False:
                        rows = torch.where(regrouped.to(rows.device), probe.changed_rows(a, b, True), rows)
                    device_mask = masks.on(mask, rows.device) if a.batched else None
                    flags.add(probe.outside(rows, a, device_mask), (call, slot, a, b, mask))
        if len(changed.calls) != len(base.calls) and flags.certain is None:
            missing = next(calls[0] for name, calls in base.calls.items() if name not in changed.calls)
            flags.certain = (missing, None, None, None, mask)
    return flags


def _regrouped(regrouped: bool | torch.Tensor, now: list[torch.Tensor], before: list[torch.Tensor]
               ) -> bool | torch.Tensor:
    """``regrouped``, or whether a call's structure tensors differ from the earlier pass's: on the host
    where their number or shapes differ, else a flag on the device."""
    if regrouped is True or len(now) != len(before) or any(x.shape != y.shape for x, y in zip(now, before)):
        return True
    for x, y in zip(now, before):
        differs = (x != y.to(x.device, non_blocking=True)).any()
        regrouped = differs if regrouped is False else regrouped | differs.to(regrouped.device)
    return regrouped


def _forward_mixing(call: Call, slot: Slot | None, a: Fingerprint | None, b: Fingerprint | None,
                    mask: torch.Tensor) -> str:
    unit = call.unit
    if slot is None:
        return (f"module {unit.name!r} mixes examples in its forward: changing {_which(mask)} changed which "
                f"tensors it is called with. {_FIX}")
    where = "as a whole (not per example)" if not a.batched else \
        f"with its examples in {slot.axis.describe()}"
    found = next((dim for dim in a.other_dims
                  if probe.unchanged_elsewhere(a.other_dims[dim], b.other_dims.get(dim), mask)), None)
    hint = _FIX if found is None or not isinstance(slot.axis, Dim) else \
        f"Changing {_which(mask)} changed only {_which(mask, 'row')} of dimension {found} of this " + \
        "tensor: " + layout_hint(unit.name, unit.module, unit.rule, slot.axis.dim, found) + "."
    return (f"module {unit.name!r} mixes examples in its forward: changing {_which(mask)} changed another "
            f"example's activations in its {slot.what} (shape {slot.shape}, read {where}). {hint}")


def _which(mask: torch.Tensor, noun: str = "example") -> str:
    """``example 3`` for one example, ``examples 0, 2, 5`` for several (the first eight named)."""
    rows = mask.nonzero().flatten().tolist()
    if len(rows) == 1:
        return f"{noun} {rows[0]}"
    return f"{noun}s " + ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")


# ----------------------------------------------------------------------------------------- backward
def _disproportion_flags(base: Tape, exponents: torch.Tensor) -> Flags:
    """Flags of the unit tensors whose gradients do not scale with each example's loss weight, exactly
    (on the device, not read)."""
    flags = Flags()
    scales: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, _, call in base.all_calls():
        for index, grads in call.grads.items():
            if len(grads) != base.backwards:
                flags.certain = flags.certain or (call, index)
                continue
            first = grads[0]
            key = (first.rows.device, first.rows.dtype)
            if key not in scales:
                scales[key] = [(2.0 ** e.double()).to(*key, non_blocking=True) for e in exponents]
            for scale, grad in zip(scales[key], grads[1:]):
                flags.add(grad.rows != first.rows * scale, (call, index))
    return flags


def _confirm_backward_mixing(model: nn.Module, units: list, args: tuple, kwargs: dict, n: int, root: int,
                             seed: int, factors: torch.Tensor, bits: int) -> str | None:
    """Some gradients did not scale with the loss weights: a backward that mixes examples, or one that is
    not linear but per example. Silence the examples of each mask of a code (of ``bits`` masks) in turn:
    if any other example's gradient changes, the refusal (``None``: none changed)."""
    masks = code_masks(n, bits)
    silenced = [factors] + [factors.masked_fill(mask, 0.0) for mask in masks]
    tape = probe.record(model, units, args, kwargs, examples=n, root=root, seed=seed, factors=silenced)
    flags, moved = Flags(), _DeviceMasks()
    for _, _, call in tape.all_calls():
        for index, grads in call.grads.items():
            for mask, grad in zip(masks, grads[1:]):
                rows = probe.changed_rows(grads[0], grad)
                flags.add(probe.outside(rows, grads[0], moved.on(mask, rows.device)),
                          (call, index, mask, grads[0], grad))
    failure = flags.first()
    return None if failure is None else _backward_mixing(*failure)


def _backward_mixing(call: Call, index: int, mask: torch.Tensor, a: Fingerprint, b: Fingerprint) -> str:
    slot = call.slots[index]
    rows = probe.outside(probe.changed_rows(a, b), a, mask).cpu()
    k = int(rows.nonzero()[0]) if rows.any() else int((~mask).nonzero()[0])
    return (f"module {call.unit.name!r} mixes examples in its backward: giving {_which(mask)} zero loss "
            f"weight changed the gradient of example {k} at its {slot.what} (shape {slot.shape}, read with "
            f"its examples in {slot.axis.describe()}): one example's gradient depends on the others "
            f"(examples combined, or a scale computed over the batch). {_FIX}")


def _not_linear_under_mean(where: tuple[Call, int] | None) -> str:
    if where is None:
        place = "a module's tensors"
    else:
        call, index = where
        place = f"module {call.unit.name!r}'s {call.slots[index].what}"
    return (f"the gradient at {place} is not proportional to the loss (a hook or Function that clips or "
            "rescales each example's gradient by its own size), and loss_reduction='mean' weighs each "
            "example's loss by 1/B, B the batch's size: each example's gradient then depends on how many "
            "other examples the batch holds, which per-example clipping does not bound. Sum the loss over "
            "the batch and pass make_private(..., loss_reduction='sum'), or make the backward linear")


# ------------------------------------------------------------------------------------- the schedule
class ProbeSchedule:
    """When a private run checks example independence, and which examples its forward check changes:
    drawn from the run's noise source (secret by default; in a seeded run keyed by the step, so that the
    run replays), so that a model cannot tell a checked step from another.

    The run's first step is checked on every physical batch with every pair seen (in both checks). Later,
    each step is checked with probability ``1/every``, independently, the forward check on one random half
    of the batch (each example in it with probability ½, drawn again while it holds all examples or none).
    A pair (i, j) in which j's data reaches i is caught at a later check with certainty where gradients
    carry it (the backward check), else with probability ≥ ¼. Mixing present in T later steps is missed by
    all of them with probability at most (1 − 1/(4·every))^T.
    """

    _KEY = 1 << 62  # keys of the run's randomness far beyond any step number the sampling uses

    def __init__(self, randomness: NoiseSource):
        self.randomness = randomness

    def due(self, step: int, every: int) -> bool:
        """Whether logical step ``step`` (after the first) is checked (with probability ``1/every``)."""
        return every == 1 or bool(self._draw(step, 0, 1, 1 / every)[0])

    def levels(self, step: int, n: int, first: bool, ordered: bool = False, passes: int | None = None
               ) -> torch.Tensor:
        """The forward check's levels ([n, k]) on a batch of ``n`` ≥ 2 examples: for the ``first`` check
        :func:`first_levels` (``ordered``: an integer input in order along the examples; at least
        ``passes`` passes), else one pass changing a random half."""
        if first:
            return first_levels(n, ordered, passes)
        return levels_of((self.half(step, 2, n),))

    def half(self, step: int, purpose: int, n: int) -> torch.Tensor:
        """A random subset of the n examples, neither empty nor all of them (drawn again up to 64 times,
        then the first example alone: a fair source gets there with probability below 2^-64)."""
        for attempt in range(64):
            mask = self._draw(step, purpose, n, 0.5, attempt)
            if 0 < int(mask.sum()) < n:
                return mask
        return torch.arange(n) == 0

    def _draw(self, step: int, purpose: int, count: int, rate: float, attempt: int = 0) -> torch.Tensor:
        """Each of ``count`` flags set with probability ``rate``; in a seeded run, keyed by (step, purpose,
        attempt) on keys that no sampling step uses."""
        return self.randomness.inclusion(self._KEY + ((4 * step + purpose) << 16) + attempt, count, rate)


# ---------------------------------------------------------------------------------------- the guard
CHECK_INTERVAL = 24  # the expected number of steps between two later checks when verify_every is not given


class Independence(Guard):
    """Checks example independence before the releases of the steps the schedule draws.

    Args:
        model: the module the engine hooks.
        engine: the per-sample engine (its trainable units, declared example dimension, ``no_capture()``).
        schedule: the step schedule; its ``checking`` flag, set here before each step, tells the loader and
            the input check (``guards/inputs.py``) and :mod:`.purity` whether the step is checked.
        probes: which later steps are checked and on which examples, from the run's randomness.
        verify_every: a later step is checked with probability 1/verify_every (``None``: 1/24; 1: every
            step); the first step is always checked.
        every_rank: under FSDP2, whose forward passes are collectives: whether a flag is True on every
            rank, so that every rank runs the check or none does (``None``: one process).
        after_probes: called after each check's passes, with where it is (the state guard's quick check).

    Every physical batch of a checked step is checked (mixing that some data trigger in one micro-batch
    only, too). A batch of fewer than two examples cannot mix; a first check due on a step without a
    larger one waits for the next step. Under FSDP2, whose ranks hold different numbers of micro-batches,
    the ranks check their first physical batch together, when every rank holds two examples or more.
    """

    def __init__(self, model: nn.Module, engine, schedule, probes: ProbeSchedule,
                 verify_every: int | None = None, every_rank: Callable[[bool], bool] | None = None,
                 after_probes: Callable[[str], None] | None = None):
        self.model, self.engine, self.schedule, self.probes = model, engine, schedule, probes
        self.verify_every, self.every_rank, self.after_probes = verify_every, every_rank, after_probes
        self.first_done = False  # whether the first (certain) check has run and passed
        # the retained batches: inputs, examples, and whether an integer input is in order (a flag on the
        # device until the engine's transfer reads it, :meth:`carried`)
        self.retained: list[tuple[tuple, dict, int, bool | torch.Tensor]] = []
        self._carried: list[int] = []
        self.alerts: list[str] = []  # kernels without a deterministic version that the checks ran
        self.schedule.checking = True

    def before_forward(self, call: ModelCall) -> None:
        if self.schedule.checking:
            args, kwargs, n = _detached(call)
            root = self.engine.declared.root
            n = examples_in(args, kwargs, root) if n is None else n
            self.retained.append((args, kwargs, n, ordered_flag(args, kwargs, n, root)))

    def carried(self, device: torch.device) -> torch.Tensor | None:
        """The retained batches' order flags, for the engine's transfer at the end of a backward pass."""
        self._carried = [k for k, batch in enumerate(self.retained) if isinstance(batch[3], torch.Tensor)]
        if not self._carried:
            return None
        return torch.stack([self.retained[k][3].to(device) for k in self._carried])

    def carried_read(self, refused: list[bool]) -> None:
        """Not refusals: whether each batch's integer input is in order."""
        for k, ordered in zip(self._carried, refused):
            self.retained[k] = (*self.retained[k][:3], ordered)
        self._carried = []

    def before_release(self, step: int) -> None:
        retained, self.retained = self.retained, []
        batches = [(args, kwargs, n, ordered) for args, kwargs, n, ordered in retained]
        if self.every_rank is not None:  # a check is due: on every rank alike, one batch each
            batches = batches[:1]
            if batches and not self.every_rank(batches[0][2] >= 2):
                batches = []
        batches = [batch for batch in batches if batch[2] >= 2]
        if batches:
            unread = [k for k, batch in enumerate(batches) if isinstance(batch[3], torch.Tensor)]
            if unread:  # no transfer carried them (a batch without a backward pass): one read
                device = batches[unread[0]][3].device
                values = torch.stack([batches[k][3].to(device) for k in unread]).tolist()
                for k, ordered in zip(unread, values):
                    batches[k] = (*batches[k][:3], ordered)
            verdicts: list[Verdict] = []
            for args, kwargs, n, ordered in batches:
                first = not self.first_done
                passes = agreed(first_passes(n, ordered), self.every_rank) if first else None
                levels = self.probes.levels(step, n, first, ordered, passes)
                check(self.model, self.engine, args, kwargs, n, levels, agree=self.every_rank,
                      cyclic=not ordered, verdicts=verdicts, alerts=self.alerts)
            settle(verdicts, self.every_rank)  # every batch's flags in one read
            if self.after_probes is not None:
                self.after_probes("after the example-independence check")
            self.first_done = True
        self.schedule.checking = self._due(step + 1)

    def _due(self, step: int) -> bool:
        """Whether logical step ``step`` is checked: until the first check has run, every step; then each
        with probability ``1/verify_every``, drawn from the run's randomness. Under FSDP2 the ranks agree
        (a step is checked if any rank drew it)."""
        due = not self.first_done or self.probes.due(step, self.verify_every or CHECK_INTERVAL)
        return due if self.every_rank is None else not self.every_rank(not due)


def _detached(call: ModelCall) -> tuple[tuple, dict, int | None]:
    leaves, spec = tree_flatten((call.args, call.kwargs))
    args, kwargs = tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    return args, kwargs, call.examples
