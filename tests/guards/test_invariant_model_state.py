"""Invariant: the model changes only through the private step.

Between two private steps no parameter, buffer or data-holding attribute of the model may change except
by the optimizer's update from the released gradient (``guards/state.py``). Each case of the zoo
writes the model's state from a batch in an ordinary-looking way — in the forward, in the backward, in
an evaluation forward, through ``.data`` (no version bump), into a number or a list on a module — and is
first shown to be a leak (the state after one plain forward and backward differs between a batch and
its neighbour), then shown refused before anything is released. The multi-step neighbour test states
the invariant itself: after step 1 on a batch B1 or a neighbour B1', with the weights and optimizer
state forced to the same values, step 2 on the same B2 releases the same bits (or the run is refused).
Public writes are declared (``engine.public_writes()``, ``make_private(public_buffers=...)``), and a
value-equal rewrite needs no declaration.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError

N = 6
R = 1.0


def features(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


class Trunk(nn.Module):
    """Linear → tanh, then ``self.mix(h)`` (the case's state), then a Linear head."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.mix(torch.tanh(self.inp(x))))

    def mix(self, h):
        return h


# ---------------------------------------------------------------------------- the zoo of state writes
class EmbeddingMaxNorm(nn.Module):
    """nn.Embedding(max_norm=1.0) renormalises the rows it looks up, in place, in the forward. Frozen here
    (pre-trained embeddings): a trainable one is refused at make_private by its layer rule already."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(12, 8, max_norm=1.0), nn.Linear(8, 3)
        with torch.no_grad():
            self.emb.weight.mul_(10)
        self.emb.weight.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def token_ids(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example has a token of its own (row i) and a shared one (row 10 or 11)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.tensor([i, 10 + i % 2]) for i in range(n)])
    return ids, torch.randint(0, 3, (n,), generator=g)


class InstanceNormStats(nn.Module):
    """InstanceNorm2d(affine=False, track_running_stats=True): per-example normalisation, but running
    statistics averaged over the batch (and a count of forward passes)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.norm = nn.InstanceNorm2d(3, affine=False, track_running_stats=True)
        self.head = nn.Linear(27, 3)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).flatten(1))


def images(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 5, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


class RunningMean(Trunk):
    """A running mean of the activations (a buffer, updated in grad-enabled forwards) subtracted."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mu", torch.zeros(8))

    def mix(self, h):
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * h.mean(0))
        return h - self.mu


class DataWrittenStats(Trunk):
    """A BatchNorm-like user module writing its running variance through ``.data`` (no version bump)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("var", torch.ones(8))

    def mix(self, h):
        self.var.data.mul_(0.9).add_(0.1 * h.detach().var(0))
        return h / self.var.sqrt()


class KeptTensor(Trunk):
    """A tensor kept from one batch for the next as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.prev = None

    def mix(self, h):
        out = h if self.prev is None else h + self.prev
        self.prev = h.detach().mean(0)
        return out


class KeptNumber(Trunk):
    """A Python number computed from the batch (``.item()``) and used to scale the next batch."""

    def __init__(self):
        super().__init__()
        self.peak = 1.0

    def mix(self, h):
        out = h / self.peak
        self.peak = 1.0 + h.detach().abs().mean().item()
        return out


class KeptList(Trunk):
    """A list of batch means appended to in every forward (a history)."""

    def __init__(self):
        super().__init__()
        self.history: list[torch.Tensor] = []

    def mix(self, h):
        self.history.append(h.detach().mean(0))
        return h - torch.stack(self.history).mean(0)


class KeptDict(Trunk):
    """A dict cache holding the last batch's activations."""

    def __init__(self):
        super().__init__()
        self.cache: dict[str, torch.Tensor] = {}

    def mix(self, h):
        out = h + self.cache["h"].mean(0) if "h" in self.cache else h
        self.cache["h"] = h.detach()
        return out


class MemoryBank(Trunk):
    """A frozen parameter (a memory bank) whose first row is overwritten through ``.data`` by the first
    example's activations: a sparse write, with no version bump."""

    def __init__(self):
        super().__init__()
        self.bank = nn.Parameter(torch.zeros(4, 8), requires_grad=False)

    def mix(self, h):
        self.bank.data[0] = h[0].detach()
        return h + self.bank.mean(0)


class BackwardStats(Trunk):
    """A buffer written in the backward pass by a tensor hook: the gradient norm of the activations."""

    def __init__(self):
        super().__init__()
        self.register_buffer("grad_norm", torch.zeros(()))

    def mix(self, h):
        if h.requires_grad:
            h.register_hook(self.record)
        return h * (1 + self.grad_norm)

    def record(self, grad):
        self.grad_norm.copy_(grad.norm())


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], str]] = {
    # name: (model, data, the path the refusal names)
    "embedding-max-norm": (EmbeddingMaxNorm, token_ids, r"parameter 'emb\.weight' was written"),
    "instance-norm-running-stats": (InstanceNormStats, images, r"buffer 'norm\.running_mean' was written"),
    "running-mean-buffer": (RunningMean, features, r"buffer 'mu' was written"),
    "stats-written-through-data": (DataWrittenStats, features, r"buffer 'var' was written"),
    "tensor-kept-as-attribute": (KeptTensor, features, r"attribute 'prev' appeared"),
    "number-kept-as-attribute": (KeptNumber, features, r"attribute 'peak' was set to another value"),
    "list-of-batch-means": (KeptList, features, r"attribute 'history\[0\]' appeared"),
    "dict-cache": (KeptDict, features, r"attribute 'cache\['h'\]' appeared"),
    "frozen-bank-row-written-through-data": (MemoryBank, features, r"parameter 'bank' was written"),
    "buffer-written-in-backward": (BackwardStats, features, r"buffer 'grad_norm' was written"),
}


