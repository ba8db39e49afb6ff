"""The loss, watched by behaviour (``guards/loss.py``): a loss the training loop writes in which one
example's output gradient depends on another example is refused before the first release, whatever its
code; every loss that sums per-example losses trains as before, exactly.

The mixing losses are ordinary code (contrastive learning, metric learning, hard-example mining, batch
statistics in a target or a temperature); each moves a release by more than R when it is not refused
(1.01–2.2·R by the neighbour test in ``support/neighbour.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.neighbour import neighbour_distance_of_step
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError

R = 1.0


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


# ------------------------------------------------------------------------- losses that mix examples
def info_nce(model, x, y):
    z = F.normalize(model(x), dim=1)
    return F.cross_entropy(z @ z.T / 0.5, torch.arange(len(z)), reduction="sum")


def pairwise_margin(model, x, y):
    out = model(x)
    same = (y[:, None] == y[None]).float()
    distance = torch.cdist(out, out)
    return (same * distance - (1 - same) * distance.clamp(max=2)).sum()


def targets_standardised_by_the_batch(model, x, y):
    target = F.one_hot(y, 3).float()
    target = (target - target.mean(0)) / (target.std(0) + 1)
    return F.mse_loss(model(x), target, reduction="sum")


def label_smoothing_from_the_batch(model, x, y):
    target = F.one_hot(y, 3).float()
    target = 0.9 * target + 0.1 * target.mean(0)
    return -(target * F.log_softmax(model(x), 1)).sum()


def hard_example_mining(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none").topk(min(5, len(x))).values.sum()


def weights_from_the_batch_largest_loss(model, x, y):
    losses = F.cross_entropy(model(x), y, reduction="none")
    return (losses * (losses.detach() / losses.detach().max())).sum()


def temperature_from_the_batch(model, x, y):
    out = model(x)
    return F.cross_entropy(out / (out.detach().std() + 1), y, reduction="sum")


def token_mean_over_the_batch(model, x, y):
    labels = torch.where(y == 0, torch.full_like(y, -100), y)  # some examples carry no label
    losses = F.cross_entropy(model(x), labels, reduction="none", ignore_index=-100)
    return losses.sum() / (labels != -100).sum() * len(x)  # each weighed by the batch's labelled count


MIXING = [info_nce, pairwise_margin, targets_standardised_by_the_batch, label_smoothing_from_the_batch,
          hard_example_mining, weights_from_the_batch_largest_loss, temperature_from_the_batch,
          token_mean_over_the_batch]


def _private(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "sum", **settings
             ) -> tunefree.DPEngine:
    """A private run of ``model`` on (x, y): Poisson batches of 16 expected, a summed loss, seeded."""
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
                                 target_delta=1e-3, steps=4, seed=0, loss_reduction=reduction, **settings)


def _step(loss_fn):
    def step(ctx):
        loss_fn(ctx.model, ctx.x, ctx.y).backward()
    return step


@pytest.mark.parametrize("loss_fn", MIXING, ids=[f.__name__ for f in MIXING])
def test_a_loss_that_mixes_examples_is_refused_before_the_first_release(loss_fn):
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(32)
    engine = _private(model, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyError, match="the training loss mixes examples"):
        train(engine, 4, loss=loss_fn)
    assert engine.steps == 0
    assert engine.optimizer.accumulator.pop().examples == 0  # the step's sums were dropped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_without_the_check_these_losses_move_a_release_by_more_than_r(monkeypatch):
    """The cases are leaks: with the loss check's replays switched off, one example moves the release of
    a step by more than R (the neighbour test; noise 0, Abadi clipping at R). The token mean is left out:
    it scales every example's loss by a factor of the batch, which clipping at this R hides (every
    gradient here is above R) and a larger R does not."""
    from tunefree.guards import loss as loss_guard
    monkeypatch.setattr(loss_guard, "_check", lambda *args: [])
    x, y = _data()
    distances = {f.__name__: neighbour_distance_of_step(_mlp, _step(f), x, y, R)
                 for f in MIXING if f is not token_mean_over_the_batch}
    assert all(d > 1.005 * R for d in distances.values()), distances


# ------------------------------------------------------------------------------ losses that do not
def cross_entropy_sum(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def label_smoothing(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum", label_smoothing=0.1)


def focal(model, x, y):
    log_p = F.log_softmax(model(x), 1).gather(1, y[:, None]).squeeze(1)
    return (-(1 - log_p.exp()) ** 2 * log_p).sum()


def class_weights_and_a_mask_written_in_place(model, x, y):
    losses = F.cross_entropy(model(x), y, reduction="none") * torch.tensor([1.0, 2.0, 0.5])[y]
    losses[y == 2] *= 0.5
    return losses.sum()


def one_loss_per_example_in_a_loop(model, x, y):
    out = model(x)
    return sum(F.cross_entropy(out[i:i + 1], y[i:i + 1], reduction="sum") for i in range(len(out)))


def logged_between_forward_and_backward(model, x, y):
    out = model(x)
    accuracy = (out.argmax(1) == y).float().mean().item()  # the loop's own logging, outside the release
    loss = F.cross_entropy(out, y, reduction="sum")
    assert 0.0 <= accuracy <= 1.0 and loss.item() > 0
    return loss


def under_bf16_autocast(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x).float(), y, reduction="sum")


PER_EXAMPLE = [cross_entropy_sum, label_smoothing, focal, class_weights_and_a_mask_written_in_place,
               one_loss_per_example_in_a_loop, logged_between_forward_and_backward, under_bf16_autocast]


@pytest.mark.parametrize("loss_fn", PER_EXAMPLE, ids=[f.__name__ for f in PER_EXAMPLE])
def test_a_sum_of_per_example_losses_trains_within_r(loss_fn):
    x, y = _data()
    assert neighbour_distance_of_step(_mlp, _step(loss_fn), x, y, R) <= R * (1 + 1e-6)


def test_the_backward_call_can_be_the_functional_one_with_a_gradient():
    x, y = _data()

    def step(ctx):
        losses = F.cross_entropy(ctx.model(ctx.x), ctx.y, reduction="none")
        torch.autograd.backward([losses], [torch.ones_like(losses)])
    assert neighbour_distance_of_step(_mlp, step, x, y, R) <= R * (1 + 1e-6)


def test_a_loss_reading_state_it_updates_in_place_is_refused():
    """A running mean of the outputs kept by the loop and updated in place after it was read: the loss of
    a step then depends on earlier batches, and the replay, which reads the updated tensor, tells."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(32)
    running = torch.zeros(3)

    def loss_fn(m, xb, yb):
        out = m(xb)
        loss = ((out - running) ** 2).sum()
        running.mul_(0.9).add_(0.1 * out.detach().mean(0))
        return loss
    engine = _private(model, x, y)
    with pytest.raises(PrivacyError, match="the loss could not be recomputed"):
        train(engine, 4, loss=loss_fn)
    assert engine.steps == 0


