"""A private step synchronises with the device a fixed number of times, whatever the number of layers and
clip groups: on a GPU each read of a tensor's values by the host (a device→host copy, ``torch.equal``,
``.item()``, a boolean mask…) waits for every kernel queued before it. Counted with
``tests/support/host_reads.py`` on a CPU, which counts every synchronising operation (each kind shown by a
test below).

- A default step reads the host once: every clip group's overflow check and the state guard's comparison
  of the model's state, in one transfer at the end of the backward pass; the optimizer's own update count
  is read only when its state was replaced (fused AdamW keeps it on the device). A step whose Poisson
  batch is empty (no backward pass) reads once too: the state guard's own full comparison.
- Adaptive thresholds add their released counts, ``lr="auto"`` its distance and gradient norms (one
  transfer per device, whatever the parameters' precisions).
- A checked step (the first, then each drawn one) reads 3 times: the end of the backward pass's transfer;
  the purity probe's comparison of its two passes (one read); the example-independence check (one read for
  every forward pass and the backward's proportions of every physical batch; a backward found not
  proportional to the loss adds its confirmation's read). Not 1: both checks run the model after the backward
  pass whose transfer carried the step's other flags, and their verdicts must be on the host before the
  release; each is a guard that refuses before the next runs (a model whose function changed in the step
  is refused before the independence check runs it again).

The steps counted are chosen by their batches, which the Poisson loader draws: the first step with two
examples or more is the checked one; a later step with examples is a default one (a test that took the
third step whatever its batch read no transfer when that batch was empty, and a checked step when the
first two held fewer than two examples).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.host_reads import counted_host_reads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.guards import independence, probe
from tunefree.guards.independence import Independence
from tunefree.persample.engine import ClippingEngine
from tunefree.privacy import randomness


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


OPTIMIZERS = {  # fused AdamW keeps its step counts on the parameters' device; Adam and AdamW on the host
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "fused AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
}


def step_reads(name: str, depth: int, groups: str, checked: bool = False, optimizer: str = "SGD",
               **options):
    """The host reads of one private step of the model at ``depth`` (Poisson batches of 8 expected): the
    first check (the first step with two examples or more) if ``checked``, else the first step with
    examples from the third on, after the check. The run is counted from the start (the optimizer's state
    is made then); only that step's reads are kept."""
    torch.manual_seed(0)
    build, shape = MODELS[name]
    with counted_host_reads() as reads:
        model = build(depth)
        x, y = torch.randn(64, *shape), torch.randint(0, 3, (64,))
        engine = tunefree.make_private(model, OPTIMIZERS[optimizer](model.parameters()),
                                       DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                                       target_delta=1e-3, steps=40, groups=groups, loss_reduction="sum",
                                       verify_every=10**9, **options)  # no independence check drawn later
        independence = engine.guards.of(Independence)
        while True:
            for xb, yb in engine.data_loader:
                if checked:
                    counted = not independence.first_done and len(xb) >= 2
                else:
                    counted = independence.first_done and engine.steps >= 2 and len(xb) > 0
                reads.sites.clear()
                engine.optimizer.zero_grad()
                F.cross_entropy(model(xb), yb, reduction="sum").backward()
                engine.optimizer.step()
                if counted:
                    return reads


def steady_step_reads(name: str, depth: int, groups: str, **options):
    """The host reads of a default (not checked) step with examples."""
    return step_reads(name, depth, groups, **options)


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


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_default_step_reads_the_host_once_with_any_optimizer(optimizer):
    """The optimizer's own count of its updates is compared with the ledger before each update; kept on
    the device (fused AdamW), it is read only when the optimizer's state is not the one the last update
    left (a loaded state)."""
    assert steady_step_reads("mlp", 2, "all-layer", optimizer=optimizer).total == 1


