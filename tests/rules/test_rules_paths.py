"""The two exact norm paths (ghost norm, materialised per-sample gradients), the measured choice between
them, and the per-layer clipped sum formed a slice of examples at a time — each against a batch-size-1
autograd loop or an explicit per-example computation."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from support.models import ConvNet, SequenceLinear, TiedLM
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules import conv as conv_rule
from tunefree.rules import factored
from tunefree.rules.conv import ConvWeightGrad, patches
from tunefree.rules.factored import FactoredGrad, examples_per_chunk
from tunefree.rules.paths import GHOST, MATERIALISE, UNFOLD_COST, PathChooser, factored_estimates


def _inputs(name: str, batch: int = 6):
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 3, (batch,), generator=g)
    if name == "sequence":
        return SequenceLinear(), torch.randn(batch, 3, 2, 12, generator=g), y
    if name == "conv2d-groups":
        return ConvNet(2, groups=2, padding=1), torch.randn(batch, 4, 7, 8, generator=g), y
    if name == "conv2d-reflect-stride":
        return (ConvNet(2, padding=1, padding_mode="reflect", stride=2),
                torch.randn(batch, 4, 7, 8, generator=g), y)
    if name == "conv1d-dilated":
        return ConvNet(1, padding="same", dilation=2), torch.randn(batch, 4, 11, generator=g), y
    if name == "conv3d-strided":
        return ConvNet(3, stride=2, padding=1, groups=2), torch.randn(batch, 4, 5, 6, 5, generator=g), y
    if name == "tied":  # a weight used twice: its per-sample gradients are summed over the uses
        ids = torch.randint(0, 9, (batch, 4), generator=g)
        targets = torch.randint(0, 9, (batch,), generator=g)
        return TiedLM(), ids, targets
    raise KeyError(name)


MODELS = ["sequence", "conv2d-groups", "conv2d-reflect-stride", "conv1d-dilated", "conv3d-strided", "tied"]


def _engine_sums(model, x, y, grouping, chooser):
    engine = ClippingEngine(model, make_groups(model, grouping, 1.3), clip_function("auto-s"),
                            path_chooser=chooser)
    F.cross_entropy(model(x), y).backward()
    sums, examples, norms = pop_step(engine)
    engine.detach()
    return engine, sums, examples, norms


def _assert_matches_brute_force(name, grouping, chooser):
    model, x, y = _inputs(name)
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    reference = copy.deepcopy(model)
    engine, sums, examples, norms = _engine_sums(model, x, y, grouping, chooser)
    assert examples == len(y)
    groups, ref_groups = make_groups(model, grouping, 1.3), make_groups(reference, grouping, 1.3)
    per_example = per_example_grads(reference, lambda out, t: F.cross_entropy(out, t), x, y)
    expected, expected_norms = clipped_sum(per_example, ref_groups, clip_function("auto-s"))
    for group, ref_group in zip(groups, ref_groups):
        torch.testing.assert_close(norms[group.name], expected_norms[ref_group.name], rtol=1e-7, atol=1e-10)
        for p, ref_p in zip(group.params, ref_group.params):
            torch.testing.assert_close(sums[p], expected[ref_p], rtol=1e-7, atol=1e-10)
    return engine


@pytest.mark.parametrize("path", [GHOST, MATERIALISE])
@pytest.mark.parametrize("grouping", ["all-layer", "per-layer", "per-param"])
@pytest.mark.parametrize("name", MODELS)
def test_each_forced_path_matches_brute_force(name, grouping, path):
    _assert_matches_brute_force(name, grouping, PathChooser(fixed=path))


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
@pytest.mark.parametrize("name", ["sequence", "conv2d-groups", "conv1d-dilated"])
def test_measured_choice_matches_brute_force_and_takes_the_faster_path(name, grouping):
    chooser = PathChooser(min_cost=0, max_ratio=float("inf"))
    engine = _assert_matches_brute_force(name, grouping, chooser)
    layers = [m for m in engine.model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    assert len(chooser.choices) == len(layers)  # one choice per layer (distinct shapes), cached
    assert chooser.timings_ms, "some layer must have been timed"
    for key, timings in chooser.timings_ms.items():
        assert set(timings) == {GHOST, MATERIALISE} and all(t > 0 for t in timings.values())
        assert chooser.choices[key] == min(timings, key=timings.get)


def test_choice_is_made_once_per_shape_whatever_the_batch_size():
    model, x, y = _inputs("conv2d-groups", batch=6)
    engine = ClippingEngine(model, make_groups(model, "per-layer", 1.0), clip_function("auto-s"),
                            path_chooser=PathChooser(min_cost=0, max_ratio=float("inf")))
    F.cross_entropy(model(x), y).backward()
    pop_step(engine)
    first = dict(engine.path_chooser.timings_ms)
    assert first, "the first step must time the paths"
    F.cross_entropy(model(x[:4]), y[:4]).backward()  # a smaller (e.g. Poisson) batch: no new timing
    assert pop_step(engine)[1] == 4
    assert engine.path_chooser.timings_ms == first


class _Run:
    """A fake path runner: ``slow`` sleeps, the other returns at once; counts the calls."""

    def __init__(self, slow: str):
        self.slow, self.calls = slow, []

    def __call__(self, path: str) -> None:
        self.calls.append(path)
        if path == self.slow:
            time.sleep(0.02)


@pytest.mark.parametrize("slow, expected", [(GHOST, MATERIALISE), (MATERIALISE, GHOST)])
def test_the_measured_faster_path_wins_against_the_estimate(slow, expected):
    chooser = PathChooser(min_cost=0)
    estimates = {GHOST: 1.0, MATERIALISE: 1.0}
    estimates[expected] = 2.0  # the estimate prefers the slow path; the measurement decides
    run = _Run(slow)
    assert chooser.choose("layer", estimates, run, torch.device("cpu")) == expected
    assert sorted(run.calls) == sorted([GHOST, MATERIALISE] * 2)  # two timed runs of each
    assert chooser.timings_ms["layer"][slow] >= 20
    assert chooser.choose("layer", estimates, run, torch.device("cpu")) == expected
    assert len(run.calls) == 4, "the choice is cached: no second calibration"


@pytest.mark.parametrize("chooser, estimates", [
    (PathChooser(measure=False, min_cost=0), {GHOST: 3.0, MATERIALISE: 2.0}),
    (PathChooser(min_cost=100), {GHOST: 50.0, MATERIALISE: 40.0}),  # cheap layer
    (PathChooser(min_cost=0, max_ratio=8), {GHOST: 90.0, MATERIALISE: 10.0}),  # far apart
])
def test_untimed_choices_follow_the_lower_estimate(chooser, estimates):
    run = _Run(slow=MATERIALISE)
    assert chooser.choose("layer", estimates, run, torch.device("cpu")) == MATERIALISE
    assert run.calls == [] and chooser.timings_ms == {}


def test_a_path_the_caller_marks_untimeable_is_not_timed():
    run = _Run(slow=GHOST)
    chooser = PathChooser(min_cost=0)
    assert chooser.choose("k", {GHOST: 2.0, MATERIALISE: 1.0}, run, torch.device("cpu"), timeable=False) \
        == MATERIALISE
    assert run.calls == []


def test_ghost_norms_larger_than_the_layer_are_not_timed():
    """Long sequences, narrow layer: the Gram matrices (2·T² per example) outgrow a and b (T·(d_in + d_out)),
    so calibrating would raise the peak memory; the estimate (materialise) decides untimed."""
    a, b = torch.randn(2, 1, 64, 4), torch.randn(2, 1, 64, 3)
    grad = FactoredGrad(a, b, torch.Size([3, 4]))
    grad.chooser = PathChooser(min_cost=0, max_ratio=float("inf"))
    grad.sq_norms()
    assert list(grad.chooser.choices.values()) == [MATERIALISE] and grad.chooser.timings_ms == {}


def test_fixed_path_and_bad_arguments():
    run = _Run(slow=GHOST)
    assert PathChooser(fixed=GHOST).choose("k", {GHOST: 9.0, MATERIALISE: 1.0}, run, torch.device("cpu")) \
        == GHOST
    assert run.calls == []
    with pytest.raises(ValueError, match="fixed must be one of"):
        PathChooser(fixed="fast")
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        PathChooser(repeats=0)


def test_estimates_are_the_multiply_adds_of_each_path():
    assert factored_estimates(2, 5, 3, 4) == {GHOST: 2 * 25 * 7, MATERIALISE: 2 * 5 * 12}
    # a convolution's paths both first copy its T·d_in patches
    unfold = UNFOLD_COST * 5 * 3
    assert factored_estimates(2, 5, 3, 4, unfolded=True) == {GHOST: 2 * (25 * 7 + unfold),
                                                               MATERIALISE: 2 * (5 * 12 + unfold)}


@pytest.mark.parametrize("conv, size, ghost", [
    (nn.Conv2d(16, 32, 4, stride=2), (16, 13, 13), True),   # mnist-cnn's second layer: 25 positions
    (nn.Conv2d(1, 16, 8, stride=2, padding=3), (1, 28, 28), False),  # its first: 196 positions
    (nn.Conv2d(128, 128, 3, padding=1), (128, 4, 4), True),  # a resnet's 4×4 stage: 16 positions, wide
    (nn.Conv2d(16, 32, 3, padding=1), (16, 16, 16), False),  # 256 positions, narrow
])
def test_the_formula_picks_the_measured_faster_conv_path(conv, size, ghost):
    """On the CPU the ghost norm copies the patches and the native kernel materialises without them; near
    the crossover the copy decides (one thread, RESULTS §8.5: mnist-cnn's second layer at B 256, ghost
    7.3 ms against 13–15 ms materialised); far from it the multiply-adds do."""
    x = torch.randn(2, *size)
    grad = ConvWeightGrad(conv, x, torch.ones_like(conv(x)))  # no chooser: the path the formula picks
    assert grad.chooser is None and (grad._path(fused=False) == GHOST) is ghost


def _weights_of(calls):
    def weights_of(sq):
        calls.append(len(sq))
        return 1.0 / (sq.sqrt() + 0.1)
    return weights_of


@pytest.mark.parametrize("path", [GHOST, MATERIALISE])
def test_factored_clipped_sum_slices_examples_and_matches_explicit(path, monkeypatch):
    monkeypatch.setattr(factored, "SLICE_LIMIT", 16)  # slices as small as the layer's own tensors
    g = torch.Generator().manual_seed(0)
    batch, groups, positions, d_in, d_out = 7, 2, 1, 6, 5
    a = torch.randn(batch, groups, positions, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(batch, groups, positions, d_out, generator=g, dtype=torch.float64)
    other = torch.rand(batch, generator=g, dtype=torch.float64)
    shape = torch.Size([groups * d_out, d_in])
    per_example = (b.transpose(-1, -2) @ a).reshape(batch, *shape)
    sq = per_example.flatten(1).pow(2).sum(1)
    weights = 1.0 / ((sq + other).sqrt() + 0.1)
    calls = []
    grad = FactoredGrad(a, b, shape)
    grad.chooser = PathChooser(fixed=path)
    result = grad.clipped_sum(other, _weights_of(calls))
    torch.testing.assert_close(result.total, torch.einsum("b,bij->ij", weights, per_example))
    torch.testing.assert_close(result.sq_norms, sq)
    torch.testing.assert_close(result.weights, weights)
    if path == MATERIALISE:  # a + b hold 7·2·11 numbers, one gradient 60: slices of 2 examples
        assert examples_per_chunk(60, a.numel() + b.numel()) == 2
        assert calls == [2, 2, 2, 1]
    else:
        assert calls == [batch]


@pytest.mark.parametrize("native", [True, False], ids=["native-grads", "batched-matmul-grads"])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole-batch", "sliced"])
@pytest.mark.parametrize("path", [GHOST, MATERIALISE])
@pytest.mark.parametrize("kwargs", [{"padding": 1}, {"stride": 2, "groups": 2},
                                    {"padding": 1, "padding_mode": "circular"}])
def test_conv_clipped_sum_matches_a_per_example_loop(path, kwargs, sliced, native, monkeypatch):
    """Norms alone and the fused clipped sum, over the whole batch at once or in slices of examples
    (slices of 2: the batch of 5 is split in 3), with the per-sample gradients by
    the native grouped kernel (CPU) or by the batched matrix product (other devices)."""
    if not native:
        monkeypatch.setattr(conv_rule, "NATIVE_PER_SAMPLE", frozenset())
    if sliced:
        monkeypatch.setattr(factored, "examples_per_chunk", lambda per_example, layer_elements: 2)
    g = torch.Generator().manual_seed(1)
    conv = nn.Conv2d(4, 6, 3, **kwargs).double()
    x = torch.randn(5, 4, 6, 7, generator=g, dtype=torch.float64)
    out = conv(x)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    per_example = torch.stack([
        torch.autograd.grad((conv(x[i:i + 1]) * grad_out[i:i + 1]).sum(), conv.weight)[0] for i in range(5)])
    other = torch.rand(5, generator=g, dtype=torch.float64)
    sq = per_example.flatten(1).pow(2).sum(1)
    weights = 1.0 / ((sq + other).sqrt() + 0.1)
    grad = ConvWeightGrad(conv, x, grad_out)
    grad.chooser = PathChooser(fixed=path)
    slices = 3 if sliced else 1
    assert -(-5 // grad._chunk(path)) == slices
    calls = []
    with torch.no_grad():
        torch.testing.assert_close(grad.sq_norms_by(path), sq)
        result = grad.clipped_sum(other, _weights_of(calls))
    assert len(calls) == (slices if path == MATERIALISE else 1)
    torch.testing.assert_close(result.total, torch.einsum("b,boihw->oihw", weights, per_example))
    torch.testing.assert_close(result.sq_norms, sq)
    torch.testing.assert_close(result.weights, weights)


@pytest.mark.parametrize("dims, kwargs", [
    (2, {}), (2, {"stride": (2, 1)}), (2, {"dilation": (1, 2)}), (2, {"stride": 3, "dilation": 2}),
    (2, {"groups": 2, "stride": 2}), (2, {"groups": 4}), (1, {"stride": 2, "dilation": 3, "groups": 2}),
    (3, {"stride": (1, 2, 1), "dilation": (2, 1, 1)}), (3, {"groups": 2}),
])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_patches_give_the_convolution(dims, kwargs, layout):
    """The batched patches (one strided view of the input, copied once) times the weight are the
    convolution, for every stride, dilation and grouping, whatever the input's memory layout."""
    g = torch.Generator().manual_seed(2)
    size = {1: (11,), 2: (9, 8), 3: (6, 7, 5)}[dims]
    x = torch.randn(3, 4, *size, generator=g, dtype=torch.float64)
    if layout == "channels-last":  # the same values, strided differently
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    kernel = {1: (3,), 2: (3, 2), 3: (2, 3, 2)}[dims]
    groups = kwargs.get("groups", 1)
    weight = torch.randn(8, 4 // groups, *kernel, generator=g, dtype=torch.float64)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    expected = conv(x, weight, **kwargs)
    tuple_of = lambda v: v if isinstance(v, tuple) else (v,) * dims  # noqa: E731
    a = patches(x, kernel, tuple_of(kwargs.get("stride", 1)), tuple_of(kwargs.get("dilation", 1)), groups)
    assert a.shape == (3, groups, expected[0, 0].numel(), weight[0].numel())
    assert a.transpose(-1, -2).is_contiguous()  # one copy, output positions innermost
    per_group = weight.reshape(groups, 8 // groups, -1)  # [G, C_out/G, d_in]
    out = (a @ per_group.transpose(-1, -2)[None]).transpose(-1, -2)  # [B, G, C_out/G, T]
    torch.testing.assert_close(out.reshape(expected.shape), expected)


@pytest.mark.parametrize("dims, kwargs", [
    (2, {}), (2, {"stride": 2}), (2, {"stride": 3, "dilation": 2, "groups": 2}), (1, {"stride": 2}),
    (3, {"stride": (1, 2, 1), "groups": 2}),
])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last", "sliced"])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_the_gathered_patches_are_the_strided_copy_bit_for_bit(dims, kwargs, layout, dtype, monkeypatch):
    """The gather that copies short runs of the patches (rules/conv.py: ``gathers``) gives the elements,
    dtype and layout of the strided copy exactly, whatever the input's memory layout."""
    g = torch.Generator().manual_seed(3)
    size = {1: (21,), 2: (13, 12), 3: (7, 9, 6)}[dims]
    x = torch.randn(5, 6, *[n + 1 for n in size], generator=g, dtype=torch.float64)
    x = x[1:4, 2:6][(..., *[slice(1, None)] * dims)] if layout == "sliced" else x[:3, :4, ..., 1:]
    if layout == "channels-last":
        x = x.contiguous().movedim(1, -1).contiguous().movedim(-1, 1)
    tuple_of = lambda v: v if isinstance(v, tuple) else (v,) * dims  # noqa: E731
    args = (x, tuple_of(3), tuple_of(kwargs.get("stride", 1)), tuple_of(kwargs.get("dilation", 1)),
            kwargs.get("groups", 1), dtype)
    monkeypatch.setattr(conv_rule, "gathers", lambda *_: True)
    gathered = patches(*args)
    monkeypatch.setattr(conv_rule, "gathers", lambda *_: False)
    copied = patches(*args)
    assert gathered.dtype == copied.dtype == (dtype or x.dtype)
    assert gathered.stride() == copied.stride()
    assert torch.equal(gathered, copied)


def test_materialised_norms_too_large_to_keep_are_taken_slice_by_slice(monkeypatch):
    monkeypatch.setattr(factored, "SLICE_LIMIT", 16)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(9, 1, 1, 8, generator=g, dtype=torch.float64)  # one example's gradient: 40 numbers,
    b = torch.randn(9, 1, 1, 5, generator=g, dtype=torch.float64)  # the layer holds 9·13: 2 per slice
    shape = torch.Size([5, 8])
    per_example = (b.transpose(-1, -2) @ a).reshape(9, *shape)
    grad = FactoredGrad(a, b, shape)
    grad.chooser = PathChooser(fixed=MATERIALISE)
    torch.testing.assert_close(grad.sq_norms(), per_example.flatten(1).pow(2).sum(1))
    assert examples_per_chunk(40, a.numel() + b.numel()) == 2
    grad.compact()
    w = torch.rand(9, generator=g, dtype=torch.float64)
    torch.testing.assert_close(grad.weighted_sum(w), torch.einsum("b,bij->ij", w, per_example))


def test_a_seeded_run_follows_the_cost_estimates_and_a_secure_run_times_the_paths():
    """A seeded run repeats bit for bit across processes, so no norm path of it may depend on a timing."""
    def engine(seed):
        model = nn.Linear(3, 2)
        data = TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
        return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(data, batch_size=4), target_delta=1e-5,
                                     noise_multiplier=1.0, steps=2, seed=seed)

    assert engine(seed=0).clipper.path_chooser.measure is False
    assert engine(seed=None).clipper.path_chooser.measure is True


def test_the_number_of_slices_is_set_by_the_layer_not_the_batch():
    """Slices of examples hold at most max(the layer's captured tensors, SLICE_LIMIT): the whole batch
    while it fits, and never more slices than one example's work over its captured elements (+2 for
    rounding)."""
    per_example, captured = 100_000, 300  # one example's work is 333 times its captured tensors
    slices = {batch: -(-batch // examples_per_chunk(per_example, batch * captured))
              for batch in (1, 8, 41, 42, 64, 1024, 2**14, 2**17)}
    assert slices[1] == slices[8] == slices[41] == 1  # 41 examples' work fits in SLICE_LIMIT
    assert slices[42] == 2
    assert max(slices.values()) <= per_example // captured + 2
    assert abs(slices[2**14] - slices[2**17]) <= 1  # beyond SLICE_LIMIT: set by the layer's shape alone


def test_norm_path_is_a_performance_knob_of_make_private():
    """``norm_path`` picks the chooser: forced paths, the cost formula, or timing (secret runs only)."""
    def chooser(**options):
        model = nn.Linear(3, 2)
        data = TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
        engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       DataLoader(data, batch_size=4), target_delta=1e-5,
                                       noise_multiplier=1.0, steps=2, **options)
        return engine.clipper.path_chooser

    assert chooser(norm_path="ghost").fixed == "ghost"
    assert chooser(norm_path="materialise", seed=0).fixed == "materialise"
    assert chooser(norm_path="formula").measure is False and chooser(norm_path="formula").fixed is None
    assert chooser(norm_path="auto", seed=0).measure is False
