"""Clip weights and book-keeping: each clip group's per-sample norms → clip weights → ``Σᵢ wᵢ gᵢ`` into the
step's accumulator, as soon as the group's last use in the pass is done (per-layer and per-parameter groups
inside the backward pass, all-layer groups at its end), and each backward pass's examples booked once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..clipping.functions import ClipFunction
from ..clipping.groups import ClipGroup
from ..dtypes import norm_dtype
from ..errors import PrivacyError
from ..rules import PerSampleGrad
from ..rules.summed import SummedUses
from .accumulator import StepAccumulator
from .units import PassState, Use

# A per-sample norm at or above this (or NaN) is an overflow: refused rather than clipped, since a
# float32 clip weight R/‖g‖ would then be subnormal and the bound ‖w·g‖ ≤ R could round away.
NORM_LIMIT = 1e30


class Booking:
    """The clip groups' side of the engine: their thresholds for the current step, the clip function,
    and the accumulator their clipped sums go to. Its methods read and write the pass state they are
    given."""

    def __init__(self, groups: list[ClipGroup], clip: ClipFunction, loss_reduction: str,
                 accumulator: StepAccumulator):
        self.clip, self.loss_reduction, self.accumulator = clip, loss_reduction, accumulator
        self.group_of = {p: g for g in groups for p in g.params}
        self.thresholds: dict[str, float] = {g.name: g.threshold for g in groups}

    def begin_step(self, thresholds: Mapping[str, float]) -> None:
        if set(thresholds) != set(self.thresholds):
            raise ValueError(f"thresholds must name exactly the clip groups {sorted(self.thresholds)}")
        self.thresholds = {name: float(value) for name, value in thresholds.items()}

    def book_batch(self, state: PassState, serial: int) -> None:
        """One backward pass per physical batch (without a loader: per logical step)."""
        if state.input_refusal is not None:
            raise PrivacyError(state.input_refusal)
        if not self.accumulator.book_batch(serial):
            what = "this batch" if serial else "this step (no private loader: one batch per step)"
            raise PrivacyError(second_backward_message(what))

    def expect(self, state: PassState, use: Use) -> None:
        """A captured call: its parameters' groups wait for it."""
        for p in use.params.values():
            state.pending[self.group_of[p].name] += 1
            state.uses_of[p] += 1

    def add(self, state: PassState, use: Use, per_sample: dict[str, PerSampleGrad]) -> None:
        """A call's per-sample gradients (none where no example reached it); the groups it completes
        are clipped."""
        for p in use.params.values():
            state.pending[self.group_of[p].name] -= 1
        for name, p in use.params.items():
            grad = per_sample.get(name)
            if grad is not None:
                self._add_use(state, p, grad)
        for group in {self.group_of[p] for p in use.params.values()}:
            if state.pending[group.name] == 0:
                self.clip_group(state, group)

    def _add_use(self, state: PassState, p: nn.Parameter, grad: PerSampleGrad) -> None:
        if state.uses_of[p] == 1:
            if state.pending[self.group_of[p].name] != 0:  # kept until the group's last use
                state.sq_norms[p] = grad.sq_norms()
                grad.compact()
            state.per_param[p] = grad
        else:  # used more than once: the per-sample gradient is the sum over uses, kept as their forms
            total = state.per_param.get(p)
            state.per_param[p] = grad if total is None else SummedUses.join(total, grad)

    def clip_group(self, state: PassState, group: ClipGroup) -> None:
        """Clip weights from the group's per-sample norms, and its clipped sums into the accumulator,
        one parameter at a time in the group's order (``None`` for a parameter no example of this pass
        reached): every parameter's sum is complete when it is booked, and is formed only when its turn
        comes, so that an accumulator that sends each sum on (FSDP2) holds few of them at once and
        receives them in the same order on every rank, one with no example included."""
        if group.name in state.clipped_groups:
            return
        state.clipped_groups.add(group.name)
        per_param = state.per_param
        present = [p for p in group.params if p in per_param]
        weights, fused = self._clip_weights(state, group, present) if present else (None, {})
        converted: dict[torch.dtype | None, torch.Tensor] = {}  # the weights in each form's dtype
        for p in group.params:
            if p in fused:
                self.accumulator.add(p, fused.pop(p))
            elif p in per_param:
                grad = per_param.pop(p)
                dtype = grad.weights_dtype()
                if dtype not in converted:
                    converted[dtype] = weights if dtype is None else weights.to(dtype)
                self.accumulator.add(p, grad.weighted_sum(converted[dtype]))
            else:
                self.accumulator.add(p, None)

    def _clip_weights(self, state: PassState, group: ClipGroup, present: list[nn.Parameter]
                      ) -> tuple[torch.Tensor, dict[nn.Parameter, torch.Tensor]]:
        """The group's clip weights from its per-sample norms (booked, with their overflow check) and
        the clipped sum of the largest parameter whose norms were not yet known (for per-layer groups:
        the layer's weight), formed with its norms and weights in one pass
        (``PerSampleGrad.clipped_sum``); the group's other parameters get the same weights."""
        per_param, known = state.per_param, state.sq_norms
        scale = float(state.batch) if self.loss_reduction == "mean" else 1.0
        weights_of = _Weigher(self.clip, self.thresholds[group.name], state.batch, scale)
        pending = [p for p in present if p not in known]
        fused = max(pending, key=lambda p: p.numel()) if pending else None
        parts = [known.pop(p) if p in known else per_param[p].sq_norms() for p in present if p is not fused]
        if not parts:  # the fused parameter is the group's only one
            sq = torch.zeros(state.batch, dtype=norm_dtype(present[0].dtype), device=present[0].device)
        else:  # one reduction over the parameters (stack promotes float32 norms beside float64 ones)
            sq = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        sums = {}
        if fused is None:
            weights = weights_of(sq)
        else:
            result = per_param.pop(fused).clipped_sum(sq, weights_of)
            sums[fused], weights = result.total, result.weights
        norms = weights_of.norms()
        state.finite_checks.append((group.name, norms))
        self.accumulator.add_norms(group.name, norms)
        return weights, sums

    def close(self, state: PassState, carried: Callable[[torch.device], torch.Tensor | None] | None
              ) -> list[bool] | None:
        """The end of a backward pass: every group's norms in one check, the flags ``carried`` gives on
        their device (the guards' comparisons of the model's state, guards/base.py) with them, in one
        transfer to the host; then the pass's examples booked. The step's sums are dropped if any norm
        overflowed. Returns the carried flags as read (None when there were none)."""
        read, flags = None, None
        if state.finite_checks:
            norms = torch.stack([norms for _, norms in state.finite_checks])
            finite = (norms < NORM_LIMIT).all(1)
            flags = carried(finite.device) if carried is not None else None
            read = (finite if flags is None else torch.cat([finite, flags])).cpu().tolist()
            bad = [name for (name, _), ok in zip(state.finite_checks, read) if not ok]
            if bad:
                self.accumulator.pop()  # the logical step's sums are tainted: nothing of them may be released
                raise PrivacyError(
                    f"per-sample gradient norms of clip groups {bad} are NaN, infinite or beyond "
                    f"{NORM_LIMIT:g} (overflowing): the loss "
                    "or the model overflowed for some example (lower the learning rate, check the "
                    "inputs, or use float32/bfloat16 instead of float16)"
                )
        self.accumulator.add_examples(state.batch or 0)
        return None if flags is None else read[len(state.finite_checks):]


def second_backward_message(what: str) -> str:
    return (f"a second backward pass reached {what}, whose examples were already booked: each "
            "example may add one clipped gradient per step. Sum the losses into one backward "
            "(loss = loss_a + loss_b; loss.backward()); for adversarial examples, compute input "
            "gradients inside engine.no_capture() or with torch.autograd.grad(loss, inputs)")


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
