"""The R-independence theorems of automatic clipping (Bu et al., Theorems 1 and 2) as exact trajectory
tests: same seed, so the same Poisson batches and the same noise draws; only R and the optimizer
hyperparameters differ as the theorems say."""

from __future__ import annotations

import pytest
import torch
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree

STEPS = 12


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (64,), generator=g)
    return TensorDataset(x, y)


def trajectory(make_optimizer, max_grad_norm, groups="all-layer", clipping="auto-s", steps=STEPS,
               state=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    if state is not None:
        model.load_state_dict(state["model"])
    optimizer = make_optimizer(model.parameters())
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    engine = tunefree.make_private(model, optimizer, DataLoader(data(), batch_size=16),
                                   noise_multiplier=0.7, target_delta=1e-3, clipping=clipping,
                                   max_grad_norm=max_grad_norm, groups=groups, seed=11)
    train(engine, steps)
    engine.detach()
    return model, optimizer


def assert_same_weights(a, b, rtol=1e-10):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-12)


R = 4.0  # a power of two: the theorems then hold bit for bit; 3.3 below checks a general R


@pytest.mark.parametrize("r", [R, 3.3])
@pytest.mark.parametrize("groups", ["all-layer", "per-layer"])
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_theorem_1(r, groups, momentum, nesterov):
    """Non-adaptive: (R, η, λ) behaves as (1, ηR, λ/R)."""
    lr, wd = 0.05, 0.01

    def sgd(lr_, wd_):
        return lambda params: torch.optim.SGD(params, lr=lr_, momentum=momentum, nesterov=nesterov,
                                              weight_decay=wd_)

    with_r, _ = trajectory(sgd(lr, wd), r, groups)
    unit, _ = trajectory(sgd(lr * r, wd / r), 1.0, groups)
    assert_same_weights(with_r, unit)
    other, _ = trajectory(sgd(lr, wd), 1.0, groups)  # the claim is not vacuous
    assert not torch.allclose(other[0].weight, with_r[0].weight)


ADAPTIVE = {
    # (R, η, λ, ε) behaves as (1, η, λ/R, ε/R): coupled (L2) weight decay is rescaled; ε, which the
    # theorem neglects, is rescaled so that the equivalence is exact.
    "adam": lambda lr, wd, eps: (lambda p: torch.optim.Adam(p, lr=lr, weight_decay=wd, eps=eps)),
    "nadam": lambda lr, wd, eps: (lambda p: torch.optim.NAdam(p, lr=lr, weight_decay=wd, eps=eps)),
    "adagrad": lambda lr, wd, eps: (lambda p: torch.optim.Adagrad(p, lr=lr, weight_decay=wd,
                                                                  eps=eps)),
}


@pytest.mark.parametrize("r", [R, 3.3])
@pytest.mark.parametrize("name", list(ADAPTIVE))
def test_adaptive_theorem_2(name, r):
    make = ADAPTIVE[name]
    with_r, _ = trajectory(make(0.01, 0.02, 1e-8), r)
    unit, _ = trajectory(make(0.01, 0.02 / r, 1e-8 / r), 1.0)
    assert_same_weights(with_r, unit)


@pytest.mark.parametrize("r", [R, 3.3])
def test_adamw_theorem_2_keeps_decoupled_weight_decay(r):
    """Decoupled weight decay: the same η and λ."""
    def adamw(eps):
        return lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, eps=eps)

    with_r, _ = trajectory(adamw(1e-8), r)
    unit, _ = trajectory(adamw(1e-8 / r), 1.0)
    assert_same_weights(with_r, unit)


def test_radam_is_r_independent_once_rectified():
    """torch's RAdam takes un-adapted (SGD-like, R-dependent) steps while its variance rectification
    term ρₜ ≤ 5, i.e. for the first steps; from a state past that warm-up it is R-independent."""
    def radam(eps):
        return lambda p: torch.optim.RAdam(p, lr=0.01, eps=eps)

    warm_model, warm_opt = trajectory(radam(1e-8), 1.0, steps=8)
    warm = {"model": warm_model.state_dict(), "optimizer": warm_opt.state_dict()}
    scaled = {"model": warm["model"], "optimizer": _scale_moments(warm["optimizer"], R)}
    with_r, _ = trajectory(radam(1e-8 * R), R, state=scaled)
    unit, _ = trajectory(radam(1e-8), 1.0, state=warm)
    assert_same_weights(with_r, unit)
    # and the warm-up is where R matters
    cold_r, _ = trajectory(radam(1e-8 * R), R, steps=3)
    cold_1, _ = trajectory(radam(1e-8), 1.0, steps=3)
    assert not torch.allclose(cold_r[0].weight, cold_1[0].weight)


def _scale_moments(state, r):
    """The optimizer state a run with threshold R would have: first moments ×R, second ×R², ε×R."""
    groups = [{**group, "eps": group["eps"] * r} for group in state["param_groups"]]
    out = {"param_groups": groups, "state": {}}
    for key, s in state["state"].items():
        out["state"][key] = {"step": s["step"].clone(), "exp_avg": s["exp_avg"] * r,
                             "exp_avg_sq": s["exp_avg_sq"] * r * r}
    return out
