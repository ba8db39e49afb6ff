"""The independence check covers the whole batch at random steps of the whole run (issue 21, item 2).

The first two steps are checked, the first with a gradient probe, the second with a forward probe; then
each step is checked with probability 1/verify_every, at steps drawn from the run's randomness, with a
probe of a random kind; each probe on a random half of the batch. A directed pair of examples that mixes
is caught by a probe of a kind that sees it with probability ≥ 1/4, so by one later check with
probability ≥ 1/8 (≥ 1/4 when both kinds of probe see it), independently from check to check
(tunefree.persample.independence.ProbeSchedule). The run-level
tests below are seeded, so they are deterministic; each states the probability that a run of its length
would miss the mixing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mixing_models import LateMix, MiddleMix, OddPairsMix, ValueMix
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import Abadi
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.persample.independence import (
    FORWARD,
    GRADIENT,
    ProbeSchedule,
    verify_example_independence,
)
from tunefree.privacy.randomness import NoiseSource, SecretSource, SeededSource

N = 8  # examples, all in every batch (q = 1)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 3, generator=generator).clamp(-1.4, 1.4)  # no first feature above 1.5 …
    x[2, 0] = 2.0  # … but example 2's: ValueMix leaks example 2 into example 3 only
    return x, torch.randint(0, 2, (N,), generator=generator)


def _train(model: nn.Module, steps: int, verify_every: int, mixing_from: int | None = None) -> int | None:
    """Train ``steps`` seeded steps through the Poisson loader; the step whose check refused (None: none
    did). A refused step releases and records nothing: the ledger and the parameters stay as they were."""
    torch.manual_seed(0)
    x, y = _data()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=N), noise_multiplier=1.0,
                                   target_delta=1e-3, steps=steps, seed=0, verify_every=verify_every)
    for step in range(1, steps + 1):
        if mixing_from is not None:
            model.mixing = step >= mixing_from
        before = [p.detach().clone() for p in model.parameters()]
        xb, yb = next(iter(engine.data_loader))  # q = 1: one batch per step
        engine.optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        try:
            engine.optimizer.step()
        except tunefree.PrivacyError as error:
            assert "mixes examples" in str(error)
            assert engine.steps == step - 1 and engine.optimizer.accumulator.pop().examples == 0
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            return step
    return None


def test_mixing_of_one_pair_in_the_middle_of_the_batch_is_refused_over_a_run():
    # forward and gradient probes both see it: each step is caught with probability ≥ ½ · ¼ = 1/8,
    # so 60 steps miss it with probability ≤ (7/8)^60 < 4e-4
    assert _train(MiddleMix(), steps=60, verify_every=2) is not None


def test_mixing_that_starts_at_step_7_is_refused_at_a_later_check():
    # a batch statistic mixes every pair: any check from step 7 on refuses it; steps 7-40 are all
    # unchecked with probability (1/2)^34 < 1e-10
    refused = _train(LateMix(), steps=40, verify_every=2, mixing_from=7)
    assert refused is not None and refused >= 7


def test_mixing_of_pairs_i_and_i_plus_1_for_odd_i_is_refused_over_a_run():
    # three mixing pairs: a probe misses all of them with probability 1/8, so a step is caught with
    # probability ≥ ½ · 7/8; 40 steps miss it with probability ≤ (9/16)^40 < 1e-9
    assert _train(OddPairsMix(), steps=40, verify_every=2) is not None


def test_mixing_that_depends_on_a_value_in_the_data_is_refused_over_a_run():
    # only example 2 (first feature 2.0 > 1.5) leaks, into example 3: one pair, as in the middle case
    assert _train(ValueMix(), steps=60, verify_every=2) is not None


def test_a_clean_model_is_never_refused_at_any_check():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Tanh(), nn.Linear(4, 2))
    assert _train(model, steps=30, verify_every=1) is None


class MixBackwardIntoOne(torch.autograd.Function):
    """Identity forward; the backward adds example 5's output gradient to example 4's: one pair that
    only a gradient probe sees."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g[:4], g[4:5] + g[5:6], g[5:]])


class BackwardPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(MixBackwardIntoOne.apply(self.fc(x)))


@pytest.mark.parametrize(("model", "expected"), [(MiddleMix, 1 / 4), (BackwardPair, 1 / 8)],
                         ids=["forward-pair (both probes)", "backward-pair (gradient probes)"])
def test_one_check_catches_one_mixing_pair_with_the_stated_probability(model, expected):
    """400 checks as a run draws them (seeded): one pair is caught with probability 1/4 when both kinds
    of probe see it and 1/8 when only one does (× 1/(1 − 2^-7) for halves that are never trivial); the
    observed fraction lies within 2.5 binomial standard deviations."""
    torch.manual_seed(0)
    net = model()
    engine = ClippingEngine(net, make_groups(net, "all-layer", 1.0), Abadi(), "sum")
    x = torch.randn(N, 3)
    schedule = ProbeSchedule(SeededSource(11))
    caught = 0
    for step in range(1, 401):
        try:
            verify_example_independence(net, engine, (x,), probes=schedule.probes(step, N))
        except tunefree.PrivacyError:
            caught += 1
    p = expected / (1 - 2 ** -7)
    spread = 2.5 * (p * (1 - p) / 400) ** 0.5
    assert abs(caught / 400 - p) <= spread, caught


