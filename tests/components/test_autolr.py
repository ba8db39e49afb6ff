"""HyFreeDP's learning rate (GeN-DP): the fit, the probes, the end-to-end accounting, and its build on the
public extension points alone."""

from __future__ import annotations

import ast
import importlib
import math
import pathlib

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from support import component_step, pop_step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.privacy.accounting import epsilon_of
from tunefree.step.component import StepReport


def quadratic_problem(h=2.0, d=8):
    """Per-sample losses ½(xᵢᵀw)² = ½h·d·wᵢ² whose mean is ½h‖w‖² (Hessian h·I, minimum w* = 0).
    Started from weights of equal magnitude, every example has the same loss all along, so the loss
    clipping at R_l (the previous mean; initially 1, above the starting loss 0.72) never bites and
    the noise-free fit is exact."""
    x = torch.eye(d, dtype=torch.float64) * math.sqrt(h * d)
    w_star = torch.zeros(d, dtype=torch.float64)
    return TensorDataset(x, x @ w_star), w_star


def squared_errors(model, x, y):
    return 0.5 * (model(x).squeeze(1) - y) ** 2


def run(model, engine, steps, closure_on=True):
    taken = 0
    while taken < steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            squared_errors(model, x, y).mean().backward()
            engine.optimizer.step((lambda x=x, y=y: squared_errors(model, x, y)) if closure_on
                                  else None)
            taken += 1
            if taken == steps:
                return


def quadratic_engine(h=2.0, interval=1, optimizer=torch.optim.SGD, **kwargs):
    data, w_star = quadratic_problem(h)
    model = nn.Linear(8, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(0.3 * torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]))
    engine = tunefree.make_private(
        model, optimizer(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
        noise_multiplier=0.0, target_delta=1e-2, clipping="abadi", max_grad_norm=1e6, steps=60,
        lr=tunefree.HyFreeDP(interval=interval), seed=0, **kwargs)
    return model, engine, w_star


def test_noise_free_fit_is_the_exact_gen_learning_rate_and_converges_to_it():
    h = 2.0
    model, engine, w_star = quadratic_engine(h)
    auto = engine.lr_rule
    run(model, engine, 5)
    # SGD on ½h‖w − w*‖²: m = G, so b = GᵀG and a = GᵀHG = h·b, and b/a = 1/h exactly, whatever w is: the
    # first step (from η = 10⁻⁴) lands on w*, and later fits (of rounding-sized updates, or none) keep 1/h
    first, *later = auto.history
    assert first.slope > 0 and first.curvature == pytest.approx(h * first.slope, rel=1e-9)
    assert len(later) == 4 and all(fit.lr == pytest.approx(1 / h, rel=1e-6) for fit in [first, *later])
    torch.testing.assert_close(model.weight.detach().squeeze(0), w_star, atol=1e-9, rtol=0)


def test_probes_leave_weights_and_optimizer_state_bit_identical():
    model, engine, _ = quadratic_engine(optimizer=torch.optim.Adam)
    run(model, engine, 3)
    x, y = next(iter(engine.data_loader))  # q = 1: the whole data set, as the loader hands it out
    engine.optimizer.zero_grad()
    squared_errors(model, x, y).mean().backward()
    sums, _, _ = pop_step(engine.clipper)
    for p in model.parameters():
        p.grad = sums[p] / 8
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                    for k, v in engine.optimizer.original.state_dict()["state"].items()}
    step, events = component_step(StepReport(step=4, examples=len(y)), engine.optimizer.original,
                                  lambda: squared_errors(model, x, y), expected_batch_size=8.0)
    engine.lr_rule.released_losses(step)
    assert events == [dpa.GaussianDpEvent(engine.lr_rule.loss_noise)] * 3
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)
    after = engine.optimizer.original.state_dict()["state"]
    for key, values in state_before.items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key][name])), name


def test_adam_steps_once_per_step():
    model, engine, _ = quadratic_engine(optimizer=torch.optim.Adam)
    run(model, engine, 7)
    steps = {int(s["step"]) for s in engine.optimizer.original.state_dict()["state"].values()}
    assert steps == {7}


