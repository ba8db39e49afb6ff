"""The private step: the ledger is written before the update, the trainable set is fixed at make_private,
step hooks fire once per logical step (never in lr="auto" probes), and going past the plan warns once."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree import PrivacyError
from tunefree.guards import independence

HYFREEDP_EVERY_STEP = tunefree.HyFreeDP(interval=1)


def data(n=60):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def private(net=None, optimizer=None, **kwargs):
    net = net or model()
    optimizer = optimizer or torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    options = {"noise_multiplier": 1.0, "target_delta": 1e-3, "seed": 0, **kwargs}
    return tunefree.make_private(net, optimizer, DataLoader(data(), batch_size=10), **options)


def step(engine, with_losses=False):
    """One logical step (all its physical batches)."""
    batches = iter(engine.data_loader)
    while True:
        x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step((lambda x=x, y=y: F.cross_entropy(engine.model(x), y, reduction="none"))
                              if with_losses else None)
        if engine.schedule.ends_logical:
            return


# ----------------------------------------------------------------------------- ledger before update
def _full_run():
    """A run whose step has every part: both components (adaptive thresholds, lr='auto'). σ = 0 spares
    the budget split's calibration; the releases and their ledger records are those of any σ."""
    # verify_every=1: the independence check runs on the failing step too
    return private(thresholds="adaptive", lr=tunefree.HyFreeDP(), steps=8,
                   noise_multiplier=0.0, verify_every=1)


def _component(engine, kind):
    return next(c for c in engine.optimizer.components if type(c).__name__ == kind)


INJECTION_POINTS = {  # where step() calls out, and whether that point comes before the release
    "check_no_leak": (lambda e: (e.clipper, "check_no_leak"), True),
    "independence check": (lambda e: (independence, "check"), True),
    "accumulator pop": (lambda e: (e.optimizer.accumulator, "pop"), True),
    "gradient release": (lambda e: (e.optimizer.release, "release"), True),
    "thresholds before_update": (lambda e: (_component(e, "QuantileEstimator"), "before_update"), False),
    "auto lr before_update": (lambda e: (_component(e, "HyFreeDPStep"), "before_update"), False),
    "wrapped optimizer step": (lambda e: (e.optimizer.original, "step"), False),
    "thresholds after_update": (lambda e: (_component(e, "QuantileEstimator"), "after_update"), False),
    "auto lr after_update": (lambda e: (_component(e, "HyFreeDPStep"), "after_update"), False),
    "ledger amendment": (lambda e: (e.ledger, "amend_last_step"), False),
    "engine thresholds": (lambda e: (e.clipper, "begin_step"), False),
}


@pytest.mark.parametrize("point", INJECTION_POINTS)
def test_a_failure_anywhere_in_step_never_leaves_an_update_unrecorded(point, monkeypatch):
    failure = KeyboardInterrupt if point == "wrapped optimizer step" else RuntimeError  # e.g. Ctrl-C
    engine = _full_run()
    step(engine, with_losses=True)  # step 1: a probe step, all fine
    target, before_release = INJECTION_POINTS[point]
    owner, name = target(engine)

    def fail(*args, **kwargs):
        raise failure(f"injected at {point}")

    monkeypatch.setattr(owner, name, fail)
    weights = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(failure, match="injected"):
        step(engine, with_losses=True)
    moved = any(not torch.equal(w, p) for w, p in zip(weights, engine.model.parameters()))
    assert 1 + moved <= engine.steps  # updates applied ≤ steps in the ledger
    assert engine.steps == (1 if before_release else 2)  # nothing released: nothing recorded
    if before_release:
        assert not moved


def test_every_release_of_a_step_is_one_sampled_event_of_the_ledger():
    engine = _full_run()
    step(engine, with_losses=True)
    (event, count), = engine.ledger.state_dict()["runs"]
    assert count == 1 and len(event["event"]["composed"]) == 5  # gradient, 3 losses, counts


# ----------------------------------------------------------------------------- fixed trainable set
def _unchanged(engine, weights):
    return engine.steps == 0 and all(torch.equal(w, p) for w, p in zip(weights, engine.model.parameters()))


def test_a_module_added_to_the_original_optimizer_after_make_private_is_refused():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = private(net, optimizer)
    net.add_module("extra", nn.Linear(2, 2))
    optimizer.add_param_group({"params": net.extra.parameters()})
    weights = [p.detach().clone() for p in net.parameters()]
    refusal = r"extra\.weight.*not trainable at make_private.*make_private again"
    with pytest.raises(PrivacyError, match=refusal):
        step(engine)
    assert _unchanged(engine, weights)