# ---------------------------------------------------------------------------- helpers
def plain_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict and the tensors, numbers and containers on its modules (a copy)."""
    state: dict[str, Any] = {k: v.clone() for k, v in model.state_dict().items()}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if not name.startswith("_") and isinstance(value, (torch.Tensor, int, float, list, dict)):
                state[f"{prefix}.{name}"] = copy.deepcopy(value)
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return type(a) is type(b) and a == b


def state_after_a_plain_step(factory: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor) -> dict:
    """The state after one forward and backward of plain PyTorch (no tunefree) on (x, y)."""
    torch.manual_seed(0)
    model = factory().train()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    return plain_state(model)


def private(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **options) -> tunefree.DPEngine:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    settings = {"noise_multiplier": 1.0, "steps": 4, "seed": 0, **options}
    return tunefree.make_private(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=len(x)),
                                 target_delta=1e-3, **settings)


def assert_nothing_released(engine: tunefree.DPEngine) -> None:
    assert engine.steps == 0
    assert engine.optimizer.accumulator.pop().examples == 0  # the step's sums were dropped


# ---------------------------------------------------------------------------- the zoo: leaks, refused
@pytest.mark.parametrize("case", list(ZOO))
def test_each_state_write_is_a_leak(case):
    """Without tunefree, the state after one forward and backward depends on which examples the batch
    holds: removing one example changes it (so the case would leak through the published model and
    every later release)."""
    factory, data, _ = ZOO[case]
    x, y = data()
    full = state_after_a_plain_step(factory, x, y)
    assert not same(full, state_after_a_plain_step(factory, x[1:], y[1:]))


@pytest.mark.parametrize("case", list(ZOO))
def test_each_state_write_is_refused_before_anything_is_released(case):
    factory, data, named = ZOO[case]
    x, y = data()
    engine = private(factory(), x, y)
    with pytest.raises(PrivacyError, match=named + r"(.|\n)*nothing of this step is released"):
        train(engine, 1)
    assert_nothing_released(engine)
    with pytest.raises(PrivacyError, match=named):  # and it stays refused
        train(engine, 1)
    assert engine.steps == 0


def test_a_write_in_one_physical_batch_is_refused_at_the_next_ones_forward():
    """Seen at the end of the first micro-batch's backward pass (with its finite check, one read of the
    host), refused when the next one starts."""
    x, y = token_ids(12)
    engine = private(EmbeddingMaxNorm(), x, y, physical_batch_size=4)
    forwards = []
    engine.model.register_forward_pre_hook(lambda module, args: forwards.append(len(args[0])))
    with pytest.raises(PrivacyError, match=r"at the end of a backward pass(.|\n)*emb\.weight"):
        train(engine, 1)
    assert len(forwards) == 2  # the second micro-batch's forward was refused
    assert_nothing_released(engine)


class Calibrated(Trunk):
    """Writes a calibration buffer in evaluation forwards only, and uses it in training."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calibration", torch.zeros(()))

    def mix(self, h):
        if not self.training:
            self.calibration.copy_(h.abs().max())
        return h / (1 + self.calibration)


def test_an_evaluation_forward_that_writes_state_is_refused_at_the_next_training_forward():
    x, y = features()
    model = Calibrated()
    engine = private(model, x, y)
    train(engine, 1)
    model.eval()
    with torch.no_grad():
        model(features(seed=1)[0])
    model.train()
    refusal = r"start of a training forward pass(.|\n)*'calibration' was written"
    with pytest.raises(PrivacyError, match=refusal):
        train(engine, 1)
    assert engine.steps == 1


