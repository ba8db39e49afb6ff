"""``FactoredGrad`` (per-sample gradients ``gᵢ = Σₜ bᵢₜ aᵢₜᵀ`` per channel group) against an explicit
per-example loop: norms by either path, and the clip-weighted sum as one matrix product."""

from __future__ import annotations

import pytest
import torch

from tunefree.rules.factored import FactoredGrad


def explicit(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, G·d_out, d_in]: each example's gradient, group by group, as a plain loop of outer products."""
    batch, groups, positions, _ = a.shape
    rows = []
    for i in range(batch):
        blocks = [sum(torch.outer(b[i, g, t], a[i, g, t]) for t in range(positions)) for g in range(groups)]
        rows.append(torch.cat(blocks))
    return torch.stack(rows)


@pytest.mark.parametrize("groups, positions, d_in, d_out", [
    (1, 1, 5, 3), (1, 4, 3, 7), (2, 3, 4, 2), (3, 5, 2, 6), (2, 40, 3, 3),  # materialised norms
    (2, 2, 6, 8), (2, 2, 8, 6), (1, 3, 16, 16),  # ghost norms
])
def test_factored_grad_matches_explicit_per_example_gradients(groups, positions, d_in, d_out):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, groups, positions, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(6, groups, positions, d_out, generator=g, dtype=torch.float64)
    weights = torch.rand(6, generator=g, dtype=torch.float64)
    shape = torch.Size([groups * d_out, d_in])
    expected = explicit(a, b)
    grad = FactoredGrad(a, b, shape)
    weighted = torch.einsum("b,bij->ij", weights, expected)
    # the sum from the factors (nothing materialised yet), then after the norms chose their path
    torch.testing.assert_close(FactoredGrad(a, b, shape).weighted_sum(weights), weighted)
    torch.testing.assert_close(grad.sq_norms(), expected.flatten(1).pow(2).sum(1))
    torch.testing.assert_close(grad.weighted_sum(weights), weighted)
    torch.testing.assert_close(FactoredGrad(a, b, shape).materialize(), expected)
