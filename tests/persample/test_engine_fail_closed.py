"""The engine fails closed: every situation it cannot handle exactly is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import captured_calls, pop_step
from support.models import MLP
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine
from tunefree.rules.factored import FactoredGrad


def engine_for(model, grouping="all-layer"):
    return ClippingEngine(model, make_groups(model, grouping, 1.0), clip_function("auto-s"))


def test_batchnorm_is_refused_with_the_fix():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with pytest.raises(PrivacyError, match="GroupNorm"):
        engine_for(model)


def test_instance_norm_with_running_stats_is_refused():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, affine=True,
                                                               track_running_stats=True))
    with pytest.raises(ValueError, match="track_running_stats=False"):
        engine_for(model)


def test_embedding_scale_grad_by_freq_is_refused():
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        engine_for(nn.Sequential(nn.Embedding(5, 2, scale_grad_by_freq=True)))


def test_parameter_used_outside_its_module_is_an_error():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 3)

        def forward(self, ids):  # reads the weight directly: no per-sample gradient possible
            return self.emb(ids).mean(1) @ self.emb.weight.T

    model = Functional()
    engine_for(model)
    out = model(torch.randint(0, 6, (4, 2)))
    with pytest.raises(PrivacyError, match="emb.weight"):
        F.cross_entropy(out, torch.zeros(4, dtype=torch.long)).backward()


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
@pytest.mark.parametrize("value", [float("inf"), 1e32])
def test_non_finite_or_overflowing_per_sample_norm_is_an_error(value, grouping):
    model = MLP()
    engine = engine_for(model, grouping)
    x = torch.randn(4, 6)
    x[2, 0] = value
    with pytest.raises(PrivacyError, match="NaN, infinite or beyond"):
        F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    sums, examples, _ = pop_step(engine)
    assert sums == {} and examples == 0  # nothing of the tainted step is left to release


def test_a_form_that_weighs_an_example_twice_is_an_internal_error(monkeypatch):
    """The norms booked and checked are those whose clip weights were applied, each example's once: a
    per-sample form that weighs examples twice (or skips some) cannot pass a step off as clipped."""
    clipped_sum = FactoredGrad.clipped_sum

    def twice(self, other_sq_norms, weights_of):
        weights_of(self.sq_norms() + other_sq_norms)
        return clipped_sum(self, other_sq_norms, weights_of)

    monkeypatch.setattr(FactoredGrad, "clipped_sum", twice)
    model = MLP()
    engine_for(model, "per-layer")
    with pytest.raises(RuntimeError, match="8 per-sample norms weighed for a pass of 4 examples"):
        F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()


def test_input_modified_in_place_after_use_is_an_error():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            h = x * 1.0
            out = self.fc(h)
            h.mul_(2)  # the layer's input changes after the layer used it
            return out + h.sum()

    model = InPlace()
    engine_for(model)
    with pytest.raises(PrivacyError, match="modified in place"):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_batch_not_in_dimension_zero_is_an_error():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 2)

        def forward(self, x):  # x: [B, T, 3]; layer b gets it sequence-first, [T, B, 3]
            return self.b(self.a(x).transpose(0, 1))

    model = SeqFirst()
    engine_for(model)
    with pytest.raises(PrivacyError, match=r"'b'.*shows 4 examples in dimension 0.*holds 5: .*"
                                           r"examples in dimension 1.*batch_dim=\{'b': 1\}"):
        model(torch.randn(5, 4, 3)).sum().backward()


def test_evaluation_passes_store_nothing():
    model = MLP()
    engine = engine_for(model)
    with torch.no_grad():
        model(torch.randn(4, 6))
    assert captured_calls(engine) == 0
    model.eval()
    model(torch.randn(4, 6))
    assert captured_calls(engine) == 0
    model.train()
    model(torch.randn(4, 6))
    assert captured_calls(engine) == 2


def test_forward_without_backward_is_forgotten_and_stale_backward_refused():
    model = MLP()
    engine = engine_for(model)
    first = model(torch.randn(4, 6))
    second = model(torch.randn(4, 6))
    assert captured_calls(engine) == 2  # only the second forward is kept
    with pytest.raises(PrivacyError, match="one batch per backward"):
        (first.sum() + second.sum()).backward()


def test_backward_in_eval_mode_cannot_reach_the_optimizer():
    model = MLP()
    engine = engine_for(model)
    model.eval()
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(PrivacyError, match="eval mode"):
        engine.check_no_leak()


def test_detach_restores_a_plain_module():
    model = MLP()
    engine = engine_for(model)
    engine.detach()
    model(torch.randn(4, 6)).sum().backward()
    assert model.fc1.weight.grad is not None
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("positions,d_in,d_out", [(1, 5, 4), (9, 3, 2), (2, 30, 40), (40, 6, 5)])
def test_ghost_and_materialised_norms_agree(positions, d_in, d_out):
    a = torch.randn(3, 2, positions, d_in, dtype=torch.float64)
    b = torch.randn(3, 2, positions, d_out, dtype=torch.float64)
    shape = torch.Size([2 * d_out, d_in])
    ghost_or_not = FactoredGrad(a, b, shape).sq_norms()
    explicit = (b.transpose(-1, -2) @ a).reshape(3, -1).pow(2).sum(1)
    torch.testing.assert_close(ghost_or_not, explicit)
    w = torch.rand(3, dtype=torch.float64)
    grad = FactoredGrad(a, b, shape)
    grad.sq_norms()
    grad.compact()
    expected = torch.einsum("b,bgoi->goi", w, b.transpose(-1, -2) @ a).reshape(shape)
    torch.testing.assert_close(grad.weighted_sum(w), expected)


def test_bfloat16_autocast_matches_float32():
    """Under bfloat16 autocast the clipped sums stay within bfloat16's precision of float32's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def clipped(use_autocast):  # a summed loss: 16-bit gradients of a mean loss are refused
        engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"),
                                loss_reduction="sum")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        sums, _, norms = pop_step(engine)
        engine.detach()
        return sums, norms["all"]

    sums32, norms32 = clipped(False)
    sums16, norms16 = clipped(True)
    assert norms16.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: a few percent on per-sample norms and clipped sums.
    torch.testing.assert_close(norms16, norms32, rtol=0.03, atol=1e-3)
    for p in model.parameters():
        assert sums16[p].dtype == torch.float32
        rel = (sums16[p] - sums32[p]).norm() / sums32[p].norm()
        assert rel < 0.03, rel
