"""Capture: what the engine keeps of each training call of a unit, and how it reads it back.

In the forward pass: the unit's parameters out of autograd's graph for the call, its inputs detached with
their version counters, its layout (where its tensors carry the examples), the parameters it answers
for; a call shared by all examples (one row) expanded to one row per example; a generic fallback's own
reads of parameters watched. As the call's output gradients arrive: its example count checked against the
batch's (by provenance, never by shape), its inputs checked unchanged, and both turned batch-first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PrivacyError
from ..rules import Capture
from ..rules.layout import Axis, CallLayout, Dim
from .layout import expand_rows, has_one_row, layout_hint, only_from_batch
from .units import Frame, PassState, Unit, Use


class EnableGrad(torch.autograd.Function):
    """Identity on a layer output that ties it to the engine's anchor leaf. It makes the output part of
    the graph when nothing before it requires grad (the first layer, whose parameters the engine has
    taken out of the graph), and the anchor's node runs only in a backward pass over all leaves
    (``loss.backward()``), never in ``torch.autograd.grad(loss, inputs)``: such a pass does not reach
    the parameters and books nothing."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


@dataclass(frozen=True)
class Broadcast:
    """The model call in progress, for expanding shared inputs: its examples and the storages of its
    tensor inputs (a tensor sharing one of them holds example data and is never expanded)."""

    examples: int
    call_storages: set[int]


def broadcast_for(args: tuple, kwargs: dict, examples: int | None, root: int = 0, own: bool = False
                  ) -> Broadcast | None:
    """How to expand shared inputs in a model call of the batch's ``examples`` (the model's examples in
    dimension ``root`` of its inputs), or, ``own`` (inside ``no_capture()``: the independence check), of
    the call's own examples when its inputs agree; ``None`` when there is nothing to expand (one example,
    or not known), or when no input of the call has the batch's rows: the model called on part of the
    batch (manual micro-batching), whose one-row layer calls hold an example's data, not a shared value
    (the engine's example count then refuses the call, naming micro-batching)."""
    leaves = [x for x in flatten_call(args, kwargs)[0] if isinstance(x, torch.Tensor)]
    sizes = {x.shape[root] for x in leaves if x.dim() > root}
    if own:
        examples = sizes.pop() if len(sizes) == 1 else None
    elif examples is not None and sizes and max(sizes) < examples:
        return None
    if examples is None or examples == 1:
        return None
    return Broadcast(examples, storages(leaves))


def expand_shared(broadcast: Broadcast | None, unit: Unit, args: tuple, kwargs: dict, leaves: list[Any],
                  hooked: list[int]) -> int | None:
    """Expand the outputs ``leaves[hooked]`` of a call shared by all examples to the batch's examples
    (returned; ``None``: not shared), so that its output gradient has a row per example; broadcasting
    downstream is unchanged. A call is shared when its outputs have one row in the unit's example
    dimension while the batch has another number, no input is computed with gradients, and every input
    sharing memory with the model call's inputs has one row per example (e.g. position ids (1, L) from a
    buffer or ``arange``, or BART's positions built from the shape of the decoder ids). The independence
    check refuses a shared output that depends on an example's values. Never for units whose tensors
    carry the examples in different dimensions (recurrent layers, attention)."""
    dim = unit.example_dim
    if broadcast is None or not hooked or dim is None:
        return None
    if not all(has_one_row(leaves[i], dim) for i in hooked):
        return None
    for x in flatten_call(args, kwargs)[0]:
        if isinstance(x, torch.Tensor) and (x.requires_grad or (
                storage(x) in broadcast.call_storages
                and (x.dim() <= dim or x.shape[dim] != broadcast.examples))):
            return None
    for i in hooked:
        leaves[i] = expand_rows(leaves[i], dim, broadcast.examples)
    return broadcast.examples


