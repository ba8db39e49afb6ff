"""The per-sample engine: hooks, grouping, norms → clip weights → book-keeping of ``Σᵢ wᵢ gᵢ``.

One forward and ONE backward pass. For every module that owns trainable parameters (a *unit*), a forward
hook keeps the module's inputs and a tensor hook receives the gradient of its outputs. From those, the
unit's layer rule (``rules/``) gives each parameter's per-sample gradients in a lazy form; the engine
sums their squared norms per clip group, turns them into clip weights, and accumulates the weighted sum
into ``clipped_sum``. Autograd never computes the ordinary (non-private) parameter gradients: the unit's
parameters stop requiring grad for the duration of its own forward call, so the graph has no edges to
them.

A group is clipped as soon as all of its parameters are done: per-layer and per-parameter groups inside
the backward pass, the moment their layer's output gradient arrives (then that layer's tensors are freed
at once); all-layer groups at the end of the backward pass. The clipped sums go into the step's
``StepAccumulator``.

The batch is known by provenance (the Poisson loader's count of each physical batch, else the model
call's inputs), never guessed from shapes: every layer call must show exactly that many examples, and
each batch is booked by one backward pass that reaches the parameters (an input-gradient pass books
nothing). The trainable set is fixed when the engine is built.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import Variable
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..clipping.functions import ClipFunction, check_clip_function
from ..clipping.groups import ClipGroup
from ..dtypes import accumulation_dtype, norm_dtype
from ..errors import ModelRefused, PrivacyError
from ..rules import Capture, LayerRule, PerSampleGrad, rule_for
from ..rules.generic import fallback_per_sample_grads
from ..rules.layout import Axis, CallLayout, Dim
from ..rules.paths import PathChooser
from ..rules.summed import SummedUses
from .accumulator import StepAccumulator
from .float32 import ALL_DEVICES, ieee_float32
from .layout import (
    BatchDim,
    DeclaredDims,
    call_layout,
    example_dim,
    expand_rows,
    has_one_row,
    layout_hint,
    only_from_batch,
)
from .model_loss import watch_model_losses
from .parametrized import check_parametrized

# Modules whose statistics mix the examples of a batch, with the replacement to suggest (add one with
# tunefree.extend.register_example_mixing).
SAMPLE_MIXING: dict[type[nn.Module], str] = {
    nn.modules.batchnorm._BatchNorm: "nn.GroupNorm (or nn.LayerNorm)",
}


# Each example's gradient must reach the engine as a function of that example alone (issue 21).
MEAN_IN_HALF_PRECISION = (
    "loss_reduction='mean' with gradients in float16 or bfloat16 (autocast, or half-precision parameters) "
    "is refused: the mean divides each example's gradient by the number of examples in the batch before "
    "it is rounded to 16 bits, so how it rounds (and, under loss scaling, whether it overflows) depends on "
    "how many other examples were sampled: one example would move the others' contributions (measured up "
    "to 1.02·R in bfloat16). Sum the per-example losses (loss_fn(..., reduction='sum')) and pass "
    "make_private(..., loss_reduction='sum'); float32 needs no change")

# A per-sample norm at or above this (or NaN) is an overflow: refused rather than clipped, since a
# float32 clip weight R/‖g‖ would then be subnormal and the bound ‖w·g‖ ≤ R could round away.
NORM_LIMIT = 1e30


class BatchSource(Protocol):
    """Where the engine learns the batch by provenance (the Poisson loader's ``StepSchedule``):
    ``batch_serial`` numbers the physical batches handed out (0: none yet), ``batch_examples`` is the
    number of examples in the last one."""

    batch_serial: int
    batch_examples: int | None


@dataclass(frozen=True)
class ModelCall:
    """A training call of the model, as the root hook sees it: its plain inputs (provenance taken off), the
    examples of the batch by provenance (``None``: not known), and, for each input leaf in
    ``tree_flatten((args, kwargs))`` order, whether it was computed from the Poisson loader's batch
    (``None``: no provenance, the loop's own loader)."""

    args: tuple
    kwargs: dict
    examples: int | None
    from_loader: tuple[bool, ...] | None


class InputCheck(Protocol):
    """What the model trains on (``guards/inputs.py``): takes the provenance off a model call's inputs and
    says why a training call must not be booked (``None``: it may), and which leaves come from the
    loader's batch."""

    def model_call(self, args: tuple, kwargs: dict, training: bool, root: int
                   ) -> tuple[tuple, dict, str | None, tuple[bool, ...]]: ...


class ForwardGuard(Protocol):
    """A private run's guards (``guards/base.py``), at the start of every training call of the model."""

    def before_forward(self, call: ModelCall) -> None: ...

    def carried(self, device: torch.device) -> torch.Tensor | None: ...  # flags read with the transfer

    def carried_read(self, refused: list[bool]) -> None: ...


class _EnableGrad(torch.autograd.Function):
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


@dataclass(eq=False)
class Unit:
    """A module the engine hooks, with the trainable parameters it answers for.

    ``rule`` units answer for their direct parameters. Fallback units (``rule is None``) answer for
    their direct parameters and for the parameters of descendant units that do not run during the call
    (e.g. ``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``).
    """

    name: str
    module: nn.Module
    rule: LayerRule | None
    direct: dict[str, nn.Parameter]
    descendants: list[Unit] = field(default_factory=list)
    declared_dim: int = 0  # the example dimension declared for it (batch_dim), for layers that take one
    example_dim: int | None = 0  # the one dimension all its tensors carry the examples in, if any

    _plain: dict[tuple[int, int], CallLayout] = field(default_factory=dict)  # layouts of plain calls

    def layout(self, args: tuple, kwargs: dict, num_outputs: int) -> CallLayout:
        """Where this call's inputs and floating-point outputs carry the examples (for a plain call of
        a layer with one example dimension, made once per number of inputs and outputs)."""
        plain = self.rule is not None and self.example_dim is not None and not kwargs \
            and all(isinstance(x, torch.Tensor) for x in args)
        key = (len(args), num_outputs)
        if not plain or key not in self._plain:
            layout = call_layout(self.module, self.rule, self.declared_dim, args, kwargs, num_outputs)
            if not plain:
                return layout
            self._plain[key] = layout
        return self._plain[key]

    def subtree_params(self) -> dict[nn.Parameter, None]:
        params = dict.fromkeys(self.direct.values())
        for unit in self.descendants:
            params.update(dict.fromkeys(unit.direct.values()))
        return params


@dataclass(eq=False)
class _Use:
    """One call of a unit in the current forward pass."""

    unit: Unit
    capture: Capture
    layout: CallLayout
    params: dict[str, nn.Parameter]  # names as the rule (or torch.func) sees them
    versions: list[tuple[torch.Tensor, int]]
    n_outputs: int
    grads: list[torch.Tensor | None]
    anchor_node: Any  # the anchor's node in this call's graph (see _EnableGrad)
    autocast: tuple[str, torch.dtype] | None = None  # the call's autocast, replayed by the fallback
    received: int = 0
    done: bool = False
    superseded: bool = False  # a later forward pass replaced this one before any backward


@dataclass(eq=False)
class _Frame:
    """A unit call in progress in the forward pass."""

    unit: Unit
    saved: list[tuple[nn.Parameter, bool]]  # requires_grad flags to restore after the call
    fired: set[Unit] = field(default_factory=set)  # units called inside it (for fallback units)
    reads: _ParameterReads | None = None  # parameters its own code reads (for fallback units)


@dataclass(frozen=True)
class _Broadcast:
    """The model call in progress, for expanding shared inputs: its examples and the storages of its
    tensor inputs (a tensor sharing one of them holds example data and is never expanded)."""

    examples: int
    call_storages: set[int]


@dataclass(eq=False)
class _PassState:
    """Everything the engine knows about the current forward/backward pass."""

    uses: list[_Use] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # group → uses not yet done
    uses_of: dict[nn.Parameter, int] = field(default_factory=lambda: defaultdict(int))
    per_param: dict[nn.Parameter, PerSampleGrad] = field(default_factory=dict)
    sq_norms: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    clipped_groups: set[str] = field(default_factory=set)
    finite_checks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    frames: list[_Frame] = field(default_factory=list)
    fallback_stack: list[_Frame] = field(default_factory=list)
    batch: int | None = None  # examples of this pass, once checked
    call_examples: int | None = None  # examples of the model call (without a loader)
    batch_storages: set[int] = field(default_factory=set)  # storages of the model call's inputs
    model_storages: set[int] = field(default_factory=set)  # storages of parameters and buffers
    in_backward: bool = False
    in_hook: bool = False  # the engine's own forward hooks are running (not the model's code)
    loss_scale: float = 1.0  # the GradScaler factor of this backward pass's loss
    input_refusal: str | None = None  # why the model call's inputs must not train (InputProvenance)


class ClippingEngine:
    """Hooks a model and produces, after each backward pass, the clipped per-sample gradient sums.

    Args:
        model: the model, in train mode; it stays a plain ``nn.Module``.
        groups: clip groups covering every trainable parameter exactly once.
        clip: the clip function; each group's clipped per-sample gradient has norm ≤ its threshold.
        loss_reduction: ``"mean"`` if the loss is the mean of the per-example losses over the batch,
            ``"sum"`` if it is their sum. Per-sample gradients are those of each example's own loss.
        accumulator: where each backward pass books its clipped sums (``make_private`` passes the one
            the private optimizer releases from); a new one by default, for standalone use.
        batch_dim: where the layers' tensors carry the examples, for layers whose type does not fix it
            (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, HF ``Conv1D``, modules of
            the generic fallback): one dimension for the whole model (and its inputs), or a mapping from
            module names to dimensions (``""``: the model itself; a module takes its closest named
            ancestor's entry). Recurrent layers and attention follow their ``batch_first``,
            convolutions and GroupNorm dimension 0. A wrong declaration is refused (example counts, the
            example-independence check), never trusted.
        batch_source: where the number of examples of each physical batch comes from (a private run: the
            Poisson loader's schedule). Every captured layer call must show exactly that many at its
            example dimension, and each physical batch may be booked by one backward pass only. Without
            it, the examples are those of the model call (dimension 0 of its tensor inputs) and a logical
            step books one backward pass.
        path_chooser: how layers with two exact norm paths (ghost norm, materialised per-sample
            gradients) pick one: timed once per layer shape by default; ``PathChooser(measure=False)``
            follows the cost formula (deterministic), ``PathChooser(fixed="ghost")`` forces a path.
            Privacy does not depend on it.
        guards: a private run's guards (``guards/``), told of every training call of the model before it
            runs (``before_forward``: the trainable set, the model's state, the inputs a checked step
            keeps for its checks).
        inputs: with the Poisson loader's ``batch_source``, refuse a training call of the model
            given no tensor of the loader's last batch (the sample the guarantee accounts for) and, on
            checked steps, inputs whose rows depend on other examples (``guards/inputs.py``).

    Each group's clip threshold starts at its configured ``threshold``; the private step hands the
    thresholds of each following step over with :meth:`begin_step`.

    ``grad_scaler`` (given by :meth:`attach_grad_scaler`): the ``torch.amp.GradScaler`` whose
    factor multiplies the loss. Each backward pass divides it out of the output gradients before any
    norm or clip weight, and an example whose output gradient or input overflows in a layer call adds
    nothing through that call (see :func:`_drop_overflowed_examples`).
    """

    def __init__(self, model: nn.Module, groups: list[ClipGroup], clip: ClipFunction,
                 loss_reduction: str = "mean", accumulator: StepAccumulator | None = None,
                 batch_dim: BatchDim = 0, *, batch_source: BatchSource | None = None,
                 path_chooser: PathChooser | None = None, guards: ForwardGuard | None = None,
                 inputs: InputCheck | None = None):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.model, self.groups, self.clip = model, groups, clip
        check_clip_function(clip, tuple(g.threshold for g in groups))  # per example, bounded (issue 29.4)
        self.loss_reduction = loss_reduction
        self.declared = DeclaredDims.of(model, batch_dim)
        self.units = build_units(model, self.declared)
        self._has_fallback = any(unit.rule is None for unit in self.units)
        self._group_of = {p: g for g in groups for p in g.params}
        self._check_coverage()
        self._anchor = torch.zeros((), requires_grad=True)
        self._handles: list[Any] = []
        self.accumulator = StepAccumulator() if accumulator is None else accumulator
        self.batch_source = batch_source
        # With the Poisson loader (``batch_source``): the model must train on the loader's last batch.
        self.input_provenance = inputs if batch_source is not None else None
        self._pass = _PassState()
        self._recomputing = False
        self._suspended = 0
        self._broadcast: _Broadcast | None = None
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.thresholds: dict[str, float] = {g.name: g.threshold for g in groups}
        self.path_chooser = PathChooser() if path_chooser is None else path_chooser
        self._leaked: set[str] = set()
        self.guards = guards
        self._attach()

    # ------------------------------------------------------------------ set-up
    def _check_coverage(self) -> None:
        covered = {p for u in self.units for p in u.direct.values()}
        for name, p in self.model.named_parameters():
            if p.requires_grad and p not in covered:  # pragma: no cover - every owner is a unit
                raise PrivacyError(f"trainable parameter {name!r} is not reachable by any layer "
                                   "rule or the fallback")

    def _attach(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(
            lambda mod, args, kwargs: self._new_forward(args, kwargs), prepend=True, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(
            lambda mod, args, out: self._end_forward(), always_call=True))
        for unit in self.units:
            m = unit.module
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, u=unit: self._pre_forward(u), with_kwargs=True))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, kwargs, out, u=unit: self._post_forward(u, args, kwargs, out),
                with_kwargs=True, always_call=True, prepend=True))
        # a Hugging Face model's own loss from labels= must be one loss_reduction describes (issue 29.3)
        self._handles += watch_model_losses(self.model, self._capturing, self.loss_reduction)
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, name=name: self._non_private_grad(name)))

    def detach(self) -> None:
        """Remove every hook; the model is left exactly as it was given."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset_pass()

    # ------------------------------------------------------------------ forward
    def _capturing(self) -> bool:
        return (torch.is_grad_enabled() and self.model.training and not self._recomputing
                and not self._suspended)

    @contextmanager
    def no_capture(self) -> Iterator[None]:
        """Forward and backward passes inside this block are invisible to the engine: they book no
        example and release nothing (e.g. the input gradient of an adversarial example). A backward
        that reaches trainable parameters inside it still writes ordinary gradients, which the next
        ``step()`` refuses."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def attach_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Divide ``scaler``'s loss scale out of every output gradient from the next backward pass on
        (``DPOptimizer.attach_grad_scaler``)."""
        self.grad_scaler = scaler

    def begin_step(self, thresholds: Mapping[str, float]) -> None:
        """The clip threshold of each group (by name) for the backward passes of the next step (the
        private step, which owns them, hands them over)."""
        if set(thresholds) != set(self.thresholds):
            raise ValueError(f"thresholds must name exactly the clip groups {sorted(self.thresholds)}")
        self.thresholds = {name: float(value) for name, value in thresholds.items()}

    def _new_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        training = self._capturing() and not self._pass.in_backward
        refusal, from_loader = None, None
        if self.input_provenance is not None:  # the model computes on the call's plain tensors
            args, kwargs, refusal, from_loader = self.input_provenance.model_call(args, kwargs, training,
                                                                                  self.declared.root)
        if training:
            if self.guards is not None:
                self.guards.before_forward(ModelCall(args, kwargs, self._expected_examples(), from_loader))
            # Calls of a forward pass that never had a backward pass released nothing: forget them.
            for use in self._pass.uses:
                use.superseded = not use.done
                use.done = True
            self._reset_pass()
            self._pass.input_refusal = refusal
            self._pass.call_examples = _root_examples(args, kwargs, self.declared.root) \
                if self._serial() == 0 else None
            if self._has_fallback:  # only the fallback needs to tell batch data from the model's own
                self._pass.batch_storages = _storages(_flatten_call(args, kwargs)[0])
                self._pass.model_storages = _storages([*self.model.parameters(),
                                                       *self.model.buffers()])
        self._broadcast = self._broadcast_for(args, kwargs)
        return None if self.input_provenance is None else (args, kwargs)

    def _broadcast_for(self, args: tuple, kwargs: dict) -> _Broadcast | None:
        """How to expand shared inputs in this model call: to the batch's examples by provenance, or,
        inside ``no_capture()`` (the independence check), to the call's own examples when its inputs
        agree; ``None`` when there is nothing to expand (no gradient, one example)."""
        if not (torch.is_grad_enabled() and self.model.training) or self._recomputing \
                or self._pass.in_backward:
            return None
        leaves = [x for x in _flatten_call(args, kwargs)[0] if isinstance(x, torch.Tensor)]
        if self._capturing():
            examples = self._expected_examples()
        else:
            root = self.declared.root
            sizes = {x.shape[root] for x in leaves if x.dim() > root}
            examples = sizes.pop() if len(sizes) == 1 else None
        if examples is None or examples == 1:
            return None
        return _Broadcast(examples, _storages(leaves))

    def _end_forward(self) -> None:
        self._broadcast = None

    def _shared_examples(self, unit: Unit, args: tuple, kwargs: dict,
                         outputs: list[torch.Tensor]) -> int | None:
        """The examples to expand this call's outputs to, when the call is shared by all examples: its
        outputs have one row in the unit's example dimension while the batch has another number, no
        input is computed with gradients, and every input sharing memory with the model call's inputs
        has one row per example (e.g. position ids (1, L) from a buffer or ``arange``, or BART's
        positions built from the shape of the decoder ids). The independence check refuses a shared
        output that depends on an example's values. ``None`` otherwise, and for units whose tensors carry
        the examples in different dimensions (recurrent layers, attention)."""
        broadcast, dim = self._broadcast, unit.example_dim
        if broadcast is None or not outputs or dim is None:
            return None
        if not all(has_one_row(out, dim) for out in outputs):
            return None
        for x in _flatten_call(args, kwargs)[0]:
            if isinstance(x, torch.Tensor) and (x.requires_grad or (
                    _storage(x) in broadcast.call_storages
                    and (x.dim() <= dim or x.shape[dim] != broadcast.examples))):
                return None
        return broadcast.examples

    # The forward hooks mark the engine's own work (``in_hook``), which reads parameters for no model output.
    def _pre_forward(self, unit: Unit) -> None:
        state = self._pass
        state.in_hook = True
        try:
            self._enter_unit(unit)
        finally:
            state.in_hook = False

    def _post_forward(self, unit: Unit, args: tuple, kwargs: dict, output: Any) -> Any:
        state = self._pass
        state.in_hook = True
        try:
            return self._leave_unit(unit, args, kwargs, output)
        finally:
            state.in_hook = False

    def _enter_unit(self, unit: Unit) -> None:
        if not self._capturing():
            return
        if self._pass.in_backward:
            raise PrivacyError(
                "a forward pass ran inside the backward pass (activation checkpointing?); tunefree "
                "captures each layer once per step: disable checkpointing for private training"
            )
        for frame in self._pass.fallback_stack:
            frame.fired.add(unit)
        saved = [(t, t.requires_grad) for t in _tensors_in_call(unit)]
        for t, _ in saved:
            t.requires_grad_(False)
        self._pass.frames.append(_Frame(unit, saved))
        if unit.rule is None:
            frame = self._pass.frames[-1]
            frame.reads = _ParameterReads(self._pass, set(unit.subtree_params()))
            frame.reads.__enter__()
            self._pass.fallback_stack.append(frame)

    def _leave_unit(self, unit: Unit, args: tuple, kwargs: dict, output: Any) -> Any:
        capturing = bool(self._pass.frames) and self._pass.frames[-1].unit is unit
        if not capturing and self._broadcast is None:
            return None  # e.g. evaluation, generate()
        leaves, spec = _flatten(output)
        hooked = [i for i, leaf in enumerate(leaves)
                  if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        shared = self._shared_examples(unit, args, kwargs, [leaves[i] for i in hooked])
        if shared is not None:
            # A call shared by all examples: make its broadcast over the batch explicit, so that its
            # output gradient has a row per example. Broadcasting downstream is unchanged.
            for i in hooked:
                leaves[i] = expand_rows(leaves[i], unit.example_dim, shared)
        if not capturing:
            return None if shared is None else _unflatten(leaves, spec)
        frame = self._pass.frames.pop()
        for p, flag in frame.saved:
            p.requires_grad_(flag)
        if unit.rule is None:
            self._pass.fallback_stack.pop()
            self._check_reads(frame)
        if self._pass.fallback_stack:
            # Inside a fallback call, a unit that ran answers for its own parameters: any further read
            # of them there (a tied head, F.linear(h, tok.weight)) must reach autograd, where the
            # engine refuses it as a use outside their module, instead of being silently dropped.
            for p in unit.direct.values():
                p.requires_grad_(True)
        if not hooked:
            return None
        capture, versions = _capture(args, kwargs, expand_to=shared if unit.rule is not None else None,
                                     dim=unit.example_dim)
        layout = self._layout(unit, args, kwargs, capture, [leaves[i] for i in hooked])
        use = _Use(unit=unit, capture=capture, layout=layout,
                   params=self._use_params(unit, frame),
                   versions=versions, n_outputs=len(hooked), grads=[None] * len(hooked),
                   anchor_node=None, autocast=_autocast_of(unit) if unit.rule is None else None)
        for slot, i in enumerate(hooked):
            leaves[i] = _EnableGrad.apply(self._anchor, leaves[i])
            leaves[i].register_hook(lambda g, use=use, slot=slot: self._on_grad(use, slot, g))
        use.anchor_node = leaves[hooked[0]].grad_fn.next_functions[0][0]
        for p in use.params.values():
            self._pass.pending[self._group_of[p].name] += 1
            self._pass.uses_of[p] += 1
        self._pass.uses.append(use)
        return _unflatten(leaves, spec)

    def _check_reads(self, frame: _Frame) -> None:
        """A fallback unit's own code read a parameter of a unit it also called: that read's share
        of the gradient would reach neither the unit's rule nor the fallback's re-run, and is refused."""
        frame.reads.__exit__(None, None, None)
        fired = {p: name for u in frame.fired for name, p in u.direct.items()}
        lost = [p for p in frame.reads.seen if p in fired]
        if lost:
            names = {p: n for n, p in self.model.named_parameters()}
            raise PrivacyError(
                f"parameter {names.get(lost[0], fired[lost[0]])!r} is used outside the forward of the "
                f"module that owns it, in the forward of {type(frame.unit.module).__name__} (handled "
                "by tunefree's generic fallback), which also calls that module: that use's share of "
                "the gradient would be lost. Use the parameter only through its module (for a tied "
                "output head, an nn.Linear sharing the weight)")

    def _layout(self, unit: Unit, args: tuple, kwargs: dict, capture: Capture,
                outputs: list[torch.Tensor]) -> CallLayout:
        """The call's layout; for a generic fallback call, only its inputs derived from the batch with
        the batch's examples count as per example (the others are passed whole to each example)."""
        layout = unit.layout(capture.args, capture.kwargs, len(outputs))
        if unit.rule is not None or unit.example_dim is None:
            return layout
        examples = self._expected_examples()
        if examples is None:  # a layer called outside the model's forward: its own output tells
            examples = layout.outputs[0].examples(outputs[0])
        leaves = _flatten_call(capture.args, capture.kwargs)[0]
        return only_from_batch(layout, leaves, self._from_batch(args, kwargs), examples)

    def _from_batch(self, args: tuple, kwargs: dict) -> tuple[bool, ...]:
        """For each input leaf: derived from the batch, i.e. downstream of hooked outputs (requires
        grad) or sharing storage with the model call's inputs, and never a parameter or buffer."""
        def derived(x: Any) -> bool:
            if not isinstance(x, torch.Tensor) or _storage(x) in self._pass.model_storages:
                return False
            return x.requires_grad or _storage(x) in self._pass.batch_storages
        return tuple(derived(x) for x in _flatten_call(args, kwargs)[0])

    def _use_params(self, unit: Unit, frame: _Frame) -> dict[str, nn.Parameter]:
        if unit.rule is not None:
            return dict(unit.direct)
        names = {m: n for n, m in unit.module.named_modules()}
        params = dict(unit.direct)
        for child in unit.descendants:
            if child not in frame.fired:
                params.update({f"{names[child.module]}.{n}": p for n, p in child.direct.items()})
        return params

    # ------------------------------------------------------------------ backward
    def _on_grad(self, use: _Use, slot: int, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            raise PrivacyError(
                f"a backward pass with create_graph=True reached layer '{use.unit.name}' (double "
                "backward, e.g. a gradient penalty): tunefree clips each example's first-order gradient "
                "and cannot bound the gradient of a gradient; train without the penalty term"
            )
        if not torch._C._will_engine_execute_node(use.anchor_node):
            return  # torch.autograd.grad w.r.t. inputs (e.g. FGSM): does not reach the parameters
        if self.loss_reduction == "mean" and grad.dtype in (torch.float16, torch.bfloat16):
            self._reset_pass()
            self.accumulator.pop()  # nothing of this step may be released
            raise PrivacyError(MEAN_IN_HALF_PRECISION)
        if use.superseded:
            raise PrivacyError(
                "a backward pass reached a forward pass that was superseded: tunefree computes "
                "per-example gradients of one batch per backward pass; concatenate the inputs into "
                "one forward pass instead of several"
            )
        if use.done:
            raise PrivacyError(self._second_backward_message(f"layer '{use.unit.name}'"))
        if not self._pass.in_backward:
            self._book_batch()
            self._pass.in_backward = True
            self._pass.loss_scale = self._loss_scale()
            Variable._execution_engine.queue_callback(self._end_of_backward)
        rule = use.unit.rule
        use.grads[slot] = self._unscaled(grad, keep_dtype=rule is not None and rule.takes_16_bit_grads)
        use.received += 1
        if use.received == use.n_outputs:
            with ieee_float32(grad.device.type):  # no TF32 in norms and sums (docs/gpu.md, TF32)
                self._process(use)

    def _loss_scale(self) -> float:
        """The factor the loss of the starting backward pass was multiplied by (1 without a scaler)."""
        scaler = self.grad_scaler
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0

    def _unscaled(self, grad: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """A layer's output gradient as the unscaled loss gives it, in float32 for half-precision
        gradients (the dtype policy): per-sample norms, clip weights and clipped sums never see the loss
        scale, and none of them is rounded to 16 bits. ``keep_dtype``: the layer's rule converts a
        16-bit gradient itself where it computes (``LayerRule.takes_16_bit_grads``), so without a loss
        scale to divide out it is kept as it arrived, in half the memory."""
        if self._pass.loss_scale == 1.0:
            return grad if keep_dtype else grad.to(accumulation_dtype(grad.dtype))
        return grad.to(accumulation_dtype(grad.dtype)) / self._pass.loss_scale

    def _serial(self) -> int:
        return 0 if self.batch_source is None else self.batch_source.batch_serial

    def _book_batch(self) -> None:
        """One backward pass per physical batch (without a loader: per logical step)."""
        if self._pass.input_refusal is not None:
            raise PrivacyError(self._pass.input_refusal)
        serial = self._serial()
        if not self.accumulator.book_batch(serial):
            what = "this batch" if serial else "this step (no private loader: one batch per step)"
            raise PrivacyError(self._second_backward_message(what))

    @staticmethod
    def _second_backward_message(what: str) -> str:
        return (f"a second backward pass reached {what}, whose examples were already booked: each "
                "example may add one clipped gradient per step. Sum the losses into one backward "
                "(loss = loss_a + loss_b; loss.backward()); for adversarial examples, compute input "
                "gradients inside engine.no_capture() or with torch.autograd.grad(loss, inputs)")

    def _expected_examples(self) -> int | None:
        """The examples of the current batch by provenance: the loader's physical batch, else the
        model call's; ``None`` when neither is known (a layer called outside the model)."""
        if self._serial() != 0:
            return self.batch_source.batch_examples
        return self._pass.call_examples

    def _check_examples(self, use: _Use) -> int:
        present = [(g, axis) for g, axis in zip(use.grads, use.layout.outputs) if g is not None]
        expected = self._expected_examples() if self._pass.batch is None else self._pass.batch
        if expected is None:
            expected = present[0][1].examples(present[0][0])
        for grad, axis in present:
            if axis.examples(grad) != expected:
                raise PrivacyError(_batch_mismatch(use.unit, use.capture, grad, axis, expected))
        self._pass.batch = expected
        return expected

    def _batch_first(self, use: _Use) -> None:
        """Turn the call's output gradients batch-first, and, for a layer with one example dimension
        (``nn.Linear``, ``nn.Embedding``, …), its inputs too: rules and the fallback work on examples in
        dimension 0 (the fallback restores each example's layout as it re-runs the module)."""
        use.grads = [None if g is None else axis.batch_first(g)
                     for g, axis in zip(use.grads, use.layout.outputs)]
        dim = use.unit.example_dim
        if use.unit.rule is not None and dim:
            leaves, spec = _flatten_call(use.capture.args, use.capture.kwargs)
            leaves = [x.movedim(dim, 0) if isinstance(x, torch.Tensor) else x for x in leaves]
            use.capture.args, use.capture.kwargs = _unflatten_call(leaves, spec)
            use.layout = CallLayout(tuple(None if a is None else Dim(0) for a in use.layout.inputs),
                                    use.layout.outputs)

    def _process(self, use: _Use) -> None:
        use.done = True
        if use.received == 0:
            per_sample: dict[str, PerSampleGrad] = {}
        else:
            batch = self._check_examples(use)
            for tensor, version in use.versions:
                if tensor._version != version:
                    raise PrivacyError(
                        f"the input of layer '{use.unit.name}' was modified in place after the layer "
                        "used it; tunefree needs it unchanged (replace the in-place operation)"
                    )
            if batch == 0:  # an empty Poisson batch: no example, nothing to clip
                per_sample = {}
            else:
                self._batch_first(use)
                if self.grad_scaler is not None:
                    _drop_overflowed_examples(use, batch)
                with torch.no_grad(), _no_autocast(use.grads):
                    per_sample = self._per_sample(use)
        with torch.no_grad():
            for p in use.params.values():
                self._pass.pending[self._group_of[p].name] -= 1
            for name, p in use.params.items():
                grad = per_sample.get(name)
                if grad is not None:
                    self._add_use(p, grad)
            for group in {self._group_of[p] for p in use.params.values()}:
                if self._group_ready(group):
                    self._clip_group(group)
        use.capture = None  # free the inputs now
        use.grads, use.versions = [], []

    def _per_sample(self, use: _Use) -> dict[str, PerSampleGrad]:
        if use.unit.rule is not None:
            grads = use.unit.rule.per_sample_grads(use.unit.module, use.capture, use.grads, use.params)
            for grad in grads.values():
                grad.chooser = self.path_chooser
            return grads
        self._recomputing = True
        try:
            with torch.enable_grad(), _replayed_autocast(use.autocast):
                return fallback_per_sample_grads(use.unit.module, use.unit.name, use.capture, use.layout,
                                                 use.grads, use.params)
        finally:
            self._recomputing = False

    def _add_use(self, p: nn.Parameter, grad: PerSampleGrad) -> None:
        if self._pass.uses_of[p] == 1:
            if not self._group_ready(self._group_of[p]):  # kept until the group's last use
                self._pass.sq_norms[p] = grad.sq_norms()
                grad.compact()
            self._pass.per_param[p] = grad
        else:  # used more than once: the per-sample gradient is the sum over uses, kept as their forms
            total = self._pass.per_param.get(p)
            self._pass.per_param[p] = grad if total is None else SummedUses.join(total, grad)

    def _group_ready(self, group: ClipGroup) -> bool:
        return self._pass.pending[group.name] == 0

    def _clip_group(self, group: ClipGroup) -> None:
        """Clip weights from the group's per-sample norms, and its clipped sums into the accumulator,
        one parameter at a time in the group's order (``None`` for a parameter no example of this pass
        reached): every parameter's sum is complete when it is booked, and is formed only when its turn
        comes, so that an accumulator that sends each sum on (FSDP2) holds few of them at once and
        receives them in the same order on every rank, one with no example included."""
        if group.name in self._pass.clipped_groups:
            return
        self._pass.clipped_groups.add(group.name)
        per_param = self._pass.per_param
        present = [p for p in group.params if p in per_param]
        weights, fused = self._clip_weights(group, present) if present else (None, {})
        for p in group.params:
            if p in fused:
                self.accumulator.add(p, fused.pop(p))
            elif p in per_param:
                self.accumulator.add(p, per_param.pop(p).weighted_sum(weights))
            else:
                self.accumulator.add(p, None)

    def _clip_weights(self, group: ClipGroup, present: list[nn.Parameter]
                      ) -> tuple[torch.Tensor, dict[nn.Parameter, torch.Tensor]]:
        """The group's clip weights from its per-sample norms (booked, with their overflow check) and
        the clipped sum of the largest parameter whose norms were not yet known (for per-layer groups:
        the layer's weight), formed with its norms and weights in one pass
        (``PerSampleGrad.clipped_sum``); the group's other parameters get the same weights."""
        per_param, known = self._pass.per_param, self._pass.sq_norms
        scale = float(self._pass.batch) if self.loss_reduction == "mean" else 1.0
        weights_of = _Weigher(self.clip, self.thresholds[group.name], self._pass.batch, scale)
        pending = [p for p in present if p not in known]
        fused = max(pending, key=lambda p: p.numel()) if pending else None
        sq = None
        for p in present:
            if p is not fused:
                more = known.pop(p) if p in known else per_param[p].sq_norms()
                sq = more if sq is None else sq + more
        if sq is None:  # the fused parameter is the group's only one
            sq = torch.zeros(self._pass.batch, dtype=norm_dtype(present[0].dtype), device=present[0].device)
        sums = {}
        if fused is None:
            weights = weights_of(sq)
        else:
            result = per_param.pop(fused).clipped_sum(sq, weights_of)
            sums[fused], weights = result.total, result.weights
        norms = weights_of.norms()
        self._pass.finite_checks.append((group.name, norms))
        self.accumulator.add_norms(group.name, norms)
        return weights, sums

    def _end_of_backward(self) -> None:
        with torch.no_grad(), ieee_float32(*ALL_DEVICES):
            for use in self._pass.uses:
                if not use.done:
                    self._process(use)
            for group in self.groups:
                self._clip_group(group)
        carried = None
        if self._pass.finite_checks:  # every group's norms in one check, the guards' flags with them (their
            # comparisons of the model's state, guards/base.py), in one transfer to the host
            norms = torch.stack([norms for _, norms in self._pass.finite_checks])
            finite = (norms < NORM_LIMIT).all(1)
            carried = self.guards.carried(finite.device) if self.guards is not None else None
            read = (finite if carried is None else torch.cat([finite, carried])).cpu().tolist()
            bad = [name for (name, _), ok in zip(self._pass.finite_checks, read) if not ok]
            if bad:
                self._reset_pass()
                self.accumulator.pop()  # the logical step's sums are tainted: nothing of them may be released
                raise PrivacyError(
                    f"per-sample gradient norms of clip groups {bad} are NaN, infinite or beyond "
                    f"{NORM_LIMIT:g} (overflowing): the loss "
                    "or the model overflowed for some example (lower the learning rate, check the "
                    "inputs, or use float32/bfloat16 instead of float16)"
                )
        self.accumulator.add_examples(self._pass.batch or 0)
        groups = len(self._pass.finite_checks)
        self._reset_pass()
        if carried is not None:
            self.guards.carried_read(read[groups:])

    def _reset_pass(self) -> None:
        self._pass = _PassState()

    # ------------------------------------------------------------------ results
    def _non_private_grad(self, name: str) -> None:
        self._leaked.add(name)
        if self._pass.uses:
            raise PrivacyError(
                f"parameter {name!r} received an ordinary (non-private) gradient: it was used "
                "outside the forward of the module that owns it (e.g. read as `module.weight` in "
                "another module's forward). Use it through its module (for a tied output head, an "
                "nn.Linear sharing the weight), so tunefree can compute its per-sample gradient"
            )

    def check_no_leak(self) -> None:
        """Raise if autograd wrote ordinary gradients into trainable parameters since the last step."""
        if self._leaked:
            names = sorted(self._leaked)
            self._leaked.clear()
            raise PrivacyError(
                f"parameters {names} hold ordinary gradients from a backward pass the engine did not "
                "see (was the model in eval mode, or called under torch.no_grad?); run training steps "
                "with model.train() and let the private optimizer produce the gradients"
            )


# Tensor methods and attributes that read a parameter's metadata or switch its flags, not its values.
_NOT_A_READ = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "data", "size",
    "dim", "numel", "requires_grad_", "detach", "data_ptr", "untyped_storage", "element_size", "stride",
    "is_floating_point", "is_complex", "is_contiguous", "__hash__", "__repr__", "__format__", "__len__",
})


