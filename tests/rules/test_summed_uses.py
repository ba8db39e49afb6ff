"""A parameter used more than once (tied embedding and head, a block called twice): its per-sample norms
from the uses' own forms and their cross terms, against the materialised sum of the uses' gradients and
against a batch-size-1 loop; and the tied head's [B, vocabulary, d] gradients are never formed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.models import TinyTransformer
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules.base import Materialized
from tunefree.rules.embedding import EmbeddingGrad
from tunefree.rules.factored import FactoredGrad
from tunefree.rules.summed import SummedUses, inner


def _explicit_inner(u, v):
    return (u.materialize() * v.materialize()).flatten(1).sum(1)


def _head_and_embedding(batch=4, positions=5, ids_per_example=6, vocab=13, d=3, padding_idx=2):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(batch, 1, positions, d, generator=g, dtype=torch.float64)
    b = torch.randn(batch, 1, positions, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, ids_per_example), generator=g)
    ids[:, :2] = ids[:, 2:4]  # repeated ids within an example
    ids[0, 0] = padding_idx
    e = torch.randn(batch, ids_per_example, d, generator=g, dtype=torch.float64)
    head = FactoredGrad(a, b, torch.Size([vocab, d]))
    return head, EmbeddingGrad(ids, e, vocab, padding_idx)


def test_a_tied_head_and_embedding_cross_term_reads_only_the_ids():
    head, embedding = _head_and_embedding()
    torch.testing.assert_close(inner(head, embedding), _explicit_inner(head, embedding))
    torch.testing.assert_close(inner(embedding, head), _explicit_inner(head, embedding))


@pytest.mark.parametrize("positions, other, d_in, d_out", [(3, 2, 5, 4), (40, 30, 2, 3)],
                         ids=["gram", "per-sample"])
def test_two_factored_uses_cross_term(positions, other, d_in, d_out):
    g = torch.Generator().manual_seed(1)
    shape = torch.Size([2 * d_out, d_in])
    u = FactoredGrad(torch.randn(4, 2, positions, d_in, generator=g, dtype=torch.float64),
                     torch.randn(4, 2, positions, d_out, generator=g, dtype=torch.float64), shape)
    v = FactoredGrad(torch.randn(4, 2, other, d_in, generator=g, dtype=torch.float64),
                     torch.randn(4, 2, other, d_out, generator=g, dtype=torch.float64), shape)
    torch.testing.assert_close(inner(u, v), _explicit_inner(u, v))


def test_three_uses_of_any_forms_sum_exactly():
    head, embedding = _head_and_embedding()
    g = torch.Generator().manual_seed(2)
    other = Materialized(torch.randn(4, 13, 3, generator=g, dtype=torch.float64))
    summed = SummedUses.join(SummedUses.join(head, embedding), other)
    assert len(summed.uses) == 3
    total = head.materialize() + embedding.materialize() + other.materialize()
    torch.testing.assert_close(summed.sq_norms(), total.flatten(1).pow(2).sum(1))
    weights = torch.rand(4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(summed.weighted_sum(weights), torch.einsum("b,bij->ij", weights, total))
    torch.testing.assert_close(summed.materialize(), total)


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
def test_a_tied_head_is_clipped_without_its_per_sample_gradients(grouping):
    """The step's largest tensor is far smaller than the tied weight's per-sample gradients
    [B, vocabulary, d], and the clipped sums match a batch-size-1 loop."""
    from support.brute_force import clipped_sum, per_example_grads

    batch, vocab, d = 6, 400, 32  # d above the 6 positions: the logits are smaller than [B, V, d]
    model = TinyTransformer(vocab=vocab, d=d).double()
    reference = TinyTransformer(vocab=vocab, d=d).double()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, vocab, (batch, 6))
    y = torch.randint(0, vocab, (batch,))
    engine = ClippingEngine(model, make_groups(model, grouping, 1.0), clip_function("auto-s"))
    with _LargestOutput() as mode:
        F.cross_entropy(model(ids), y).backward()
    sums, examples, norms = pop_step(engine)
    assert mode.largest < batch * vocab * d / 4
    groups, ref_groups = make_groups(model, grouping, 1.0), make_groups(reference, grouping, 1.0)
    expected, expected_norms = clipped_sum(per_example_grads(reference, F.cross_entropy, ids, y), ref_groups,
                                           clip_function("auto-s"))
    for group, ref_group in zip(groups, ref_groups):
        torch.testing.assert_close(norms[group.name], expected_norms[ref_group.name], rtol=1e-7, atol=1e-10)
        for p, ref_p in zip(group.params, ref_group.params):
            torch.testing.assert_close(sums[p], expected[ref_p], rtol=1e-7, atol=1e-10)
    assert isinstance(model.head, nn.Linear) and model.head.weight is model.tokens.weight
