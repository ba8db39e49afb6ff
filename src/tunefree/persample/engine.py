"""The per-sample engine: the hooks' lifecycle, from a model call to the clipped sums of its backward pass.

One forward and ONE backward pass. For every module that owns trainable parameters (a *unit*,
``units.py``), a forward hook captures the call (``capture.py``) and a tensor hook receives the gradient
of its outputs. From those, the unit's layer rule (``rules/``) gives each parameter's per-sample gradients
in a lazy form, and each clip group is clipped and booked into the step's ``StepAccumulator`` as soon as
all of its uses are done (``booking.py``); under a ``GradScaler`` the loss scale is divided out first
(``amp.py``). Autograd never computes the ordinary (non-private) parameter gradients: the unit's
parameters stop requiring grad for the duration of its own forward call, so the graph has no edges to
them.

The batch is known by provenance (the Poisson loader's count of each physical batch, else the model
call's inputs), never guessed from shapes: every layer call must show exactly that many examples, and
each batch is booked by one backward pass that reaches the parameters (an input-gradient pass books
nothing). The trainable set is fixed when the engine is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import Variable

from ..clipping.functions import ClipFunction, check_clip_function
from ..clipping.groups import ClipGroup
from ..errors import PrivacyError
from ..rules import PerSampleGrad
from ..rules.generic import fallback_per_sample_grads
from ..rules.paths import PathChooser
from . import amp, capture
from .accumulator import StepAccumulator
from .booking import Booking, second_backward_message
from .float32 import ALL_DEVICES, ieee_float32
from .layout import BatchDim, DeclaredDims
from .model_loss import watch_model_losses
from .units import PassState, Unit, Use, build_units


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
        batch_dim: where the layers' tensors carry the examples (as ``make_private``'s ``batch_dim``). A
            wrong declaration is refused (example counts, the example-independence check), never trusted.
        batch_source: where the number of examples of each physical batch comes from (a private run: the
            Poisson loader's schedule). Every captured layer call must show exactly that many at its
            example dimension, and each physical batch may be booked by one backward pass only. Without
            it, the examples are those of the model call (dimension 0 of its tensor inputs) and a logical
            step books one backward pass.
        path_chooser: how layers with two exact norm paths pick one (``rules/paths.py``; timed once per
            layer shape by default). Privacy does not depend on it.
        guards: a private run's guards (``guards/``), told of every training call of the model before it
            runs (``before_forward``: the trainable set, the model's state, the inputs a checked step
            keeps for its checks).
        inputs: with the Poisson loader's ``batch_source``, refuse a training call of the model
            given no tensor of the loader's last batch (the sample the guarantee accounts for) and, on
            checked steps, inputs whose rows depend on other examples (``guards/inputs.py``).

    Each group's clip threshold starts at its configured ``threshold``; the private step hands the
    thresholds of each following step over with :meth:`begin_step`.

    ``loss_scaling`` holds the ``torch.amp.GradScaler`` whose factor multiplies the loss, once
    ``DPOptimizer.attach_grad_scaler`` attached one: each backward pass divides it out of the output
    gradients before any norm or clip weight, and an example whose output gradient or input overflows
    in a layer call adds nothing through that call (``amp.py``).
    """

    def __init__(self, model: nn.Module, groups: list[ClipGroup], clip: ClipFunction,
                 loss_reduction: str = "mean", accumulator: StepAccumulator | None = None,
                 batch_dim: BatchDim = 0, *, batch_source: BatchSource | None = None,
                 path_chooser: PathChooser | None = None, guards: ForwardGuard | None = None,
                 inputs: InputCheck | None = None):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        check_clip_function(clip, tuple(g.threshold for g in groups))  # per example, bounded (issue 29.4)
        self.model, self.groups, self.loss_reduction = model, groups, loss_reduction
        self.declared = DeclaredDims.of(model, batch_dim)
        self.units = build_units(model, self.declared)
        self._has_fallback = any(unit.rule is None for unit in self.units)
        self.accumulator = StepAccumulator() if accumulator is None else accumulator
        self.booking = Booking(groups, clip, loss_reduction, self.accumulator)  # thresholds, clip weights
        self.loss_scaling = amp.LossScaling(loss_reduction)  # the GradScaler, once one is attached
        self.batch_source, self.guards = batch_source, guards
        # With the Poisson loader (``batch_source``): the model must train on the loader's last batch.
        self.input_provenance = inputs if batch_source is not None else None
        self.path_chooser = PathChooser() if path_chooser is None else path_chooser
        self._pass = PassState()
        self._broadcast: capture.Broadcast | None = None  # the model call in progress
        self._recomputing, self._suspended, self._training_call, self._forwards = False, 0, False, 0
        self._anchor = torch.zeros((), requires_grad=True)
        self._leaked: set[str] = set()
        self._handles: list[Any] = []
        self._attach()

    def _attach(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(
            lambda mod, args, kwargs: self._new_forward(args, kwargs), prepend=True, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(
            lambda mod, args, out: self._end_forward(out), always_call=True))
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

    def begin_step(self, thresholds: Mapping[str, float]) -> None:
        """The clip threshold of each group (by name) for the backward passes of the next step (the
        private step, which owns them, hands them over)."""
        self.booking.begin_step(thresholds)

    # ------------------------------------------------------------------ forward
    def _new_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._forwards += 1
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
            self._pass.call_examples = capture.root_examples(args, kwargs, self.declared.root) \
                if self._serial() == 0 else None
            if self._has_fallback:  # only the fallback needs to tell batch data from the model's own
                self._pass.batch_storages = capture.storages(capture.flatten_call(args, kwargs)[0])
                self._pass.model_storages = capture.storages([*self.model.parameters(),
                                                              *self.model.buffers()])
        self._training_call = training  # after the guards' probes, whose own forwards end before this one
        # Shared inputs expand to the batch's examples, or inside no_capture() (the independence check)
        # to the call's own; never in a backward pass or the fallback's re-run.
        expand = torch.is_grad_enabled() and self.model.training and not self._recomputing \
            and not self._pass.in_backward
        self._broadcast = capture.broadcast_for(args, kwargs, self._expected_examples(), self.declared.root,
                                                own=not training) if expand else None
        return None if self.input_provenance is None else (args, kwargs)

    def _end_forward(self, output: Any) -> None:
        self._broadcast = None
        self._forwards -= 1
        training, self._training_call = self._training_call, False
        if training and self.guards is not None and output is not None:
            self.guards.after_forward(output)

    def running_model(self) -> bool:
        """Whether a forward of the model, the engine's own hook or a ``no_capture()`` block is running:
        its operations are not the training loop's loss."""
        return self._forwards > 0 or self._pass.in_hook or self._suspended > 0

    # The forward hooks mark the engine's own work (``in_hook``), which reads parameters for no model output.
    def _pre_forward(self, unit: Unit) -> None:
        if not self._capturing():
            return
        if self._pass.in_backward:
            raise PrivacyError(
                "a forward pass ran inside the backward pass (activation checkpointing?); tunefree "
                "captures each layer once per step: disable checkpointing for private training"
            )
        state = self._pass
        state.in_hook = True
        try:
            capture.enter_unit(state, unit)
        finally:
            state.in_hook = False

    def _post_forward(self, unit: Unit, args: tuple, kwargs: dict, output: Any) -> Any:
        state = self._pass
        capturing = bool(state.frames) and state.frames[-1].unit is unit
        if not capturing and self._broadcast is None:
            return None  # e.g. evaluation, generate()
        state.in_hook = True
        try:
            leaves, spec = capture.flatten(output)
            hooked = [i for i, leaf in enumerate(leaves)
                      if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
            shared = capture.expand_shared(self._broadcast, unit, args, kwargs, leaves, hooked)
            if not capturing:
                return None if shared is None else capture.unflatten(leaves, spec)
            frame = capture.leave_unit(state, unit, self.model)
            if not hooked:
                return None
            use = capture.new_use(state, frame, args, kwargs, [leaves[i] for i in hooked], shared,
                                  self._expected_examples)
            if unit.rule is None:  # the fallback re-runs the call in its precision
                use.autocast = amp.autocast_of(unit)
            for slot, i in enumerate(hooked):
                leaves[i] = capture.EnableGrad.apply(self._anchor, leaves[i])
                leaves[i].register_hook(lambda g, use=use, slot=slot: self._on_grad(use, slot, g))
            use.anchor_node = leaves[hooked[0]].grad_fn.next_functions[0][0]
            self.booking.expect(state, use)
            state.uses.append(use)
            return capture.unflatten(leaves, spec)
        finally:
            state.in_hook = False

    # ------------------------------------------------------------------ backward
    def _on_grad(self, use: Use, slot: int, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            raise PrivacyError(
                f"a backward pass with create_graph=True reached layer '{use.unit.name}' (double "
                "backward, e.g. a gradient penalty): tunefree clips each example's first-order gradient "
                "and cannot bound the gradient of a gradient; train without the penalty term"
            )
        if not torch._C._will_engine_execute_node(use.anchor_node):
            return  # torch.autograd.grad w.r.t. inputs (e.g. FGSM): does not reach the parameters
        if self.loss_scaling.refuses(grad):
            self._reset_pass()
            self.accumulator.pop()  # nothing of this step may be released
            raise PrivacyError(amp.MEAN_IN_HALF_PRECISION)
        if use.superseded:
            raise PrivacyError(
                "a backward pass reached a forward pass that was superseded: tunefree computes "
                "per-example gradients of one batch per backward pass; concatenate the inputs into "
                "one forward pass instead of several"
            )
        if use.done:
            raise PrivacyError(second_backward_message(f"layer '{use.unit.name}'"))
        state = self._pass
        if not state.in_backward:
            self.booking.book_batch(state, self._serial())
            state.in_backward = True
            state.loss_scale = self.loss_scaling.factor()
            Variable._execution_engine.queue_callback(self._end_of_backward)
        rule = use.unit.rule
        use.grads[slot] = amp.unscaled(grad, state.loss_scale,
                                       keep_dtype=rule is not None and rule.takes_16_bit_grads)
        use.received += 1
        if use.received == use.n_outputs:
            with ieee_float32(grad.device.type):  # no TF32 in norms and sums (docs/gpu.md, TF32)
                self._process(use)

    def _serial(self) -> int:
        return 0 if self.batch_source is None else self.batch_source.batch_serial

    def _expected_examples(self) -> int | None:
        """The examples of the current batch by provenance: the loader's physical batch, else the
        model call's; ``None`` when neither is known (a layer called outside the model)."""
        if self._serial() != 0:
            return self.batch_source.batch_examples
        return self._pass.call_examples

    def _process(self, use: Use) -> None:
        use.done = True
        per_sample: dict[str, PerSampleGrad] = {}
        if use.received:
            batch = capture.check_examples(self._pass, use, self._expected_examples())
            capture.check_versions(use)
            if batch:  # (an empty Poisson batch: no example, nothing to clip)
                capture.batch_first(use)
                if self.loss_scaling.scaler is not None:
                    amp.drop_overflowed_examples(use, batch)
                with torch.no_grad(), amp.no_autocast(use.grads):
                    per_sample = self._per_sample(use)
        with torch.no_grad():
            self.booking.add(self._pass, use, per_sample)
        use.capture = None  # free the inputs now
        use.grads, use.versions = [], []

    def _per_sample(self, use: Use) -> dict[str, PerSampleGrad]:
        if use.unit.rule is not None:
            grads = use.unit.rule.per_sample_grads(use.unit.module, use.capture, use.grads, use.params)
            for grad in grads.values():
                grad.chooser = self.path_chooser
            return grads
        self._recomputing = True
        try:
            with torch.enable_grad(), amp.replayed_autocast(use.autocast):
                return fallback_per_sample_grads(use.unit.module, use.unit.name, use.capture, use.layout,
                                                 use.grads, use.params)
        finally:
            self._recomputing = False

    def _end_of_backward(self) -> None:
        state = self._pass
        with torch.no_grad(), ieee_float32(*ALL_DEVICES):
            for use in state.uses:
                if not use.done:
                    self._process(use)
            for group in self.groups:
                self.booking.clip_group(state, group)
        self._reset_pass()
        carried_read = self.booking.close(state, None if self.guards is None else self.guards.carried)
        if carried_read is not None:
            self.guards.carried_read(carried_read)

    def _reset_pass(self) -> None:
        self._pass = PassState()

    # ------------------------------------------------------------------ ordinary gradients
    def _non_private_grad(self, name: str) -> None:
        self._leaked.add(name)
        if self._pass.uses:
            raise PrivacyError(
                f"parameter {name!r} received an ordinary (non-private) gradient: it was used "
                "outside the forward of the module that owns it (e.g. read as `module.weight` in "
                "another module's forward), or in the loss (a penalty on the weights such as "
                "λ·Σ‖p‖²). Use it through its module (for a tied output head, an nn.Linear sharing the "
                "weight), so tunefree can compute its per-sample gradient; for the penalty, give the "
                "optimizer weight_decay=2λ instead (it acts on the public weights after the release)"
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
