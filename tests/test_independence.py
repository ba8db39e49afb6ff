import pytest
import torch
from torch import nn

from tunefree.clipping import ClipFunction
from tunefree.engine import ClippingEngine
from tunefree.errors import PrivacyError
from tunefree.grouping import make_groups
from tunefree.independence import verify_example_independence


class CenterMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h - h.mean(0))


class TimeMajor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # x [B, T, F] is treated as [T, B, F] by a mean over dim 1
        return self.fc(x.transpose(0, 1)).mean(1)


def engine_for(model):
    return ClippingEngine(model, make_groups(model, "all-layer", 1.0), ClipFunction("abadi"), "sum")


@pytest.mark.parametrize(("model", "shape"), [(CenterMix(), (4, 3)), (TimeMajor(), (4, 4, 3))])
def test_forward_mixing_is_refused(model, shape):
    x = torch.randn(*shape)
    with pytest.raises(PrivacyError, match="mixes examples"):
        verify_example_independence(model, engine_for(model), (x,), {})


def test_clean_mlp_with_dropout_passes_and_leaves_no_grad():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.LayerNorm(4), nn.Linear(4, 2)).train()
    verify_example_independence(model, engine_for(model), (torch.randn(5, 3),), {})
    assert all(p.grad is None for p in model.parameters())
    assert model.training


class MixGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True)


class BackwardMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(MixGrad.apply(self.fc(x)))


def test_backward_mixing_custom_function_is_refused():
    model = BackwardMix()
    with pytest.raises(PrivacyError, match="backward"):
        verify_example_independence(model, engine_for(model), (torch.randn(4, 3),), {})


def test_transformer_block_and_embedding_pass():
    model = nn.Sequential(nn.Embedding(10, 8),
                          nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)).train()
    verify_example_independence(model, engine_for(model), (torch.randint(0, 10, (3, 5)),), {})
    assert all(p.grad is None for p in model.parameters())
