"""The loss check: each example's gradient at the model's outputs depends on its own outputs and labels
alone.

Per-sample clipping bounds what one example adds to the release only if the loss the training loop
writes is a sum (or mean) of per-example losses. A contrastive loss over the batch, targets
standardised by the batch, hard-example mining (``topk`` of the losses), a loss weighted by the batch's
largest loss, a temperature or label smoothing from the batch's statistics: each makes one example's
output gradient depend on the others, which clipping does not bound (1.01–2.2·R measured).

On a checked step (``schedule.checking``: the run's first step, then the steps the independence check
draws) the check records, from the end of the model's training forward to the backward call, every
torch operation the loop runs (a :class:`~torch.overrides.TorchFunctionMode`; in grad mode and under the
autocast settings each ran with). At ``loss.backward()`` (or ``torch.autograd.backward``), before anything
is booked, it replays that computation from the model's outputs as leaves: once as it ran — the replayed
loss must equal the loss (else the computation reads something the replay cannot reproduce, and the
step is refused) — then with the examples of a mask changed: their outputs moved and their labels (the
tensors of the private loader's batch the loss reads) taken from other examples. Every example outside
the mask must keep its output gradient bit for bit. The run's first check replays once per mask of a
code (:func:`probe.row_codes`, ~log₂ B masks): for every ordered pair (j, i) some mask changes j and not
i, so a loss that lets any example reach another's gradient is refused before the first release,
whatever its code. A later check replays one random half (the run's randomness): a pair is seen with
probability ≥ ¼ there.

The first check also replays the loss on the batch with every example twice (outputs and labels
repeated): a sum of per-example losses gives each copy the gradient it had, a mean half of it, exactly (a
power of two). Where that is not what ``loss_reduction`` declares — a mean over the batch, or over its
tokens, declared as a sum, whose weight on each example depends on how many examples the batch holds —
the step is refused. A computation that cannot run on twice the rows (a shape written into it) is not
checked so.

What it cannot see: a dependence through values that leave torch (``.item()``, NumPy) and come back as
constants, and labels the loss reads from somewhere other than the private loader's batch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..data.provenance import sources_of
from ..errors import PrivacyError
from . import probe
from .base import Guard, ModelCall
from .independence import ProbeSchedule, perturbed

# Operations recorded between a forward and its backward at most: a loop that runs more (an evaluation
# between them) is refused on a checked step rather than replayed.
MAX_RECORDED = 20_000

_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)
_PURPOSE = 3  # the key of the loss check's random halves in the run's randomness (ProbeSchedule)
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass
class _Randomness:
    """The global generators' states where the replay must set them (the recording's start, the forward's
    end)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor]


def _randomness() -> _Randomness:
    return _Randomness(torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in probe.rng_devices()])


