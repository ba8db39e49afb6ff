import pytest
import torch
from support.mixing_models import CenterMix, FunctionMix, TimeMajorLinear, fallback_mix, hook_mix
from torch import nn

from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine


def engine_for(model):
    return ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"), "sum")


@pytest.mark.parametrize(("model", "shape"), [(CenterMix(), (4, 3)), (TimeMajorLinear(), (4, 4, 3))])
def test_forward_mixing_is_refused(model, shape):
    x = torch.randn(*shape)
    with pytest.raises(PrivacyError, match="mixes examples"):
        verify_example_independence(model, engine_for(model), (x,), {})


def test_clean_mlp_with_dropout_passes_and_leaves_no_grad():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.LayerNorm(4), nn.Linear(4, 2)).train()
    verify_example_independence(model, engine_for(model), (torch.randn(5, 3),), {})
    assert all(p.grad is None for p in model.parameters())
    assert model.training


def test_backward_mixing_custom_function_is_refused():
    model = FunctionMix()
    with pytest.raises(PrivacyError, match="backward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


def test_transformer_block_and_embedding_pass():
    model = nn.Sequential(nn.Embedding(10, 8),
                          nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)).train()
    model[1].self_attn.dropout = 0.0  # the layer's other dropouts stay: the check replays their draws
    verify_example_independence(model, engine_for(model), (torch.randint(0, 10, (3, 5)),), {})
    assert all(p.grad is None for p in model.parameters())


class IntoFirst(nn.Module):
    """Forward mixing that flows only into example 0: perturbing example 0 alone cannot see it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(torch.cat([h[:1] + h[1:].sum(0, keepdim=True), h[1:]]))


def test_forward_mixing_into_the_first_example_only_is_refused():
    model = IntoFirst()
    changing_3 = r"mixes examples in its forward: changing examples? [0-9, …]*\b3\b"
    with pytest.raises(PrivacyError, match=changing_3):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


class MixIntoLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g[:-1], g[-1:] + g[:-1].sum(0, keepdim=True)])


def test_backward_mixing_into_the_last_example_only_is_refused():
    model = FunctionMix()
    model.forward = lambda x: model.out(MixIntoLast.apply(model.fc(x)))
    with pytest.raises(PrivacyError, match="mixes examples in its backward: .* the gradient of example 3 at"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


def test_mixing_full_backward_hook_is_refused():
    model = hook_mix()
    with pytest.raises(PrivacyError, match="mixes examples in its backward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


def test_mixing_fallback_module_is_refused_by_name():
    model = fallback_mix()
    engine = engine_for(model)
    assert engine.units[1].rule is None  # the mixing module is a fallback unit
    with pytest.raises(PrivacyError, match="module '1' mixes examples in its forward"):
        verify_example_independence(model, engine, (torch.randn(4, 3),), {})


def test_user_forward_hook_that_mixes_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].register_forward_hook(lambda m, i, out: out - out.mean(0))
    with pytest.raises(PrivacyError, match="module '0' mixes examples in its forward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


class SharedTable(nn.Module):
    """A fallback unit handed a shared [T, F] table: not batched, unchanged by any example."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, h, table):
        return (h + table) * self.scale


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.register_buffer("table", torch.randn(5, 4))
        self.block = SharedTable()

    def forward(self, x):
        return self.block(self.fc(x), self.table).mean(1)


@pytest.mark.parametrize("batch", [3, 5], ids=["B!=T", "B==T"])
def test_shared_table_that_no_example_changes_passes(batch):
    model = WithTable()
    verify_example_independence(model, engine_for(model), (torch.randn(batch, 5, 3),), {})


def test_batch_dependent_unbatched_input_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model.forward = lambda x: model[1](model[0](x).mean(0, keepdim=True).expand(2, -1)).mean(0) + 0 * x[:, :2]
    with pytest.raises(PrivacyError, match="module '1' mixes examples in its forward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


def test_rng_state_is_restored():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    x = torch.randn(4, 3)
    state = torch.get_rng_state()
    verify_example_independence(model, engine_for(model), (x,), {})
    assert torch.equal(torch.get_rng_state(), state)


class WeakMix(nn.Module):
    """Mixes the examples with a weight far below float32's resolution of the activations' sum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 64)
        self.out = nn.Linear(64, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h + 1e-6 * h[:, :1].mean(0))


def test_weak_mixing_is_still_refused():
    """The forward check keeps a projection of each example's activations, not the activations: a mixing
    weight of 1e-6 still changes the other examples' projections."""
    model = WeakMix()
    with pytest.raises(PrivacyError, match="module 'out' mixes examples in its forward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3) * 100,), {})


def test_backward_mixing_names_the_example_of_the_whole_batch():
    model = FunctionMix()
    model.forward = lambda x: model.out(MixIntoLast.apply(model.fc(x)))
    with pytest.raises(PrivacyError, match="mixes examples in its backward: .* the gradient of example 9 at"):
        verify_example_independence(model, engine_for(model), (torch.randn(10, 3),), {})


class SharedMaskInput(nn.Module):
    """Takes a shared [T, T] mask as an input: with T == n it looks batched; cutting it breaks the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, mask):
        return self.fc(x) @ mask  # x [n, T], mask [T, T]


def test_gradient_probes_fall_back_to_the_whole_batch_when_a_cut_input_breaks_the_model():
    model = SharedMaskInput()
    engine = engine_for(model)
    verify_example_independence(model, engine, (torch.randn(8, 6), torch.ones(6, 6)), {})
    n_equals_t = (torch.randn(6, 6), torch.tril(torch.ones(6, 6)))  # the cut mask is [4, 6]: matmul fails
    verify_example_independence(model, engine, n_equals_t, {})


def test_probe_pattern_is_built_in_one_buffer():
    # A pattern may be as large as a batch's inputs (the forward probe's change); out of place it held
    # three buffers of its size at once (when the gradient probe weighted GPT's whole output by one, +60 MB
    # on the benchmark's first, checked, step; RESULTS §8.5).
    from torch.profiler import ProfilerActivity, profile

    from tunefree.guards.probe import pattern as _pattern

    like = torch.empty(64, 1000)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pattern = _pattern(like)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert allocated < 1.5 * like.numel() * like.element_size()
    index = torch.arange(like.numel(), dtype=like.dtype)
    assert torch.equal(pattern, torch.cos(index * 0.7 + 0.3).reshape(like.shape))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_probe_pattern_of_a_large_16_bit_tensor_is_finite_and_not_periodic(dtype):
    # float16 cannot hold an index past 65,504 (the pattern was NaN there); bfloat16 rounds indices
    # past 256 (the pattern repeated values): both are computed in float32 and rounded once.
    from tunefree.guards.probe import pattern as _pattern

    like = torch.empty(70_000, dtype=dtype)
    pattern = _pattern(like)
    assert pattern.dtype == dtype and torch.isfinite(pattern).all()
    index = torch.arange(like.numel(), dtype=torch.float32)
    assert torch.equal(pattern, torch.cos(index * 0.7 + 0.3).to(dtype))