def test_only_checked_steps_are_replayed_and_the_loop_runs_unwatched_after_them():
    """After the first (checked) step, with checks switched off for later steps, a mixing loss is not
    replayed (the check runs on the steps the schedule draws, like the independence check), and no
    recorder stays on torch's stack of function modes once the step is over."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(64)
    engine = _private(model, x, y, verify_every=10**9)
    assert train(engine, 1, loss=cross_entropy_sum) == 1
    assert torch._C._len_torch_function_stack() == 0
    assert train(engine, 2, loss=info_nce) == 2  # unchecked steps (documented detection: 1/verify_every)


def test_work_inside_no_capture_between_hand_out_and_loss_is_not_recorded(monkeypatch):
    """The refusal for a loop too long to replay points at ``engine.no_capture()``: operations inside it
    (an adversarial example, an evaluation) are not recorded, so they neither count nor are replayed."""
    from tunefree.guards import loss as loss_guard
    monkeypatch.setattr(loss_guard, "MAX_RECORDED", 40)
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(32)
    engine = _private(model, x, y, verify_every=1)

    def busy(lines):
        def loss_fn(m, xb, yb):
            scratch = torch.zeros(3)
            for _ in range(lines):
                scratch = scratch + 1.0
            return cross_entropy_sum(m, xb, yb) + 0 * scratch.sum()
        return loss_fn

    def quiet(m, xb, yb):
        with engine.clipper.no_capture():
            busy(60)(m, xb, yb)  # 60 operations, not recorded
        return cross_entropy_sum(m, xb, yb)
    assert train(engine, 1, loss=quiet) == 1
    with pytest.raises(PrivacyError, match="more than 40 torch operations"):
        train(engine, 1, loss=busy(60))


def test_what_the_replay_cannot_follow_is_a_number_that_left_torch():
    """A batch statistic taken out of torch (``.item()``) and used as a constant is replayed as that
    constant: the check passes such a loss (docs/refusals.md lists it). Kept as a test so that the day the
    replay follows it, the documentation changes with it."""
    x, y = _data()

    def temperature_as_a_number(ctx):
        out = ctx.model(ctx.x)
        F.cross_entropy(out / (1 + out.detach().std().item()), ctx.y, reduction="sum").backward()

    def temperature_as_a_tensor(ctx):
        out = ctx.model(ctx.x)
        F.cross_entropy(out / (1 + out.detach().std()), ctx.y, reduction="sum").backward()
    neighbour_distance_of_step(_mlp, temperature_as_a_number, x, y, R)  # not refused
    with pytest.raises(PrivacyError, match="the training loss mixes examples"):
        neighbour_distance_of_step(_mlp, temperature_as_a_tensor, x, y, R)


# ---------------------------------------------------------- the declared reduction (the doubled batch)
def sum_over_len(model, x, y):  # a mean written with the batch's size as a Python number
    return F.cross_entropy(model(x), y, reduction="sum") / len(y)


def dropout_on_the_outputs(model, x, y):  # a loss that draws random numbers
    return F.cross_entropy(F.dropout(model(x), 0.5), y, reduction="sum")


def test_a_sum_declared_as_a_mean_is_refused_at_the_first_step():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(32)
    engine = _private(model, x, y, reduction="mean")
    with pytest.raises(PrivacyError, match="not as loss_reduction='mean' says"):
        train(engine, 1, loss=cross_entropy_sum)
    assert engine.steps == 0


def test_a_mean_over_the_batch_size_as_a_python_number_is_seen_as_a_constant():
    """The replay keeps a number that left torch as it was: ``sum / len(y)`` replays as ``sum / 16`` on
    twice the rows. Declared as a sum, a constant divisor is what it looks like, and trains — the batch's
    size reaches each example's weight unseen (docs/refusals.md, "What tunefree cannot detect"; measured
    below). The refusal's message names ``.mean()`` for the other declaration."""
    torch.manual_seed(0)
    x, y = _data(32)
    assert train(_private(_mlp(), x, y), 2, loss=sum_over_len) == 2


def test_a_loss_that_draws_random_numbers_is_not_judged_on_the_doubled_batch():
    torch.manual_seed(0)
    x, y = _data(32)
    assert train(_private(_mlp(), x, y), 2, loss=dropout_on_the_outputs) == 2
