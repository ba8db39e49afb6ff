import pytest
import torch
from neighbour import neighbour_distance
from torch import nn

import tunefree

R = 1.0


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


class CenterMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h - h.mean(0))


class TimeMajorLinear(nn.Module):
    """Reads x [B, T, F] as time-major [T, B, F] (T == B) and pools over its 'time' dimension."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).mean(1)


def within_bound_or_refused(factory, x, y):
    try:
        distance = neighbour_distance(factory, ce, x, y, R)
    except (tunefree.PrivacyError, ValueError):
        return
    assert distance <= R * (1 + 1e-6), f"{distance / R:.2f}·R released"


def test_clean_mlp_and_layernorm_stay_within_R():
    torch.manual_seed(1)
    x, y = torch.randn(5, 3) * 5, torch.randint(0, 2, (5,))
    factory = lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))  # noqa: E731
    assert neighbour_distance(factory, ce, x, y, R) <= R * (1 + 1e-6)


@pytest.mark.parametrize(("factory", "shape"), [(CenterMix, (5, 3)), (TimeMajorLinear, (4, 4, 3))])
def test_example_mixing_is_refused_or_bounded(factory, shape):
    torch.manual_seed(2)
    x, y = torch.randn(*shape) * 5, torch.randint(0, 2, (shape[0],))
    within_bound_or_refused(factory, x, y)