def test_evaluation_forwards_and_a_weight_swap_undone_need_no_declaration():
    """model.eval()/no_grad forwards that write nothing are fine, and so is a change of the weights
    that is undone before the next step (e.g. evaluating averaged weights): the state compares by value."""
    x, y = features()
    model = Trunk()
    engine = private(model, x, y)
    train(engine, 1)
    model.eval()
    with torch.no_grad():
        model(features(seed=1)[0])
        saved = model.head.weight.clone()
        model.head.weight.add_(1.0)
        model(features(seed=2)[0])
        model.head.weight.copy_(saved)
    model.train()
    train(engine, 2)
    assert engine.steps == 3


@pytest.mark.slow
def test_a_write_in_a_step_components_probe_forward_is_refused_before_the_update():
    """HyFreeDP's probe forwards (no grad, after the release) write a buffer, from the third step on (an
    unchecked one: a forward probe's no-grad forwards would see the write first), of a module that writes
    in no-grad forwards only: refused before the wrapped optimizer's update."""

    class NoGradWrites(Trunk):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(8))
            self.armed = False

        def mix(self, h):
            if self.armed and not torch.is_grad_enabled():
                self.seen.copy_(h.mean(0))
            return h + self.seen

    x, y = features()
    model = NoGradWrites()
    engine = private(model, x, y, lr=tunefree.HyFreeDP(interval=1), noise_multiplier=None,
                     target_epsilon=4.0, verify_every=10**9)  # steps 1 and 2 checked, step 3 not
    for step in range(3):
        xb, yb = next(iter(engine.data_loader))
        engine.optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if step < 2:
            engine.optimizer.step(lambda xb=xb, yb=yb: F.cross_entropy(model(xb), yb, reduction="none"))
    model.armed = True
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyError, match=r"before the optimizer's update(.|\n)*'seen' was written(.|\n)*"
                                           r"already released and recorded, is not applied"):
        engine.optimizer.step(lambda: F.cross_entropy(model(xb), yb, reduction="none"))
    assert engine.steps == 3  # the release is in the ledger
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # no update


# ---------------------------------------------------------------------------- the multi-step neighbour test
def step2_release(factory: Callable[[], nn.Module], first: tuple, second: tuple,
                  reference: nn.Module, **options) -> torch.Tensor | None:
    """Step 1 on ``first``; then the weights and the momentum forced to ``reference``'s (declared public);
    then the release (noise 0, Abadi at R) of step 2 on ``second``, as ``.grad`` × the expected batch
    size, which is the same in every run. ``None`` if the run is refused."""
    torch.manual_seed(0)
    model = factory().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # poisson_sampling=False: the batches are given here
        engine = tunefree.make_private(
            model, optimizer, DataLoader(TensorDataset(*features(N)), batch_size=N), target_delta=1e-3,
            noise_multiplier=0.0, steps=2, clipping="abadi", max_grad_norm=R, loss_reduction="sum",
            seed=0, poisson_sampling=False, **options)
    try:
        for t, (x, y) in enumerate((first, second)):
            if t == 1:
                with engine.public_writes(), torch.no_grad():
                    for p, q in zip(model.parameters(), reference.parameters()):
                        p.copy_(q)
                for p in model.parameters():
                    optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 0.01)
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            engine.optimizer.step()
    except PrivacyError:
        return None
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * engine.plan.expected_batch_size


def second_releases(factory: Callable[[], nn.Module], data: Callable[..., tuple], **options) -> list:
    """Step 2's release after step 1 on B1 and on each neighbour B1∖{j}, on the same B2."""
    (x, y), second = data(N, 0), data(N, 1)
    torch.manual_seed(5)
    reference = factory()
    keep = torch.ones(N, dtype=torch.bool)
    releases = [step2_release(factory, (x, y), second, reference, **options)]
    for j in range(N):
        keep[j] = False
        releases.append(step2_release(factory, (x[keep], y[keep]), second, reference, **options))
        keep[j] = True
    return releases


def assert_a_function_of_the_weights_and_the_batch(releases: list) -> None:
    if releases[0] is None:
        assert all(r is None for r in releases), "refused for some neighbours only"
    else:
        assert all(r is not None and torch.equal(r, releases[0]) for r in releases)