def test_a_parameter_unfrozen_and_appended_to_param_groups_is_refused():
    net = model()
    net[0].requires_grad_(False)
    engine = private(net)
    net[0].requires_grad_(True)
    engine.optimizer.param_groups.append({**engine.optimizer.param_groups[0], "params": [net[0].weight]})
    weights = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(PrivacyError, match=r"'0.weight' requires grad but was not trainable at make_private"):
        step(engine)
    assert _unchanged(engine, weights)


def test_a_parameter_frozen_after_make_private_is_refused():
    engine = private()
    engine.model[2].bias.requires_grad_(False)
    with pytest.raises(PrivacyError, match=r"'2.bias' was trainable at make_private but no longer"):
        step(engine)
    assert engine.steps == 0


@pytest.mark.slow
def test_the_refusal_suggests_a_new_make_private_that_carries_the_ledger_over():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = private(net, optimizer)
    step(engine)
    spent = engine.epsilon()
    net.add_module("extra", nn.Linear(2, 2))
    optimizer.add_param_group({"params": net.extra.parameters()})
    with pytest.raises(PrivacyError, match=r"new_engine\.ledger\.load_state_dict"):
        step(engine)
    engine.detach()
    new_engine = tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                       DataLoader(data(), batch_size=10), noise_multiplier=1.0,
                                       target_delta=1e-3, seed=1)
    new_engine.ledger.load_state_dict(engine.ledger.state_dict())
    assert new_engine.steps == 1 and new_engine.epsilon() == spent
    new_engine.optimizer.zero_grad()
    x, y = next(iter(new_engine.data_loader))
    F.cross_entropy(net.extra(net[:3](x)), y).backward()
    new_engine.optimizer.step()
    assert new_engine.steps == 2


# ----------------------------------------------------------------------------- step hooks
def test_step_hooks_fire_once_per_logical_step_not_per_micro_batch():
    engine = private(physical_batch_size=2)
    calls = []
    engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", engine.steps)))
    engine.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", engine.steps)))
    for _ in range(3):
        step(engine)
    assert calls == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2), ("pre", 2), ("post", 3)]


def test_a_pre_hook_sees_the_optimizer_and_may_replace_the_closure():
    engine = private()
    seen = []

    def replace(opt, args, kwargs):
        seen.append(opt)
        return (opt, lambda: "replaced"), {}

    engine.optimizer.register_step_pre_hook(replace)
    assert engine.optimizer.step(lambda: "given") == "replaced"
    assert seen == [engine.optimizer]


def test_hooks_on_the_original_optimizer_do_not_fire_in_auto_lr_probes():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = private(net, optimizer, lr=HYFREEDP_EVERY_STEP, steps=4, noise_multiplier=0.0)
    fired = {"pre": 0, "post": 0, "global": 0}
    optimizer.register_step_pre_hook(lambda *a: fired.__setitem__("pre", fired["pre"] + 1))
    optimizer.register_step_post_hook(lambda *a: fired.__setitem__("post", fired["post"] + 1))
    handle = register_optimizer_step_pre_hook(
        lambda *a: fired.__setitem__("global", fired["global"] + 1))
    try:
        for _ in range(3):
            step(engine, with_losses=True)
    finally:
        handle.remove()
    assert engine.steps == 3 and len(engine.quantile_estimator or []) == 0
    assert fired == {"pre": 3, "post": 3, "global": 3}


def test_hooks_are_restored_when_a_probe_fails():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = private(net, optimizer, lr=HYFREEDP_EVERY_STEP, steps=4, noise_multiplier=0.0)
    fired = []
    optimizer.register_step_post_hook(lambda *a: fired.append(1))
    x, y = next(iter(engine.data_loader))
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(ValueError, match="one loss per example"):
        engine.optimizer.step(lambda: torch.zeros(len(y) + 1))
    assert "step" not in vars(optimizer)
    engine.detach()  # the user's optimizer steps on its own again
    optimizer.step()
    assert fired == [1]


# ----------------------------------------------------------------------------- past the plan
def test_training_past_the_planned_steps_warns_once():
    engine = private(steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(engine)
        step(engine)
    with pytest.warns(UserWarning, match="past the planned 2 steps.*beyond the target") as caught:
        step(engine)
        step(engine)
    assert len([w for w in caught if "planned" in str(w.message)]) == 1
    assert engine.steps == 4


def test_probes_skip_hooks_even_with_a_scheduler_on_the_original_optimizer():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = private(net, optimizer, lr=HYFREEDP_EVERY_STEP, steps=4, noise_multiplier=0.0)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)  # wraps optimizer.step on the instance
    scheduler_step = vars(optimizer)["step"]
    fired = []
    optimizer.register_step_pre_hook(lambda *a: fired.append(1))
    step(engine, with_losses=True)
    step(engine, with_losses=True)
    assert fired == [1, 1] and vars(optimizer)["step"] is scheduler_step
