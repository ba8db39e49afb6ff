"""The state guard's fingerprints (``guards/state.py``): packed and large tensors alike give each tensor's
exact 64-bit word sum modulo 2⁶⁴ and its words at the secret positions, and a write through ``.data`` of
one word of any of them is refused, naming it. The pack limits are lowered so that a small model has
tensors of both kinds and several packs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tunefree.errors import PrivacyError
from tunefree.guards import state


@pytest.fixture(autouse=True)
def small_packs(monkeypatch):
    monkeypatch.setattr(state, "_PACKED", 8)  # tensors of more than 8 words are large
    monkeypatch.setattr(state, "_PACK", 16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 5), nn.Linear(5, 4), nn.Conv1d(4, 4, 3))
    model.register_buffer("odd", torch.arange(5, dtype=torch.int8))  # not a whole number of words
    return model


def _brute_force(t: torch.Tensor, positions: list[int]) -> tuple[int, list[int]]:
    raw = t.detach().reshape(-1).view(torch.uint8)
    raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)])
    words = raw.view(torch.int64).tolist()
    return sum(words) % 2**64, [words[q] for q in positions]


def test_every_fingerprint_is_the_word_sum_and_the_secret_words():
    guard = state.StateGuard(_model(), [])
    (group,) = guard._groups
    fingerprints, entries = group.fingerprints, group.entries
    assert fingerprints.large and len(fingerprints.packs) > 1  # both kinds, several packs
    words = fingerprints([e.tensor for e in entries]).tolist()
    for i, entry in enumerate(entries):
        end, before, picks = fingerprints.slots[i]
        total = (words[end] - (words[before] if before is not None else 0)) % 2**64
        assert (total, words[picks:picks + state.POSITIONS]) == _brute_force(entry.tensor, entry.positions)


@pytest.mark.parametrize("name", ["0.weight", "0.bias", "2.weight", "3.weight", "odd"])
def test_a_write_of_one_word_through_data_is_refused_naming_the_tensor(name):
    model = _model()
    guard = state.StateGuard(model, [])
    guard.check("unchanged")
    tensor = dict([*model.named_parameters(), *model.named_buffers()])[name]
    tensor.data.view(-1)[-1] += 1
    with pytest.raises(PrivacyError, match=f"'{name}' was written"):
        guard.check("after the write")