def enter_unit(state: PassState, unit: Unit) -> None:
    """A training call of ``unit`` starts: the parameters it answers for leave autograd's graph for the
    call, and a fallback unit's own reads of parameters are watched."""
    for frame in state.fallback_stack:
        frame.fired.add(unit)
    frame = Frame(unit, [(t, t.requires_grad) for t in tensors_in_call(unit)])
    for t, _ in frame.saved:
        t.requires_grad_(False)
    state.frames.append(frame)
    if unit.rule is None:
        frame.reads = ParameterReads(state, set(unit.subtree_params()))
        frame.reads.__enter__()
        state.fallback_stack.append(frame)


def leave_unit(state: PassState, unit: Unit, model: nn.Module) -> Frame:
    """The call of ``unit`` ends: its parameters' flags restored, a fallback's reads checked."""
    frame = state.frames.pop()
    for p, flag in frame.saved:
        p.requires_grad_(flag)
    if unit.rule is None:
        state.fallback_stack.pop()
        _check_reads(frame, model)
    if state.fallback_stack:
        # Inside a fallback call, a unit that ran answers for its own parameters: any further read
        # of them there (a tied head, F.linear(h, tok.weight)) must reach autograd, where the
        # engine refuses it as a use outside their module, instead of being silently dropped.
        for p in unit.direct.values():
            p.requires_grad_(True)
    return frame


def new_use(state: PassState, frame: Frame, args: tuple, kwargs: dict, outputs: list[torch.Tensor],
                shared: int | None, examples: Callable[[], int | None]) -> Use:
    """The call as its backward will need it: inputs (a rule's shared inputs expanded to ``shared``
    rows), version counters, layout, the parameters it answers for."""
    unit = frame.unit
    leaves, spec = flatten_call(args, kwargs)
    leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    versions = [(x, x._version) for x in leaves if isinstance(x, torch.Tensor)]
    if shared is not None and unit.rule is not None and unit.example_dim is not None:
        dim = unit.example_dim
        leaves = [expand_rows(x, dim, shared) if isinstance(x, torch.Tensor) and has_one_row(x, dim) else x
                  for x in leaves]
    capture = Capture(*unflatten_call(leaves, spec))
    layout = unit.layout(capture.args, capture.kwargs, len(outputs))
    if unit.rule is None and unit.example_dim is not None:
        # only inputs derived from the batch with the batch's examples count as per example; the
        # others are passed whole to each example
        count = examples()
        if count is None:  # a layer called outside the model's forward: its own output tells
            count = layout.outputs[0].examples(outputs[0])
        layout = only_from_batch(layout, leaves, _from_batch(state, args, kwargs), count)
    return Use(unit=unit, capture=capture, layout=layout, params=_use_params(unit, frame), versions=versions,
               n_outputs=len(outputs), grads=[None] * len(outputs))


def _from_batch(state: PassState, args: tuple, kwargs: dict) -> tuple[bool, ...]:
    """For each input leaf: derived from the batch, i.e. downstream of hooked outputs (requires
    grad) or sharing storage with the model call's inputs, and never a parameter or buffer."""
    def derived(x: Any) -> bool:
        if not isinstance(x, torch.Tensor) or storage(x) in state.model_storages:
            return False
        return x.requires_grad or storage(x) in state.batch_storages
    return tuple(derived(x) for x in flatten_call(args, kwargs)[0])


def _use_params(unit: Unit, frame: Frame) -> dict[str, nn.Parameter]:
    if unit.rule is not None:
        return dict(unit.direct)
    names = {m: n for n, m in unit.module.named_modules()}
    params = dict(unit.direct)
    for child in unit.descendants:
        if child not in frame.fired:
            params.update({f"{names[child.module]}.{n}": p for n, p in child.direct.items()})
    return params


def check_examples(state: PassState, use: Use, expected: int | None) -> int:
    """The examples the call's output gradients show where it carries them, which must be the pass's (the
    batch's by provenance, ``expected``; the first call's when not known)."""
    present = [(g, axis) for g, axis in zip(use.grads, use.layout.outputs) if g is not None]
    if state.batch is not None:
        expected = state.batch
    if expected is None:
        expected = present[0][1].examples(present[0][0])
    for grad, axis in present:
        if axis.examples(grad) != expected:
            raise PrivacyError(_batch_mismatch(use.unit, use.capture, grad, axis, expected))
    state.batch = expected
    return expected


