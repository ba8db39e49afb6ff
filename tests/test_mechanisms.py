"""Every release is a mechanism in privacy/mechanisms.py, and its noise has the stated scale."""

import math
import pathlib
import re

import dp_accounting as dpa
import torch

from tunefree.privacy.mechanisms import release_counts, release_loss_sum
from tunefree.privacy.randomness import Randomness

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tunefree"
# the one np.random use allowed is the public train/test split of cli/datasets.py (a fixed seed, not noise)
NOISE_DRAW = re.compile(r"randomness\.normal|torch\.randn|torch\.normal|\.normal_\(|Laplace\("
                        r"|\.exponential_\(|torch\.rand\b|np\.random\.(?!default_rng\(SPLIT_SEED\))")


def test_no_noise_is_drawn_outside_the_mechanisms():
    allowed = {SRC / "privacy" / "mechanisms.py", SRC / "privacy" / "randomness.py"}
    offenders = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path not in allowed
                 for n, line in enumerate(path.read_text().splitlines(), 1) if NOISE_DRAW.search(line)]
    assert offenders == []


def test_count_noise_has_the_stated_scale_and_event():
    draws, std = 20000, 3.0
    counts = torch.zeros(4, dtype=torch.float64)
    samples = torch.stack([release_counts(counts, std, Randomness(seed=1 + i))[0] for i in range(draws // 4)])
    assert abs(float(samples.std()) / std - 1) < 0.02
    _, event = release_counts(counts, std, Randomness(seed=0))
    assert event == dpa.GaussianDpEvent(2 * std / math.sqrt(4))


def test_gaussian_loss_noise_has_the_stated_scale():
    rng, bound, sigma = Randomness(seed=3), 2.0, 1.5
    values = torch.tensor([release_loss_sum(0.0, bound, sigma, "gaussian", rng)[0] for _ in range(20000)])
    assert abs(float(values.std()) / (sigma * bound) - 1) < 0.02
    assert release_loss_sum(0.0, bound, sigma, "gaussian", rng)[1] == dpa.GaussianDpEvent(sigma)


def test_laplace_loss_noise_has_the_stated_scale():
    rng, bound, sigma = Randomness(seed=4), 2.0, 1.5
    values = torch.tensor([release_loss_sum(0.0, bound, sigma, "laplace", rng)[0] for _ in range(20000)],
                          dtype=torch.float64)
    scale = sigma * bound  # Laplace(b): E|X| = b
    assert abs(float(values.abs().mean()) / scale - 1) < 0.02
    assert release_loss_sum(0.0, bound, sigma, "laplace", rng)[1] == dpa.LaplaceDpEvent(sigma)


def test_seeded_releases_replay_and_secure_releases_differ():
    counts = torch.zeros(3, dtype=torch.float64)
    a = release_counts(counts, 1.0, Randomness(seed=7))[0]
    assert torch.equal(a, release_counts(counts, 1.0, Randomness(seed=7))[0])
    secure = [release_counts(counts, 1.0, Randomness(seed=7, secure=True))[0] for _ in range(2)]
    assert not torch.equal(secure[0], secure[1])
    assert not torch.equal(secure[0], a)


def test_secure_normals_are_standard_and_independent_across_shapes_and_pairs():
    """One secure draw for several shapes (odd total, so Box-Muller's pairs are split unevenly): each
    coordinate is N(0, 1) and the cosine and sine halves of the pairs are uncorrelated."""
    shapes = [torch.Size([301, 67]), torch.Size([5]), torch.Size([2, 3, 4])]
    draws = Randomness().normals(shapes, torch.device("cpu"), torch.float64)
    assert [d.shape for d in draws] == shapes
    z = torch.cat([d.flatten() for d in draws])
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)
    half = n // 2
    correlation = float((z[:half] * z[(n + 1) // 2:(n + 1) // 2 + half]).mean())
    assert abs(correlation) < 5 / math.sqrt(half)
    kurtosis = float((z ** 4).mean())  # 3 for a normal; uniform-ish or heavy tails would miss it
    assert abs(kurtosis - 3) < 0.15


def test_gradient_noise_follows_the_thresholds_it_is_released_at_and_adds_std_times_noise():
    from torch import nn

    from tunefree.clipping.groups import make_groups
    from tunefree.privacy.mechanisms import GradientRelease, group_noise_stds

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    groups = make_groups(model, "per-layer", 1.0)
    release = GradientRelease(groups, 1.3, Randomness(5), "equal-budget")
    sizes = [g.size for g in groups]
    a, b = {"0": 1.0, "1": 2.0}, {"0": 0.5, "1": 2.0}
    for thresholds in (a, a, b, a):  # repeated, changed, changed back
        assert release.noise_stds(thresholds) == group_noise_stds(list(thresholds.values()), sizes, 1.3,
                                                                  "equal-budget")
    sums = {p: torch.full(p.shape, 0.25) for p in model.parameters()}
    noisy, _ = release.release(sums, {"0": 0.5, "1": 2.0})
    replay = Randomness(5)  # the same seeded stream: the noise the release drew, parameter by parameter
    stds = dict(release.param_stds({"0": 0.5, "1": 2.0}))
    for p in model.parameters():
        expected = sums[p] + stds[p] * replay.normal(p.shape, torch.device("cpu"), torch.float32)
        assert torch.equal(noisy[p], expected)
