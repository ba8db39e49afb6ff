"""Every layer rule × every clip function × every grouping against a batch-size-1 autograd loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from support.models import MLP, ConvNet, EmbeddingModel, FallbackNet, NormNet, SequenceLinear, TiedLM

from tunefree.clipping.functions import CLIP_FUNCTIONS, clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules import conv as conv_rule
from tunefree.rules.paths import PathChooser


def cross_entropy(reduction):
    return lambda logits, y: F.cross_entropy(logits, y, reduction=reduction)


def case_inputs(name):
    g = torch.Generator().manual_seed(1)
    B = 5
    y = torch.randint(0, 3, (B,), generator=g)
    if name == "mlp":
        return MLP(), torch.randn(B, 6, generator=g), y
    if name == "sequence":
        return SequenceLinear(), torch.randn(B, 3, 2, 12, generator=g), y
    if name == "embedding":
        ids = torch.randint(0, 7, (B, 6), generator=g)
        ids[:, :2] = ids[:, 2:4]  # repeated ids within each example
        ids[0, 0] = 0  # a padding position
        return EmbeddingModel(), ids, y
    if name == "tied":
        return TiedLM(), torch.randint(0, 9, (B, 4), generator=g), torch.randint(0, 9, (B,), generator=g)
    if name == "norms":
        return NormNet(), torch.randn(B, 2, 4, 4, generator=g), y
    if name == "fallback":
        return FallbackNet(), torch.randn(B, 3, 3, generator=g), y
    raise KeyError(name)


MODELS = ["mlp", "sequence", "embedding", "tied", "norms", "fallback"]
GROUPINGS = ["all-layer", "per-layer", "per-param", "explicit"]


def groups_for(model, grouping):
    if grouping != "explicit":
        return make_groups(model, grouping, 1.3)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    half = len(names) // 2
    thresholds = {"first": 0.7, "second": 2.0}
    return make_groups(model, {"first": names[:half], "second": names[half:]}, thresholds)


def run_engine(model, x, y, grouping, clip, reduction, chooser=None):
    groups = groups_for(model, grouping)
    engine = ClippingEngine(model, groups, clip, loss_reduction=reduction, path_chooser=chooser)
    loss = cross_entropy(reduction)(model(x), y)
    loss.backward()
    sums, examples, norms = pop_step(engine)
    engine.detach()
    return groups, sums, examples, norms


# float64 throughout: 1e-7 relative leaves room for AUTO-V amplifying tiny group norms
# (w = R/‖g‖), while any real error in a rule is of order one.
def assert_matches_brute_force(model, x, y, grouping, clip, reduction="mean", chooser=None):
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    reference = copy.deepcopy(model)
    groups, sums, examples, norms = run_engine(model, x, y, grouping, clip, reduction, chooser)
    assert examples == len(y)
    ref_groups = groups_for(reference, grouping)
    per_example = per_example_grads(reference, cross_entropy("mean"), x, y)
    expected, expected_norms = clipped_sum(per_example, ref_groups, clip)
    for g, ref_g in zip(groups, ref_groups):
        torch.testing.assert_close(norms[g.name], expected_norms[ref_g.name], rtol=1e-7, atol=1e-10)
        for p, ref_p, name in zip(g.params, ref_g.params, g.param_names):
            torch.testing.assert_close(sums[p], expected[ref_p], rtol=1e-7, atol=1e-10,
                                       msg=lambda m, name=name: f"{name}: {m}")
    for p in model.parameters():
        assert p.grad is None, "autograd must not compute ordinary gradients"


@pytest.mark.parametrize("clip", CLIP_FUNCTIONS)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("name", MODELS)
def test_clipped_sums_match_brute_force(name, grouping, clip):
    model, x, y = case_inputs(name)
    assert_matches_brute_force(model, x, y, grouping, clip_function(clip))


@pytest.mark.parametrize("name", MODELS)
def test_sum_reduction(name):
    model, x, y = case_inputs(name)
    assert_matches_brute_force(model, x, y, "per-layer", clip_function("abadi"), reduction="sum")


CONV_CASES = [
    (1, {}), (1, {"stride": 2, "padding": 1}), (1, {"padding": "same", "dilation": 2}),
    (2, {}), (2, {"stride": (2, 1), "padding": (1, 0)}), (2, {"padding": "same"}),
    (2, {"padding": "valid", "dilation": (1, 2)}), (2, {"groups": 2, "padding": 1}),
    (2, {"padding": 1, "padding_mode": "reflect"}), (2, {"padding": 2, "padding_mode": "circular"}),
    (2, {"padding": 1, "padding_mode": "replicate", "stride": 2}),
    (3, {}), (3, {"stride": 2, "padding": 1, "groups": 2}), (3, {"padding": "same", "dilation": 2}),
    # few output positions: the ghost-norm path
    (1, {"stride": 4}), (2, {"stride": 3}), (2, {"stride": 3, "groups": 2, "padding": 1}),
    (3, {"stride": 3, "padding": "valid"}),
]


@pytest.mark.parametrize("native", [True, False], ids=["native-grads", "batched-matmul-grads"])
@pytest.mark.parametrize("path", [None, "ghost", "materialise"], ids=["formula", "ghost", "materialise"])
@pytest.mark.parametrize("dims,kwargs", CONV_CASES)
@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
def test_convolutions_match_brute_force(dims, kwargs, grouping, path, native, monkeypatch):
    """Every convolution variant by both norm paths (forced), and by the one the cost formula picks; the
    per-sample gradients by the CPU's native grouped kernel and by the batched matrix product that other
    devices (CUDA) use."""
    if not native:
        monkeypatch.setattr(conv_rule, "NATIVE_PER_SAMPLE", frozenset())
    g = torch.Generator().manual_seed(2)
    size = {1: (4, 11), 2: (4, 7, 8), 3: (4, 5, 6, 5)}[dims]
    x = torch.randn(4, *size, generator=g)
    y = torch.randint(0, 3, (4,), generator=g)
    chooser = None if path is None else PathChooser(fixed=path)
    assert_matches_brute_force(ConvNet(dims, **kwargs), x, y, grouping, clip_function("auto-s"),
                               chooser=chooser)