def check_versions(use: Use) -> None:
    for tensor, version in use.versions:
        if tensor._version != version:
            raise PrivacyError(
                f"the input of layer '{use.unit.name}' was modified in place after the layer "
                "used it; tunefree needs it unchanged (replace the in-place operation)"
            )


def batch_first(use: Use) -> None:
    """Turn the call's output gradients batch-first, and, for a layer with one example dimension
    (``nn.Linear``, ``nn.Embedding``, …), its inputs too: rules and the fallback work on examples in
    dimension 0 (the fallback restores each example's layout as it re-runs the module)."""
    use.grads = [None if g is None else axis.batch_first(g) for g, axis in zip(use.grads, use.layout.outputs)]
    dim = use.unit.example_dim
    if use.unit.rule is not None and dim:
        leaves, spec = flatten_call(use.capture.args, use.capture.kwargs)
        leaves = [x.movedim(dim, 0) if isinstance(x, torch.Tensor) else x for x in leaves]
        use.capture.args, use.capture.kwargs = unflatten_call(leaves, spec)
        use.layout = CallLayout(tuple(None if a is None else Dim(0) for a in use.layout.inputs),
                                use.layout.outputs)


def root_examples(args: tuple, kwargs: dict, dim: int = 0) -> int | None:
    """The examples of a model call: dimension ``dim`` (declared, 0 by default) of its tensor inputs,
    which must agree."""
    sizes = {tuple(t.shape): t.shape[dim] for t in flatten_call(args, kwargs)[0]
             if isinstance(t, torch.Tensor) and t.dim() > dim}
    if len(set(sizes.values())) > 1:
        raise PrivacyError(
            f"the model was called with tensor inputs of shapes {sorted(sizes)}, whose dimension {dim} "
            f"disagree: without the private loader tunefree takes the examples from dimension {dim} of "
            "the model's inputs (batch_dim declares it); pass every input with one row per example "
            "there (expand a tensor shared by all examples, e.g. position ids (1, L) → (B, L), or build "
            "it, or an initial state, inside the model), or train with the private loader, which counts "
            "the examples itself"
        )
    return next(iter(sizes.values()), None)


def _batch_mismatch(unit: Unit, capture: Capture | None, grad: torch.Tensor, axis: Axis,
                    expected: int) -> str:
    inputs = [tuple(t.shape) for t in tree_flatten((capture.args, capture.kwargs))[0]
              if isinstance(t, torch.Tensor)] if capture is not None else []
    seen = axis.examples(grad)
    shape = tuple(grad.shape)
    partial = ("the model or a layer called on part of the batch cannot be attributed to examples. If the "
               "loop cuts the loader's batch into parts (a forward and backward per part: manual "
               "micro-batching), let tunefree cut it: make_private(..., physical_batch_size=k) hands out "
               "each Poisson batch in physical batches of at most k examples (call engine.optimizer.step() "
               "after each; the step releases once per logical batch). A layer called on part of the batch "
               "(e.g. only the sequences still running at a step of a loop over packed sequences): call it "
               "on every example (keep finished sequences in the batch and mask their outputs, or use "
               "nn.LSTM/GRU/RNN, which take a PackedSequence)")
    if seen == 1 and expected != 1:
        hint = ("a tensor with one row is broadcast over the batch (e.g. position ids of shape (1, L)): "
                f"expand it to one row per example, (B, ...), before the call; or {partial}")
    elif isinstance(axis, Dim) and expected in shape[:axis.dim] + (None,) + shape[axis.dim + 1:]:
        hint = layout_hint(unit.name, unit.module, unit.rule, axis.dim, shape.index(expected))
    elif seen is not None and seen < expected:
        hint = partial
    else:
        hint = ("feed the model the batches the private loader hands out, with one row per example "
                "where each layer carries its examples")
    return (f"layer '{unit.name}' (inputs of shapes {inputs}, output of shape {shape}, a "
            f"{type(unit.module).__name__}) shows {seen} examples in {axis.describe()}, where it carries its "
            f"examples, but the batch holds {expected}: {hint}")