class _ParameterReads(TorchFunctionMode):
    """While a fallback unit's forward runs: which of ``watched`` (its subtree's parameters) its own
    code reads with gradients enabled — not inside a captured unit's forward, which answers for its
    own parameters, nor in the engine's own hooks (``state.in_hook``)."""

    def __init__(self, state: _PassState, watched: set[nn.Parameter]):
        super().__init__()
        self.state, self.watched = state, watched
        self.seen: set[nn.Parameter] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frames = self.state.frames
        if (torch.is_grad_enabled() and not self.state.in_hook and frames and frames[-1].unit.rule is None
                and _method_name(func) not in _NOT_A_READ):
            for leaf in _flatten_call(args, kwargs)[0]:
                if isinstance(leaf, nn.Parameter) and leaf in self.watched:
                    self.seen.add(leaf)
        return func(*args, **kwargs)


def _tensors_in_call(unit: Unit) -> list[torch.Tensor]:
    """The parameter tensors a unit's modules hold as its call starts, which the engine takes out of
    autograd's graph for the call: its own parameters, or the tensor a wrapper's earlier pre-forward
    hook swapped in for one (FSDP2 replaces each sharded parameter by its all-gathered, unsharded
    tensor for the call). Everything else is keyed by the parameters themselves (``unit.direct``)."""
    owners = [unit, *unit.descendants] if unit.rule is None else [unit]
    return [owner.module._parameters[name] for owner in owners for name in owner.direct]


