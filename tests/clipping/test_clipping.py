"""Clip functions: the bound ‖wᵢ gᵢ‖ ≤ R at norm 0, tiny norms and huge norms, and their values."""

from __future__ import annotations

import pytest
import torch

from tunefree.clipping.functions import CLIP_FUNCTIONS, PSAC, Abadi, AutoS, AutoV, clip_function

NORMS = torch.tensor([0.0, 1e-45, 1e-30, 1e-12, 1e-6, 0.01, 0.5, 1.0, 3.0, 1e6, 1e30, 3e38])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threshold", [1e-3, 0.1, 1.0, 7.5, 1e4])
@pytest.mark.parametrize("name", CLIP_FUNCTIONS)
def test_clipped_norm_never_exceeds_threshold(name, threshold, dtype):
    norms = NORMS.to(dtype)
    weights = clip_function(name).weights(norms, threshold)
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    assert weights.dtype == torch.float64
    clipped = weights * norms.to(torch.float64)
    # A few units in the last place (of float64, where weights are computed) for the division itself.
    assert (clipped <= threshold * (1 + 4 * torch.finfo(torch.float64).eps)).all(), clipped


def test_values():
    n = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(clip_function("abadi").weights(n, 1.0),
                               torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(clip_function("auto-v").weights(n[1:], 1.0),
                               torch.tensor([2.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(AutoS(gamma=0.1).weights(n, 2.0), 2.0 / (n + 0.1))
    r = 0.3
    torch.testing.assert_close(PSAC(r=r).weights(n, 2.0), 2.0 / (n + r / (n + r)))


def test_auto_v_normalises_and_psac_is_non_monotonic():
    n = torch.tensor([1e-3, 0.2, 5.0], dtype=torch.float64)
    torch.testing.assert_close(clip_function("auto-v").weights(n, 1.5) * n, torch.full((3,), 1.5,
                                                                                      dtype=torch.float64))
    # PSAC's clipped norm ‖g‖/(‖g‖ + r/(‖g‖+r)) rises, but the weight itself is not monotonic.
    grid = torch.linspace(1e-4, 2, 2001, dtype=torch.float64)
    w = PSAC(r=0.1).weights(grid, 1.0)
    assert (w.diff() > 0).any() and (w.diff() < 0).any()


@pytest.mark.parametrize("make, words", [(lambda: clip_function("clip"), "unknown clipping"),
                                         (lambda: AutoS(gamma=0.0), "AutoS.gamma"),
                                         (lambda: PSAC(r=-1.0), "PSAC.r")])
def test_bad_clip_configuration_is_refused(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_the_typed_functions_are_the_registered_ones_and_say_whether_they_normalise():
    assert [type(clip_function(name)) for name in ("auto-s", "auto-v", "psac", "abadi")] == \
        [AutoS, AutoV, PSAC, Abadi]
    assert clip_function("auto-s") == AutoS() and AutoS().describe() == {"name": "auto-s", "gamma": 0.01}
    assert [c.normalising for c in (AutoS(), AutoV(), PSAC(), Abadi())] == [True, True, True, False]


@pytest.mark.parametrize("name", list(CLIP_FUNCTIONS))
def test_every_registered_function_bounds_the_clipped_norm(name):
    norms = torch.tensor([0.0, 1e-30, 1.0, 1e30], dtype=torch.float64)
    for threshold in (0.1, 1.0, 10.0):
        clipped = clip_function(name).weights(norms, threshold) * norms
        assert (clipped <= threshold * (1 + 4 * torch.finfo(torch.float64).eps)).all(), (name, clipped)


@pytest.mark.parametrize("clip", [AutoS(), AutoV(), PSAC(), Abadi(), AutoS(gamma=0.3), PSAC(r=2.0)])
def test_the_built_in_functions_are_elementwise_so_they_run_on_the_whole_batch(clip):
    """The built-in functions run on the whole batch at once (one example at a time costs 31–44% of a
    private step with per-layer groups: benchmarks/clip_function_cost.py), which is safe only if each
    weight is a function of its own norm: the batch's weights are the weights of each norm alone, and
    they do not move when another example joins or the batch is permuted."""
    norms = NORMS.to(torch.float64)
    weights = clip.weights(norms, 0.7)
    alone = torch.stack([clip.weights(n.reshape(1), 0.7)[0] for n in norms])
    assert torch.equal(weights, alone)
    order = torch.randperm(len(norms), generator=torch.Generator().manual_seed(0))
    assert torch.equal(clip.weights(norms[order], 0.7), weights[order])
    joined = clip.weights(torch.cat([norms, norms.new_tensor([1e-3, 1e9])]), 0.7)
    assert torch.equal(joined[:len(norms)], weights)


def test_only_the_built_in_types_skip_the_per_example_evaluation():
    from dataclasses import dataclass

    from tunefree.clipping import functions

    @dataclass(frozen=True)
    class Reads(AutoS):  # a subclass may override weigh: it runs one example at a time
        def weigh(self, norms, threshold):
            return threshold / (norms.max() + self.gamma)

    assert {AutoS, AutoV, PSAC, Abadi} == functions._ELEMENTWISE
    norms = torch.tensor([1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(Reads().weights(norms, 1.0), 1.0 / (norms + 0.01))


@pytest.mark.parametrize("name", list(CLIP_FUNCTIONS))
def test_every_registered_function_passes_the_check_make_private_runs(name):
    from tunefree.clipping.functions import check_clip_function

    check_clip_function(clip_function(name), (0.25, 3.0))