def classifier_engine(interval=5, **kwargs):
    """A small classifier on 400 random examples with HyFreeDP's learning rate at ε = 2."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(400, 5, generator=g), torch.randint(0, 3, (400,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = tunefree.make_private(
        model, torch.optim.AdamW(model.parameters()), DataLoader(data, batch_size=40),
        target_epsilon=2.0, target_delta=1e-4, lr=tunefree.HyFreeDP(interval=interval),
        seed=0, **kwargs)
    return model, engine


@pytest.mark.slow
def test_planned_run_meets_the_target_and_every_update_step_is_one_event():
    model, engine = classifier_engine(epochs=2, interval=3)
    assert engine.optimizer.release.noise_multiplier == pytest.approx(1.01 * engine.noise_multiplier)
    taken = 0
    for _ in range(2):
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step(lambda x=x, y=y: F.cross_entropy(model(x), y, reduction="none"))
            taken += 1
    assert taken == engine.planned_steps == 20
    assert 0.99 * 2.0 <= engine.epsilon() <= 2.0
    runs = engine.ledger.state_dict()["runs"]
    update = [r for r in runs if "composed" in r[0]["event"]]
    assert sum(count for _, count in update) == math.ceil(20 / 3)
    assert all(len(r[0]["event"]["composed"]) == 4 for r in update)  # gradient + 3 losses
    # The paper's separate accounting (loss probes as independently sampled events) would
    # under-report: with the same noise levels it gives a smaller ε than the joint ledger.
    sigma_l = engine.optimizer.components[-1].loss_noise
    q = engine.sample_rate
    separate = dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(
            engine.optimizer.release.noise_multiplier)), 20),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma_l)),
                                3 * math.ceil(20 / 3))])
    assert epsilon_of(separate, 1e-4) < engine.epsilon()


def test_missing_closure_and_wrong_losses_are_errors():
    model, engine, _ = quadratic_engine()
    with pytest.raises(ValueError, match="closure"):
        run(model, engine, 1, closure_on=False)
    model, engine, _ = quadratic_engine()
    x, y = engine.data_loader.dataset.tensors
    engine.optimizer.zero_grad()
    with pytest.raises(ValueError, match="1-D tensor"):
        engine.optimizer.step(lambda: squared_errors(model, x, y).mean())


@pytest.mark.parametrize("closure_losses,error,match", [
    (lambda losses: losses[:4], ValueError, "4 losses for a step of 8"),
    (lambda losses: torch.cat([losses[:-1], torch.tensor([math.nan], dtype=losses.dtype)]),
     tunefree.PrivacyError, "NaN or infinite"),
])
def test_losses_that_break_the_sensitivity_bound_are_refused(closure_losses, error, match):
    model, engine, _ = quadratic_engine()
    x, y = next(iter(engine.data_loader))  # q = 1: the whole data set, as the loader hands it out
    engine.optimizer.zero_grad()
    squared_errors(model, x, y).mean().backward()
    with pytest.raises(error, match=match):
        engine.optimizer.step(lambda: closure_losses(squared_errors(model, x, y)))


def test_lr_auto_needs_the_planned_length():
    data, _ = quadratic_problem()
    model = nn.Linear(8, 1, bias=False).double()
    with pytest.raises(ValueError, match="epochs or steps"):
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              DataLoader(data, batch_size=4), noise_multiplier=1.0,
                              target_delta=1e-2, lr=tunefree.HyFreeDP())


def test_checkpoint_keeps_the_learning_rate_state():
    model, engine, _ = quadratic_engine()
    run(model, engine, 5)
    model2, engine2, _ = quadratic_engine()
    engine2.load_state_dict(engine.state_dict())
    assert engine2.optimizer.components[-1].state_dict() == engine.optimizer.components[-1].state_dict()


@pytest.mark.slow
def test_adaptive_thresholds_and_auto_lr_share_one_budget():
    model, engine = classifier_engine(steps=12, interval=4, groups="per-layer",
                                      thresholds="adaptive")
    while engine.steps < 12:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step(lambda x=x, y=y: F.cross_entropy(model(x), y, reduction="none"))
            if engine.steps == 12:
                break
    assert engine.steps == 12
    first = engine.ledger.event().events
    releases = {len(e.event.event.events) for e in first}  # gradient + counts (+ 3 losses)
    assert releases == {2, 5}
    assert 0.99 * 2.0 <= engine.epsilon() <= 2.0


def test_hyfreedp_is_built_on_the_public_extension_points_alone():
    """components/hyfreedp.py imports from tunefree only what tunefree.extend or tunefree offer (besides the
    argument checks every option shares): its loss releases go through StepContext.release, which records
    them in the ledger, and its accounting is its Share."""
    import tunefree.extend

    path = pathlib.Path(tunefree.__file__).parent / "components" / "hyfreedp.py"
    public = {name: getattr(module, name) for module in (tunefree, tunefree.extend)
              for name in module.__all__}
    package = {1: "tunefree.components.", 2: "tunefree."}
    imported = [(package[node.level] + node.module, alias.name)
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level and node.module != "_validate"
                for alias in node.names]
    assert {name for _, name in imported} >= {"Share", "StepComponent", "StepContext"}
    private = [f"{module}.{name}" for module, name in imported
               if public.get(name) is not getattr(importlib.import_module(module), name)]
    assert private == []