def _method_name(func: Any) -> str:
    """``torch.Tensor.shape.__get__`` → ``shape``; a function's own name otherwise."""
    name = resolve_name(func) or ""
    return name.removeprefix("torch.Tensor.").removesuffix(".__get__")


class _Weigher:
    """A clip group's ``weights_of``: clip weights from per-sample squared norms (of the pass's examples
    in order, a slice of them per call), keeping the norms it weighed: the step books and checks exactly
    the norms whose weights clipped the sums. Under a mean loss each example's gradient is the batch size
    times its share of the loss's."""

    def __init__(self, clip: ClipFunction, threshold: float, batch: int, scale: float):
        self.clip, self.threshold, self.batch, self.scale = clip, threshold, batch, scale
        self._norms: list[torch.Tensor] = []

    def __call__(self, sq: torch.Tensor) -> torch.Tensor:
        norms = sq.sqrt() if self.scale == 1.0 else sq.sqrt() * self.scale
        self._norms.append(norms)
        weights = self.clip.weights(norms, self.threshold)
        return weights if self.scale == 1.0 else weights * self.scale

    def norms(self) -> torch.Tensor:
        """The norms of every example weighed, in order; each example of the pass weighed once."""
        weighed = sum(n.shape[0] for n in self._norms)
        if weighed != self.batch:  # a form that skipped or repeated examples: its sum is not clipped right
            raise RuntimeError(f"internal error: {weighed} per-sample norms weighed for a pass of "
                               f"{self.batch} examples")
        return self._norms[0] if len(self._norms) == 1 else torch.cat(self._norms)