@dataclass
class _Op:
    func: Callable
    args: tuple
    kwargs: dict
    result: Any
    grad_enabled: bool
    autocast: tuple


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def _in_place(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


class _Recorder(TorchFunctionMode):
    """Records the loop's torch operations until the backward call, which it hands to ``at_backward``;
    passes everything through after that (it is popped at the next point of the step)."""

    def __init__(self, at_backward: Callable, quiet: Callable[[], bool]):
        super().__init__()
        self.ops: list[_Op] = []
        self.at_backward, self.quiet = at_backward, quiet
        self.recording, self.overflowed = True, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recording or self.quiet():
            return func(*args, **kwargs)
        if func in _BACKWARDS:
            self.recording = False
            return self.at_backward(func, args, kwargs, self.ops, self.overflowed)
        if func is torch.autograd.grad:  # an input gradient (e.g. an adversarial example): not the loss
            self.recording = False
            return func(*args, **kwargs)
        grad_enabled, autocast = torch.is_grad_enabled(), _autocast_state()
        result = func(*args, **kwargs)
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            return result  # communication is never replayed: what it received is a constant there
        if len(self.ops) < MAX_RECORDED:
            self.ops.append(_Op(func, args, kwargs, result, grad_enabled, autocast))
        else:
            self.overflowed = True
        return result


class LossCheck(Guard):
    """Refuses a training loss in which one example's output gradient depends on another example.

    Args:
        schedule: the step schedule; its ``checking`` flag says whether the coming batches are checked,
            and the private loader calls :meth:`batch_handed_out` (``schedule.watchers``).
        quiet: whether the engine is inside the model's forward, its own hooks or ``no_capture()`` (those
            operations are not the loop's loss; the forward's outputs take their place in the replay).
        drop: drops the step's booked sums (a refusal releases nothing of the step).
        reduction: the ``loss_reduction`` declared to ``make_private`` (``"sum"`` or ``"mean"``).
    """

    def __init__(self, schedule, probes: ProbeSchedule, quiet: Callable[[], bool],
                 drop: Callable[[], object], reduction: str = "mean"):
        self.schedule, self.probes, self.quiet, self.drop = schedule, probes, quiet, drop
        self.reduction = reduction  # the loss_reduction declared: what the doubled batch must give
        self.first_done = False  # whether a check with every pair (the code's masks) has run
        self._recorder: _Recorder | None = None
        self._outputs: list[torch.Tensor] = []
        self._n = 0
        self._verdicts: list[tuple[torch.Tensor, Callable[[], str]]] = []  # on the device, not read yet
        schedule.watchers.append(self.batch_handed_out)

    # -- the guard's points of the step
    def batch_handed_out(self) -> None:
        """The private loader handed out a batch: on a checked step, what the loop computes from it (its
        labels' targets too) is recorded from here."""
        self._stop()
        if self.schedule.checking:
            self._start()

    def before_forward(self, call: ModelCall) -> None:
        self._n = call.examples or 0

    def after_forward(self, output: object) -> None:
        if not self.schedule.checking or self._n < 2:
            return
        outputs, _ = probe.batched_outputs(output, self._n, 0)
        if not outputs:
            return
        if self._recorder is None or not self._recorder.recording:  # the loop's own loader: from here
            self._start()
        self._outputs = outputs
        self._recorder.ops.append(_randomness())  # the loss draws from where the forward left the generators

    def before_release(self, step: int) -> None:
        self._stop()
        if self._verdicts:  # no transfer carried them (a backward pass the engine did not see): one read
            device = self._verdicts[0][0].device
            self.carried_read(torch.stack([f.to(device) for f, _ in self._verdicts]).tolist())

    def carried(self, device: torch.device) -> torch.Tensor | None:
        """The replays' flags, for the engine's transfer at the end of the backward pass they precede."""
        return torch.stack([f.to(device) for f, _ in self._verdicts]) if self._verdicts else None

    def carried_read(self, refused: list[bool]) -> None:
        verdicts, self._verdicts = self._verdicts, []
        for (_, reason), failed in zip(verdicts, refused):
            if failed:
                raise PrivacyError(reason())

    # -- the check
    def _start(self) -> None:
        self._stop()
        self._outputs = []
        self._recorder = _Recorder(self._at_backward, self.quiet)
        self._recorder.ops.append(_randomness())
        self._recorder.__enter__()

    def _stop(self) -> None:
        """Stop recording and take the recorders that are done off torch's stack of function modes (a
        refusal raised inside a recorder's backward call leaves it there, inert, until this point)."""
        if self._recorder is not None:
            self._recorder.recording = False
            self._recorder = None
        while (depth := torch._C._len_torch_function_stack()) > 0:
            top = torch._C._get_function_stack_at(depth - 1)
            if not isinstance(top, _Recorder) or top.recording:
                break
            top.__exit__(None, None, None)

    def _at_backward(self, func: Callable, args: tuple, kwargs: dict, ops: list[_Op], overflowed: bool):
        outputs, self._outputs = self._outputs, []
        if not outputs:  # no checked forward of this batch reached the backward: nothing to replay
            ops.clear()
            return func(*args, **kwargs)
        try:
            if overflowed:
                raise PrivacyError(
                    f"more than {MAX_RECORDED} torch operations ran between the model's training forward "
                    "and the backward call on a checked step: tunefree replays the loss computation to "
                    "check that each example's loss depends on its own outputs and labels only. Compute "
                    "the loss right after the forward (evaluate elsewhere, or under engine.no_capture())")
            losses, gradients = _backward_targets(func, args, kwargs)
            masks = probe.row_codes(self._n).unbind(1) if not self.first_done else \
                [self.probes.half(self.schedule.consumed, _PURPOSE, self._n)]
            self._verdicts += _check(ops, outputs, self._n, losses, gradients, masks,
                                     None if self.first_done else self.reduction)
            self.first_done = True
        except PrivacyError:
            self.drop()
            raise
        finally:
            ops.clear()
        return func(*args, **kwargs)


def _backward_targets(func: Callable, args: tuple, kwargs: dict) -> tuple[list, list]:
    """The tensors a backward call differentiates and the gradients it starts from (``None``: ones)."""
    if func is torch.Tensor.backward:
        return [args[0]], [kwargs.get("gradient", args[1] if len(args) > 1 else None)]
    tensors = kwargs.get("tensors", args[0] if args else None)
    grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    grads = [None] * len(tensors) if grads is None else \
        [grads] if isinstance(grads, torch.Tensor) else list(grads)
    return tensors, grads


def _check(ops: list, outputs: list[torch.Tensor], n: int, losses: list, gradients: list,
           masks: list[torch.Tensor], reduction: str | None = None
           ) -> list[tuple[torch.Tensor, Callable[[], str]]]:
    """The replays' verdicts, on the device (not read): each a flag, True where refused, and its reason.
    ``masks``: the examples changed in each replay after the first. ``reduction``: the declared
    ``loss_reduction``, which the batch with every example twice checks (``None``: not checked)."""
    labels = _labels(ops, outputs, n)
    base_losses, base = _replay(ops, outputs, labels, losses, gradients)
    verdicts = [(~_same(replayed, loss.detach()), lambda: _NOT_REPLAYED)
                for replayed, loss in zip(base_losses, losses)]
    for mask in masks:
        changed_outputs, changed_labels = _perturbed(outputs, n, mask), _perturbed(labels, n, mask)
        _, grads = _replay(ops, outputs, labels, losses, gradients, changed_outputs, changed_labels)
        for output, before, after in zip(outputs, base, grads):
            moved = _differs(before, after).reshape(n, -1).any(1) & ~mask.to(before.device, non_blocking=True)
            verdicts.append((moved.any(), lambda mask=mask, moved=moved, output=output:
                             _mixing(mask, int(moved.nonzero()[0]), output)))
    if reduction is not None:  # after the masks: a loss that mixes is refused as mixing first
        verdicts += _doubled(ops, outputs, labels, losses, gradients, base, n, reduction)
    return verdicts


def _doubled(ops: list, outputs: list[torch.Tensor], labels: list[torch.Tensor], losses: list,
             gradients: list, base: list[torch.Tensor], n: int, reduction: str
             ) -> list[tuple[torch.Tensor, Callable[[], str]]]:
    """The verdicts of the replay on the batch with every example twice: where the two copies of each
    example get the same output gradient, it must be the base one (a sum) or half of it (a mean), bit for
    bit. None where the replay cannot run on twice the rows; where the copies differ, the computation
    treats rows by their position (a loop over the batch's indices) or draws random numbers (twice the
    rows draw other ones for the second copy), and says nothing of the count."""
    twice = [torch.cat([t, t]) for t in outputs], [torch.cat([t, t]) for t in labels]
    try:
        _, grads = _replay(ops, outputs, labels, losses, gradients, *twice)
    except (RuntimeError, ValueError, IndexError):  # a shape written into the computation
        return []
    factor = 1.0 if reduction == "sum" else 0.5
    verdicts = []
    for output, before, after in zip(outputs, base, grads):
        if after.shape[:1] != (2 * n,) or after.shape[1:] != before.shape[1:]:
            continue
        alike = ~_differs(after[:n], after[n:]).any()  # else the computation is not the batch's own
        moved = _differs(after[:n], before * factor).reshape(n, -1).any(1)
        verdicts.append((alike & moved.any(), lambda moved=moved, output=output, after=after, before=before:
                         _depends_on_the_count(reduction, int(moved.nonzero()[0]), output, n,
                                               after[:n], before)))
    return verdicts


def _depends_on_the_count(reduction: str, i: int, output: torch.Tensor, n: int, after: torch.Tensor,
                          before: torch.Tensor) -> str:
    ratio = float(after[i].double().norm() / before[i].double().norm().clamp_min(1e-300))
    expected = "the same" if reduction == "sum" else "half of it"
    return (f"the training loss weighs each example by the number of examples (or tokens) in the batch, "
            f"not as loss_reduction={reduction!r} says: replayed on the batch of {n} with every example "
            f"twice, example {i}'s gradient at the model's output (shape {tuple(output.shape)}) became "
            f"{ratio:.4g} times what it was, where {reduction!r} means {expected}. Removing or adding one "
            "example then changes every other example's contribution, which clipping does not bound. A "
            "mean over the batch (or over its tokens) goes with make_private(..., loss_reduction='mean'); "
            "a mean over all tokens of the batch (e.g. cross_entropy over flattened tokens with "
            "ignore_index) weighs each example by its share of the batch's tokens under either: compute "
            "each example's mean over its own tokens, then sum them with loss_reduction='sum' "
            "(tunefree.token_losses_per_example). A mean written as a sum divided by the batch's size taken "
            "as a Python number (len(y), x.shape[0]) replays as a sum divided by a constant: write it with "
            ".mean() (or reduction='mean') instead")


def _labels(ops: list, outputs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The tensors of the private loader's batch (one row per example) that the recorded operations read
    without having made them: the labels (or targets) of the loss."""
    ops = [op for op in ops if isinstance(op, _Op)]
    made = set()
    for op in ops:  # a result that is one of its inputs (``.to`` of the same dtype) was not made there
        read = {id(t) for t in tree_flatten((op.args, op.kwargs))[0] if isinstance(t, torch.Tensor)}
        made |= {id(t) for t in tree_flatten(op.result)[0]
                 if isinstance(t, torch.Tensor) and id(t) not in read}
    made |= {id(t) for t in outputs}
    found: dict[int, torch.Tensor] = {}
    for op in ops:
        for t in tree_flatten((op.args, op.kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in made and sources_of(t) and t.dim() > 0 \
                    and t.shape[0] == n:
                found.setdefault(id(t), t)
    return list(found.values())


def _perturbed(tensors: list[torch.Tensor], n: int, mask: torch.Tensor) -> list[torch.Tensor]:
    """The forward check's change of the masked examples (floats moved by a pattern, integers taken from
    another example)."""
    return list(perturbed(tuple(tensors), {}, n, mask.long(), 0)[0])


def _replay(ops: list, outputs: list[torch.Tensor], labels: list[torch.Tensor], losses: list,
            gradients: list, output_values: list[torch.Tensor] | None = None,
            label_values: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The recorded operations run again from the outputs (as leaves, ``output_values`` if given) and the
    labels (``label_values``): the losses they give and the gradients of the outputs."""
    leaves = [(v if v is not None else o).detach().clone().requires_grad_()
              for o, v in zip(outputs, output_values or [None] * len(outputs))]
    env: dict[int, Any] = {id(o): leaf for o, leaf in zip(outputs, leaves)}
    for t, v in zip(labels, label_values or labels):
        env[id(t)] = v

    def mapped(x: object) -> object:
        return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

    with probe.preserved_randomness():
        for op in ops:
            if isinstance(op, _Randomness):
                torch.set_rng_state(op.cpu)
                for device, state in zip(probe.rng_devices(), op.cuda):
                    torch.cuda.set_rng_state(state, device)
                continue
            if _in_place(op.func):
                for t in tree_flatten(([op.args[0]] if op.args else [], op.kwargs.get("out")))[0]:
                    if isinstance(t, torch.Tensor) and env.get(id(t), t) is t:
                        env[id(t)] = t.detach().clone()  # a tensor from outside: written in a copy
            args, kwargs = tree_map(mapped, op.args), tree_map(mapped, op.kwargs)
            with ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(op.grad_enabled))
                for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, op.autocast):
                    if enabled != torch.is_autocast_enabled(device) or \
                            (enabled and dtype != torch.get_autocast_dtype(device)):
                        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                result = op.func(*args, **kwargs)
            for before, after in zip(tree_flatten(op.result)[0], tree_flatten(result)[0]):
                if isinstance(before, torch.Tensor):
                    env[id(before)] = after
        replayed = [env.get(id(loss), loss) for loss in losses]
        pairs = [(r, g) for r, g in zip(replayed, gradients)
                 if isinstance(r, torch.Tensor) and r.requires_grad]
        grads = torch.autograd.grad([r for r, _ in pairs], leaves,
                                    [mapped(g) if g is not None else torch.ones_like(r) for r, g in pairs],
                                    allow_unused=True) if pairs else [None] * len(leaves)
    return [r.detach() if isinstance(r, torch.Tensor) else r for r in replayed], \
        [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


def _same(a: object, b: torch.Tensor) -> torch.Tensor:
    """Whether ``a`` is ``b`` bit for bit (NaN where NaN), a flag on the device."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=b.device)
    return ~_differs(a, b).any()


_NOT_REPLAYED = (
    "the loss could not be recomputed from the model's outputs and the batch's labels: tunefree replays, on "
    "checked steps, the operations between the model's training forward and loss.backward() to check that "
    "each example's loss depends on its own outputs and labels only, and the replay gave another loss. The "
    "loss reads something that changes between calls (state kept across batches, such as a queue of earlier "
    "outputs, or randomness not drawn from torch). Compute each example's loss from its outputs and labels, "
    "and sum (or average) them")


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a != b) & ~(a.isnan() & b.isnan())


def _mixing(mask: torch.Tensor, i: int, output: torch.Tensor) -> str:
    rows = mask.nonzero().flatten().tolist()
    which = ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")
    return (f"the training loss mixes examples: changing the outputs and labels of examples {which} changed "
            f"the gradient of example {i}'s loss at the model's output (shape {tuple(output.shape)}). Per-"
            "example clipping bounds one example's contribution only if the loss is a sum (or mean) of "
            "per-example losses, each computed from that example's outputs and labels alone: a "
            "contrastive loss over the batch, targets or a temperature from the batch's statistics, "
            "hard-example mining (topk over the batch's losses) or weights from the batch's largest loss "
            "each let one example move the others' gradients. Compute each example's loss on its own, "
            "e.g. loss_fn(outputs, labels, reduction='none').sum(), with make_private(..., "
            "loss_reduction='sum')")
