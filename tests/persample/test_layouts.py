"""Issue 22 through the public API: the batch dimension declared once (``make_private(batch_dim=...)``),
recurrent initial states from the loader, and refusals that tell the truth.

Each exact case runs one private step (noise 0, Abadi clipping at R over one all-layer group, SGD(lr=1),
sampling rate 1, loss sum), so the update is the released clipped sum, and compares it with a
batch-size-1 autograd loop over the same examples; the independence check runs before the release.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine

R = 0.5


def private_update(model, dataset, loss_fn, collate_fn=None, **options):
    """The released clipped sum of one step over the whole data set, by parameter name."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(dataset, batch_size=len(dataset), collate_fn=collate_fn)
    engine = tunefree.make_private(model, optimizer, loader, target_delta=1e-3, noise_multiplier=0.0, steps=1,
                                   clipping="abadi", max_grad_norm=R, loss_reduction="sum", seed=0, **options)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for batch in engine.data_loader:
        engine.optimizer.zero_grad()
        loss_fn(model, *batch).backward()
        engine.optimizer.step()
    engine.clipper.detach()
    return {n: (before[n] - p.detach()) * len(dataset) for n, p in model.named_parameters()}


def brute_force_update(model, examples, loss_fn):
    """Σ over examples of each one's gradient (from the model run on it alone), clipped at R."""
    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for example in examples:
        grads = torch.autograd.grad(loss_fn(model, *example), list(model.parameters()))
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        weight = clip_function("abadi").weights(norm.reshape(1), R)[0]
        for n, g in zip(names, grads):
            total[n] += weight * g
    return total


def assert_same(got, want):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------- time-major, declared
class TimeMajorNet(nn.Module):
    """Every layer on time-major tensors [T, B, …]: an embedding, a layer norm, attention (its own
    batch_first=False) and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):  # ids [T, B]
        h = self.norm(self.embed(ids))
        h = self.attn(h, h, h, key_padding_mask=(ids == 0).T, need_weights=False)[0]
        return self.head(h).mean(0)  # [B, 3]


def time_major(batch):
    ids, y = torch.utils.data.default_collate(batch)
    return ids.T.contiguous(), y


def test_time_major_model_declared_with_batch_dim_matches_brute_force():
    torch.manual_seed(0)
    ids = torch.randint(1, 9, (5, 4))
    ids[1, 3] = ids[3, 2] = 0  # padded positions: the key padding mask is built inside the model
    y = torch.randint(0, 3, (5,))
    model = TimeMajorNet().double()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(m, x, t):
        return F.cross_entropy(m(x), t, reduction="sum")
    got = private_update(model, TensorDataset(ids, y), loss, collate_fn=time_major, batch_dim=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reference[n])
    want = brute_force_update(model, [(ids[i:i + 1].T, y[i:i + 1]) for i in range(5)], loss)
    assert_same(got, want)


def test_time_major_model_without_the_declaration_is_refused_with_it():
    torch.manual_seed(0)
    ids, y = torch.randint(1, 9, (5, 4)), torch.randint(0, 3, (5,))

    def loss(m, x, t):
        return F.cross_entropy(m(x), t, reduction="sum")
    with pytest.raises(tunefree.PrivacyError, match=r"batch_dim=\{'\w+': 1\}"):
        private_update(TimeMajorNet().double(), TensorDataset(ids, y), loss, collate_fn=time_major)


# ------------------------------------------------------------------ recurrent state from the loader
class WithInitialState(nn.Module):
    """An LSTM whose initial state is part of each example ([B, layers, H] from the loader)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2)
        self.head = nn.Linear(4, 2)

    def forward(self, x, h0):
        h0 = h0.transpose(0, 1).contiguous()
        out, _ = self.lstm(x.transpose(0, 1), (h0, torch.tanh(h0)))
        return self.head(out[-1])


def test_recurrent_initial_state_from_the_loader_matches_brute_force():
    """The independence check read h0 [layers, B, H] along dimension 0 and refused ("mixes examples")."""
    torch.manual_seed(1)
    x, h0, y = torch.randn(5, 4, 3), torch.randn(5, 2, 4), torch.randint(0, 2, (5,))
    model = WithInitialState().double()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(m, x, h, t):
        return F.cross_entropy(m(x.double(), h.double()), t, reduction="sum")
    got = private_update(model, TensorDataset(x, h0, y), loss)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    want = brute_force_update(model, [(x[i:i + 1], h0[i:i + 1], y[i:i + 1]) for i in range(5)], loss)
    assert_same(got, want)


