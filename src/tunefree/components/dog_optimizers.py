"""DoG's step for optimizers other than plain SGD: the learning rate at which the optimizer's update
carries the noise walk of the SGD step that DoG (within its noise budget) chose.

:class:`~tunefree.components.dog.DistanceOverGradients` picks an SGD step size η_t from the released
gradients, bounded so that the planned run's noise walk ``Σ η_t² E‖n_t‖²`` stays within its budget. Another
optimizer moves the weights by ``lr · P_t ∘ m_t``, with ``m_t`` the released gradient or its moving average
and ``P_t`` a diagonal factor: ``1/(1 − μ)`` for momentum μ (in the long run), ``1/(√v̂_t + ε)`` for
Adam-type second moments. Its noise walk over the run is then ``Σ lr_t² Σ_j P_tj² s_j²`` (each noise draw
enters the running average with total weight 1), with ``s_j²`` the known noise variance of coordinate j.
So the learning rate that gives the same walk as DoG's SGD step is

    lr_t = η_t · √(Σ_j s_j² / Σ_j P_tj² s_j²),

which for Adam with noise-dominated second moments (v̂_j ≈ s_j²) is ``η_t`` times the noise's standard
deviation per coordinate. Without noise (σ = 0, a non-private reference run) there is no walk to match,
and the factor is the rms of √v̂, which gives the update the length of the SGD step. The factor reads only
the released gradients (the second moments are those the optimizer itself forms from them, recomputed here
with its β₂ and ε) and public noise scales: it is post-processing, with no ε and no ledger event, like DoG
itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..privacy.mechanisms import GradientRelease
from ..step.component import StepContext
from .dog import DistanceOverGradients, DoG

# The optimizers whose update the rule knows: plain or momentum SGD, Adam-type second moments (an
# exponential average), and Adagrad's (a sum).
ADAM_TYPE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)
SUPPORTED = "torch.optim.SGD (with or without momentum), Adam, AdamW, NAdam, RAdam or Adagrad"


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose update the rule cannot translate, saying which it can."""
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD) and type(optimizer) is torch.optim.SGD:
        if any(g.get("dampening") for g in groups):
            raise ValueError("lr='auto' sets SGD's step size for momentum without dampening: drop "
                             "dampening (torch.optim.SGD(params, lr=1.0, momentum=0.9))")
        return
    if type(optimizer) in ADAM_TYPE:
        if any(g.get("amsgrad") for g in groups):
            raise ValueError(f"lr='auto' does not follow {type(optimizer).__name__}'s amsgrad maximum: "
                             "drop amsgrad=True")
        return
    if type(optimizer) is torch.optim.Adagrad:
        if any(g.get("lr_decay") for g in groups):
            raise ValueError("lr='auto' sets Adagrad's step size itself: drop lr_decay")
        return
    raise ValueError(f"lr='auto' sets the step size of {SUPPORTED}; got {type(optimizer).__name__}: use "
                     "one of those, give a learning rate (lr=None keeps the optimizer's own), or "
                     "lr=tunefree.HyFreeDP() (any optimizer)")


class OptimizerDoG(DistanceOverGradients):
    """DoG's SGD step, translated to the learning rate of ``optimizer`` (see the module's docstring).

    Args:
        optimizer: the wrapped optimizer, read for its kind and hyperparameters (β₂, ε, momentum); its
            state is not touched.
        release, expected_batch_size, settings, planned_steps: as for :class:`DistanceOverGradients`.
    """

    state_key = "OptimizerDoG"

    def __init__(self, optimizer: torch.optim.Optimizer, release: GradientRelease,
                 expected_batch_size: float, settings: DoG | None = None, *,
                 planned_steps: int | None = None):
        check_optimizer(optimizer)
        super().__init__(release, expected_batch_size, DoG() if settings is None else settings,
                         planned_steps=planned_steps)
        group = optimizer.param_groups[0]
        self.kind = ("sgd" if type(optimizer) is torch.optim.SGD else
                     "adagrad" if type(optimizer) is torch.optim.Adagrad else "adam")
        self.momentum = float(group.get("momentum", 0.0)) if self.kind == "sgd" else 0.0
        self.beta2 = float(group["betas"][1]) if self.kind == "adam" else 1.0
        self.eps = float(group.get("eps", 0.0))
        self.initial_moment = float(group.get("initial_accumulator_value", 0.0))
        self.moments: list[torch.Tensor] | None = None  # v_t, as the optimizer forms it
        self.sgd_lr = math.nan  # η_t, DoG's SGD step
        self.factor = math.nan  # lr_t / η_t

    def before_update(self, step: StepContext) -> None:
        super().before_update(step)
        self.sgd_lr = self.lr
        self.factor = self._factor(step)
        self.history[-1] = self.sgd_lr * self.factor  # the optimizer's learning rate at this step
        step.update.set_lr(self.history[-1])

    def _factor(self, step: StepContext) -> float:
        """lr_t / η_t: √(Σ s_j² / Σ P_j² s_j²) over the coordinates."""
        if self.kind == "sgd":
            return 1.0 - self.momentum
        params = step.update.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        with torch.no_grad():
            if self.moments is None:
                self.moments = [torch.full_like(p, self.initial_moment,
                                                dtype=torch.promote_types(p.dtype, torch.float32))
                                for p in params]
            squares = [g.detach().to(m.dtype).square() for g, m in zip(grads, self.moments)]
            if self.kind == "adam":
                torch._foreach_mul_(self.moments, self.beta2)
                torch._foreach_add_(self.moments, squares, alpha=1 - self.beta2)
                correction = 1 - self.beta2 ** (self.updates + 1)
            else:  # Adagrad: a sum
                torch._foreach_add_(self.moments, squares)
                correction = 1.0
            variances = [v for _, v in self.coordinate_variances(step.report.thresholds)]
            # A second moment below the noise's variance is the noise's own fluctuation (at the first
            # steps v̂ is a handful of squares): the expected moment is at least s².
            expected = [torch.clamp(m / correction, min=v) for m, v in zip(self.moments, variances)]
            roots = torch._foreach_sqrt(expected)
            torch._foreach_add_(roots, self.eps)
            inverse = torch._foreach_reciprocal(roots)
            weighted = torch.stack([(x * x).sum(dtype=torch.float64) for x in inverse]).tolist()
        noise = sum(p.numel() * v for p, v in zip(params, variances))
        preconditioned = sum(w * v for w, v in zip(weighted, variances))
        if noise <= 0:  # no noise (σ = 0): the step of SGD's length, at the rms of √v̂
            with torch.no_grad():
                total = sum(float(m.sum(dtype=torch.float64)) for m in self.moments) / correction
            return math.sqrt(total / sum(p.numel() for p in params))
        return math.sqrt(noise / preconditioned)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "moments": self.moments, "sgd_lr": self.sgd_lr,
                "factor": self.factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.moments = None if state["moments"] is None else [t.clone() for t in state["moments"]]
        self.sgd_lr, self.factor = state["sgd_lr"], state["factor"]
