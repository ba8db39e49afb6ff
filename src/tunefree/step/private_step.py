"""One private step, in order: guards → release → record → components → update.

At the end of each logical batch the private optimizer calls :meth:`PrivateStep.run`. Every release joins
the ledger's one Poisson-sampled event for the step the moment it is made, so that no update is ever
applied for a release the ledger lacks, whatever fails or interrupts the step; a guard's refusal drops
the step's sums before anything of them is released (``guards/base.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import dp_accounting as dpa
import torch

from ..errors import PrivacyError
from ..guards.base import Guards
from ..persample.accumulator import StepAccumulator
from ..privacy.ledger import Ledger
from ..privacy.mechanisms import SINGLE_PROCESS, GradientRelease, Reduction, release_values
from .component import StepComponent, StepContext, StepReport, UpdateControl


class PrivateStep:
    """Args:
        optimizer: the user's optimizer; it updates only here (a ``step()`` called on it directly is
            refused: it would see no gradient and silently do nothing).
        engine: the per-sample engine; it receives each step's clip thresholds (``begin_step``).
        release: the gradient mechanism (noise σ relative to the clip groups' total sensitivity).
        ledger: where each step's releases are recorded.
        accumulator: where the engine booked the step's clipped sums.
        guards: the run's guards, in order.
        sample_rate: the Poisson sampling rate q of every logical batch.
        expected_batch_size: ``q·N``; the noisy sum is divided by it (never by the private batch size).
        components: the parts of the step beyond the gradient release (adaptive thresholds, a
            learning-rate rule), run in this order after the release.
        planned_steps: the length of training the noise was calibrated for (``None``: no plan); the
            first step beyond it warns that ε now grows past the target.
        overflowed: whether the released gradient overflowed under a GradScaler (the update alone is then
            skipped; the release stays recorded).
        parallelism: the run's; a component's release sums every process's values and noises them once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine, release: GradientRelease, ledger: Ledger,
                 accumulator: StepAccumulator, guards: Guards, sample_rate: float,
                 expected_batch_size: float, components: Sequence[StepComponent] = (),
                 planned_steps: int | None = None, overflowed: Callable[[], bool] = lambda: False,
                 parallelism: Reduction = SINGLE_PROCESS):
        self.optimizer, self.engine, self.release, self.ledger = optimizer, engine, release, ledger
        self.accumulator, self.guards = accumulator, guards
        self.sample_rate, self.expected_batch_size = sample_rate, expected_batch_size
        self.components = tuple(components)
        self.planned_steps, self.overflowed, self.parallelism = planned_steps, overflowed, parallelism
        self._warned_past_plan = False
        self._updating = False
        # The wrapped optimizer's updates before this run (0 again once a checkpoint's ledger is loaded).
        self.updates_before_run = updates_applied(optimizer)
        self._count_after_update: tuple[object, int] | None = None  # the count's tensor, its version
        self._direct = optimizer.register_step_pre_hook(self._refuse_direct_step)
        self._written: dict[int, weakref.ref] = {}  # the gradients the last release wrote, by identity
        self.thresholds: dict[str, float] = {}
        self.hand_over_thresholds()

    def run(self, closure: Callable[[], Any] | None) -> StepReport:
        """The step's order. Returns what it released from."""
        step = self.ledger.steps + 1
        self._warn_past_plan()
        self.guards.before_release(step)  # trainable set, leaks, state, purity, example independence
        self._refuse_assigned_grads()
        booked = self.accumulator.pop()
        thresholds = self.thresholds  # those the step's backward passes clipped with
        sums, booked.sums = booked.sums, {}  # the release takes them over
        noisy, event = self.release.release(sums, thresholds)
        del sums
        events = [event]
        self.ledger.record_step(self.sample_rate, events)  # before anything uses the release
        self._write_grads(noisy)
        report = StepReport(step=step, examples=booked.examples, group_norms=booked.group_norms,
                            thresholds=thresholds)
        if self.overflowed():
            return report  # released and recorded; the update alone is skipped
        context = StepContext(report, closure, UpdateControl(self.optimizer), self.expected_batch_size,
                              partial(self._release_values, events))
        for component in self.components:
            component.before_update(context)
        self.guards.before_update(step)
        if not _same_count(self._count_after_update, _count_version(self.optimizer)):
            check_updates_recorded(self.optimizer, self.ledger.steps - 1, self.updates_before_run)
        self._updating = True
        try:
            self.optimizer.step()
        finally:
            self._updating = False
        self._count_after_update = _count_version(self.optimizer)
        self.guards.after_update(step)
        for component in self.components:
            component.after_update(context)
        self.hand_over_thresholds()
        return report

    def _write_grads(self, noisy: dict[torch.Tensor, torch.Tensor]) -> None:
        """``.grad`` = noisy sum / ``q·N``, divided in place and written in the parameter's dtype: the
        noisy sum itself where the dtypes agree, else a copy, each noisy sum dropped once written (one
        parameter's sum alive beside the written gradients)."""
        torch._foreach_div_(list(noisy.values()), self.expected_batch_size)
        self._written.clear()
        while noisy:
            p, grad = noisy.popitem()
            p.grad = grad.to(p.dtype)
            self._written[id(p.grad)] = weakref.ref(p.grad)
            del grad

    def _refuse_assigned_grads(self) -> None:
        """Only the private step writes ``.grad``: a gradient assigned by hand between the backward pass and
        the step (e.g. from ``torch.autograd.grad``) would be replaced unseen by the release — and, computed
        from private data outside the engine, it is unclipped and un-noised. Refused before the release,
        the step's sums dropped as a guard's refusal drops them."""
        assigned = [p for group in self.optimizer.param_groups for p in group["params"]
                    if p.grad is not None and not _same_tensor(self._written.get(id(p.grad)), p.grad)]
        if not assigned:
            return
        names = {p: n for n, p in self.engine.model.named_parameters()}
        which = sorted(names.get(p, "a parameter of the optimizer") for p in assigned)
        self.guards.drop()
        raise PrivacyError(
            f"parameters {which[:8]}{' …' if len(which) > 8 else ''} hold a .grad that tunefree did not "
            "write (assigned by hand between the backward pass and engine.optimizer.step(), e.g. from "
            "torch.autograd.grad): the private step writes each gradient as the clipped, noisy release, so "
            "this one would be replaced unseen, and a gradient computed from private data outside the "
            "engine is neither clipped nor noised. Leave the gradients to loss.backward() and the private "
            "step (engine.optimizer.zero_grad() between steps sets them to None); to change the update, "
            "post-process the released gradient in a StepComponent's before_update (docs/extending.md), "
            "or use the optimizer's weight_decay for a penalty on the weights")

    def hand_over_thresholds(self) -> None:
        """The thresholds the next step clips with: those a component sets (adaptive thresholds), else
        the groups' own; the engine receives them here, and only here."""
        proposed = [t for c in self.components if (t := c.thresholds()) is not None]
        own = {g.name: g.threshold for g in self.engine.groups}
        self.thresholds = dict(proposed[-1]) if proposed else own
        self.engine.begin_step(self.thresholds)

    def _release_values(self, events: list[dpa.DpEvent], sums: torch.Tensor, sensitivity: float,
                        noise_multiplier: float) -> torch.Tensor:
        """A component's release (:meth:`StepContext.release`), joined to the step's ledger record
        (``events``) before its values are returned."""
        noisy, event = release_values(sums, sensitivity, noise_multiplier, self.release.randomness,
                                      self.parallelism)
        events.append(event)
        self.ledger.amend_last_step(self.sample_rate, events)
        return noisy

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._updating:
            raise PrivacyError(
                f"step() was called on the optimizer passed to make_private "
                f"({type(optimizer).__name__}): it sees no gradient (tunefree writes the released, noisy "
                "gradient only in the private step) and would do nothing. Call engine.optimizer.step() "
                "(and engine.optimizer.zero_grad()); for a GradScaler, scaler.step(engine.optimizer)")

    def detach(self) -> None:
        """Stop refusing direct steps of the user's optimizer (the run is over)."""
        self._direct.remove()

    def _warn_past_plan(self) -> None:
        if self.planned_steps is None or self._warned_past_plan or self.ledger.steps < self.planned_steps:
            return
        self._warned_past_plan = True
        warnings.warn(
            f"training past the planned {self.planned_steps} steps: the noise was calibrated for them, "
            "so from this step on ε grows beyond the target (engine.epsilon() reports what is spent)",
            UserWarning, stacklevel=5)


def _same_tensor(written: weakref.ref | None, grad: torch.Tensor) -> bool:
    return written is not None and written() is grad


def updates_applied(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's own count of its updates (``state[p]["step"]``, kept by Adam, AdamW, RMSprop...);
    0 for one that keeps none (SGD)."""
    counted = next((state["step"] for state in optimizer.state.values() if "step" in state), None)
    return 0 if counted is None else int(counted)


def _count_version(optimizer: torch.optim.Optimizer) -> tuple[object, int] | None:
    """The tensor holding the optimizer's count of its updates, and its version: while both are those the
    last update left, the count is that update's, already checked (a loaded state is another tensor); a
    count kept on the device (fused, capturable) is then not read. ``None``: not a tensor."""
    counted = next((state["step"] for state in optimizer.state.values() if "step" in state), None)
    return (counted, counted._version) if isinstance(counted, torch.Tensor) else None


def _same_count(before: tuple[object, int] | None, now: tuple[object, int] | None) -> bool:
    return before is not None and now is not None and before[0] is now[0] and before[1] == now[1]


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
