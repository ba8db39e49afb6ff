"""Every release is a mechanism in privacy/mechanisms.py, and its noise has the stated scale."""

import math
import pathlib
import re

import dp_accounting as dpa
import torch

from tunefree.privacy.mechanisms import release_values
from tunefree.privacy.randomness import SecretSource, SeededSource

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "tunefree"
# the np.random uses allowed: the public train/test split of cli/datasets.py (a fixed seed, not noise),
# and the probe passes' saving, seeding and restoring of NumPy's global generator (guards/probe.py: no draw)
NOISE_DRAW = re.compile(r"randomness\.normal|torch\.randn|torch\.normal|\.normal_\(|Laplace\("
                        r"|\.exponential_\(|torch\.rand\b"
                        r"|np\.random\.(?!default_rng\(SPLIT_SEED\)|get_state\(\)|set_state\(|seed\()")


def test_no_noise_is_drawn_outside_the_mechanisms():
    allowed = {SRC / "privacy" / "mechanisms.py", SRC / "privacy" / "statistics.py",
               SRC / "privacy" / "randomness.py"}
    offenders = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path not in allowed
                 for n, line in enumerate(path.read_text().splitlines(), 1) if NOISE_DRAW.search(line)]
    assert offenders == []


def test_component_release_noise_has_the_stated_scale_and_event():
    """A step component's release (clip counts, losses): noise of standard deviation σ·sensitivity on each
    coordinate, accounted as one Gaussian event of multiplier σ."""
    draws, multiplier = 20000, 3.0
    counts = torch.zeros(4, dtype=torch.float64)
    std = multiplier * math.sqrt(4) / 2  # the joint release of 4 counts has sensitivity √4/2
    samples = torch.stack([release_values(counts, math.sqrt(4) / 2, multiplier, SeededSource(1 + i))[0]
                           for i in range(draws // 4)])
    assert abs(float(samples.std()) / std - 1) < 0.02
    _, event = release_values(counts, 1.0, multiplier, SeededSource(0))
    assert event == dpa.GaussianDpEvent(multiplier)
    # one count of a joint release of 4 (a pipeline stage's): the same noise
    one = torch.stack([release_values(counts[:1], math.sqrt(4) / 2, multiplier, SeededSource(i))[0]
                       for i in range(draws)])
    assert abs(float(one.std()) / std - 1) < 0.02
    loss_sums = torch.stack([release_values(torch.zeros(1), 2.0, 1.5, SeededSource(i))[0]
                             for i in range(draws)])
    assert abs(float(loss_sums.std()) / (1.5 * 2.0) - 1) < 0.02  # a loss sum clipped to R_l = 2, σ_l = 1.5


def test_seeded_releases_replay_and_secure_releases_differ():
    counts = torch.zeros(3, dtype=torch.float64)
    a = release_values(counts, 0.5, 1.0, SeededSource(7))[0]
    assert torch.equal(a, release_values(counts, 0.5, 1.0, SeededSource(7))[0])
    secure = [release_values(counts, 0.5, 1.0, SecretSource())[0] for _ in range(2)]
    assert not torch.equal(secure[0], secure[1])
    assert not torch.equal(secure[0], a)


def test_secure_normals_are_standard_and_independent_across_shapes_and_pairs():
    """One secure draw for several shapes (odd total, so Box-Muller's pairs are split unevenly): each
    coordinate is N(0, 1) and the cosine and sine halves of the pairs are uncorrelated."""
    shapes = [torch.Size([301, 67]), torch.Size([5]), torch.Size([2, 3, 4])]
    draws = SecretSource().normals(shapes, torch.device("cpu"), torch.float64)
    assert [d.shape for d in draws] == shapes
    z = torch.cat([d.flatten() for d in draws])
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)
    half = n // 2
    correlation = float((z[:half] * z[(n + 1) // 2:(n + 1) // 2 + half]).mean())
    assert abs(correlation) < 5 / math.sqrt(half)
    # 3 for a normal (uniform: 1.8, Laplace: 6); the estimate's deviation is √((E z⁸ − 9)/n) = √(96/n),
    # 0.069 here: 5 deviations like the other moments (a fixed 0.15, 2.2 deviations, failed 1 run in ~35)
    kurtosis = float((z ** 4).mean())
    assert abs(kurtosis - 3) < 5 * math.sqrt(96 / n)


def test_gradient_noise_follows_the_thresholds_it_is_released_at_and_adds_std_times_noise():
    from torch import nn

    from tunefree.clipping.groups import make_groups
    from tunefree.privacy.mechanisms import GradientRelease, group_noise_stds

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    groups = make_groups(model, "per-layer", 1.0)
    release = GradientRelease(groups, 1.3, SeededSource(5), "equal-budget")
    sizes = [g.size for g in groups]
    a, b = {"0": 1.0, "1": 2.0}, {"0": 0.5, "1": 2.0}
    for thresholds in (a, a, b, a):  # repeated, changed, changed back
        assert release.noise_stds(thresholds) == group_noise_stds(list(thresholds.values()), sizes, 1.3,
                                                                  "equal-budget")
    sums = {p: torch.full(p.shape, 0.25) for p in model.parameters()}
    given = {p: s.clone() for p, s in sums.items()}
    noisy, _ = release.release(sums, {"0": 0.5, "1": 2.0})
    replay = SeededSource(5)  # the same seeded stream: the noise the release drew, parameter by parameter
    stds = dict(release.param_stds({"0": 0.5, "1": 2.0}))
    for p in model.parameters():
        expected = given[p] + stds[p] * replay.normal(p.shape, torch.device("cpu"), torch.float32)
        assert torch.equal(noisy[p], expected)
        assert noisy[p] is sums[p]  # the noise went into the sum in place: no copy of the sums


def test_every_source_says_what_it_promises():
    from tunefree.privacy.randomness import NoiseSource

    secret, seeded = SecretSource(), SeededSource(3)
    assert isinstance(secret, NoiseSource) and isinstance(seeded, NoiseSource)
    assert (secret.secret, secret.replayable, secret.seed) == (True, False, None)
    assert (seeded.secret, seeded.replayable, seeded.seed) == (False, True, 3)
    assert "remove the noise" in seeded.description and secret.description == "secure"


BUCKET = [torch.Size([7, 3]), torch.Size([5]), torch.Size([4, 2])]  # 21 + 5 + 8 coordinates


def _bucket_noise(randomness, stds, shard):
    from tunefree.privacy.mechanisms import add_bucket_noise

    flat = torch.zeros(sum(math.prod(s) for s in BUCKET))
    add_bucket_noise(flat, [(torch.nn.Parameter(torch.zeros(s)), std) for s, std in zip(BUCKET, stds)],
                     randomness, shard)
    return flat


def test_seeded_bucket_noise_is_one_process_noise_added_by_rank_0_and_every_stream_stays_in_step():
    stds = [2.0, 0.0, 0.5]  # a parameter without noise takes no draw
    ranks = [SeededSource(9) for _ in range(3)]
    flats = [_bucket_noise(r, stds, (rank, 3)) for rank, r in enumerate(ranks)]
    one = SeededSource(9)  # one process: parameter by parameter, as GradientRelease.release draws
    cpu, f32 = torch.device("cpu"), torch.float32
    expected = torch.cat([2.0 * one.normal(BUCKET[0], cpu, f32).reshape(-1), torch.zeros(5),
                          0.5 * one.normal(BUCKET[2], cpu, f32).reshape(-1)])
    assert torch.equal(flats[0], expected)
    assert not flats[1].any() and not flats[2].any()
    states = [r.state_dict()["noise"]["cpu"] for r in (*ranks, one)]
    assert all(torch.equal(states[0], s) for s in states)


def test_secret_bucket_noise_covers_every_noised_coordinate_exactly_once_over_the_ranks():
    stds = [4.0, 0.0, 0.25]
    flats = [_bucket_noise(SecretSource(), stds, (rank, 3)) for rank in range(3)]
    touched = torch.stack([f != 0 for f in flats]).int()
    assert touched[:, 21:26].sum() == 0  # the parameter without noise
    assert torch.equal(touched.sum(0)[:21], torch.ones(21, dtype=torch.int))
    assert torch.equal(touched.sum(0)[26:], torch.ones(8, dtype=torch.int))
    assert all(t.sum() in (9, 10) for t in touched)  # each rank its own third of the 29
    total = sum(flats)
    assert float(total[:21].std()) > 1 > float(total[26:].std())  # each piece with its own deviation


def test_shard_noise_seeded_is_one_process_rows_and_secret_noises_each_shard_once():
    from tunefree.privacy.mechanisms import add_shard_noise

    shapes, stds, world = [torch.Size([5, 3]), torch.Size([3])], [1.5, 0.5], 2
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]

    def rows(shape, rank):  # FSDP2's shard of dim 0: ⌈rows/W⌉ rows from ⌈rows/W⌉·rank
        per = math.ceil(shape[0] / world)
        return slice(per * rank, min(per * (rank + 1), shape[0]))

    one = SeededSource(4)
    whole = [std * one.normal(s, torch.device("cpu"), torch.float32) for s, std in zip(shapes, stds)]
    for rank in range(world):
        for randomness in (SeededSource(4), SecretSource()):
            shards = {p: torch.zeros(p[rows(p.shape, rank)].shape) for p in params}
            add_shard_noise(shards, list(zip(params, stds)), randomness, (rank, world))
            for p, noise in zip(params, whole):
                if randomness.replayable:
                    assert torch.equal(shards[p], noise[rows(p.shape, rank)])
                else:
                    assert shards[p].shape == noise[rows(p.shape, rank)].shape and shards[p].all()
