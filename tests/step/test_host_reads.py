"""A private step reads tensor values on the host a fixed number of times, whatever the number of layers and
clip groups: on a GPU each read is a device→host copy that waits for every kernel queued before it.

The default step reads once (every clip group's overflow check, in one transfer); the adaptive thresholds
add their released counts, ``lr="auto"`` its distance and gradient norms (one transfer per device, whatever
the parameters' precisions). Counted with ``tests/support/host_reads.py`` on a CPU, in the steady state
(after the first step's independence check and path choices; a step that draws an independence check does
that check's own reads).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from support.host_reads import counted_host_reads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree


def mlp(depth: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(6, 6), nn.Tanh())], nn.Linear(6, 3))


def cnn(depth: int) -> nn.Module:
    convs = [m for _ in range(depth) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())]
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), *convs, nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


class Mixed(nn.Module):
    """``depth`` bfloat16 layers, then a float32 head: parameters of two precisions."""

    def __init__(self, depth: int):
        super().__init__()
        self.low = nn.ModuleList(nn.Linear(6, 6).bfloat16() for _ in range(depth))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = x.bfloat16()
        for layer in self.low:
            h = torch.tanh(layer(h))
        return self.head(h.float())


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (1, 6, 6)), "mixed": (Mixed, (6,))}


def steady_step_reads(name: str, depth: int, groups: str, **options):
    """The host reads of the third private step of the model at ``depth`` (batches of 8 expected)."""
    torch.manual_seed(0)
    build, shape = MODELS[name]
    model = build(depth)
    x, y = torch.randn(64, *shape), torch.randint(0, 3, (64,))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                                   target_delta=1e-3, steps=40, groups=groups, loss_reduction="sum",
                                   verify_every=10**9, **options)  # no independence check drawn later
    batches = iter(engine.data_loader)

    def step(counted: bool):
        xb, yb = next(batches)
        with counted_host_reads() if counted else nullcontext() as reads:
            engine.optimizer.zero_grad()
            F.cross_entropy(model(xb), yb, reduction="sum").backward()
            engine.optimizer.step()
        return reads

    step(False)
    step(False)
    return step(True)


CONFIGS = {"default": ({}, 1), "adaptive thresholds": ({"thresholds": "adaptive"}, 3),
           "lr=auto": ({"lr": "auto"}, 2)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("groups", ["all-layer", "per-layer"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_private_step_reads_the_host_as_often_at_any_depth(name, groups, config):
    options, most = CONFIGS[config]
    shallow = steady_step_reads(name, 1, groups, **options)
    deep = steady_step_reads(name, 4, groups, **options)
    assert deep.sites == shallow.sites, (dict(shallow.sites), dict(deep.sites))
    assert 1 <= deep.total <= most, dict(deep.sites)  # at least the overflow check


def test_lr_auto_reads_parameters_of_two_precisions_in_one_transfer():
    """DoG's norms of bfloat16 and float32 parameters: one transfer (it was one per parameter)."""
    shallow, deep = steady_step_reads("mixed", 1, "all-layer", lr="auto"), \
        steady_step_reads("mixed", 4, "all-layer", lr="auto")
    assert deep.sites == shallow.sites and deep.total == 2, dict(deep.sites)


def test_the_counter_sees_each_kind_of_host_read():
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with counted_host_reads() as reads:
        t.sum().item()
        host = (t + 1).cpu()  # one copy; the host copy's values, and what is computed from them, are free
        host.tolist()
        (host * 2).sum().item()
        bool(t.any())
        t[mask]  # the result's size depends on the values
        t * 2  # no read
    assert reads.total == 4, dict(reads.sites)
