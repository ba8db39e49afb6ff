"""Ordinary user code around the engine: exact against brute force, or refused with a true message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine


def test_user_forward_hook_registered_before_the_engine_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    # A hook that changes the first layer's output, registered before the engine hooks the model.
    model[0].register_forward_hook(lambda mod, args, out: out * 2.0 + 0.5)
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    clip = clip_function("abadi")
    groups = make_groups(model, "all-layer", 0.1)
    engine = ClippingEngine(model, groups, clip)
    F.cross_entropy(model(x), y).backward()
    sums, examples, norms = pop_step(engine)
    engine.detach()
    assert examples == 5
    per_example = per_example_grads(reference, F.cross_entropy, x, y)
    expected, expected_norms = clipped_sum(per_example, make_groups(reference, "all-layer", 0.1), clip)
    torch.testing.assert_close(norms[groups[0].name], expected_norms[groups[0].name], rtol=1e-7, atol=1e-10)
    for p, ref_p in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(sums[p], expected[ref_p], rtol=1e-7, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "child"])
def test_compiled_model_is_refused_at_construction(where):
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    if where == "root":
        model = torch.compile(model)
    else:
        model[0] = torch.compile(model[0])
    with pytest.raises(PrivacyError, match="torch.compile before make_private"):
        ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))


def test_double_backward_is_refused_with_a_true_message():
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    x = torch.randn(5, 4, requires_grad=True)
    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 1, 0, 1]))
    with pytest.raises(PrivacyError, match="create_graph=True.*gradient penalty"):
        torch.autograd.grad(loss, x, create_graph=True)
    engine.detach()