def test_the_checked_steps_are_random_at_the_stated_rate_and_replay_with_the_seed():
    def schedule(randomness: NoiseSource) -> list[bool]:
        probes = ProbeSchedule(randomness)
        return [probes.due(step, 16) for step in range(1, 4001)]

    seeded = schedule(SeededSource(3))
    assert abs(sum(seeded) - 250) <= 3 * (4000 / 16 * 15 / 16) ** 0.5  # binomial(4000, 1/16)
    assert seeded == schedule(SeededSource(3))  # a seeded run replays its checks
    assert seeded != schedule(SeededSource(4))
    assert schedule(SecretSource()) != schedule(SecretSource())  # secret: no two runs alike
    every_step = ProbeSchedule(SecretSource())
    assert all(every_step.due(step, 1) for step in range(1, 50))


def test_each_probe_is_one_kind_on_a_proper_random_half_of_a_random_or_the_asked_kind():
    schedule = ProbeSchedule(SeededSource(5))
    kinds = []
    for step in range(1, 501):
        probes = schedule.probes(step, 3)
        assert (len(probes.perturbed), len(probes.zeroed)) in ((1, 0), (0, 1))
        kinds.append(bool(probes.perturbed))
        mask = (probes.perturbed or probes.zeroed)[0]
        assert 0 < int(mask.sum()) < 3  # never all examples nor none
    assert abs(sum(kinds) - 250) <= 3 * (500 / 4) ** 0.5
    forward, gradient = schedule.probes(1, 6, FORWARD), schedule.probes(1, 6, GRADIENT)
    assert (len(forward.perturbed), len(forward.zeroed)) == (1, 0)
    assert (len(gradient.perturbed), len(gradient.zeroed)) == (0, 1)
    assert torch.equal(forward.perturbed[0], gradient.zeroed[0])  # the step's half, whatever the kind


@pytest.mark.parametrize(("model", "seeing"), [(MiddleMix, 2), (BackwardPair, 1)],
                         ids=["forward-pair (both probes)", "backward-pair (gradient probes)"])
def test_the_first_two_checks_catch_one_mixing_pair_with_the_stated_probability(model, seeing):
    """The first two checks as runs draw them (a gradient probe, then a forward probe), 240 seeded runs:
    one pair is caught by the two with probability 1 − (3/4)² = 7/16 when both kinds see it and 1/4 when
    only one does (each probe's half never trivial: 1/4 becomes p = 1/4 / (1 − 2^-7)); the observed
    fraction lies within 2.5 binomial standard deviations."""
    p = 1 / 4 / (1 - 2 ** -7)
    expected = 1 - (1 - p) ** seeing
    torch.manual_seed(0)
    net = model()
    engine = ClippingEngine(net, make_groups(net, "all-layer", 1.0), Abadi(), "sum")
    x = torch.randn(N, 3)
    caught = 0
    for seed in range(240):
        schedule = ProbeSchedule(SeededSource(seed))
        try:
            for step, kind in enumerate((GRADIENT, FORWARD), start=1):
                verify_example_independence(net, engine, (x,), probes=schedule.probes(step, N, kind))
        except tunefree.PrivacyError:
            caught += 1
    spread = 2.5 * (expected * (1 - expected) / 240) ** 0.5
    assert abs(caught / 240 - expected) <= spread, caught


class MixBeforeAnyUnit(nn.Module):
    """Adds the previous example's input to each example's, before the first trainable unit: every
    pair (i - 1, i) mixes, which forward probes see with certainty and gradient probes never see."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x + x.roll(1, 0))


class MixEveryGradient(torch.autograd.Function):
    """Identity forward; the backward adds each example's output gradient to the next one's: every
    pair mixes, which gradient probes see with certainty and forward probes never see."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.roll(1, 0)


class BackwardOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(MixEveryGradient.apply(self.fc(x)))


def test_the_first_release_is_checked_by_a_gradient_probe_and_the_second_by_a_forward_probe():
    """Both first steps are checked before their releases (verify_every so large that no later step
    is): mixing only a gradient probe sees is refused at step 1, with nothing released; mixing only a
    forward probe sees is released at step 1 and refused at step 2, before its release (the cost of
    checking the first two steps one probe each, ProbeSchedule's docstring)."""
    assert _train(BackwardOnly(), steps=4, verify_every=10**9) == 1
    assert _train(MixBeforeAnyUnit(), steps=4, verify_every=10**9) == 2
    assert _train(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), steps=4,
                  verify_every=10**9) is None


def test_the_checks_change_no_batch_of_a_seeded_run():
    """The checks' draws use keys of the run's randomness that no sampling step uses."""
    def batches(verify_every: int) -> list[torch.Tensor]:
        x = torch.arange(40.0)[:, None].expand(40, 3).contiguous()
        model = nn.Linear(3, 2)
        engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       DataLoader(TensorDataset(x, torch.zeros(40, dtype=torch.long)),
                                                  batch_size=8), noise_multiplier=1.0, target_delta=1e-3,
                                       seed=7, verify_every=verify_every)
        seen = []
        for xb, yb in engine.data_loader:
            seen.append(xb[:, 0].detach().clone())
            engine.optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            engine.optimizer.step()
        return seen

    assert all(torch.equal(a, b) for a, b in zip(batches(1), batches(10**6)))
