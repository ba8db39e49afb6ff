"""The engine knows the batch by provenance and books each batch's examples in one backward pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.models import MLP
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.data.poisson import StepSchedule, from_loader
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine
from tunefree.privacy.randomness import SeededSource


def engine_for(model, source=None):
    return ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"),
                          batch_source=source)


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


def data(n=4):
    torch.manual_seed(0)
    return torch.randn(n, 6), torch.randint(0, 3, (n,))


def test_two_losses_backpropagated_separately_are_refused():
    model = MLP()
    engine_for(model)
    x, y = data()
    out = model(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    with pytest.raises(PrivacyError, match="second backward.*Sum the losses into one backward"):
        (out ** 2).mean().backward()


def test_two_forwards_of_one_batch_with_two_backwards_are_refused_without_a_loader():
    model = MLP()
    engine = engine_for(model)
    x, y = data()
    loss_of(model, x, y).backward()
    with pytest.raises(PrivacyError, match="second backward.*this step"):
        loss_of(model, x, y).backward()
    assert pop_step(engine)[1] == 4
    loss_of(model, x, y).backward()  # a new step books again
    assert pop_step(engine)[1] == 4


def test_each_physical_batch_is_booked_once_and_a_step_never_exceeds_the_logical_batch():
    model, schedule = MLP(), StepSchedule()
    engine = engine_for(model, schedule)
    x, y = data(7)
    for first, last, rows in [(True, False, slice(0, 4)), (False, True, slice(4, 7))]:
        schedule.on_batch(first, last, rows.stop - rows.start)
        loss_of(model, x[rows], y[rows]).backward()
        with pytest.raises(PrivacyError, match="second backward.*this batch"):
            loss_of(model, x[rows], y[rows]).backward()  # the same micro-batch again
    assert pop_step(engine)[1] == 7


def test_a_batch_that_is_not_the_loaders_is_refused_with_the_shapes():
    model, schedule = MLP(), StepSchedule()
    engine_for(model, schedule)
    schedule.on_batch(True, True, 4)
    x, y = data(5)
    message = r"layer 'fc2' \(inputs of shapes \[\(5, 5\)\].*shows 5 examples.*holds 4: feed the model"
    with pytest.raises(PrivacyError, match=message):
        loss_of(model, x, y).backward()


def engine_declaring(model, source, batch_dim):
    return ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"),
                          batch_dim=batch_dim, batch_source=source)


def test_time_major_layer_is_refused_with_the_declaration_that_fixes_it():
    model, schedule = nn.Sequential(nn.Linear(3, 2)), StepSchedule()
    refusing = engine_for(model, schedule)
    schedule.on_batch(True, True, 4)
    x = torch.randn(6, 4, 3)  # [T, B, F]
    message = r"shows 6 examples in dimension 0.*holds 4: if this layer's tensors carry the examples in " \
        r"dimension 1.*batch_dim=\{'0': 1\}"
    with pytest.raises(PrivacyError, match=message):
        model(x).sum().backward()
    refusing.detach()
    schedule = StepSchedule()
    engine = engine_declaring(model, schedule, {"0": 1})  # what the message says: the same call is booked
    schedule.on_batch(True, True, 4)
    model(x).sum().backward()
    assert pop_step(engine)[1] == 4


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(5, 4), nn.Linear(4, 2)

    def forward(self, ids, pos_ids):
        return self.head(self.tok(ids) + self.pos(pos_ids)).mean(1)


def test_broadcast_position_ids_are_refused_with_the_expand_hint():
    model, schedule = WithPositions(), StepSchedule()
    engine_for(model, schedule)
    schedule.on_batch(True, True, 3)
    ids, pos = torch.randint(0, 9, (3, 5)), torch.arange(5)[None]
    with pytest.raises(PrivacyError, match=r"layer 'pos'.*shows 1 examples.*expand it"):
        model(ids, pos).sum().backward()


def test_without_a_loader_the_model_inputs_must_agree_on_the_examples():
    model = WithPositions()
    engine_for(model)
    ids, pos = torch.randint(0, 9, (3, 5)), torch.arange(5)[None]
    with pytest.raises(PrivacyError, match=r"dimension 0 disagree.*\(1, L\) → \(B, L\)"):
        model(ids, pos)
    model(ids, pos.expand(3, 5)).sum().backward()


def fgsm(model, x, y, eps=0.1):
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(loss_of(model, x, y), x)
    return (x + eps * gx.sign()).detach()


def test_input_gradient_books_nothing_and_training_on_the_adversarial_batch_is_exact():
    model = MLP()
    engine = engine_for(model)
    x, y = data()
    x_adv = fgsm(model, x, y)  # no no_capture: a backward w.r.t. inputs does not reach parameters
    loss_of(model, x_adv, y).backward()
    sums, examples, _ = pop_step(engine)
    loss_of(model, x_adv, y).backward()
    reference, reference_examples, _ = pop_step(engine)
    assert examples == reference_examples == 4
    for p in sums:
        torch.testing.assert_close(sums[p], reference[p])


@pytest.mark.parametrize("attack_steps", [1, 3])  # FGSM and PGD-3
def test_adversarial_training_through_no_capture_books_the_batch_once(attack_steps):
    model, schedule = MLP(), StepSchedule()
    engine = engine_for(model, schedule)
    x, y = data()
    schedule.on_batch(True, True, 4)
    x_adv = x
    with engine.no_capture():
        for _ in range(attack_steps):
            x_adv = x_adv.clone().requires_grad_(True)
            loss_of(model, x_adv, y).backward(inputs=[x_adv])
            x_adv = (x_adv + 0.05 * x_adv.grad.sign()).detach()
    loss_of(model, x_adv, y).backward()
    sums, examples, _ = pop_step(engine)
    assert examples == 4 and all(p.grad is None for p in model.parameters())
    assert sums and all(torch.isfinite(s).all() for s in sums.values())


def test_the_poisson_loader_records_each_physical_batch_it_hands_out():
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    schedule = StepSchedule()
    loader = from_loader(torch.utils.data.DataLoader(dataset, batch_size=10), SeededSource(3), schedule,
                         max_physical_batch_size=4)
    serials = []
    for x, _ in loader:
        assert schedule.batch_examples == len(x)
        serials.append(schedule.batch_serial)
        schedule.on_step()  # what the optimizer's step() does
    assert serials == list(range(1, len(serials) + 1)) and len(serials) > 4
