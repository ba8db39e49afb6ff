"""The release holds no extra copy of the gradient: the noise goes into the clipped sums in place, a piece
at a time, and the division by q·N writes ``.grad`` without another full copy.

Memory is counted by a tracker of the tensors the step allocates (every storage an operator returns,
until it is freed): what a private ``optimizer.step()`` holds at its peak beyond what was alive when it
started."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.memory import Allocations
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.privacy import mechanisms

WIDTH = 128


def _model_and_step(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).to(dtype)
    x, y = torch.randn(16, WIDTH, dtype=dtype), torch.randint(0, WIDTH, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="not Poisson-sampled"):
        engine = tunefree.make_private(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=16),
                                       noise_multiplier=1.0, target_delta=1e-3, seed=0,
                                       poisson_sampling=False, loss_reduction="sum")

    def backward():
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x).float(), y, reduction="sum").backward()
    return model, engine, backward


def _step_peak(dtype: torch.dtype) -> tuple[int, int]:
    """Peak bytes a private step allocates beyond what is alive at its start, and the largest
    parameter's bytes in its accumulation dtype (float32)."""
    model, engine, backward = _model_and_step(dtype)
    backward()
    engine.optimizer.step()  # the first step checks example independence: measure the second
    backward()
    with Allocations() as tracker:
        engine.optimizer.step()
    return tracker.peak, 4 * max(p.numel() for p in model.parameters())


@pytest.fixture
def one_layer_pieces(monkeypatch):
    """Noise drawn one layer (weight and bias) at a time."""
    monkeypatch.setattr(mechanisms, "NOISE_PIECE", WIDTH * WIDTH + WIDTH)


def test_a_float32_step_holds_one_piece_of_noise_beyond_the_sums(one_layer_pieces):
    peak, largest = _step_peak(torch.float32)
    parameters = 4 * 4 * (WIDTH * WIDTH + WIDTH)  # bytes: four layers, float32
    # before: the noise of every parameter and a divided copy of every sum (2 × the parameters)
    assert peak <= 4 * (WIDTH * WIDTH + WIDTH) + 64 * 1024 < parameters // 2
    assert peak >= largest  # the tracker saw the noise


def test_a_bfloat16_step_holds_its_gradients_and_one_piece_of_noise(one_layer_pieces):
    peak, _ = _step_peak(torch.bfloat16)
    gradients = 2 * 4 * (WIDTH * WIDTH + WIDTH)  # the released .grad, in bfloat16, as non-private holds
    assert peak <= gradients + 4 * (WIDTH * WIDTH + WIDTH) + 64 * 1024


def test_the_noise_pieces_do_not_change_a_seeded_release(monkeypatch):
    """A seeded source draws shape by shape: drawing in pieces gives the same numbers, bit for bit."""
    grads = []
    for piece in (1, 2**30):
        monkeypatch.setattr(mechanisms, "NOISE_PIECE", piece)
        model, engine, backward = _model_and_step()
        backward()
        engine.optimizer.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert all(g.abs().sum() > 0 for g in grads[0])


def test_a_float32_gradient_is_the_noisy_sum_itself():
    """Where the dtypes agree, ``.grad`` is the accumulator's sum, noised and divided in place."""
    model, engine, backward = _model_and_step()
    backward()
    sums = dict(engine.clipper.accumulator.sink._sums)
    engine.optimizer.step()
    assert sums and all(p.grad is t for p, t in sums.items())


def test_a_secret_release_cuts_a_large_parameter_into_pieces(monkeypatch):
    """A secret source's noise is not replayed: a parameter larger than a piece is noised span by span,
    every coordinate once, with the planned deviation; the release holds one piece of noise."""
    from tunefree.clipping.groups import make_groups
    from tunefree.privacy.randomness import SecretSource

    monkeypatch.setattr(mechanisms, "NOISE_PIECE", 1000)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3))
    groups = make_groups(model, "all-layer", 1.0)
    release = mechanisms.GradientRelease(groups, 2.0, SecretSource())
    thresholds = {g.name: g.threshold for g in groups}
    release.release({}, thresholds)  # the generator's own buffers, made once per process
    sums = {p: torch.zeros(p.shape) for p in model.parameters()}
    with Allocations() as tracker:
        noisy, _ = release.release(sums, thresholds)
    assert tracker.peak <= 4 * 2048 + 1024  # a piece's draw: one group of 2048 Gaussians (float32)
    weight = noisy[model[0].weight]
    assert weight is sums[model[0].weight] and bool((weight != 0).all())
    assert abs(float(weight.std()) / 2.0 - 1) < 0.05  # σ·R = 2, over 16,384 coordinates
