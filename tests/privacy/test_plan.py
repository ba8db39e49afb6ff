"""The planned run: calibration and budget splits solved once, the planned ledger against the recorded
one, and the plan as the identity of a checkpoint."""

from __future__ import annotations

import copy
from dataclasses import replace

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tunefree import AdaptiveQuantile, DoG, HyFreeDP, make_private
from tunefree.components.hyfreedp import LossShare
from tunefree.errors import SettingsRefused
from tunefree.privacy.accounting import epsilon_of
from tunefree.privacy.ledger import to_dict
from tunefree.privacy.plan import CountShare, Plan, data_digest


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dataset(n: int = 200, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def engine_for(data: TensorDataset, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"noise_multiplier": 1.0, "steps": 7, "seed": 0, "accountant": "rdp", **kwargs}
    return make_private(model, optimizer, DataLoader(data, batch_size=20), target_delta=1e-4, **kwargs)


def train(engine, steps: int) -> None:
    batches = iter(engine.data_loader)
    for _ in range(steps):
        x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step(lambda x=x, y=y: F.cross_entropy(engine.model(x), y, reduction="none"))


COMPONENTS = {
    "fixed thresholds, fixed lr": {},
    "adaptive thresholds, fixed lr": {"shares": (CountShare(0.1, 3),)},
    "fixed thresholds, HyFreeDP": {"shares": (LossShare(4),)},
    "adaptive thresholds, HyFreeDP": {"shares": (CountShare(0.1, 3), LossShare(4))},
}


def loss_noise(plan: Plan) -> float:
    """σ_l of HyFreeDP's loss releases (0 without them)."""
    share = plan.share(LossShare)
    return 0.0 if share is None else share.noise


@pytest.mark.slow
@pytest.mark.parametrize("components", COMPONENTS.values(), ids=COMPONENTS.keys())
def test_solved_plan_spends_the_target_within_one_percent_never_above(components):
    plan = Plan(sample_rate=0.05, steps=30, num_examples=1000, delta=1e-5, **components).solve(2.0)
    assert plan.noise_multiplier > 0
    assert (loss_noise(plan) > 0) == any(isinstance(s, LossShare) for s in components.get("shares", ()))
    assert 0.99 * 2.0 <= plan.epsilon() <= 2.0


@pytest.mark.slow
def test_combined_plan_does_not_depend_on_the_order_its_components_are_declared_in():
    base = Plan(sample_rate=0.05, steps=30, num_examples=1000, delta=1e-5, accountant="rdp")
    counts, losses = CountShare(0.1, 3), LossShare(4)
    first = replace(base, shares=(counts, losses)).solve(2.0)
    second = replace(base, shares=(losses, counts)).solve(2.0)
    assert first.noise_multiplier == second.noise_multiplier and loss_noise(first) == loss_noise(second)
    assert first.step_releases(1) == second.step_releases(1) and first.event() == second.event()
    # the count share stays inside the gradient's step, at γσ jointly (Proposition 3.1)
    joint = (first.gradient_noise ** -2 + first.count_noise ** -2) ** -0.5
    assert joint == pytest.approx(1.01 * first.noise_multiplier, rel=1e-12)
    # σ is that of the run without the loss share; the losses take their share of the same target
    assert first.noise_multiplier == replace(base, shares=(counts,)).solve(2.0).noise_multiplier


@pytest.mark.parametrize("kwargs", [{}, pytest.param({"thresholds": "adaptive", "groups": "per-layer",
                                                       "lr": HyFreeDP(interval=3)}, marks=pytest.mark.slow)],
                         ids=["plain", "adaptive+auto"])
def test_recorded_ledger_spends_what_the_plan_said(kwargs):
    engine = engine_for(dataset(), **kwargs)
    plan = engine.plan
    assert engine.optimizer.release.noise_multiplier == plan.gradient_noise
    for component in engine.optimizer.components:
        noise = getattr(component, "count_std", None)
        assert (plan.count_std if noise is not None else loss_noise(plan)) == (
            noise if noise is not None else component.loss_noise)
    taken = 0
    for step in (1, 4, plan.steps):  # midway too, the recorded ledger is the plan's first steps
        train(engine, step - taken)
        taken = step
        assert engine.steps == step
        assert engine.epsilon() == pytest.approx(plan.epsilon(step), rel=1e-9)


THRESHOLD_RULES = {"fixed": "fixed", "adaptive": AdaptiveQuantile(budget=0.1)}
LR_RULES = {"optimizer's lr": None, "DoG": DoG(), "HyFreeDP K=2": HyFreeDP(interval=2),
            "HyFreeDP K=3": HyFreeDP(interval=3, gradient_noise_increase=1.05)}


@pytest.mark.parametrize("lr", [pytest.param(name, marks=[pytest.mark.slow] if "HyFreeDP" in name else [])
                                for name in LR_RULES])
@pytest.mark.parametrize("thresholds", THRESHOLD_RULES)
def test_every_component_records_exactly_the_releases_its_share_planned(thresholds, lr):
    """Whatever the components, each step's record in the ledger is the plan's step releases: the events
    the mechanisms returned are those the plan was solved on (no component releases what its share does
    not declare, or declares what it does not release)."""
    engine = engine_for(dataset(), thresholds=THRESHOLD_RULES[thresholds], lr=LR_RULES[lr], steps=5,
                        groups="per-layer", noise_multiplier=2.0)  # σ = 2: a quick loss-noise solve
    plan = engine.plan
    train(engine, 5)
    recorded = [event for event, count in engine.ledger.state_dict()["runs"] for _ in range(count)]
    planned = [to_dict(dpa.PoissonSampledDpEvent(plan.sample_rate, joint(plan.step_releases(t))))
               for t in range(1, 6)]
    assert recorded == planned
    declared = {type(share).__name__ for share in plan.shares}
    assert declared == {name for name, used in (("CountShare", thresholds == "adaptive"),
                                                ("LossShare", lr.startswith("HyFreeDP"))) if used}
    assert engine.epsilon() == pytest.approx(plan.epsilon(), rel=1e-9)


def test_canaries_release_nothing_the_plan_does_not_hold():
    engine = engine_for(dataset(), audit_canaries=4, steps=3)
    train(engine, 3)
    recorded = [event for event, count in engine.ledger.state_dict()["runs"] for _ in range(count)]
    assert recorded == [to_dict(dpa.PoissonSampledDpEvent(engine.plan.sample_rate,
                                                          joint(engine.plan.step_releases(t))))
                        for t in range(1, 4)]


def joint(releases):
    return releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(releases)


# ----------------------------------------------------------------------------- identity
@pytest.mark.parametrize("change,named", [
    ({"sample_rate": 0.06}, "sample_rate"), ({"steps": 31}, "steps"),
    ({"num_examples": 1001}, "num_examples"), ({"noise_multiplier": 1.2}, "noise_multiplier"),
    ({"shares": (CountShare(0.2, 3), LossShare(4, noise=2.0))}, "shares"),
    ({"shares": (CountShare(0.1, 3), LossShare(5, noise=2.0))}, "shares"),
    ({"shares": (CountShare(0.1, 3), LossShare(4, noise=3.0))}, "shares"),
    ({"settings": {"clipping": "abadi"}}, "settings.clipping"),
])
def test_fingerprint_changes_with_every_part_of_the_plan(change, named):
    plan = Plan(sample_rate=0.05, steps=30, num_examples=1000, delta=1e-5, noise_multiplier=1.1,
                shares=(CountShare(0.1, 3), LossShare(4, noise=2.0)),
                settings={"clipping": "auto-s"})
    other = replace(plan, **change)
    assert other.fingerprint() != plan.fingerprint()
    assert named in [line.split(":")[0] for line in other.differences(plan.describe())]
    assert replace(plan).fingerprint() == plan.fingerprint()


@pytest.mark.slow
def test_checkpoint_of_an_auto_lr_run_is_refused_by_a_fixed_lr_run():
    auto = engine_for(dataset(), lr=HyFreeDP())
    train(auto, 2)
    fixed = engine_for(dataset())
    with pytest.raises(ValueError, match="other privacy settings(.|\n)*LossShare"):
        fixed.load_state_dict(auto.state_dict())
    assert fixed.steps == 0


@pytest.mark.slow
def test_component_states_are_restored_strictly():
    engine = engine_for(dataset(), lr=HyFreeDP())
    train(engine, 2)
    state = copy.deepcopy(engine.state_dict())
    resumed = engine_for(dataset(), lr=HyFreeDP())
    resumed.load_state_dict(state)
    assert resumed.steps == 2
    state["components"] = {}
    with pytest.raises(ValueError, match="step components"):
        engine_for(dataset(), lr=HyFreeDP()).load_state_dict(state)


@pytest.mark.parametrize("other,named", [(dataset(seed=1), "settings.data"),
                                         (dataset(n=220), "num_examples")])
def test_resuming_onto_another_data_set_is_refused(other, named):
    engine = engine_for(dataset())
    train(engine, 2)
    elsewhere = engine_for(other)
    with pytest.raises(ValueError, match=f"same data set(.|\n)*{named}"):
        elsewhere.load_state_dict(engine.state_dict())


def test_data_digest_reads_the_examples():
    data = dataset()
    assert data_digest(data, len(data)) == data_digest(dataset(), len(data))
    last = TensorDataset(data.tensors[0].clone(), data.tensors[1].clone())
    last.tensors[0][-1, 0] += 1.0
    assert data_digest(last, len(data)) != data_digest(data, len(data))


# ---------------------------------------------------------------------------- releases made before training
PRIOR = (dpa.GaussianDpEvent(4.0),  # e.g. a private scaling, and a partition selection with its (0, p) part
         dpa.ComposedDpEvent([dpa.GaussianDpEvent(6.0),
                              dpa.PoissonSampledDpEvent(1e-7, dpa.NonPrivateDpEvent())]))


PRIOR_COMPONENTS = {name: COMPONENTS[name] for name in ("fixed thresholds, fixed lr",
                                                          "adaptive thresholds, HyFreeDP")}


@pytest.mark.slow
@pytest.mark.parametrize("components", PRIOR_COMPONENTS.values(), ids=PRIOR_COMPONENTS.keys())
def test_prior_releases_are_in_the_calibration_so_the_whole_run_spends_the_target(components):
    without = Plan(sample_rate=0.05, steps=30, num_examples=1000, delta=1e-5, **components).solve(2.0)
    plan = replace(without, prior=PRIOR).solve(2.0)
    assert 0.99 * 2.0 <= plan.epsilon() <= 2.0
    assert plan.noise_multiplier > without.noise_multiplier  # training pays for what came before
    assert plan.event().events[:2] == list(PRIOR)
    assert plan.describe()["prior"] == [to_dict(event) for event in PRIOR]
    assert "prior" not in without.describe()  # the fingerprints of runs without them are unchanged


@pytest.mark.slow
def test_make_private_records_prior_releases_first_and_spends_the_target_in_all():
    engine = engine_for(dataset(), noise_multiplier=None, target_epsilon=2.0, prior_releases=list(PRIOR))
    assert engine.ledger.epsilon(1e-4, "rdp") == pytest.approx(
        epsilon_of(dpa.ComposedDpEvent(list(PRIOR)), 1e-4, "rdp"))  # before the first step
    train(engine, 7)
    assert engine.steps == 7  # the releases before training are no steps
    assert 0.99 * 2.0 <= engine.epsilon() <= 2.0
    # a checkpoint of a run with other releases before training is another run's
    other = engine_for(dataset(), noise_multiplier=None, target_epsilon=2.0, prior_releases=list(PRIOR[:1]))
    with pytest.raises(ValueError, match=r"other privacy settings(.|\n)*prior: \[\{.gaussian.: 4.0\}, "):
        other.load_state_dict(engine.state_dict())


def test_prior_releases_that_spend_the_target_alone_are_refused():
    with pytest.raises(SettingsRefused, match=r"already spend ε = .* at least the target ε = 0.5: nothing "
                                              r"is left for training"):
        engine_for(dataset(), noise_multiplier=None, target_epsilon=0.5,
                   prior_releases=[dpa.GaussianDpEvent(1.0)])
    with pytest.raises(ValueError, match="would count as a training step: give it as "
                                         r"dpa.ComposedDpEvent\(\[event\]\)"):
        engine_for(dataset(), prior_releases=[dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0))])
    with pytest.raises(TypeError, match="prior_releases must hold dp_accounting DpEvents, got 0.5"):
        engine_for(dataset(), prior_releases=[0.5])
