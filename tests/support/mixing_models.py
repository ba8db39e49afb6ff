"""Small models whose forward or backward mixes the examples of a batch (shared by the independence
check's tests and the neighbour zoo): each must be refused, or its release stay within R."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayer(nn.Module):
    """``fc`` (3 → 4) then ``out`` (4 → 2): the trunk of the mixing models, whose forwards differ."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)


class CenterMix(TwoLayer):
    """Subtracts the batch mean in the forward."""

    def forward(self, x):
        h = self.fc(x)
        return self.out(h - h.mean(0))


class TimeMajorLinear(nn.Module):
    """Reads x [B, T, F] as time-major [T, B, F] and pools over its 'time' dimension (the batch)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).mean(1)


class MixBackward(torch.autograd.Function):
    """Identity forward; the backward adds the batch's summed gradient to every example's."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + 3 * g.sum(0, keepdim=True)


class FunctionMix(TwoLayer):
    """Mixes only in the backward, through a custom autograd.Function."""

    def forward(self, x):
        return self.out(MixBackward.apply(self.fc(x)))


class MixingFallback(nn.Module):
    """A fallback unit (a bare nn.Parameter, no layer rule) whose forward mixes the examples."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, h):
        h = h * self.scale
        return h - h.mean(0)


def fallback_mix() -> nn.Module:
    """Linear → a mixing fallback unit (module '1') → Linear."""
    return nn.Sequential(nn.Linear(3, 4), MixingFallback(), nn.Linear(4, 2))


def hook_mix() -> nn.Module:
    """A full-backward hook whose returned input gradient mixes the examples."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[1].register_full_backward_hook(lambda m, gin, gout: (gin[0] + 3 * gin[0].sum(0, keepdim=True),))
    return model


# Mixing the check sees only at some steps or on some examples (issue 21): each must be refused over a run.
class MiddleMix(TwoLayer):
    """Adds example n//2 − 1's activations into example n//2's: one pair, in the middle of the batch."""

    def forward(self, x):
        h = self.fc(x)
        m = len(h) // 2
        return self.out(torch.cat([h[:m], h[m:m + 1] + 3 * h[m - 1:m], h[m + 1:]]))


class OddPairsMix(TwoLayer):
    """Averages the activations of examples i and i + 1 for every odd i (1 and 2, 3 and 4, …)."""

    def forward(self, x):
        h = self.fc(x)
        pairs = torch.arange(1, len(h) - 1, 2)
        mixed = h.clone()
        mixed[pairs] = (h[pairs] + h[pairs + 1]) / 2
        mixed[pairs + 1] = (h[pairs] + h[pairs + 1]) / 2
        return self.out(mixed)


class ValueMix(TwoLayer):
    """An example whose first feature exceeds 1.5 leaks its activations into the next example: the
    mixing depends on a value in the data."""

    def forward(self, x):
        h = self.fc(x)
        leaking = (x[:, :1] > 1.5).to(h.dtype)
        into_next = torch.cat([torch.zeros_like(h[:1]), (leaking * h)[:-1]])
        return self.out(h + into_next)


class LateMix(TwoLayer):
    """Subtracts the batch mean once ``mixing`` is set (from some step of the run on)."""

    def __init__(self):
        super().__init__()
        self.mixing = False

    def forward(self, x):
        h = self.fc(x)
        return self.out(h - h.mean(0) if self.mixing else h)
