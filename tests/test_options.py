"""The run's settings (RunConfig): refusals, shortcuts equal to typed forms, defaults, make_private's
signature against the config's fields, the clip registry."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

import tunefree
from tunefree.clipping.functions import CLIP_FUNCTIONS, ClipFunction, register_clip_function
from tunefree.config import (
    PSAC,
    Abadi,
    AdaptiveQuantile,
    AutoS,
    AutoV,
    DoG,
    Fixed,
    HyFreeDP,
    Performance,
    RunConfig,
)

BASE = {"target_delta": 1e-5, "noise_multiplier": 1.0}


def resolve(**kwargs):
    return RunConfig.from_keywords(**{**BASE, **kwargs})


def test_defaults_unchanged():
    options = resolve()
    assert options.clipping == AutoS(gamma=0.01)
    assert options.thresholds == Fixed() and options.lr is None
    assert options.performance == Performance() and options.poisson_sampling
    assert (options.groups, options.max_grad_norm, options.accountant) == ("all-layer", 1.0, "pld")
    assert resolve(thresholds="adaptive").thresholds == AdaptiveQuantile(0.5, 0.3, 0.01)
    assert resolve(lr="auto").lr == DoG() and DoG().noise_budget == 4.0 and DoG().initial_distance == 0.1
    assert HyFreeDP() == HyFreeDP(interval=5, gradient_noise_increase=1.01, initial_lr=1e-4)  # the paper's
    assert resolve(clipping="psac").clipping == PSAC(r=0.1)


@pytest.mark.parametrize("shortcut, typed", [
    ({"clipping": "auto-s"}, {"clipping": AutoS(gamma=0.01)}),
    ({"clipping": "auto-v"}, {"clipping": AutoV()}),
    ({"clipping": "psac"}, {"clipping": PSAC(r=0.1)}),
    ({"clipping": "abadi"}, {"clipping": Abadi()}),
    ({"thresholds": "fixed"}, {"thresholds": Fixed()}),
    ({"thresholds": "adaptive"}, {"thresholds": AdaptiveQuantile(target=0.5, lr=0.3, budget=0.01)}),
    ({"lr": "auto"}, {"lr": DoG()}),
])
def test_shortcut_equals_typed_form(shortcut, typed):
    assert resolve(**shortcut) == resolve(**typed)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"lr": "fast"}, ValueError, "unknown lr"),
    ({"clipping": "bogus"}, ValueError, "unknown clipping"),
    ({"thresholds": "bogus"}, ValueError, "unknown thresholds"),
    ({"groups": "bogus"}, ValueError, "unknown groups"),
    ({"noise_allocation": "bogus"}, ValueError, "noise_allocation"),
    ({"loss_reduction": "median"}, ValueError, "loss_reduction"),
    ({"accountant": "bogus"}, ValueError, "accountant"),
    ({"target_delta": 1.0}, ValueError, r"target_delta must be in \(0, 1\)"),
    ({"target_delta": True}, ValueError, "target_delta"),
    ({"physical_batch_size": 0}, ValueError, "physical_batch_size"),
    ({"physical_batch_size": True}, TypeError, "physical_batch_size"),
    ({"physical_batch_size": 4, "poisson_sampling": False}, ValueError, "Poisson"),
    ({"steps": 2.5}, TypeError, "steps"),
    ({"epochs": -1}, ValueError, "epochs"),
    ({"seed": True}, TypeError, "seed"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be a positive"),
    ({"max_grad_norm": {"head": math.nan}}, ValueError, r"max_grad_norm\['head'\] must be a positive"),
])
def test_invalid_or_irrelevant_options_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        resolve(**kwargs)


@pytest.mark.parametrize("rule, fields, error, words", [
    (HyFreeDP, {"interval": -3}, ValueError, "interval"),
    (HyFreeDP, {"interval": True}, TypeError, "interval"),
    (HyFreeDP, {"gradient_noise_increase": 1.0}, ValueError, "> 1"),
    (HyFreeDP, {"mode": "safeguarded"}, TypeError, "mode"),  # the paper's rule only
    (HyFreeDP, {"loss_privacy": "laplace"}, TypeError, "loss_privacy"),  # Gaussian only: exact accounting
    (DoG, {"noise_budget": 0.0}, ValueError, "noise_budget"),
    (DoG, {"interval": 3}, TypeError, "interval"),  # a field of the other rule
])
def test_learning_rate_rule_fields_are_validated(rule, fields, error, words):
    with pytest.raises(error, match=words):
        rule(**fields)


def test_hyfreedp_keywords_are_fields_of_hyfreedp_only():
    """lr_update_interval and gradient_noise_increase were make_private keywords for HyFreeDP; they live in
    HyFreeDP(...) only."""
    for keyword in ("lr_update_interval", "gradient_noise_increase"):
        with pytest.raises(TypeError, match=keyword):
            resolve(lr="auto", **{keyword: 3})


def test_epsilon_and_sigma_are_exclusive_and_validated():
    with pytest.raises(ValueError, match="exactly one"):
        RunConfig.from_keywords(target_delta=1e-5)
    with pytest.raises(ValueError, match="target_epsilon"):
        RunConfig.from_keywords(target_delta=1e-5, target_epsilon=-1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        RunConfig.from_keywords(target_delta=1e-5, noise_multiplier=math.inf)


def test_registered_clip_function_is_usable_by_name():
    @register_clip_function("half")
    @dataclasses.dataclass(frozen=True)
    class Half(ClipFunction):
        def weigh(self, norms, threshold):
            return 0.5 * threshold / norms.clamp_min(1e-30)

    try:
        options = resolve(clipping="half")
        assert options.clipping.name == "half" and options.clipping.describe() == {"name": "half"}
        norms = torch.tensor([0.5, 2.0])
        torch.testing.assert_close(options.clipping.weights(norms, 1.0),
                                   torch.tensor([1.0, 0.25], dtype=torch.float64))
        with pytest.raises(ValueError, match="already registered"):
            register_clip_function("half")(Half)
    finally:
        del CLIP_FUNCTIONS["half"]
    with pytest.raises(ValueError, match="unknown clipping"):
        resolve(clipping="half")


def test_a_plain_function_is_not_a_clip_function():
    def half(norms, threshold):
        return 0.5 * threshold / norms.clamp_min(1e-30)

    with pytest.raises(TypeError, match="ClipFunction subclass"):
        register_clip_function("plain-half")(half)
    assert "plain-half" not in CLIP_FUNCTIONS


def test_registered_grouping_is_usable_by_name():
    from torch import nn

    from tunefree.clipping.groups import GROUPINGS, make_groups, register_grouping

    @register_grouping("weights-apart")
    def weights_apart(model):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return {"weights": [n for n in names if n.endswith("weight")],
                "rest": [n for n in names if not n.endswith("weight")]}

    try:
        assert resolve(groups="weights-apart").groups == "weights-apart"
        groups = make_groups(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), "weights-apart", 2.0)
        assert [g.name for g in groups] == ["weights", "rest"]
        assert [g.param_names for g in groups] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
        assert all(math.isclose(g.threshold, 2.0 / math.sqrt(2)) for g in groups)
    finally:
        del GROUPINGS["weights-apart"]
    with pytest.raises(ValueError, match="unknown groups"):
        resolve(groups="weights-apart")


def test_make_private_keywords_are_the_config_fields():
    """make_private keeps its explicit signature; RunConfig defines each setting once. They cannot drift:
    every keyword is a field of RunConfig (or of its Performance block), and every field is a keyword."""
    parameters = inspect.signature(tunefree.make_private).parameters
    keywords = set(parameters) - {"model", "optimizer", "data_loader"}
    config = {f.name for f in dataclasses.fields(RunConfig)} - {"performance"}
    performance = {f.name for f in dataclasses.fields(Performance)}
    assert keywords == config | performance
    defaults = {name: p.default for name, p in parameters.items()}
    given = {name: defaults[name] for name in (config | performance) - {"target_delta", "noise_multiplier"}}
    # make_private's defaults (strings where there is a shortcut) are RunConfig's
    assert RunConfig.from_keywords(target_delta=1e-5, noise_multiplier=1.0, **given) == \
        RunConfig(target_delta=1e-5, noise_multiplier=1.0)


def test_a_keyword_make_private_does_not_take_is_refused_by_name():
    with pytest.raises(TypeError, match="clip_gamma"):
        tunefree.make_private(torch.nn.Linear(2, 1), None, None, target_delta=1e-5, noise_multiplier=1.0,
                              clip_gamma=0.2)


def test_performance_knobs_are_validated_once_and_apart_from_the_privacy_settings():
    with pytest.raises(ValueError, match="norm_path"):
        resolve(norm_path="fastest")
    with pytest.raises(ValueError, match="verify_every"):
        resolve(verify_every=0)
    config = resolve(physical_batch_size=4, verify_every=2)
    assert config.performance == Performance(physical_batch_size=4, verify_every=2)
    assert "performance" not in config.identity()  # speed knobs are not part of the run's identity
