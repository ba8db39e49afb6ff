"""The trainable set is the one planned at ``make_private``, and only the private step writes gradients.

The clip groups and the noise are planned for the parameters that required gradients at ``make_private``,
and the wrapped optimizer updates exactly those. A parameter frozen later would still be noised and
updated; one unfrozen later, or added to the optimizer, would get a raw, unclipped, un-noised gradient; a
parameter of the model left out of the optimizer would be noised for nothing. And no trainable parameter
may hold an ordinary gradient from a backward pass the engine did not see (``engine.check_no_leak``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..errors import PrivacyError
from .base import Guard, ModelCall


class TrainableSet(Guard):
    """Args:
        model: the module the engine hooks.
        trainable: the parameters the clip groups cover (those that required gradients at make_private).
        optimizer: the user's optimizer, wrapped by the private one.
        leaks: raises if autograd wrote ordinary gradients into trainable parameters (the engine's check).

    Refuses at construction (``ValueError``) an optimizer that does not update exactly the trainable
    parameters; then, at every training forward and before every release and update, any change of the
    set (``PrivacyError``)."""

    def __init__(self, model: nn.Module, trainable: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
                 leaks: Callable[[], None] = lambda: None):
        self.model, self.optimizer, self.leaks = model, optimizer, leaks
        self.trainable = frozenset(trainable)
        self._check_optimizer()

    def before_forward(self, call: ModelCall) -> None:
        self._check_model()

    def before_release(self, step: int) -> None:
        self.leaks()
        self._check_model()
        self._check_updated()

    def before_update(self, step: int) -> None:
        self._check_updated()

    def _names(self) -> dict[nn.Parameter, str]:
        return {p: n for n, p in self.model.named_parameters()}

    def _check_optimizer(self) -> None:
        optimized = {p for group in self.optimizer.param_groups for p in group["params"]}
        names = self._names()
        frozen = sorted(names[p] for p in optimized if p not in self.trainable and p in names)
        if frozen:
            raise ValueError(
                f"the optimizer holds parameters {frozen} that are frozen (requires_grad=False): tunefree "
                "releases private gradients only for trainable parameters, and fixes that set at "
                "make_private; build the optimizer from the trainable ones, e.g. "
                "torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=...), or unfreeze "
                "them before make_private")
        outside = [p for p in optimized if p not in self.trainable]
        if outside:
            raise ValueError(
                "the optimizer updates parameters that are not parameters of the model "
                f"({len(outside)} of them); build it from model.parameters() of the private model")
        left_out = sorted(names[p] for p in self.trainable if p not in optimized)
        if left_out:
            raise ValueError(
                f"trainable parameters {left_out} are not in the optimizer: they would be noised but "
                "never updated; add them to the optimizer or freeze them with requires_grad_(False) "
                "before make_private")

    def _check_model(self) -> None:
        """The parameters that require grad are exactly those clipped and noised since make_private."""
        if all(p.requires_grad == (p in self.trainable) for p in self.model.parameters()):
            return
        for name, p in self.model.named_parameters():
            if p.requires_grad != (p in self.trainable):
                change = ("was trainable at make_private but no longer requires grad" if p in self.trainable
                          else "requires grad but was not trainable at make_private")
                raise PrivacyError(
                    f"parameter {name!r} {change}: the trainable set is fixed when make_private plans the "
                    "run (its clip groups and noise); to change it, call make_private again on the model "
                    "with the parameters frozen or unfrozen as wanted, and carry the budget spent so far "
                    "over with new_engine.ledger.load_state_dict(engine.ledger.state_dict())")

    def _check_updated(self) -> None:
        """The parameters the wrapped optimizer updates are still exactly the trainable ones."""
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        if all(p in self.trainable for p in optimized):
            return
        names = self._names()
        added = sorted({names.get(p, "a parameter outside the model") for p in optimized
                        if p not in self.trainable})
        raise PrivacyError(
            f"the optimizer now updates {added}, which were not trainable at make_private: they would get "
            "a raw, unclipped, un-noised gradient. The trainable parameters are fixed at make_private; to "
            "change them, call make_private again with the new optimizer and carry the privacy spent over: "
            "new_engine.ledger.load_state_dict(engine.ledger.state_dict())")