@pytest.mark.parametrize("groups", ["all-layer", "per-layer"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_checked_step_reads_the_host_three_times_at_any_depth(name, groups):
    """The transfer at the end of the backward pass, the purity probe's comparison, the independence check
    (all its passes at once): see the module's docstring for why not once."""
    shallow = step_reads(name, 1, groups, checked=True)
    deep = step_reads(name, 4, groups, checked=True)
    assert deep.sites == shallow.sites, (dict(shallow.sites), dict(deep.sites))
    assert deep.total == 3, dict(deep.sites)


def test_a_step_without_examples_reads_the_host_once(monkeypatch):
    """An empty Poisson batch (drawn here on the third step): no backward pass carries a transfer, and the
    state guard's comparison before the release reads the host itself."""
    draws = iter([True, True, False])  # all examples in steps 1 and 2 (the first is checked), none in 3
    inclusion = randomness.SecretSource.inclusion

    def drawn(self, step, count, rate):
        flags = inclusion(self, step, count, rate)
        sampling = count == 64 and rate == 8 / 64  # the loader's draw, not a check's random half
        return torch.full_like(flags, next(draws, True)) if sampling else flags

    monkeypatch.setattr(randomness.SecretSource, "inclusion", drawn)
    torch.manual_seed(0)
    with counted_host_reads() as reads:
        model = mlp(2)
        data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
        engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       DataLoader(data, batch_size=8), noise_multiplier=1.0,
                                       target_delta=1e-3, steps=40, loss_reduction="sum")
        for examples, (xb, yb) in zip((64, 64, 0), engine.data_loader):
            assert len(xb) == examples
            reads.sites.clear()
            engine.optimizer.zero_grad()
            F.cross_entropy(model(xb), yb, reduction="sum").backward()
            engine.optimizer.step()
    assert reads.total == 1 and engine.steps == 3, dict(reads.sites)


def test_lr_auto_reads_parameters_of_two_precisions_in_one_transfer():
    """DoG's norms of bfloat16 and float32 parameters: one transfer (it was one per parameter)."""
    shallow, deep = steady_step_reads("mixed", 1, "all-layer", lr="auto"), \
        steady_step_reads("mixed", 4, "all-layer", lr="auto")
    assert deep.sites == shallow.sites and deep.total == 2, dict(deep.sites)


class TwoMixers(nn.Module):
    """Two layers that mix examples in the forward, each a pair of its own (example 1 into 2, 6 into 3)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        h = torch.cat([h[:2], h[2:3] + h[1:2], h[3:]])
        h = self.b(torch.tanh(h))
        return self.out(torch.cat([h[:3], h[3:4] + h[6:7], h[4:]]))


def test_the_independence_check_reads_once_and_refuses_what_reading_each_pass_would(monkeypatch):
    """All the check's flags are read at the end, once; the refusal is the one a read after each forward
    pass would have made: the first failure of the first pass that fails."""
    read = []
    failures = probe.failures
    monkeypatch.setattr(probe, "failures", lambda comparisons: read.append(list(comparisons)) or
                        failures(comparisons))
    model = TwoMixers()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum")
    with counted_host_reads() as reads, \
            pytest.raises(PrivacyError, match="mixes examples in its forward") as refusal:
        independence.verify_example_independence(model, engine, (torch.randn(8, 3),), {})
    assert reads.total == 1 and len(read) == 1, dict(reads.sites)
    per_pass = next(f.first() for f in read[0] if f.first() is not None)  # a read after each pass, in order
    assert str(refusal.value) == independence._forward_mixing(*per_pass)
    assert sum(f.first() is not None for f in read[0]) > 1  # later passes failed too: the order decided


READS = {  # each kind of host read: a read on a GPU, the host waiting for the device
    "item": lambda t, mask: t.sum().item(),
    "bool": lambda t, mask: bool(t.any()),
    "if": lambda t, mask: 1 if t.sum() > 0 else 0,
    "float": lambda t, mask: float(t[0]),
    "int": lambda t, mask: int(t.long().max()),
    "index": lambda t, mask: [0, 1, 2, 3][t.long()[1]],
    "f-string": lambda t, mask: f"{t.sum():.2f}",
    "tolist": lambda t, mask: t.tolist(),
    "numpy": lambda t, mask: t.numpy(),
    "cpu": lambda t, mask: t.cpu(),
    "to cpu": lambda t, mask: t.to("cpu"),
    "equal": lambda t, mask: torch.equal(t, t + 0),
    "allclose": lambda t, mask: torch.allclose(t, t + 0),
    "nonzero": lambda t, mask: mask.nonzero(),
    "where": lambda t, mask: torch.where(mask),
    "boolean mask": lambda t, mask: t[mask],
    "boolean assignment": lambda t, mask: t.clone().__setitem__(mask, 0.0),
    "masked_select": lambda t, mask: t.masked_select(mask),
    "unique": lambda t, mask: t.unique(),
    "unique_consecutive": lambda t, mask: t.unique_consecutive(),
    "bincount": lambda t, mask: torch.bincount(t.long()),
    "histc": lambda t, mask: torch.histc(t),
    "repeat_interleave": lambda t, mask: torch.repeat_interleave(t.long()),
    "upload": lambda t, mask: torch.arange(4.0).to(t.device),  # a copy to the device that waits for it
    "upload by copy_": lambda t, mask: t.clone().copy_(torch.arange(4.0)),
    "tensor on a device": lambda t, mask: torch.tensor([1.0, 2.0], device=t.device),
}


@pytest.mark.parametrize("kind", list(READS))
def test_the_counter_sees_each_kind_of_host_read(kind):
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with counted_host_reads() as reads:
        READS[kind](t, mask)
    assert reads.total == 1, dict(reads.sites)


def test_the_counter_counts_no_device_work_and_no_second_read_of_a_host_copy():
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with counted_host_reads() as reads:
        host = (t + 1).cpu()  # one copy; the host copy's values, and what is computed from them, are free
        host.tolist()
        (host * 2).sum().item()
        torch.equal(host, host * 1)
        host[host > 1]
        t * 2, t.masked_fill(mask, 0.0), t.topk(2), torch.where(mask, t, 0.0), t.to(torch.float64)  # no read
        torch.repeat_interleave(t, 2), torch.nonzero_static(mask, size=4), t.index_select(0, mask.long())
        torch.arange(4.0).to(t.device, non_blocking=True)
        t.clone().copy_(torch.arange(4.0), non_blocking=True)
    assert reads.total == 1, dict(reads.sites)


def test_a_tensor_made_on_the_host_is_read_for_free_until_it_moves_to_the_device():
    with counted_host_reads() as reads:
        levels = torch.tensor([0, 1, 2, 1])  # no device named: the host
        levels.unique().tolist(), (levels == 1).nonzero(), bool(levels.any()), torch.arange(4)[levels > 0]
        assert reads.total == 0, dict(reads.sites)
        moved = levels.to(torch.device("cpu"), non_blocking=True)  # a device's tensor, on a GPU
        bool(moved.any())
        torch.zeros(3, device=torch.device("cpu")).tolist()
    assert reads.total == 2, dict(reads.sites)