# Tensor methods and attributes that read a parameter's metadata or switch its flags, not its values.
_NOT_A_READ = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "data", "size",
    "dim", "numel", "requires_grad_", "detach", "data_ptr", "untyped_storage", "element_size", "stride",
    "is_floating_point", "is_complex", "is_contiguous", "__hash__", "__repr__", "__format__", "__len__",
})


class ParameterReads(TorchFunctionMode):
    """While a fallback unit's forward runs: which of ``watched`` (its subtree's parameters) its own
    code reads with gradients enabled — not inside a captured unit's forward, which answers for its
    own parameters, nor in the engine's own hooks (``state.in_hook``)."""

    def __init__(self, state: PassState, watched: set[nn.Parameter]):
        super().__init__()
        self.state, self.watched = state, watched
        self.seen: set[nn.Parameter] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frames = self.state.frames
        if (torch.is_grad_enabled() and not self.state.in_hook and frames and frames[-1].unit.rule is None
                and _method_name(func) not in _NOT_A_READ):
            for leaf in flatten_call(args, kwargs)[0]:
                if isinstance(leaf, nn.Parameter) and leaf in self.watched:
                    self.seen.add(leaf)
        return func(*args, **kwargs)


def _check_reads(frame: Frame, model: nn.Module) -> None:
    """A fallback unit's own code read a parameter of a unit it also called: that read's share
    of the gradient would reach neither the unit's rule nor the fallback's re-run, and is refused."""
    frame.reads.__exit__(None, None, None)
    fired = {p: name for u in frame.fired for name, p in u.direct.items()}
    lost = [p for p in frame.reads.seen if p in fired]
    if lost:
        names = {p: n for n, p in model.named_parameters()}
        raise PrivacyError(
            f"parameter {names.get(lost[0], fired[lost[0]])!r} is used outside the forward of the "
            f"module that owns it, in the forward of {type(frame.unit.module).__name__} (handled "
            "by tunefree's generic fallback), which also calls that module: that use's share of "
            "the gradient would be lost. Use the parameter only through its module (for a tied "
            "output head, an nn.Linear sharing the weight)")


def _method_name(func: Any) -> str:
    """``torch.Tensor.shape.__get__`` → ``shape``; a function's own name otherwise."""
    name = resolve_name(func) or ""
    return name.removeprefix("torch.Tensor.").removesuffix(".__get__")


def tensors_in_call(unit: Unit) -> list[torch.Tensor]:
    """The parameter tensors a unit's modules hold as its call starts, which the engine takes out of
    autograd's graph for the call: its own parameters, or the tensor a wrapper's earlier pre-forward
    hook swapped in for one (FSDP2 replaces each sharded parameter by its all-gathered, unsharded
    tensor for the call). Everything else is keyed by the parameters themselves (``unit.direct``)."""
    owners = [unit, *unit.descendants] if unit.rule is None else [unit]
    return [owner.module._parameters[name] for owner in owners for name in owner.direct]


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, without its cost for a single tensor (spec ``None``)."""
    return ([tree], None) if isinstance(tree, torch.Tensor) else tree_flatten(tree)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))`` (same leaves, same order), without its cost for the common
    layer call: positional tensors and no keywords (spec ``None``)."""
    if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
        return list(args), None
    return tree_flatten((args, kwargs))


def unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    return (tuple(leaves), {}) if spec is None else tree_unflatten(leaves, spec)


def storage(x: torch.Tensor) -> int:
    """The memory a tensor lives in (a tensor without strided storage is its own)."""
    return x.untyped_storage().data_ptr() if x.layout == torch.strided else id(x)


def storages(leaves: list[Any]) -> set[int]:
    return {storage(x) for x in leaves if isinstance(x, torch.Tensor)}
