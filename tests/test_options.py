"""Typed options of make_private: refusals, shortcuts equal to typed forms, defaults, the clip registry."""

from __future__ import annotations

import math

import pytest
import torch

from tunefree.clipping.functions import CLIP_FUNCTIONS, register_clip_function
from tunefree.components.thresholds import QuantileSettings
from tunefree.config import PSAC, Abadi, AdaptiveQuantile, AutoLR, AutoS, AutoV, Fixed, resolve_options

BASE = {"target_delta": 1e-5, "noise_multiplier": 1.0}


def resolve(**kwargs):
    return resolve_options(**BASE, **kwargs)


def test_defaults_unchanged():
    options = resolve()
    assert options.clip == AutoS(gamma=0.01)
    assert options.quantile is None and options.auto_lr is None
    assert options.physical_batch_size is None and options.poisson_sampling
    assert (options.groups, options.max_grad_norm, options.accountant) == ("all-layer", 1.0, "pld")
    assert resolve(thresholds="adaptive").quantile == QuantileSettings(0.5, 0.3, 0.01)
    assert resolve(lr="auto").auto_lr == AutoLR() and AutoLR().mode == "dog"
    assert AutoLR().noise_budget == 4.0 and AutoLR().initial_distance == 0.1
    assert resolve(clipping="psac").clip == PSAC(r=0.1)


@pytest.mark.parametrize("legacy, typed", [
    ({"clipping": "auto-s", "clip_gamma": 0.2}, {"clipping": AutoS(gamma=0.2)}),
    ({"clipping": "auto-v"}, {"clipping": AutoV()}),
    ({"clipping": "psac", "psac_r": 0.4}, {"clipping": PSAC(r=0.4)}),
    ({"clipping": "abadi"}, {"clipping": Abadi()}),
    ({"thresholds": "fixed"}, {"thresholds": Fixed()}),
    ({"thresholds": "adaptive", "target_quantile": 0.7, "quantile_lr": 0.1, "quantile_budget": 0.05},
     {"thresholds": AdaptiveQuantile(target=0.7, lr=0.1, budget=0.05)}),
    ({"max_physical_batch_size": 8}, {"physical_batch_size": 8}),
])
def test_shortcut_equals_typed_form(legacy, typed):
    assert resolve(**legacy) == resolve(**typed)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"clip_gamma": 0.1, "clipping": "abadi"}, ValueError, "clip_gamma"),
    ({"clip_gamma": 0.1, "clipping": AutoS(0.2)}, ValueError, "clip_gamma"),
    ({"psac_r": 0.1}, ValueError, "psac_r"),
    ({"target_quantile": 0.5}, ValueError, "target_quantile"),
    ({"quantile_lr": 0.5}, ValueError, "quantile_lr"),
    ({"quantile_budget": 0.5, "thresholds": AdaptiveQuantile()}, ValueError, "quantile_budget"),
    ({"lr": "fast"}, ValueError, "unknown lr"),
    ({"clipping": "bogus"}, ValueError, "unknown clipping"),
    ({"thresholds": "bogus"}, ValueError, "unknown thresholds"),
    ({"groups": "bogus"}, ValueError, "unknown groups"),
    ({"noise_allocation": "bogus"}, ValueError, "noise_allocation"),
    ({"loss_reduction": "median"}, ValueError, "loss_reduction"),
    ({"accountant": "bogus"}, ValueError, "accountant"),
    ({"clipping": "auto-s", "clip_gamma": -1.0}, ValueError, "gamma"),
    ({"clipping": "psac", "psac_r": math.nan}, ValueError, "r"),
    ({"thresholds": "adaptive", "target_quantile": 1.5}, ValueError, "target"),
    ({"thresholds": "adaptive", "quantile_lr": math.inf}, ValueError, "lr"),
    ({"physical_batch_size": 0}, ValueError, "physical_batch_size"),
    ({"physical_batch_size": True}, TypeError, "physical_batch_size"),
    ({"physical_batch_size": 4, "max_physical_batch_size": 4}, ValueError, "physical_batch_size"),
    ({"physical_batch_size": 4, "poisson_sampling": False}, ValueError, "Poisson"),
    ({"steps": 2.5}, TypeError, "steps"),
    ({"epochs": -1}, ValueError, "epochs"),
    ({"seed": True}, TypeError, "seed"),
    ({"secure_rng": 1}, TypeError, "secure_rng"),
])
def test_invalid_or_irrelevant_options_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        resolve(**kwargs)


@pytest.mark.parametrize("fields, error, words", [
    ({"mode": "safeguarded", "loss_privacy": "bogus"}, ValueError, "loss_privacy"),
    ({"mode": "safeguarded", "interval": -3}, ValueError, "interval"),
    ({"mode": "safeguarded", "interval": True}, TypeError, "interval"),
    ({"mode": "safeguarded", "gradient_noise_increase": 1.0}, ValueError, "> 1"),
    ({"mode": "fast"}, ValueError, "mode"),
    ({"noise_budget": 0.0}, ValueError, "noise_budget"),
    ({"probes": "differences"}, ValueError, r"AutoLR\(probes\) has no effect with mode='dog'"),
    ({"interval": 3, "initial_lr": 0.1}, ValueError, r"AutoLR\(interval, initial_lr\) has no effect"),
    ({"mode": "paper", "noise_budget": 2.0}, ValueError,
     r"AutoLR\(noise_budget\) has no effect with mode='paper'"),
])
def test_auto_lr_fields_are_validated(fields, error, words):
    with pytest.raises(error, match=words):
        AutoLR(**fields)


def test_hyfreedp_keywords_are_fields_of_auto_lr_only():
    """lr_update_interval, loss_privacy and gradient_noise_increase were make_private keywords for
    HyFreeDP; lr='auto' is DoG now, so they live in AutoLR(mode='safeguarded', ...) only."""
    for keyword in ("lr_update_interval", "loss_privacy", "gradient_noise_increase"):
        with pytest.raises(TypeError, match=keyword):
            resolve(lr="auto", **{keyword: 3})


def test_epsilon_and_sigma_are_exclusive_and_validated():
    with pytest.raises(ValueError, match="exactly one"):
        resolve_options(target_delta=1e-5)
    with pytest.raises(ValueError, match="target_epsilon"):
        resolve_options(target_delta=1e-5, target_epsilon=-1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        resolve_options(target_delta=1e-5, noise_multiplier=math.inf)


def test_registered_clip_function_is_usable_by_name():
    @register_clip_function("half")
    def half(norms, threshold, clip):
        return 0.5 * threshold / norms.clamp_min(1e-30)

    try:
        options = resolve(clipping="half")
        assert options.clip.name == "half"
        norms = torch.tensor([0.5, 2.0])
        torch.testing.assert_close(options.clip.weights(norms, 1.0),
                                   torch.tensor([1.0, 0.25], dtype=torch.float64))
        with pytest.raises(ValueError, match="already registered"):
            register_clip_function("half")(half)
    finally:
        del CLIP_FUNCTIONS["half"]
    with pytest.raises(ValueError, match="unknown clipping"):
        resolve(clipping="half")


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