class _no_autocast:
    """Engine arithmetic runs outside any autocast region the user's backward call sits in."""

    def __init__(self, grads: list[torch.Tensor | None]):
        device = next((g.device.type for g in grads if g is not None), "cpu")
        self._ctx = torch.autocast(device_type=device, enabled=False) \
            if torch.is_autocast_enabled(device) else nullcontext()

    def __enter__(self):
        self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _autocast_of(unit: Unit) -> tuple[str, torch.dtype] | None:
    """The autocast region a unit's forward call runs in (device type, dtype), if any."""
    device = next(iter(unit.direct.values())).device.type
    return (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None


def _replayed_autocast(state: tuple[str, torch.dtype] | None) -> AbstractContextManager:
    """The fallback re-runs a module in the precision its forward ran in (no autocast if none)."""
    return nullcontext() if state is None else torch.autocast(device_type=state[0], dtype=state[1])


def _drop_overflowed_examples(use: _Use, batch: int) -> None:
    """Under loss scaling (float16), zero in this layer call every row of an example whose output
    gradient, or whose input to the call, is infinite or NaN: its per-sample gradient here is then 0, and
    so is its clipped contribution (norm and sum come from the same zeros). Whether an example overflows
    depends on that example alone, and only its own rows change, so each example's contribution stays a
    function of its own data bounded by the clip threshold, and the step releases on schedule whatever
    the data. Output gradients arrive batch-first; inputs are checked where the call's layout keeps their
    examples along a dimension (for the generic fallback, only inputs derived from the batch); any other
    non-finite value still fails closed at the norm check."""
    ok = torch.ones(batch, dtype=torch.bool, device=next(g for g in use.grads if g is not None).device)
    leaves, spec = tree_flatten((use.capture.args, use.capture.kwargs))
    rows = [(i, axis.dim) for i, (x, axis) in enumerate(zip(leaves, use.layout.inputs))
            if isinstance(axis, Dim) and isinstance(x, torch.Tensor) and x.is_floating_point()
            and axis.examples(x) == batch]
    for i, dim in rows:
        ok &= _finite_rows(leaves[i], dim, batch)
    for grad in use.grads:
        if grad is not None:
            ok &= _finite_rows(grad, 0, batch)
    for i, dim in rows:
        leaves[i] = _zero_rows(leaves[i], ok, dim)
    use.grads = [None if g is None else _zero_rows(g, ok, 0) for g in use.grads]
    use.capture.args, use.capture.kwargs = tree_unflatten(leaves, spec)


def _finite_rows(x: torch.Tensor, dim: int, batch: int) -> torch.Tensor:
    return torch.isfinite(x).movedim(dim, 0).reshape(batch, -1).all(1)


def _zero_rows(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    shape = [size if d == dim else 1 for d, size in enumerate(x.shape)]
    return torch.where(keep.reshape(shape), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _capture(args: tuple, kwargs: dict, expand_to: int | None = None, dim: int | None = 0
             ) -> tuple[Capture, list[tuple[torch.Tensor, int]]]:
    """The call's inputs, detached, with their version counters to detect later in-place edits.
    ``expand_to``: the call is shared by all examples; its inputs with one row in the example dimension
    ``dim`` are expanded to that many rows, as a layer rule needs one row per example (the fallback
    passes shared inputs whole)."""
    leaves, spec = _flatten_call(args, kwargs)
    leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    versions = [(x, x._version) for x in leaves if isinstance(x, torch.Tensor)]
    if expand_to is not None and dim is not None:
        leaves = [expand_rows(x, dim, expand_to) if isinstance(x, torch.Tensor) and has_one_row(x, dim) else x
                  for x in leaves]
    args, kwargs = _unflatten_call(leaves, spec)
    return Capture(args=args, kwargs=kwargs), versions


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, without its cost for a single tensor (spec ``None``)."""
    return ([tree], None) if isinstance(tree, torch.Tensor) else tree_flatten(tree)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def _flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))`` (same leaves, same order), without its cost for the common
    layer call: positional tensors and no keywords (spec ``None``)."""
    if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
        return list(args), None
    return tree_flatten((args, kwargs))


def _unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    return (tuple(leaves), {}) if spec is None else tree_unflatten(leaves, spec)


def _storage(x: torch.Tensor) -> int:
    """The memory a tensor lives in (a tensor without strided storage is its own)."""
    return x.untyped_storage().data_ptr() if x.layout == torch.strided else id(x)


def _storages(leaves: list[Any]) -> set[int]:
    return {_storage(x) for x in leaves if isinstance(x, torch.Tensor)}


def _root_examples(args: tuple, kwargs: dict, dim: int = 0) -> int | None:
    """The examples of a model call: dimension ``dim`` (declared, 0 by default) of its tensor inputs,
    which must agree."""
    sizes = {tuple(t.shape): t.shape[dim] for t in _flatten_call(args, kwargs)[0]
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


def check_model(model: nn.Module) -> None:
    """Refuse compiled models and modules that mix examples, with the fix to use."""
    check_parametrized(model)  # a weight computed from other parameters: the true reason (issue 29.8)
    if any(type(module).__name__ == "OptimizedModule" for module in model.modules()):
        raise ModelRefused(
            "the model (or one of its modules) was compiled with torch.compile before make_private; "
            "compiled code bypasses the hooks that clip each example's gradient: call make_private "
            "on the plain model"
        )
    for name, module in model.named_modules():
        for kind, fix in SAMPLE_MIXING.items():
            if isinstance(module, kind):
                raise ModelRefused(
                    f"'{name or type(model).__name__}' is a {type(module).__name__}, which mixes "
                    f"the examples of a batch (its statistics, and so each example's gradient, depend "
                    f"on the other examples); replace it with {fix}"
                )


def build_units(model: nn.Module, declared: DeclaredDims | None = None) -> list[Unit]:
    """One unit per module that directly owns trainable parameters, each with the example dimension
    declared for it (``batch_dim``)."""
    check_model(model)
    declared = declared or DeclaredDims.of(model, 0)
    units: dict[nn.Module, Unit] = {}
    for name, module in model.named_modules():
        direct = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not direct:
            continue
        rule = rule_for(module, set(direct))
        if rule is not None:
            rule.check(module, name or "(root)")
        elif module._forward_hooks or module._forward_pre_hooks:
            raise ModelRefused(
                f"module '{name or '(root)'}' ({type(module).__name__}) has forward hooks registered "
                "before make_private, and no layer rule: tunefree re-runs such a module one example at "
                "a time and cannot replay what a hook does to it; remove the hook, or register it on "
                "a module that has no trainable parameters of its own (a parent or a wrapper)"
            )
        declared.check_fixed(name, module, rule)
        dim = declared.of_module(name)
        units[module] = Unit(name=name or "(root)", module=module, rule=rule, direct=direct,
                             declared_dim=dim, example_dim=example_dim(module, rule, dim))
    for module, unit in units.items():
        if unit.rule is None:
            unit.descendants = [units[m] for m in module.modules() if m is not module and m in units]
    return list(units.values())
