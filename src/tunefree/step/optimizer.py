"""``DPOptimizer``: any ``torch.optim.Optimizer``, fed privatised gradients.

At the end of each logical batch, ``step()`` takes the engine's clipped per-sample gradient sums, has the
gradient mechanism add Gaussian noise, records the release in the ledger, divides by the expected batch
size ``q·N``, writes the result to ``.grad`` and steps the wrapped optimizer. Every release of the step
joins the ledger's one Poisson-sampled event for it the moment it is made, so that no update is ever
applied for a release the ledger lacks, whatever fails or interrupts the step. Physical micro-batches in
between only accumulate clipped sums.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import dp_accounting as dpa
import torch
from torch.utils._pytree import tree_flatten

from ..data.poisson import StepSchedule
from ..errors import PrivacyError
from ..persample.accumulator import StepAccumulator
from ..persample.engine import ClippingEngine
from ..persample.independence import FIRST_KINDS, ProbeSchedule, verify_example_independence
from ..persample.state_guard import StateGuard
from ..privacy.ledger import Ledger
from ..privacy.mechanisms import GradientRelease
from ..privacy.randomness import SecretSource
from ..rules import Capture
from .component import StepComponent, StepContext, StepReport, UpdateControl

# The expected number of steps between two independence checks when ``verify_every`` is not given.
CHECK_INTERVAL = 24


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``param_groups``, ``state``, ``state_dict`` and LR schedulers behave as with
    the wrapped optimizer.

    Args:
        optimizer: the user's optimizer over the model's trainable parameters.
        engine: the per-sample engine hooked into the model.
        release: the gradient mechanism (noise σ relative to the clip groups' total sensitivity).
        ledger: where each step's releases are recorded.
        sample_rate: the Poisson sampling rate q of every logical batch.
        expected_batch_size: ``q·N``; the noisy sum is divided by it (never by the private batch size).
        schedule: logical-step bookkeeping shared with the Poisson loader.
        accumulator: where the engine books the step's clipped sums; the optimizer pops it once per
            logical step and releases what it holds.
        components: the parts of the step beyond the gradient release (adaptive thresholds, a
            learning-rate rule), run in this order after the release.
        planned_steps: the length of training the noise was calibrated for (``None``: no plan); the
            first step beyond it warns that ε now grows past the target.
        verify_every: after the checks of the first two steps (one probe of each kind), each step checks
            example independence with probability 1/verify_every (``None``: 1/24; 1: every step).
        every_rank: under FSDP2, whose forward passes are collectives: whether a flag is True on every
            rank, so that every rank runs the independence check or none does (``None``: one process).
        probes: which steps are checked and on which examples, drawn from the run's randomness (``None``:
            fresh secret randomness).
        state_guard: the check that between steps the model changes only through the wrapped optimizer's
            update (``persample.state_guard``), run before the release and the update.

    The optimizer owns the clip thresholds: it starts from the groups' own (or those an adaptive
    component sets), releases each step with the thresholds the step clipped with, and hands the next
    step's to the engine (:meth:`ClippingEngine.begin_step`). A closure returns the loss, as in
    ``torch.optim``, unless a component reads per-sample losses from it
    (``StepComponent.closure_gives_per_sample_losses``: HyFreeDP's learning rate).
    Step hooks (``register_step_pre_hook``/``register_step_post_hook``) fire once per logical step,
    around the whole private step, as torch's do; micro-batch calls that only accumulate do not fire them.

    Mixed precision: after :meth:`attach_grad_scaler`, ``scaler.scale(loss).backward();
    scaler.step(optimizer); scaler.update()`` trains privately. The scaler hands the step to this class
    (``_step_supports_amp_scaling``), which releases on schedule and only then lets the scaler check the
    released (noisy) gradient for overflow: its skip and scale decisions see public values only.
    """

    # GradScaler.step calls our step() directly instead of unscaling ``.grad`` itself: the engine writes
    # no ``.grad`` before the release, and the loss scale is divided out inside the engine.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ClippingEngine,
                 release: GradientRelease, ledger: Ledger, sample_rate: float,
                 expected_batch_size: float, schedule: StepSchedule, accumulator: StepAccumulator, *,
                 components: Sequence[StepComponent] = (), planned_steps: int | None = None,
                 verify_every: int | None = None, every_rank: Callable[[bool], bool] | None = None,
                 probes: ProbeSchedule | None = None, state_guard: StateGuard):
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("the optimizer is already private; pass the original optimizer")
        self.original = optimizer
        self.engine, self.release, self.ledger = engine, release, ledger
        self.sample_rate, self.expected_batch_size = sample_rate, expected_batch_size
        self.schedule, self.accumulator = schedule, accumulator
        self.last_step: StepReport | None = None
        self.components: tuple[StepComponent, ...] = tuple(components)
        self.closure_gives_per_sample_losses = any(c.closure_gives_per_sample_losses for c in self.components)
        self.planned_steps = planned_steps
        self._warned_past_plan = False
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._check_parameters()
        self._trainable = frozenset(p for g in engine.groups for p in g.params)
        self.verify_every, self.every_rank = verify_every, every_rank
        self.probes = ProbeSchedule(SecretSource()) if probes is None else probes
        self.verified = False  # whether a check has run and passed
        self.first_kinds = FIRST_KINDS  # the probes the next checks must run, each due on its own step
        self.grad_scaler: torch.amp.GradScaler | None = None
        # The wrapped optimizer's updates before this run (0 again once a checkpoint's ledger is loaded).
        self.updates_before_run = updates_applied(optimizer)
        self.state_guard = state_guard
        self.thresholds: dict[str, float] = {}
        self._hand_over_thresholds()

    def attach_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Train with ``scaler`` (float16 loss scaling). Its scale is divided out of every output
        gradient before per-sample norms and clip weights, so it changes no clip weight; an example
        that overflows contributes nothing where it overflows, and every step is released and recorded
        as planned. Call it before the first backward pass. It needs ``loss_reduction="sum"``: under a
        mean loss each example's scaled gradient is divided by the batch size, so whether it overflows
        would depend on how many other examples were sampled."""
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"attach_grad_scaler needs a torch.amp.GradScaler, got {type(scaler).__name__}")
        if self.engine.loss_reduction == "mean":
            raise PrivacyError(_MEAN_LOSS_UNDER_SCALING)
        self.grad_scaler = scaler
        self.engine.attach_grad_scaler(scaler)

    def _check_parameters(self) -> None:
        optimized = {p for group in self.param_groups for p in group["params"]}
        trainable = {p for g in self.engine.groups for p in g.params}
        names = {p: n for n, p in self.engine.model.named_parameters()}
        frozen = sorted(names[p] for p in optimized if p not in trainable and p in names)
        if frozen:
            raise ValueError(
                f"the optimizer holds parameters {frozen} that are frozen (requires_grad=False): tunefree "
                "releases private gradients only for trainable parameters, and fixes that set at "
                "make_private; build the optimizer from the trainable ones, e.g. "
                "torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=...), or unfreeze "
                "them before make_private"
            )
        outside = [p for p in optimized if p not in trainable]
        if outside:
            raise ValueError(
                "the optimizer updates parameters that are not parameters of the model "
                f"({len(outside)} of them); build it from model.parameters() of the private model"
            )
        left_out = sorted(names[p] for p in trainable if p not in optimized)
        if left_out:
            raise ValueError(
                f"trainable parameters {left_out} are not in the optimizer: they would be noised but "
                "never updated; add them to the optimizer or freeze them with requires_grad_(False) "
                "before make_private"
            )

    def _check_trainable_set(self) -> None:
        """Before each step: the parameters the wrapped optimizer updates are still exactly those the
        engine clips and noises. Anything else would be updated with a raw, unclipped, un-noised
        gradient (added to the optimizer after make_private), or noised for nothing (frozen)."""
        optimized = [p for group in self.param_groups for p in group["params"]]
        if all(p in self._trainable for p in optimized) and all(p.requires_grad for p in self._trainable):
            return
        names = {p: n for n, p in self.engine.model.named_parameters()}
        added = [names.get(p, "a parameter outside the model") for p in optimized if p not in self._trainable]
        frozen = sorted(names[p] for p in self._trainable if not p.requires_grad and p in names)
        if not added and not frozen:
            return
        change = (f"the optimizer now updates {sorted(set(added))}, which were not trainable at "
                  "make_private: they would get a raw, unclipped, un-noised gradient" if added else
                  f"{frozen} were frozen after make_private: they would still be noised and updated")
        raise PrivacyError(
            f"{change}. The trainable parameters are fixed at make_private; to change them, call "
            "make_private again with the new optimizer and carry the privacy spent over: "
            "new_engine.ledger.load_state_dict(engine.ledger.state_dict())")

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

    # -- the example-independence check
    def _verification_due(self, step: int) -> bool:
        """Whether logical step ``step`` (1-based) checks example independence before its release: until
        the first checks have run (:data:`FIRST_KINDS`), every step; then each step with probability
        ``1/verify_every``, drawn from the run's randomness. Under FSDP2 the ranks agree (a step is
        checked if any rank drew it)."""
        due = bool(self.first_kinds) or self.probes.due(step, self.verify_every or CHECK_INTERVAL)
        return due if self.every_rank is None else not self.every_rank(not due)

    def _verify_independence(self) -> None:
        """Before a release that needs it, check on each physical batch of the step that no example's
        activations or output gradients depend on another example
        (``tunefree.verify_example_independence``): mixing that some data trigger in one micro-batch
        only is checked too. A batch of fewer than two examples cannot mix; a check due on a step
        without a larger one waits for the next step. Under FSDP2, whose forwards are collectives and
        whose ranks hold different numbers of micro-batches, the ranks check their first physical batch
        together. On failure the step's sums are dropped: nothing of them is ever released."""
        retained, self.engine.retained = self.engine.retained, []
        batches = [(inputs, _examples_in(inputs, self.engine.declared.root) if examples is None else examples)
                   for inputs, examples in retained]
        if self.every_rank is not None:  # a check is due: on every rank alike, one batch each
            batches = batches[:1]
            if batches:
                ready = self.every_rank(batches[0][1] >= 2)
                batches = batches if ready else []
        batches = [(inputs, examples) for inputs, examples in batches if examples >= 2]
        if batches:
            kind = self.first_kinds[0] if self.first_kinds else None
            try:
                for inputs, examples in batches:
                    probes = self.probes.probes(self.ledger.steps + 1, examples, kind)
                    verify_example_independence(self.engine.model, self.engine, inputs.args, inputs.kwargs,
                                                examples=examples, probes=probes)
                self.state_guard.check("after the example-independence check", full=False)
            except PrivacyError:
                self.accumulator.pop()
                raise
            self.verified, self.first_kinds = True, self.first_kinds[1:]
        self.engine.retain_inputs = self.schedule.checking = self._verification_due(self.ledger.steps + 2)

    # -- the private step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on privatised gradients (only at the end of a logical batch).

        ``closure``, if given, is evaluated first with gradients enabled, as ``torch.optim`` does: it
        runs the forward and backward pass of the current batch and returns the loss. With HyFreeDP's
        learning rate (``AutoLR(mode="safeguarded"/"paper")``) it instead returns the current batch's
        per-sample losses (a 1-D tensor) and tunefree evaluates it, without gradients, at the probe
        points of the learning-rate fit.
        """
        self._check_trainable_set()
        logical = self.schedule.ends_logical
        self._check_scaler_call(logical)
        if logical:
            closure = self._run_pre_hooks(closure)
        loss = None
        if closure is not None and not self.closure_gives_per_sample_losses:
            with torch.enable_grad():
                loss = closure()
        if not self.schedule.on_step():
            return loss
        self._private_step(closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, *self._hook_arguments(closure))
        return loss

    def _private_step(self, closure: Callable[[], Any] | None) -> None:
        """Release, record, update: each release is in the ledger before anything uses it."""
        self._warn_past_plan()
        self.engine.check_no_leak()
        self.state_guard.check("before the release of a step")
        self._verify_independence()
        booked = self.accumulator.pop()
        thresholds = self.thresholds  # those the step's backward passes clipped with
        sums, booked.sums = booked.sums, {}  # the release takes them over
        noisy, event = self.release.release(sums, thresholds)
        del sums
        events = [event]
        self.ledger.record_step(self.sample_rate, events)
        self._write_grads(noisy)
        report = StepReport(step=self.ledger.steps, examples=booked.examples,
                            group_norms=booked.group_norms, thresholds=thresholds)
        if self._release_overflows():
            self.last_step = report  # released and recorded; the update alone is skipped
            return
        context = StepContext(report, closure, UpdateControl(self.original), thresholds)
        for component in self.components:
            self._record(events, component.before_update(context))
        if self.components:  # they may run the model (HyFreeDP's probes)
            self.state_guard.check("before the optimizer's update", full=False, released=True)
        check_updates_recorded(self.original, self.ledger.steps - 1, self.updates_before_run)
        self.original.step()
        self.state_guard.updated()
        for component in self.components:
            self._record(events, component.after_update(context))
        self._hand_over_thresholds()
        self.last_step = report

    def _write_grads(self, noisy: dict[torch.Tensor, torch.Tensor]) -> None:
        """``.grad`` = noisy sum / ``q·N``, divided in place and written in the parameter's dtype: the
        noisy sum itself where the dtypes agree, else a copy, each noisy sum dropped once written (one
        parameter's sum alive beside the written gradients)."""
        torch._foreach_div_(list(noisy.values()), self.expected_batch_size)
        while noisy:
            p, grad = noisy.popitem()
            p.grad = grad.to(p.dtype)
            del grad

    def _hand_over_thresholds(self) -> None:
        """The thresholds the next step clips with: those a component sets (adaptive thresholds), else
        the groups' own; the engine receives them here, and only here."""
        proposed = [t for c in self.components if (t := c.thresholds()) is not None]
        own = {g.name: g.threshold for g in self.engine.groups}
        self.thresholds = dict(proposed[-1]) if proposed else own
        self.engine.begin_step(self.thresholds)

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
        self._hand_over_thresholds()
        self.updates_before_run = 0

    def _check_scaler_call(self, logical: bool) -> None:
        """``scaler.step(optimizer)`` (which sets ``grad_scale``) needs the scaler attached, so that the
        engine divided its scale out, and only one call per logical step, as ``scaler.update()`` needs
        the step's overflow check."""
        if getattr(self, "grad_scale", None) is None:
            return
        if self.grad_scaler is None:
            raise ValueError(
                "scaler.step(optimizer) was called but the GradScaler is not attached: the gradients "
                "were clipped with the loss scale in them; call optimizer.attach_grad_scaler(scaler) "
                "(engine.optimizer) before the first backward pass")
        if not logical:
            raise ValueError(
                "scaler.step(optimizer) was called in the middle of a logical batch: with physical "
                "micro-batches call scaler.step(optimizer) and scaler.update() only when "
                "engine.schedule.ends_logical (the engine books each backward pass without a step)")

    def _release_overflows(self) -> bool:
        """Whether the released gradient, in the parameters' dtype, holds an inf or NaN (a float16
        parameter can overflow where the float32 release did not). The scaler records the check for its
        ``update()``; the check reads the public release only, and the step is already in the ledger."""
        if self.grad_scaler is None or getattr(self, "grad_scale", None) is None:
            return False
        # The check GradScaler's contract asks a `_step_supports_amp_scaling` optimizer to run itself.
        found = self.grad_scaler._check_inf_per_device(self)
        return bool(sum(v.item() for v in found.values()))

    def _record(self, events: list[dpa.DpEvent], more: list[dpa.DpEvent]) -> None:
        """Join a component's releases to the step's ledger record."""
        if more:
            events += more
            self.ledger.amend_last_step(self.sample_rate, events)

    def _warn_past_plan(self) -> None:
        if self.planned_steps is None or self._warned_past_plan or self.ledger.steps < self.planned_steps:
            return
        self._warned_past_plan = True
        warnings.warn(
            f"training past the planned {self.planned_steps} steps: the noise was calibrated for them, "
            "so from this step on ε grows beyond the target (engine.epsilon() reports what is spent)",
            UserWarning, stacklevel=4)

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


def updates_applied(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's own count of its updates (``state[p]["step"]``, kept by Adam, AdamW, RMSprop...);
    0 for one that keeps none (SGD)."""
    counted = next((state["step"] for state in optimizer.state.values() if "step" in state), None)
    return 0 if counted is None else int(counted)


def check_updates_recorded(optimizer: torch.optim.Optimizer, recorded: int, before: int = 0) -> None:
    """Every update the wrapped optimizer applied in this run has its release in the ledger: its own
    count, less the ``before`` updates it had when the run began (training outside this guarantee, like
    pre-trained weights), is at most the ``recorded`` steps — else its state comes from another run
    whose ledger is missing or was edited."""
    applied = updates_applied(optimizer)
    if applied - before > recorded:
        earlier = f" ({before} of them before make_private)" if before else ""
        raise PrivacyError(
            f"the optimizer has applied {applied} updates{earlier} but the ledger records {recorded} "
            "private steps for them: its state comes from a run whose ledger was edited or left behind, "
            "and the guarantee would understate what was released. Resume with engine.load_state_dict "
            "and the ledger saved with this optimizer state (engine.state_dict() and "
            "optimizer.state_dict() of the same moment); an optimizer state from training outside this "
            "guarantee (e.g. public pre-training) is loaded before make_private")


_MEAN_LOSS_UNDER_SCALING = (
    "a GradScaler with loss_reduction='mean' is refused: a mean loss divides every example's scaled "
    "gradient by the number of examples in the batch, so under float16 whether an example's gradient "
    "overflows (and is dropped) would depend on how many other examples were sampled, and one example "
    "could change the others' contributions. Sum the per-example losses (loss_fn(..., reduction='sum')) "
    "with make_private(..., loss_reduction='sum'), and give the scaler a scale that suits a summed loss, "
    "e.g. torch.amp.GradScaler(init_scale=2**8); or train in bfloat16, which needs no loss scaling")


def _examples_in(inputs: Capture, dim: int = 0) -> int:
    """Examples in a root call's inputs: dimension ``dim`` (the one declared for the model's inputs) of
    its first tensor with that dimension."""
    leaves = tree_flatten((inputs.args, inputs.kwargs))[0]
    return next((t.shape[dim] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > dim), 0)
