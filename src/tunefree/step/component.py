"""The step component protocol (public: ``tunefree.extend``): what a part of the private step beyond the
gradient release (adaptive thresholds, a learning-rate rule) sees of the step, may do to the update, and
how it releases what it computes from private data."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


class StepComponent:
    """A part of the private step beyond the gradient release, run by the step after the noisy gradient
    is in ``.grad`` (:meth:`before_update`) and after the wrapped optimizer stepped (:meth:`after_update`).

    What it sees is a :class:`StepContext`, never the optimizer itself: the released gradient and the
    weights (``step.update``), public facts of the run (``expected_batch_size``, ``step.report``'s
    thresholds) and private values of the batch (``step.report``'s norms and example count,
    ``step.closure``'s losses). Whatever it lets out
    that depends on private values goes through :meth:`StepContext.release`, which noises it and records
    it in the ledger, joined to the step's Poisson-sampled event, before returning it; everything else it
    computes is post-processing of released values. Its option declares those releases ahead as a
    :class:`~tunefree.extend.Share`, so that the plan calibrates the run's noise for them."""

    # Whether the user's closure returns the batch's per-sample losses (read by this component) instead
    # of the loss torch.optim expects.
    closure_gives_per_sample_losses: bool = False

    @property
    def state_key(self) -> str:
        """The key of its state in a checkpoint; the built-in components pin theirs, so that a rename
        never orphans a checkpoint."""
        return type(self).__name__

    def thresholds(self) -> dict[str, float] | None:
        """The clip thresholds (by group name) it sets for the next step; ``None``: it sets none."""
        return None

    def before_update(self, step: StepContext) -> None:  # noqa: B027 - a component may do nothing here
        """After the noisy gradient is in ``.grad``, before the wrapped optimizer steps."""

    def after_update(self, step: StepContext) -> None:  # noqa: B027
        """After the wrapped optimizer stepped."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue identically."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore :meth:`state_dict`."""


class UpdateControl:
    """What a step component may do to the update of the wrapped optimizer: read the parameters, set
    the learning rate, and see the update it would make now without making it. Inside, the optimizer
    runs without step hooks: a trial step is not a real step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group (public: chosen from released values only)."""
        for group in self._optimizer.param_groups:
            group["lr"] = lr

    def trial_update(self) -> list[torch.Tensor]:
        """The update Δ the optimizer would apply now to each of :attr:`params`; its state and the
        weights are left exactly as they were."""
        params = self.params
        saved = [p.detach().clone() for p in params]
        state = copy.deepcopy(self._optimizer.state_dict())
        with _without_step_hooks(self._optimizer):
            self._optimizer.step()
        with torch.no_grad():
            update = [p.detach() - w for p, w in zip(params, saved)]
            for p, w in zip(params, saved):
                p.copy_(w)
        self._optimizer.load_state_dict(state)
        return update


@dataclass
class StepContext:
    """One private step as a component sees it.

    ``report`` says what the step released from (and the thresholds it clipped with: a component that adapts
    them says the next ones through :meth:`StepComponent.thresholds`); ``closure`` is the user's closure
    (with HyFreeDP's learning rate, the batch's per-sample losses); ``update`` controls the wrapped
    optimizer's update; ``expected_batch_size`` is q·N, by which released sums are divided (never by the
    private batch size)."""

    report: StepReport
    closure: Callable[[], Any] | None
    update: UpdateControl
    expected_batch_size: float
    # the private step's: noises the values and records their release in the ledger
    recorded_release: Callable[[torch.Tensor, float, float], torch.Tensor] = field(repr=False)

    def release(self, sums: torch.Tensor, sensitivity: float, noise_multiplier: float) -> torch.Tensor:
        """Release ``sums`` of the batch's examples (under several processes, summed over them), whose
        joint L2 sensitivity is ``sensitivity`` (one example changes the vector by at most that much), with
        Gaussian noise of standard deviation ``noise_multiplier·sensitivity`` per coordinate. The release is
        recorded in the ledger, in the step's Poisson-sampled event, before the noisy values (float64, CPU)
        are returned."""
        return self.recorded_release(sums, sensitivity, noise_multiplier)


@dataclass
class StepReport:
    """What one private step did: examples in the logical batch (a private number, kept for
    diagnostics only), each clip group's per-sample gradient norms and the thresholds they were
    clipped with."""

    step: int
    examples: int
    group_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)  # those the step clipped with


@contextmanager
def _without_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, ``optimizer.step()`` runs torch's bare step function, without the step hooks (the
    user's and torch's global ones): a component's trial steps (HyFreeDP's loss probes) are not real steps."""
    bare = getattr(type(optimizer).step, "__wrapped__", None)
    if bare is None:
        yield
        return
    wrapped = vars(optimizer).get("step")  # e.g. an LR scheduler's step counter on the instance
    optimizer.step = types.MethodType(bare, optimizer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if wrapped is None:
            del optimizer.step
        else:
            optimizer.step = wrapped  # type: ignore[method-assign]
