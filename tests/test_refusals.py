"""One hierarchy for refusals: a model tunefree cannot train privately is refused with ModelRefused, settings
that contradict each other or the guarantee with SettingsRefused; both are PrivacyErrors and ValueErrors,
so code that caught the ValueError these refusals used to be keeps working."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine

REFUSED_MODELS = {
    "BatchNorm": lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
    "running statistics": lambda: nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2, affine=True,
                                                                                       track_running_stats=True)),
    "scale_grad_by_freq": lambda: nn.Embedding(5, 3, scale_grad_by_freq=True),
    "sparse": lambda: nn.Embedding(5, 3, sparse=True),
    "max_norm": lambda: nn.Embedding(5, 3, max_norm=1.0),
    "recurrent dropout": lambda: nn.GRU(3, 3, num_layers=2, dropout=0.5),
    "forward hook": lambda: _hooked(),
}


def _hooked():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    module = Custom()
    module.register_forward_hook(lambda *args: None)
    return module


@pytest.mark.parametrize("name", REFUSED_MODELS)
def test_a_refused_model_is_a_model_refusal_a_privacy_error_and_a_value_error(name):
    model = REFUSED_MODELS[name]()
    with pytest.raises(tunefree.ModelRefused) as refused:
        ClippingEngine(model, make_groups(model, "all-layer", 1.0), tunefree.AutoS())
    assert isinstance(refused.value, tunefree.PrivacyError) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize("keywords, words", [
    ({"target_delta": 0.1}, "1/N"),
    ({"noise_multiplier": None}, "exactly one"),
    ({"noise_multiplier": None, "target_epsilon": 1.0, "steps": None}, "epochs or steps"),
    ({"poisson_sampling": False, "physical_batch_size": 4}, "Poisson"),
    ({"audit_canaries": 4, "noise_allocation": "weighted"}, "weighted"),
    ({"thresholds": tunefree.AdaptiveQuantile(rescale=True), "clipping": "abadi"}, "one group"),
])
def test_contradictory_settings_are_settings_refusals(keywords, words):
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 2))
    keywords = {"target_delta": 1e-3, "noise_multiplier": 1.0, "steps": 2, **keywords}
    with pytest.raises(tunefree.SettingsRefused, match=words) as refused:
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              DataLoader(data, batch_size=8), **keywords)
    assert isinstance(refused.value, tunefree.PrivacyError) and isinstance(refused.value, ValueError)
