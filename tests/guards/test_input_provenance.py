"""The model trains on the Poisson loader's examples, each input row derived from its own example alone
(issue 21, items 2 and 4): a step on another loader's data, or on a batch mixed before the model, is
refused; per-example augmentation trains, exactly, and leaves no gradient anywhere the user looks."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.neighbour import StepContext, release_of_step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.data.provenance import BatchTensor
from tunefree.guards import inputs
from tunefree.guards.independence import Independence
from tunefree.guards.probe import row_codes

N = 8


def images(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(N, 1, 6, 6, generator=generator), torch.randint(0, 2, (N,), generator=generator)


class Net(nn.Module):
    def __init__(self, size: int = 6):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.head = nn.Linear(2 * (size - 2) ** 2, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def private(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = N, **options):
    options = {"noise_multiplier": 1.0, "target_delta": 1e-3, "seed": 0, **options}
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(TensorDataset(x, y), batch_size=batch_size), **options)


def one_step(transform, model=None, data=None, **options):
    """The first (a checked) step with ``transform(x, y) -> (inputs, y)`` between the loader and the model."""
    model = model or Net()
    x, y = data or images()
    engine = private(model, x, y, **options)
    for xb, yb in engine.data_loader:
        inputs, target = transform(xb, yb)
        engine.optimizer.zero_grad()
        F.cross_entropy(model(inputs), target).backward()
        engine.optimizer.step()
        return engine


# ------------------------------------------------------------------------- the loader's sample, item 4
def test_a_loop_over_the_users_own_loader_is_refused_and_nothing_is_booked():
    torch.manual_seed(0)
    x, y = images()
    model = Net()
    engine = private(model, x, y, batch_size=4)
    own = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    xb, yb = next(iter(own))
    loss = F.cross_entropy(model(xb), yb)
    with pytest.raises(tunefree.PrivacyError, match="do not come from engine.data_loader.*Iterate over "
                                                    "engine.data_loader.*poisson_sampling=False"):
        loss.backward()
    assert engine.optimizer.accumulator.pop().examples == 0
    assert all(p.grad is None for p in model.parameters())


def test_own_data_next_to_the_loaders_batch_is_refused():
    """Iterating the loader is not enough: the model must be given its batch."""
    x, y = images()
    model = Net()
    engine = private(model, x, y)
    for _ in engine.data_loader:
        with pytest.raises(tunefree.PrivacyError, match="do not come from engine.data_loader"):
            F.cross_entropy(model(x), y).backward()
        break


def test_a_batch_kept_from_an_earlier_step_is_refused():
    x, y = images()
    model = Net()
    engine = private(model, x, y, batch_size=4)
    kept = None
    for step, (xb, yb) in enumerate(engine.data_loader):
        kept = kept or (xb, yb)
        engine.optimizer.zero_grad()
        if step == 1:
            with pytest.raises(tunefree.PrivacyError, match=r"computed from batch 1 of engine.data_loader, "
                                                            r"but the loader has since handed out batch 2"):
                F.cross_entropy(model(kept[0]), kept[1]).backward()
            return
        F.cross_entropy(model(xb), yb).backward()
        engine.optimizer.step()


@pytest.mark.slow
def test_poisson_sampling_false_trains_on_the_users_loader_as_an_approximation():
    x, y = images()
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = private(model, x, y, batch_size=4, poisson_sampling=False)
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=4):
        F.cross_entropy(model(xb), yb).backward()
        engine.optimizer.step()
    assert engine.steps == 2 and engine.guarantee().poisson_approximation


def test_physical_micro_batches_each_train_on_their_own_batch():
    x, y = images()
    model = Net()
    engine = private(model, x, y, physical_batch_size=3)
    batches = 0
    for xb, yb in engine.data_loader:
        F.cross_entropy(model(xb), yb).backward()
        engine.optimizer.step()
        batches += 1
        if engine.schedule.ends_logical:
            break
    assert engine.steps == 1 and batches >= 2


# -------------------------------------------------------------------- mixing before the model, item 2
def mixup(x, y):
    return 0.7 * x + 0.3 * x.flip(0), y


def cutmix(x, y):
    x = x.clone()
    x[:, :, :3, :3] = x.flip(0)[:, :, :3, :3]
    return x, y


def centred(x, y):
    return x - x.mean(0), y


def swapped(x, y):
    return x[torch.tensor([1, 0, *range(2, len(x))])], y


def timm_style_in_place(x, y):
    return x.mul_(0.6).add_(x.flip(0).mul_(0.4)), y


def mixed_in_one_pair_only(x, y):
    mixed = x.clone()
    mixed[5] = mixed[5] + 0.01 * x[4]
    return mixed, y


@pytest.mark.parametrize("transform", [mixup, cutmix, centred, swapped, timm_style_in_place,
                                       mixed_in_one_pair_only])
def test_float_inputs_mixed_before_the_model_are_refused(transform):
    with pytest.raises(tunefree.PrivacyError, match=r"model input argument 0 mixes examples before the "
                                                    r"model: row \d of the loader's batch reaches another"):
        one_step(transform)


def test_a_batch_statistic_given_to_the_model_is_refused():
    class WithScale(Net):
        def forward(self, x, scale):
            return super().forward(x / scale)

    x, y = images()
    model = WithScale()
    engine = private(model, x, y)
    xb, yb = next(iter(engine.data_loader))
    with pytest.raises(tunefree.PrivacyError, match=r"model input argument 1 \(shape \(\)\) is computed "
                                                    r"from the loader's batch but has no row per example"):
        F.cross_entropy(model(xb, xb.abs().max()), yb).backward()


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, 50, (N, 10), generator=generator), torch.randint(0, 2, (N,), generator=generator)


@pytest.mark.parametrize("transform", [
    lambda ids: ids[torch.tensor([3, 1, 2, 0, *range(4, N)])],  # two examples' tokens swapped
    lambda ids: torch.cat([ids[:, :4], ids.roll(1, 0)[:, 4:]], 1),  # 6 of 10 tokens of another example
], ids=["swapped-rows", "token-cutmix"])
def test_integer_inputs_holding_another_examples_values_are_refused(transform):
    with pytest.raises(tunefree.PrivacyError, match=r"integer model input argument 0 takes another "
                                                    r"example's values: its row \d holds the values of row"):
        one_step(lambda ids, y: (transform(ids), y), model=Tokens(), data=tokens())


@pytest.mark.parametrize("transform", [
    lambda ids: ids.to(torch.int32).long(),
    lambda ids: F.pad(ids, (0, 3), value=0),  # padding
    lambda ids: ids[:, :-1],  # truncation
    lambda ids: torch.where(torch.rand(ids.shape) < 0.15, torch.zeros_like(ids), ids),  # per-example masking
], ids=["cast", "padding", "truncation", "masking"])
def test_per_example_integer_transforms_train(transform):
    engine = one_step(lambda ids, y: (transform(ids), y), model=Tokens(), data=tokens())
    assert engine.steps == 1


# ------------------------------------------------------------------ per-example augmentation, exactly
def per_example_augmentation(x, y):
    """What docs/refusals.md shows: each example flipped by its own coin, cropped at its own offset after
    padding, cast and normalised by constants."""
    flip = torch.rand(len(x)) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    padded = F.pad(x, (1, 1, 1, 1))
    offsets = torch.randint(0, 3, (len(x), 2))
    x = torch.stack([padded[i, :, a:a + 6, b:b + 6] for i, (a, b) in enumerate(offsets.tolist())])
    return (x.to(torch.float64).float() - 0.5) / 0.25, y


def test_per_example_augmentation_trains_and_its_release_is_exact():
    """A checked step (the first) with the augmentation in the loop releases exactly what the same step
    releases when the augmented batch is the data set (noise 0, Abadi at R = 1, q = 1)."""
    x, y = images()
    torch.manual_seed(1)  # release_of_step seeds 1 before the step: the same coins here
    augmented, _ = per_example_augmentation(x, y)

    def in_the_loop(ctx: StepContext) -> None:
        inputs, target = per_example_augmentation(ctx.x, ctx.y)
        F.cross_entropy(ctx.model(inputs), target, reduction="sum").backward()

    def plain(ctx: StepContext) -> None:
        F.cross_entropy(ctx.model(ctx.x), ctx.y, reduction="sum").backward()

    looped = release_of_step(Net, in_the_loop, x, y, 1.0)
    reference = release_of_step(Net, plain, augmented.detach(), y, 1.0)
    for name in reference:
        torch.testing.assert_close(looped[name], reference[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_the_augmentation_loop_docs_refusals_md_shows_trains(capsys):
    text = (Path(__file__).parents[2] / "docs" / "refusals.md").read_text()
    section = text[text.index("## The model trains on the loader's examples"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/refusals.md", "exec"), namespace)
    assert namespace["engine"].steps == 4 and "-DP after 4 steps" in capsys.readouterr().out


def test_a_checked_step_leaves_no_gradient_where_the_user_looks():
    x, y = images()
    model = Net()
    engine = private(model, x, y)
    for xb, yb in engine.data_loader:
        assert isinstance(xb, BatchTensor) and xb.requires_grad  # the first step is a checked one
        inputs, _ = per_example_augmentation(xb, yb)
        F.cross_entropy(model(inputs), yb).backward()
        assert all(p.grad is None for p in model.parameters())  # only the release writes .grad
        record = engine.schedule.handed_out
        assert all(leaf.grad is None for leaf in record.leaves.values())
        engine.optimizer.step()
        break
    unchecked = private(Net(), x, y, verify_every=10**9)
    unchecked.guards.of(Independence).first_done = True
    unchecked.schedule.checking = False
    xb, yb = next(iter(unchecked.data_loader))
    assert not xb.requires_grad and isinstance(xb, BatchTensor)


def test_the_model_does_not_differentiate_its_inputs_unless_the_loop_asks():
    """On a checked step the check's link to the loader's rows is cut at the model (its backward does not
    differentiate the inputs); gradients the loop asks for reach it as on any step."""
    requires = []

    class Spy(Net):
        def forward(self, x):
            requires.append(x.requires_grad)
            return super().forward(x)

    one_step(lambda x, y: (x * 2, y), model=Spy())
    assert requires[0] is False  # the training call (the check's re-runs follow)

    def fgsm(x, y, model):
        x.requires_grad_(True)  # the handed-out tensor: a copy of a leaf on a checked step
        (g,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)
        return x + 0.1 * g.sign(), y
    model = Net()
    assert one_step(lambda x, y: fgsm(x, y, model), model=model).steps == 1

    shift = torch.zeros(1, 1, 6, 6, requires_grad=True)  # a tensor of the loop's own, trained with it
    one_step(lambda x, y: (x + shift, y))
    assert shift.grad is not None and shift.grad.abs().sum() > 0


def test_the_model_computes_on_plain_tensors():
    seen = []

    class Spy(Net):
        def forward(self, x):
            seen.append(type(x))
            return super().forward(x)

    one_step(lambda x, y: (x.double().float(), y), model=Spy())
    assert seen and set(seen) == {torch.Tensor}  # the training forward and the check's


def test_the_loaders_tensor_as_handed_out_takes_no_vector_jacobian_product(monkeypatch):
    """The loader's float tensor itself, never written, has each row its own example's: the check takes
    no product for it; a tensor computed from it, or the tensor after a write, gets them."""
    products = []
    take = inputs._mixed_row
    monkeypatch.setattr(inputs, "_mixed_row", lambda x, leaves: products.append(x.shape) or take(x, leaves))
    assert one_step(lambda x, y: (x, y)).steps == 1 and not products
    assert one_step(lambda x, y: (x * 1.0, y)).steps == 1 and products

    def written(x, y):
        with torch.no_grad():
            x[0] = x[0]  # a write: the tensor is no longer taken as the loader handed it out
        return x, y
    products.clear()
    assert one_step(written).steps == 1 and products


def test_an_input_computed_without_gradients_is_refused_unless_it_is_the_loaders():
    with pytest.raises(tunefree.PrivacyError, match=r"model input argument 0 was computed from the loader's "
                                                    r"batch without gradients .* x_adv = x \+ \(x_adv - x\)"):
        one_step(lambda x, y: ((x.detach() * 2), y))
    assert one_step(lambda x, y: (x.detach().clone(), y)).steps == 1  # the loader's values: nothing to hide


def pgd(model):
    def transform(x, y):
        x_adv = x.detach().clone()
        for _ in range(2):
            x_adv.requires_grad_(True)
            (g,) = torch.autograd.grad(F.cross_entropy(model(x_adv), y), x_adv)
            x_adv = (x_adv + 0.05 * g.sign()).detach()
        return x_adv, y
    return transform


def test_adversarial_examples_made_without_gradients_keep_the_link_as_the_message_says():
    model = Net()
    with pytest.raises(tunefree.PrivacyError, match="without gradients"):
        one_step(pgd(model), model=model)
    model = Net()
    attack = pgd(model)
    engine = one_step(lambda x, y: (x + (attack(x, y)[0] - x).detach(), y), model=model)
    assert engine.steps == 1


def test_row_codes_separate_every_ordered_pair_of_rows():
    for n in (2, 3, 7, 8, 70, 256):
        codes = row_codes(n)
        assert codes.shape[0] == n and codes.sum(1).unique().numel() == 1
        holds = codes[:, None, :] & ~codes[None, :, :]  # bits row i has and row j has not
        assert (holds.any(-1) | torch.eye(n, dtype=torch.bool)).all()
    assert row_codes(256).shape[1] == 11