class ConstantBuffer(Trunk):
    """A buffer that is only read (a fixed normalisation)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def mix(self, h):
        return h * self.scale


class RebuiltMask(Trunk):
    """A tensor attribute rebuilt in every forward from the shapes alone (the same values each time)."""

    def __init__(self):
        super().__init__()
        self.mask = torch.ones(8, 8).tril() / 8

    def mix(self, h):
        self.mask = torch.ones(h.shape[1], h.shape[1]).tril() / h.shape[1]
        return h @ self.mask


@pytest.mark.parametrize("case", ["running-mean-buffer", "tensor-kept-as-attribute",
                                  "number-kept-as-attribute", "stats-written-through-data", "constant-buffer",
                                  "rebuilt-mask"])
def test_step_two_releases_the_same_bits_after_any_neighbour_in_step_one(case):
    """The release of step 2 is a function of the public weights and optimizer state and the step-2
    batch only: bit-identical after step 1 on B1 or on any B1∖{j} (the leaking models are refused
    for every neighbour instead; they released 1.6·R at step 2 before the guard)."""
    factory = {"constant-buffer": ConstantBuffer, "rebuilt-mask": RebuiltMask}.get(case) or ZOO[case][0]
    releases = second_releases(factory, features)
    assert_a_function_of_the_weights_and_the_batch(releases)
    assert (releases[0] is None) == (case in ZOO)


# ---------------------------------------------------------------------------- public writes, declared
class RowProjected(Trunk):
    pass


def project_rows(model: nn.Module) -> None:
    """A max-norm projection of the head's rows: a function of the (public) weights only."""
    with torch.no_grad():
        w = model.head.weight
        w.div_(w.norm(dim=1, keepdim=True).clamp(min=0.1) / 0.1)


def test_a_weight_projection_after_the_step_is_declared_with_public_writes():
    x, y = features()
    model = RowProjected()
    engine = private(model, x, y)
    train(engine, 1)
    project_rows(model)
    refusal = r"parameter 'head\.weight' was written(.|\n)*engine\.public_writes"
    with pytest.raises(PrivacyError, match=refusal):
        train(engine, 1)
    assert engine.steps == 1

    model = RowProjected()
    engine = private(model, x, y)
    for _ in range(3):
        train(engine, 1)
        with engine.public_writes():
            project_rows(model)
    assert engine.steps == 3
    assert torch.all(model.head.weight.norm(dim=1) <= 0.1 + 1e-6)


def test_public_writes_cannot_declare_an_earlier_private_write():
    x, y = features()
    model = RunningMean()
    engine = private(model, x, y)
    model(x)  # a training forward writes the running mean from the batch
    refusal = r"on entering engine\.public_writes\(\)(.|\n)*buffer 'mu'"
    with pytest.raises(PrivacyError, match=refusal), engine.public_writes():
        pass
    with pytest.raises(PrivacyError, match="buffer 'mu'"):
        train(engine, 1)
    assert engine.steps == 0


class GrowingTable(nn.Module):
    """Positional features cached in a buffer that is rebuilt, larger, when a longer sequence arrives
    (like a rotary-embedding cache): it depends on the sequence length only."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("table", torch.zeros(0, 4), persistent=False)

    def forward(self, x):
        length = x.shape[1]
        if self.table.shape[0] < length:
            self.table = torch.sin(torch.arange(length)[:, None] * torch.arange(1.0, 5.0))
        return self.head(torch.tanh(self.proj(x) + self.table[:length]).mean(1))


def sequences(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, length, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def train_lengths(public_buffers: tuple[str, ...] = ()) -> tunefree.DPEngine:
    """Three steps on sequences of lengths 3, 5 and 4 (the user's own loop)."""
    model = GrowingTable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = private(model, *sequences(3, 0), poisson_sampling=False, public_buffers=public_buffers)
    for t, length in enumerate((3, 5, 4)):
        x, y = sequences(length, t)
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()
    return engine


def test_a_cache_that_grows_with_the_sequence_length_is_declared_with_public_buffers():
    with pytest.raises(PrivacyError, match=r"buffer 'table' was replaced(.|\n)*public_buffers"):
        train_lengths()
    assert train_lengths(public_buffers=("table",)).steps == 3


@pytest.mark.parametrize("names, error, message", [
    (["nowhere.table"], ValueError, "no module 'nowhere'"),
    (["head.weight"], ValueError, "is a parameter: parameters change only through the private optimizer"),
    (["head"], ValueError, "is a module"),
    ("table", TypeError, "a list of names"),
])
def test_public_buffers_names_are_checked(names, error, message):
    x, y = features()
    with pytest.raises(error, match=re.escape(message)):
        private(Trunk(), x, y, public_buffers=names)


def test_a_resume_loads_the_checkpoints_model_without_a_declaration():
    """model.load_state_dict after make_private, then engine.load_state_dict: the checkpoint's model is the
    state the guard compares with."""
    x, y = features()
    model = Trunk()
    engine = private(model, x, y)
    train(engine, 2)
    saved = {"model": copy.deepcopy(model.state_dict()), "engine": engine.state_dict(),
             "optimizer": engine.optimizer.state_dict()}
    resumed_model = Trunk()
    resumed = private(resumed_model, x, y)
    resumed_model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["engine"])
    train(resumed, 1)
    assert resumed.steps == 3
