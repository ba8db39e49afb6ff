"""tunefree.extend, the one door for extensions: a layer rule registered from a user's own code (one
function) is exact against the batch-size-1 loop, its capability flags are what FSDP2 reads, a module that
mixes examples is refused once registered, and a clip function is one dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import CLIP_FUNCTIONS
from tunefree.clipping.groups import make_groups
from tunefree.extend import ClipFunction, register_clip_function, register_example_mixing, register_rule
from tunefree.parallel.fsdp import _check_layer_rules
from tunefree.persample.engine import ClippingEngine
from tunefree.persample.units import SAMPLE_MIXING
from tunefree.rules import RULES, FunctionRule, rule_for


class Scale(nn.Module):
    """A layer no built-in rule knows: y = x ⊙ w + b over the last dimension."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.2, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


calls = []


def scale_grads(module, capture, grad_outputs):
    """The user's rule: per-sample gradients of Scale from its input and output gradient."""
    calls.append(type(module).__name__)
    x, g = capture.args[0], grad_outputs[0]
    batch, features = x.shape[0], x.shape[-1]  # every middle position a token of the same example
    return {"weight": (x * g).reshape(batch, -1, features).sum(1),
            "bias": g.reshape(batch, -1, features).sum(1)}


@pytest.fixture
def registered():
    register_rule(Scale, reads_parameters=False)(scale_grads)
    rule = rule_for(Scale(3), {"weight", "bias"})
    yield rule
    RULES.remove(rule)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Scale(6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
@pytest.mark.parametrize("shape", [(7, 4), (5, 3, 4)])
def test_a_rule_registered_from_user_code_is_exact_against_the_brute_force_loop(registered, grouping, shape):
    assert isinstance(registered, FunctionRule) and registered.reads_parameters is False
    net, x = model(), torch.randn(*shape)
    y = torch.randint(0, 3, shape[:1])

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, 3) if out.dim() == 2 else out.mean(1), target, reduction="sum")

    groups = make_groups(net, grouping, 1.0)
    engine = ClippingEngine(net, groups, tunefree.Abadi(), loss_reduction="sum")
    calls.clear()
    loss(net(x), y).backward()
    sums, examples, _ = pop_step(engine)
    engine.detach()
    assert calls == ["Scale"] and examples == shape[0]
    expected, _ = clipped_sum(per_example_grads(net, loss, x, y), groups, tunefree.Abadi())
    for p in net.parameters():
        torch.testing.assert_close(sums[p], expected[p], rtol=1e-5, atol=1e-6)


def test_the_rule_shown_in_the_docs_registers_from_user_code_and_is_exact():
    page = (Path(__file__).parents[1] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/extending.md", "exec"), namespace)
    documented = namespace["Scale"]
    rule = rule_for(documented(3), {"weight", "bias"})
    try:
        assert isinstance(rule, FunctionRule) and rule.function is namespace["scale_grads"]
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 5), documented(5), nn.Tanh(), nn.Linear(5, 2))
        with torch.no_grad():
            net[1].weight.uniform_(0.5, 1.5)
            net[1].bias.uniform_(-0.5, 0.5)
        x, y = torch.randn(6, 3, 4), torch.randint(0, 2, (6,))

        def loss(out, target):
            return F.cross_entropy(out.mean(1), target, reduction="sum")

        groups = make_groups(net, "per-layer", 1.0)
        engine = ClippingEngine(net, groups, tunefree.Abadi(), loss_reduction="sum")
        loss(net(x), y).backward()
        sums, _, _ = pop_step(engine)
        engine.detach()
        expected, _ = clipped_sum(per_example_grads(net, loss, x, y), groups, tunefree.Abadi())
        for p in net.parameters():
            torch.testing.assert_close(sums[p], expected[p], rtol=1e-5, atol=1e-6)
    finally:
        RULES.remove(rule)


def test_the_rule_trains_privately_through_make_private(registered):
    net = model()
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    engine = tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   DataLoader(data, batch_size=16), target_delta=1e-3, noise_multiplier=1.0,
                                   steps=2)
    calls.clear()
    x, y = next(iter(engine.data_loader))
    F.cross_entropy(engine.model(x), y).backward()
    engine.optimizer.step()
    assert calls == ["Scale"] and engine.steps == 1


def test_fsdp2_reads_the_rules_capability_flag_not_a_list(registered):
    _check_layer_rules(model())  # every rule of the model reads no parameter
    RULES.remove(registered)
    register_rule(Scale)(scale_grads)  # the default: it may read its parameters
    try:
        with pytest.raises(ValueError, match="reads its parameters"):
            _check_layer_rules(model())
    finally:
        RULES.remove(rule_for(Scale(3), {"weight"}))
        RULES.insert(0, registered)


