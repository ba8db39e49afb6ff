"""Under bfloat16 autocast the engine keeps the layers' output gradients in bfloat16 (half the memory of
float32) for the rules that take them (``LayerRule.takes_16_bit_grads``); the rules convert them where
they compute. The clipped sums and norms are bit for bit those of converting every output gradient to
float32 on arrival, and the memory held through the backward pass drops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.memory import Allocations
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules import RULES
from tunefree.rules.linear import LinearRule
from tunefree.rules.paths import PathChooser

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, WIDTH = 23, 16


class Zoo(nn.Module):
    """Every rule that keeps 16-bit gradients: an embedding (with a padding id) tied to the output head,
    LayerNorm, nn.Linear, HF Conv1D, Conv1d, GroupNorm, RMSNorm."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), Conv1D(WIDTH, 4 * WIDTH)
        self.conv, self.group = nn.Conv1d(WIDTH, WIDTH, 3, padding=1), nn.GroupNorm(4, WIDTH)
        self.rms = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids):
        h = self.tokens(ids)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        h = h + self.group(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(self.rms(h))


def _booked(groups: str, path: str | None, keep: bool, monkeypatch) -> tuple[dict, dict]:
    for rule in RULES:
        monkeypatch.setattr(type(rule), "takes_16_bit_grads", keep and type(rule).takes_16_bit_grads)
    torch.manual_seed(0)
    model = Zoo()
    ids = torch.randint(0, VOCAB, (6, 9), generator=torch.Generator().manual_seed(1))
    engine = ClippingEngine(model, make_groups(model, groups, 0.5), clip_function("abadi"),
                            loss_reduction="sum", path_chooser=PathChooser(measure=False, fixed=path))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16  # the layers ran in bfloat16: their gradients arrive so
    F.cross_entropy(logits.float().flatten(0, 1), ids.flatten(), reduction="sum").backward()
    sums, _, norms = pop_step(engine)
    engine.detach()
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: s for p, s in sums.items()}, norms


@pytest.mark.parametrize("groups", ["all-layer", "per-layer"])
@pytest.mark.parametrize("path", [None, "ghost", "materialise"])
def test_16_bit_gradients_give_the_same_sums_and_norms_bit_for_bit(groups, path, monkeypatch):
    kept = _booked(groups, path, True, monkeypatch)
    converted = _booked(groups, path, False, monkeypatch)
    assert kept[0].keys() == converted[0].keys() and len(kept[0]) == 12
    for name, total in kept[0].items():
        assert total.dtype == torch.float32
        assert torch.equal(total, converted[0][name]), name
    for name, norms in kept[1].items():
        assert torch.equal(norms, converted[1][name]), name


class Stack(nn.Module):
    def __init__(self, layers: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _backward_peak(keep: bool, monkeypatch) -> int:
    monkeypatch.setattr(LinearRule, "takes_16_bit_grads", keep)
    torch.manual_seed(0)
    model = Stack()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("abadi"),
                            loss_reduction="sum", path_chooser=PathChooser(measure=False, fixed="ghost"))
    x = torch.randn(32, 32, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().sum()
    with Allocations() as tracker:
        loss.backward()
    engine.detach()
    return tracker.peak


def test_all_layer_clipping_holds_the_output_gradients_in_16_bits(monkeypatch):
    """All-layer clipping keeps every layer's output gradient until the end of the backward pass: 32 × 32
    × 256 values per layer, 6 layers; kept in bfloat16 they take 2 bytes each instead of 4."""
    held_in_float32 = 6 * 32 * 32 * 256 * 4
    kept, converted = _backward_peak(True, monkeypatch), _backward_peak(False, monkeypatch)
    assert converted - kept >= 0.4 * held_in_float32, (kept, converted)


@pytest.mark.parametrize("layer", ["hf-conv1d", "linear"])
def test_a_16_bit_input_never_rounds_a_clipped_sum_to_16_bits(layer):
    """One example, AUTO-V at R = 1: its clipped gradient has norm exactly R up to float32 rounding. The
    HF Conv1D rule used to form its weighted sum in the input's dtype: under bfloat16 autocast (GPT-2's
    attention and MLP output projections) the clip weight and the sum were rounded to 8 bits, and an
    example's contribution reached 1.0027·R."""
    worst = 0.0
    for seed in range(20):
        torch.manual_seed(seed)
        module = Conv1D(24, 16) if layer == "hf-conv1d" else nn.Linear(16, 24)
        engine = ClippingEngine(module, make_groups(module, "per-layer", 1.0), clip_function("auto-v"),
                                loss_reduction="sum")
        x = torch.randn(1, 5, 16).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        (out.float() * torch.randn(out.shape)).sum().backward()
        sums, _, _ = pop_step(engine)
        engine.detach()
        assert all(s.dtype == torch.float32 for s in sums.values())
        worst = max(worst, float(torch.sqrt(sum((s.double() ** 2).sum() for s in sums.values()))) - 1)
    assert worst < 1e-6
