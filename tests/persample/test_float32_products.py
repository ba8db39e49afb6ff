"""The engine's norms and clipped sums are computed in IEEE float32 whatever the user's TF32 / bf16 settings
(persample/float32.py, docs/gpu.md *TF32*); the model's own forward and backward keep those settings, and
they are the user's again after the step. On a CPU the settings are global flags that can be read while
each operator runs: a dispatch mode records them at every convolution backward of a private step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.persample.float32 import ieee_float32

SETTINGS = (("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
            ("mkldnn", "rnn"))


def precision() -> dict[tuple[str, str], str]:
    return {key: torch._C._get_fp32_precision_getter(*key) for key in SETTINGS}


@pytest.fixture
def tf32_everywhere():
    """The user turned TF32 on for every float32 product (the new API's per-operation settings)."""
    before = precision()
    for key in SETTINGS:
        torch._C._set_fp32_precision_setter(*key, "tf32")
    yield {key: "tf32" for key in SETTINGS}
    for key, value in before.items():
        torch._C._set_fp32_precision_setter(*key, value)


class Recorder(TorchDispatchMode):
    """Each convolution backward with the precision settings in force while it ran: the weight
    gradients (output_mask[1]) are the engine's (the model's parameters are out of autograd's graph),
    the input gradients the model's own backward pass."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default:
            mask = args[-1]
            self.calls.append(("engine" if mask[1] else "model", precision()))
        return func(*args, **(kwargs or {}))


def convnet_engine(groups: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(64, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 2, (40,), generator=g))
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(data, batch_size=10), noise_multiplier=1.0, target_delta=1e-5,
                                 groups=groups, seed=0, poisson_sampling=False)


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("groups", ["all-layer", "per-layer"])
def test_norms_and_sums_run_in_ieee_float32_and_the_model_keeps_the_users_tf32(tf32_everywhere, groups):
    engine = convnet_engine(groups)
    x, y = next(iter(engine.data_loader))
    recorder = Recorder()
    with recorder:
        engine.optimizer.zero_grad()
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()
    engine_calls = [seen for who, seen in recorder.calls if who == "engine"]
    model_calls = [seen for who, seen in recorder.calls if who == "model"]
    assert engine_calls and model_calls
    cpu_settings = [key for key in SETTINGS if key[0] == "mkldnn"]  # the CPU's (oneDNN's) settings
    assert all(seen[key] == "ieee" for seen in engine_calls for key in cpu_settings), engine_calls
    assert all(seen == tf32_everywhere for seen in model_calls), model_calls
    assert precision() == tf32_everywhere  # the user's settings, back after the step


def test_the_settings_come_back_when_the_block_raises(tf32_everywhere):
    with pytest.raises(RuntimeError, match="inside"), ieee_float32("cuda", "cpu"):
        assert precision() == {key: "ieee" for key in SETTINGS}
        raise RuntimeError("inside")
    assert precision() == tf32_everywhere
    with ieee_float32("cpu"):  # one device type's settings only
        inside = precision()
    assert [key for key in SETTINGS if inside[key] == "ieee"] == list(SETTINGS[3:])