def test_a_type_with_a_rule_is_not_registered_twice(registered):
    with pytest.raises(ValueError, match="already have a layer rule"):
        register_rule(Scale)(scale_grads)
    with pytest.raises(ValueError, match="already have a layer rule"):
        register_rule(nn.Linear)(scale_grads)
    with pytest.raises(TypeError, match="nn.Module types"):
        register_rule("Scale")


def test_a_module_that_mixes_examples_is_refused_once_registered():
    class BatchCentre(nn.Module):
        def forward(self, x):
            return x - x.mean(0)  # mixes the examples of a batch

    net = nn.Sequential(nn.Linear(4, 3), BatchCentre())
    register_example_mixing(BatchCentre, "a per-example normalisation such as nn.LayerNorm")
    try:
        with pytest.raises(tunefree.ModelRefused, match="nn.LayerNorm") as refused:
            ClippingEngine(net, make_groups(net, "all-layer", 1.0), tunefree.AutoS())
        assert isinstance(refused.value, ValueError) and isinstance(refused.value, tunefree.PrivacyError)
    finally:
        del SAMPLE_MIXING[BatchCentre]


def test_a_clip_function_is_one_dataclass():
    @register_clip_function("half-abadi")
    @dataclass(frozen=True)
    class HalfAbadi(ClipFunction):
        """min(1, R/‖g‖)/2: clips and halves."""

        normalising = False
        half: float = 0.5

        def weigh(self, norms, threshold):
            return self.half * (threshold / norms.clamp_min(1e-30)).clamp_max(1.0)

    try:
        norms = torch.tensor([0.5, 4.0], dtype=torch.float64)
        torch.testing.assert_close(HalfAbadi().weights(norms, 1.0),
                                   torch.tensor([0.5, 0.125], dtype=torch.float64))
        assert HalfAbadi().describe() == {"name": "half-abadi", "half": 0.5}
        assert isinstance(CLIP_FUNCTIONS["half-abadi"](), HalfAbadi)
    finally:
        del CLIP_FUNCTIONS["half-abadi"]


