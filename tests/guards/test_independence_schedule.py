"""The independence check covers the whole batch at random steps of the whole run (issues 21 and 29).

The first step is checked with certainty for every pair; then each step is checked with probability
1/verify_every, at steps drawn from the run's randomness. Every check sees, for every pair, mixing that
gradients carry (the backward check's power-of-two weights); mixing only a forward pass shows (a path
without gradients) is seen by the first check for every pair, and by a later check's random half for a
directed pair with probability ≥ 1/4 (tunefree.guards.independence.ProbeSchedule). The run-level tests
below are seeded, so they are deterministic; each states the probability that a run of its length would
miss the mixing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.mixing_models import LateMix, MiddleMix, OddPairsMix, ValueMix
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import Abadi
from tunefree.clipping.groups import make_groups
from tunefree.guards.independence import ProbeSchedule, verify_example_independence
from tunefree.persample.engine import ClippingEngine
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


def test_mixing_of_one_pair_in_the_middle_of_the_batch_is_refused_at_the_first_step():
    # gradients carry it: every check sees it, the first one included
    assert _train(MiddleMix(), steps=6, verify_every=10**9) == 1


def test_mixing_that_starts_at_step_7_is_refused_at_a_later_check():
    # a batch statistic mixes every pair: any check from step 7 on refuses it; steps 7-40 are all
    # unchecked with probability (1/2)^34 < 1e-10
    refused = _train(LateMix(), steps=40, verify_every=2, mixing_from=7)
    assert refused is not None and refused >= 7


def test_mixing_of_pairs_i_and_i_plus_1_for_odd_i_is_refused_at_the_first_step():
    assert _train(OddPairsMix(), steps=6, verify_every=10**9) == 1


def test_mixing_that_depends_on_a_value_in_the_data_is_refused_at_the_first_step():
    # only example 2 (first feature 2.0 > 1.5) leaks, into example 3: one pair, through gradients
    assert _train(ValueMix(), steps=6, verify_every=10**9) == 1


def test_a_clean_model_is_never_refused_at_any_check():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Tanh(), nn.Linear(4, 2))
    assert _train(model, steps=30, verify_every=1) is None


class MixBackwardIntoOne(torch.autograd.Function):
    """Identity forward; the backward adds example 5's output gradient to example 4's: one pair that
    only the backward check sees."""

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


class DetachedPair(nn.Module):
    """Example 4's activations get example 3's through a path without gradients: one pair that only a
    forward check sees (the gradients of example 4 still depend on example 3's data)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        carried = torch.zeros_like(h)
        if len(h) > 4:  # batches are Poisson-sampled: any size
            carried[4] = h[3].detach()
        return self.out(torch.tanh(h + carried))


class BatchScaledGradient(nn.Module):
    """A full backward hook that scales the gradient flowing into the trunk by the batch's gradient norm:
    one scalar over the batch, no example's gradient ever zeroed (issue 29, item 2)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.act = nn.Tanh()
        self.out = nn.Linear(4, 2)
        self.act.register_full_backward_hook(
            lambda m, gi, go: (gi[0] / torch.clamp(gi[0].norm() / 0.01, min=1.0),))

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class ClampedGradient(nn.Module):
    """A hook that clamps each gradient element: not linear, but per example — not mixing."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return self.out(torch.tanh(h))


def _engine(net: nn.Module) -> ClippingEngine:
    return ClippingEngine(net, make_groups(net, "all-layer", 1.0), Abadi(), "sum")


@pytest.mark.parametrize("model", [MiddleMix, BackwardPair, BatchScaledGradient],
                         ids=["forward-pair", "backward-pair", "batch-scaled-gradient"])
def test_every_check_catches_mixing_that_gradients_carry(model):
    """Whatever half a later check draws, the backward check sees every pair gradients carry."""
    torch.manual_seed(0)
    net = model()
    engine = _engine(net)
    x = torch.randn(N, 3)
    schedule = ProbeSchedule(SeededSource(11))
    for step in range(2, 42):
        with pytest.raises(tunefree.PrivacyError, match="mixes examples"):
            verify_example_independence(net, engine, (x,), levels=schedule.levels(step, N, first=False))


def test_a_gradient_hook_that_is_per_example_but_not_linear_passes():
    net = ClampedGradient()
    verify_example_independence(net, _engine(net), (torch.randn(N, 3) * 3,))


@pytest.mark.slow
def test_a_later_check_catches_a_forward_only_pair_with_the_stated_probability():
    """400 later checks as a run draws them (seeded): a directed pair only a forward pass shows is caught
    when its source is in the half and its target is not, probability 1/4 (× 1/(1 − 2^-7) for halves
    that are never trivial); the observed fraction lies within 2.5 binomial standard deviations."""
    torch.manual_seed(0)
    net = DetachedPair()
    engine = _engine(net)
    x = torch.randn(N, 3)
    schedule = ProbeSchedule(SeededSource(11))
    caught = 0
    for step in range(2, 402):
        try:
            verify_example_independence(net, engine, (x,), levels=schedule.levels(step, N, first=False))
        except tunefree.PrivacyError:
            caught += 1
    p = 1 / 4 / (1 - 2 ** -7)
    spread = 2.5 * (p * (1 - p) / 400) ** 0.5
    assert abs(caught / 400 - p) <= spread, caught


def test_the_first_check_catches_a_forward_only_pair_with_certainty():
    torch.manual_seed(0)
    net = DetachedPair()
    schedule = ProbeSchedule(SeededSource(11))
    for n in (5, 8, 33):
        x = torch.randn(n, 3)
        with pytest.raises(tunefree.PrivacyError, match="mixes examples in its forward"):
            verify_example_independence(net, _engine(net), (x,), levels=schedule.levels(1, n, first=True))


@pytest.mark.slow
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


def test_a_later_check_changes_a_proper_random_half_and_the_first_check_every_pair():
    schedule = ProbeSchedule(SeededSource(5))
    sizes = []
    for step in range(2, 502):
        levels = schedule.levels(step, 3, first=False)
        assert levels.shape == (3, 2) and not levels[:, 0].any()
        mask = levels[:, 1].bool()
        assert 0 < int(mask.sum()) < 3  # never all examples nor none
        sizes.append(int(mask.sum()))
    assert abs(sum(sizes) / len(sizes) - 1.5) < 0.15
    for n in (2, 7, 64, 300):
        for ordered in (False, True):
            levels = schedule.levels(1, n, first=True, ordered=ordered)
            assert not levels[:, 0].any()  # the first pass is the batch as it is
            if ordered:  # each pass against the first: [i, j], a pass changes j and not i
                changed = levels[:, 1:] > 0
                separated = (~changed[:, None] & changed[None, :]).any(-1)
            else:  # [i, j]: two passes give i one input and j two
                same = levels[:, :, None] == levels[:, None, :]  # [i, p, q]: i's input the same in p and q
                separated = (same[:, None] & ~same[None, :]).flatten(2).any(-1)
            assert bool((separated | torch.eye(n, dtype=torch.bool)).all())
            assert int(levels.max()) <= (1 if ordered else 3)


class MixBeforeAnyUnit(nn.Module):
    """Adds the previous example's input to each example's, before the first trainable unit: every
    pair (i - 1, i) mixes, which only a forward check sees."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x + x.roll(1, 0))


class MixEveryGradient(torch.autograd.Function):
    """Identity forward; the backward adds each example's output gradient to the next one's: every
    pair mixes, which only the backward check sees."""

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


def test_a_model_that_always_mixes_is_refused_before_the_first_release():
    """The first step is checked before its release, certainly for every pair (verify_every so large
    that no later step is): mixing only a backward check sees and mixing only a forward check sees are
    both refused at step 1, with nothing released."""
    assert _train(BackwardOnly(), steps=4, verify_every=10**9) == 1
    assert _train(MixBeforeAnyUnit(), steps=4, verify_every=10**9) == 1
    assert _train(DetachedPair(), steps=4, verify_every=10**9) == 1
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


class Tokens(nn.Module):
    """Embedded tokens, pooled per example; ``pair``: each example's ids shifted by the previous example's
    first id (integer mixing, which no gradient carries)."""

    def __init__(self, pair: bool = False):
        super().__init__()
        self.embed, self.fc, self.pair = nn.Embedding(50, 4), nn.Linear(4, 2), pair

    def forward(self, ids):
        if self.pair:
            ids = (ids + ids.roll(1, 0)[:, :1]) % 50
        return self.fc(self.embed(ids).mean(1))


@pytest.mark.parametrize("n", [40, 300])
def test_the_first_check_with_three_levels_passes_tokens_and_catches_a_token_pair(n):
    """Batches of 40 and 300 examples take three levels per pass: each example takes another's ids at a
    distance its level sets, the same in every pass."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (n, 6))
    assert int(ProbeSchedule(SeededSource(1)).levels(1, n, first=True).max()) == 2
    net = Tokens()
    verify_example_independence(net, _engine(net), (ids,))
    mixing = Tokens(pair=True)
    with pytest.raises(tunefree.PrivacyError, match="mixes examples in its forward"):
        verify_example_independence(mixing, _engine(mixing), (ids,))
