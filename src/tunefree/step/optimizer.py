"""``DPOptimizer``: any ``torch.optim.Optimizer``, fed privatised gradients — the torch façade of the
private step.

The façade keeps torch's optimizer contract (``param_groups``, ``state``, ``state_dict``, step hooks, LR
schedulers, a ``GradScaler``); at the end of each logical batch ``step()`` runs the private step
(``step/private_step.py``: guards, release, record, components, update). Physical micro-batches in between
only accumulate clipped sums.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..data.poisson import StepSchedule
from ..persample.engine import ClippingEngine
from .component import StepReport
from .private_step import PrivateStep


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``param_groups``, ``state``, ``state_dict`` and LR schedulers behave as with
    the wrapped optimizer.

    Args:
        optimizer: the user's optimizer over the model's trainable parameters.
        engine: the per-sample engine hooked into the model.
        schedule: logical-step bookkeeping shared with the Poisson loader.
        private_step: the private step run at the end of each logical batch (it owns the release, the
            ledger, the guards, the components and the clip thresholds).

    A closure returns the loss, as in ``torch.optim``, unless a component reads per-sample losses from it
    (``StepComponent.closure_gives_per_sample_losses``: HyFreeDP's learning rate). Step hooks
    (``register_step_pre_hook``/``register_step_post_hook``) fire once per logical step, around the whole
    private step, as torch's do; micro-batch calls that only accumulate do not fire them.

    Mixed precision: after :meth:`attach_grad_scaler`, ``scaler.scale(loss).backward();
    scaler.step(optimizer); scaler.update()`` trains privately (``persample/amp.py``: the contract).
    """

    # GradScaler.step calls our step() directly instead of unscaling ``.grad`` itself: the engine writes
    # no ``.grad`` before the release, and the loss scale is divided out inside the engine.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ClippingEngine, schedule: StepSchedule,
                 private_step: PrivateStep):
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("the optimizer is already private; pass the original optimizer")
        self.original, self.engine, self.schedule = optimizer, engine, schedule
        self.private_step = private_step
        private_step.overflowed = partial(engine.loss_scaling.overflowed, self)
        self.ledger, self.release = private_step.ledger, private_step.release
        self.accumulator, self.components = private_step.accumulator, private_step.components
        self.expected_batch_size = private_step.expected_batch_size
        self.closure_gives_per_sample_losses = any(c.closure_gives_per_sample_losses for c in self.components)
        self.last_step: StepReport | None = None
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def thresholds(self) -> dict[str, float]:
        """The clip thresholds of the next step, by group."""
        return self.private_step.thresholds

    def attach_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Train with ``scaler`` (float16 loss scaling). Its scale is divided out of every output
        gradient before per-sample norms and clip weights, so it changes no clip weight; an example
        that overflows contributes nothing where it overflows, and every step is released and recorded
        as planned. Call it before the first backward pass. It needs ``loss_reduction="sum"``: under a
        mean loss each example's scaled gradient is divided by the batch size, so whether it overflows
        would depend on how many other examples were sampled."""
        self.engine.loss_scaling.attach(scaler)

    # -- the wrapped optimizer's state, shared (LR schedulers edit param_groups in place)
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.original.state

    @state.setter
    def state(self, value) -> None:
        self.original.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.original.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("parameters cannot be added after make_private: the engine would not "
                           "see them; build the optimizer with every parameter first")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original!r})"

    # -- the private step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on privatised gradients (only at the end of a logical batch).

        ``closure``, if given, is evaluated first with gradients enabled, as ``torch.optim`` does: it
        runs the forward and backward pass of the current batch and returns the loss. With HyFreeDP's
        learning rate (``lr=HyFreeDP()``) it instead returns the current batch's
        per-sample losses (a 1-D tensor) and tunefree evaluates it, without gradients, at the probe
        points of the learning-rate fit.
        """
        logical = self.schedule.ends_logical
        self.engine.loss_scaling.check_step_call(self, logical)
        if logical:
            closure = self._run_pre_hooks(closure)
        loss = None
        if closure is not None and not self.closure_gives_per_sample_losses:
            with torch.enable_grad():
                loss = closure()
        if not self.schedule.on_step():
            return loss
        self.last_step = self.private_step.run(closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, *self._hook_arguments(closure))
        return loss

    def component_states(self) -> dict[str, Any]:
        """Each component's checkpoint state, by its ``state_key``."""
        return {c.state_key: c.state_dict() for c in self.components}

    def resume(self, states: dict[str, Any]) -> None:
        """Continue a checkpoint's run: restore :meth:`component_states` (the same components, or
        refused) and the thresholds that follow from them; from now on the checkpoint's ledger accounts
        for every update of the wrapped optimizer (none counts as before the run)."""
        if set(states) != {c.state_key for c in self.components}:
            raise ValueError(
                f"this checkpoint holds the state of the step components {sorted(states)}, this run has "
                f"{sorted(c.state_key for c in self.components)}; resume with the same settings")
        for component in self.components:
            component.load_state_dict(states[component.state_key])
        self.private_step.hand_over_thresholds()
        self.private_step.updates_before_run = 0

    # -- step hooks, as torch.optim runs them (torch's wrapper does not run for this class)
    def _hook_arguments(self, closure: Callable[[], Any] | None) -> tuple[tuple, dict[str, Any]]:
        return ((self,) if closure is None else (self, closure)), {}

    def _run_pre_hooks(self, closure: Callable[[], Any] | None) -> Callable[[], Any] | None:
        """Run the step pre hooks; one may return new ``(args, kwargs)``, i.e. a new closure."""
        for hook in list(self._optimizer_step_pre_hooks.values()):
            result = hook(self, *self._hook_arguments(closure))
            if result is None:
                continue
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"a step pre hook must return None or (args, kwargs), got {result!r}")
            args, kwargs = result
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
        return closure