class Gate(nn.Module):
    """Another layer of the user's own: y = x ⊙ w + b on [batch, features]."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, features))
        self.bias = nn.Parameter(torch.linspace(-0.3, 0.3, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


def test_a_rule_and_a_clip_function_from_user_code_train_one_private_step_exactly():
    """What adding a layer and a clip function touches: the user's own file, through tunefree.extend only.
    One private step of make_private (σ = 0) moves the weights by exactly −lr·Σᵢ wᵢgᵢ/(qN), the clipped sum
    of the batch-size-1 loop under the user's clip function, with the user's rule serving the layer."""
    import copy

    import tunefree.extend

    served = []

    @tunefree.extend.register_rule(Gate, reads_parameters=False)
    def gate_grads(module, capture, grad_outputs):
        served.append(len(capture.args[0]))
        return {"weight": capture.args[0] * grad_outputs[0], "bias": grad_outputs[0]}

    @tunefree.extend.register_clip_function("user-half-abadi")
    @dataclass(frozen=True)
    class HalfAbadi(tunefree.extend.ClipFunction):
        normalising = False
        half: float = 0.5

        def weigh(self, norms, threshold):
            return self.half * (threshold / norms.clamp_min(1e-30)).clamp_max(1.0)

    try:
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(4, 6), Gate(6), nn.Tanh(), nn.Linear(6, 3))
        reference = copy.deepcopy(net)  # the brute force runs on an unhooked copy of the same weights
        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
        lr, clip = 0.5, HalfAbadi(half=0.4)
        engine = tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=lr),
                                       DataLoader(data, batch_size=16), target_delta=1e-3,
                                       noise_multiplier=0.0, steps=1, clipping=clip, groups="per-layer",
                                       max_grad_norm=3.0, loss_reduction="sum")
        before = [p.detach().clone() for p in net.parameters()]
        x, y = next(iter(engine.data_loader))
        served.clear()
        F.cross_entropy(engine.model(x), y, reduction="sum").backward()
        engine.optimizer.step()
        assert served == [len(y)] and engine.steps == 1  # the user's rule served the training pass

        x, y = x.as_subclass(torch.Tensor), y.as_subclass(torch.Tensor)
        per_example = per_example_grads(reference, lambda out, t: F.cross_entropy(out, t, reduction="sum"),
                                        x, y)
        groups = make_groups(reference, "per-layer", 3.0)
        expected, norms = clipped_sum(per_example, groups, clip)
        thresholds = {g.name: g.threshold for g in groups}
        clipped = [bool((n > thresholds[name]).any()) for name, n in norms.items()]
        unclipped = [bool((n < thresholds[name]).any()) for name, n in norms.items()]
        assert any(clipped) and any(unclipped)  # both branches of the user's function are in the step
        ref_params = list(reference.parameters())
        for p, old, q in zip(net.parameters(), before, ref_params):
            torch.testing.assert_close(p.detach(), old - lr * expected[q] / 16, rtol=1e-5, atol=1e-6)
    finally:
        RULES.remove(rule_for(Gate(2), {"weight", "bias"}))
        del CLIP_FUNCTIONS["user-half-abadi"]


@dataclass(frozen=True)
class BatchMax(ClipFunction):
    """Reads the batch: every example scaled by the largest norm (issue 29: 1.34·R leaked). Each weight
    still satisfies wᵢ·‖gᵢ‖ ≤ R, so only evaluating it per example makes it safe."""

    normalising = False

    def weigh(self, norms, threshold):
        return threshold / norms.max().clamp_min(1e-30)


def test_a_clip_function_sees_one_example_s_norm_whatever_it_reads():
    norms = torch.tensor([0.5, 2.0, 8.0, 0.0], dtype=torch.float64)
    weights = BatchMax().weights(norms, 1.0)
    alone = torch.cat([BatchMax().weights(n.reshape(1), 1.0) for n in norms])
    torch.testing.assert_close(weights, alone)  # on the batch: 1/8 for every example
    torch.testing.assert_close(weights, 1.0 / norms.clamp_min(1e-30))
    # another example's norm moves no weight: the neighbour that adds a huge gradient
    joined = torch.cat([norms, norms.new_tensor([1e6])])
    torch.testing.assert_close(BatchMax().weights(joined, 1.0)[:4], weights)


def test_a_batch_reading_clip_function_clips_each_example_alone_in_a_private_step():
    """make_private (σ = 0, Abadi-like weights read through norms.max()) moves the weights by exactly the
    batch-size-1 loop's clipped sum, each example weighted by its own norm, however large another's."""
    import copy

    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = copy.deepcopy(net)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    x[0] *= 50.0  # one example with a far larger gradient than the others
    lr, clip = 0.5, BatchMax()
    engine = tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=lr),
                                   DataLoader(TensorDataset(x, y), batch_size=16), target_delta=1e-3,
                                   noise_multiplier=0.0, steps=1, clipping=clip, max_grad_norm=0.5,
                                   loss_reduction="sum", seed=1)
    before = [p.detach().clone() for p in net.parameters()]
    xb, yb = next(iter(engine.data_loader))
    F.cross_entropy(engine.model(xb), yb, reduction="sum").backward()
    engine.optimizer.step()
    xb, yb = xb.as_subclass(torch.Tensor), yb.as_subclass(torch.Tensor)
    per_example = per_example_grads(reference, lambda out, t: F.cross_entropy(out, t, reduction="sum"),
                                    xb, yb)
    expected, _ = clipped_sum(per_example, make_groups(reference, "all-layer", 0.5), clip)
    for p, old, q in zip(net.parameters(), before, reference.parameters()):
        torch.testing.assert_close(p.detach(), old - lr * expected[q] / 16, rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class ClipsByBranch(ClipFunction):
    """Python control flow on a norm's value: it cannot run one example at a time."""

    def weigh(self, norms, threshold):
        if norms > threshold:
            return threshold / norms
        return torch.ones_like(norms)


@dataclass(frozen=True)
class Doubles(ClipFunction):
    """Twice Abadi's weight: every clipped norm may reach 2R."""

    def weigh(self, norms, threshold):
        return 2 * (threshold / norms.clamp_min(1e-30)).clamp_max(1.0)


@pytest.mark.parametrize("clip, words", [
    (ClipsByBranch(), "could not compute each example's weight from that example's norm alone.*"
                      r"data-dependent control flow.*torch\.where"),
    (Doubles(), "gives the weight 2 to a gradient of norm 1 under the threshold 1: the clipped norm 2 must "
                "be .* at most the threshold")])
def test_a_clip_function_not_per_example_or_over_the_bound_is_refused_at_make_private(clip, words):
    net = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    with pytest.raises(tunefree.SettingsRefused, match=words):
        tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                              target_delta=1e-3, noise_multiplier=1.0, steps=1, clipping=clip)
    assert not net[0]._forward_hooks and not net[0]._forward_pre_hooks  # refused before any hook


def test_a_clip_function_returning_one_weight_per_example_is_required():
    @dataclass(frozen=True)
    class Pair(ClipFunction):
        def weigh(self, norms, threshold):
            return torch.stack([norms, norms]) * 0

    with pytest.raises(tunefree.SettingsRefused, match=r"returned weights of shape \(3, 2\) for 3 norms"):
        Pair().weights(torch.ones(3, dtype=torch.float64), 1.0)