# --------------------------------------------------------------------------------------- the declaration
def test_batch_dim_is_validated():
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4)
    common = dict(target_delta=1e-3, noise_multiplier=1.0, steps=1)
    with pytest.raises(ValueError, match="batch_dim names 'encoder', which is not a module"):
        tunefree.make_private(model, optimizer, loader, batch_dim={"encoder": 1}, **common)
    with pytest.raises(TypeError, match="batch_dim must be an int"):
        tunefree.make_private(model, optimizer, loader, batch_dim="time", **common)
    with pytest.raises(ValueError, match="dimensions ≥ 0"):
        tunefree.make_private(model, optimizer, loader, batch_dim=-1, **common)
    assert not model[0]._forward_hooks, "a refused declaration leaves the model as it was given"


@pytest.mark.parametrize(("layer", "declared"), [(nn.LSTM(3, 4), 0), (nn.Conv1d(3, 4, 2), 1),
                                                  (nn.MultiheadAttention(4, 2, batch_first=True), 1)])
def test_declaring_a_dimension_a_layer_type_fixes_otherwise_is_refused(layer, declared):
    model = nn.ModuleDict({"layer": layer})
    message = f"batch_dim declares dimension {declared} for 'layer'.*drop the entry"
    with pytest.raises(ValueError, match=message):
        ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum",
                       batch_dim={"layer": declared})


# ----------------------------------------------------------------------------------- refusals that tell
def test_frozen_parameter_in_the_optimizer_is_named_as_frozen():
    """It was told "build it from model.parameters()", which is what was done."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4)
    with pytest.raises(ValueError, match=r"parameters \['0.bias'\] that are frozen \(requires_grad=False\).*"
                                         r"p.requires_grad"):
        tunefree.make_private(model, optimizer, loader, target_delta=1e-3, noise_multiplier=1.0, steps=1)
    trainable = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    # the fix the message gives is accepted
    tunefree.make_private(model, trainable, loader, target_delta=1e-3, noise_multiplier=1.0, steps=1)


class Picky(nn.Module):
    """A custom module whose forward asserts on the batch it is given (a plain AssertionError)."""

    def __init__(self, error: type[Exception]):
        super().__init__()
        self.scale, self.error = nn.Parameter(torch.ones(3)), error

    def forward(self, x):
        if x.shape[0] != 4:
            raise self.error(f"expected a batch of 4, got {x.shape[0]}")
        return x * self.scale


@pytest.mark.parametrize("error", [AssertionError, KeyError, TypeError])
def test_any_exception_of_the_fallback_is_refused_with_the_layer_and_its_cause(error):
    model = nn.Sequential(nn.Linear(3, 3), Picky(error))
    ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum")
    with pytest.raises(tunefree.PrivacyError, match=r"layer '1' \(Picky\) has no layer rule.*"
                                                    rf"{error.__name__}.*expected a batch of 4") as refused:
        model(torch.randn(4, 3)).sum().backward()
    assert isinstance(refused.value.__cause__, error)


# -------------------------------------------------------------------------- the check reads each layout
class WrongLayout(nn.Module):
    """Hands a batch_first=True LSTM a time-major sequence (T == B, so the counts agree)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x):
        return self.lstm(x.transpose(0, 1))[0].transpose(0, 1)


def test_independence_check_names_the_layer_and_the_dimension():
    model = WrongLayout()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum")
    message = (r"module 'lstm' mixes examples in its forward.*input 0 \(shape \(4, 4, 3\), read with its "
               r"examples in dimension 0\).*changed only rows? [\d, ]+ of dimension 1.*batch_first=False")
    with pytest.raises(tunefree.PrivacyError, match=message):
        verify_example_independence(model, engine, (torch.randn(4, 4, 3),), {})


def test_independence_check_reads_initial_states_in_dimension_1():
    model = WithInitialState()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum")
    verify_example_independence(model, engine, (torch.randn(5, 4, 3), torch.randn(5, 2, 4)), {})


class BatchFirstLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # x [B, T, 3], batch-first all along
        return torch.tanh(self.fc(x))


def test_a_wrong_declaration_is_refused_never_trusted():
    """Declaring time-major for a batch-first layer: by the count when T ≠ B, by the check when T == B."""
    def declared_engine(model):
        return ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum",
                              batch_dim={"fc": 1})
    model = BatchFirstLinear()
    engine = declared_engine(model)
    with pytest.raises(tunefree.PrivacyError, match=r"'fc'.*shows 5 examples in dimension 1.*holds 4.*"
                                                    r"batch_dim=\{'fc': 0\}"):
        model(torch.randn(4, 5, 3)).sum().backward()
    engine.detach()
    engine = declared_engine(model)
    x = torch.randn(4, 4, 3)  # T == B: the counts agree, the examples do not
    model(x).sum().backward()
    pop_step(engine)
    message = (r"module 'fc' mixes examples in its forward.*dimension 1\).*changed only rows? [\d, ]+ of "
               r"dimension 0.*batch_dim=\{'fc': 0\}")
    with pytest.raises(tunefree.PrivacyError, match=message):
        verify_example_independence(model, engine, (x,), {})
