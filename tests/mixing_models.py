"""Small models whose forward or backward mixes the examples of a batch (shared by the independence
check's tests and the neighbour zoo): each must be refused, or its release stay within R."""

from __future__ import annotations

import torch
from torch import nn


class CenterMix(nn.Module):
    """Subtracts the batch mean in the forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

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


class FunctionMix(nn.Module):
    """Mixes only in the backward, through a custom autograd.Function."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

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
