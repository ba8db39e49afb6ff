"""Mixed precision: a ``GradScaler``'s contract with a private run, the loss scale divided out of each
output gradient, the rows of an example that overflows in a layer call, and autocast replayed by the
generic fallback.

After ``DPOptimizer.attach_grad_scaler``, ``scaler.scale(loss).backward(); scaler.step(optimizer);
scaler.update()`` trains privately: each backward pass divides the scale out before any norm or clip
weight, and the scaler hands the step to the private optimizer (``_step_supports_amp_scaling``), which
releases on schedule and only then lets the scaler check the released (noisy) gradient for overflow: its
skip and scale decisions see public values only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..dtypes import accumulation_dtype
from ..errors import PrivacyError
from ..rules.layout import Dim
from .units import Unit, Use

# Each example's gradient must reach the engine as a function of that example alone (issue 21).
MEAN_IN_HALF_PRECISION = (
    "loss_reduction='mean' with gradients in float16 or bfloat16 (autocast, or half-precision parameters) "
    "is refused: the mean divides each example's gradient by the number of examples in the batch before "
    "it is rounded to 16 bits, so how it rounds (and, under loss scaling, whether it overflows) depends on "
    "how many other examples were sampled: one example would move the others' contributions (measured up "
    "to 1.02·R in bfloat16). Sum the per-example losses (loss_fn(..., reduction='sum')) and pass "
    "make_private(..., loss_reduction='sum'); float32 needs no change")

MEAN_LOSS_UNDER_SCALING = (
    "a GradScaler with loss_reduction='mean' is refused: a mean loss divides every example's scaled "
    "gradient by the number of examples in the batch, so under float16 whether an example's gradient "
    "overflows (and is dropped) would depend on how many other examples were sampled, and one example "
    "could change the others' contributions. Sum the per-example losses (loss_fn(..., reduction='sum')) "
    "with make_private(..., loss_reduction='sum'), and give the scaler a scale that suits a summed loss, "
    "e.g. torch.amp.GradScaler(init_scale=2**8); or train in bfloat16, which needs no loss scaling")


class LossScaling:
    """The run's ``GradScaler`` (``None`` until one is attached) and the rules it trains under."""

    def __init__(self, loss_reduction: str):
        self.loss_reduction = loss_reduction
        self.scaler: torch.amp.GradScaler | None = None

    def attach(self, scaler: torch.amp.GradScaler) -> None:
        """From the next backward pass on, divide ``scaler``'s factor out of every output gradient."""
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"attach_grad_scaler needs a torch.amp.GradScaler, got {type(scaler).__name__}")
        if self.loss_reduction == "mean":
            raise PrivacyError(MEAN_LOSS_UNDER_SCALING)
        self.scaler = scaler

    def factor(self) -> float:
        """The factor the loss of the starting backward pass was multiplied by (1 without a scaler)."""
        scaler = self.scaler
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0

    def refuses(self, grad: torch.Tensor) -> bool:
        """A 16-bit output gradient of a mean loss (``MEAN_IN_HALF_PRECISION``)."""
        return self.loss_reduction == "mean" and grad.dtype in (torch.float16, torch.bfloat16)

    def check_step_call(self, optimizer: torch.optim.Optimizer, logical: bool) -> None:
        """``scaler.step(optimizer)`` (which sets ``grad_scale``) needs the scaler attached, so that the
        engine divided its scale out, and only one call per logical step, as ``scaler.update()`` needs
        the step's overflow check."""
        if getattr(optimizer, "grad_scale", None) is None:
            return
        if self.scaler is None:
            raise ValueError(
                "scaler.step(optimizer) was called but the GradScaler is not attached: the gradients "
                "were clipped with the loss scale in them; call optimizer.attach_grad_scaler(scaler) "
                "(engine.optimizer) before the first backward pass")
        if not logical:
            raise ValueError(
                "scaler.step(optimizer) was called in the middle of a logical batch: with physical "
                "micro-batches call scaler.step(optimizer) and scaler.update() only when "
                "engine.schedule.ends_logical (the engine books each backward pass without a step)")

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the released gradient, in the parameters' dtype, holds an inf or NaN (a float16
        parameter can overflow where the float32 release did not). The scaler records the check for its
        ``update()``; the check reads the public release only, and the step is already in the ledger."""
        if self.scaler is None or getattr(optimizer, "grad_scale", None) is None:
            return False
        # The check GradScaler's contract asks a `_step_supports_amp_scaling` optimizer to run itself.
        found = self.scaler._check_inf_per_device(optimizer)
        return bool(sum(v.item() for v in found.values()))


def unscaled(grad: torch.Tensor, loss_scale: float, keep_dtype: bool = False) -> torch.Tensor:
    """A layer's output gradient as the unscaled loss gives it, in float32 for half-precision gradients
    (the dtype policy): per-sample norms, clip weights and clipped sums never see the loss scale, and none
    of them is rounded to 16 bits. ``keep_dtype``: the layer's rule converts a 16-bit gradient itself
    where it computes (``LayerRule.takes_16_bit_grads``), so without a loss scale to divide out it is kept
    as it arrived, in half the memory."""
    if loss_scale == 1.0:
        return grad if keep_dtype else grad.to(accumulation_dtype(grad.dtype))
    return grad.to(accumulation_dtype(grad.dtype)) / loss_scale


def drop_overflowed_examples(use: Use, batch: int) -> None:
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


def no_autocast(grads: list[torch.Tensor | None]) -> AbstractContextManager:
    """Engine arithmetic runs outside any autocast region the user's backward call sits in."""
    device = next((g.device.type for g in grads if g is not None), "cpu")
    return torch.autocast(device_type=device, enabled=False) if torch.is_autocast_enabled(device) \
        else nullcontext()


def autocast_of(unit: Unit) -> tuple[str, torch.dtype] | None:
    """The autocast region a unit's forward call runs in (device type, dtype), if any."""
    device = next(iter(unit.direct.values())).device.type
    return (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None


def replayed_autocast(state: tuple[str, torch.dtype] | None) -> AbstractContextManager:
    """The fallback re-runs a module in the precision its forward ran in (no autocast if none)."""
    return nullcontext() if state is None else torch.autocast(device_type=state[0], dtype=state[1])
