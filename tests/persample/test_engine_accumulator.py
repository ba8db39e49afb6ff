"""StepAccumulator: a step's bookings, popped once."""

from __future__ import annotations

import torch
from torch import nn

from tunefree.persample.accumulator import StepAccumulator


def test_bookings_add_up_and_pop_starts_a_new_step():
    p = nn.Parameter(torch.zeros(2, 3))
    acc = StepAccumulator()
    assert acc.book_batch(1) and not acc.book_batch(1) and acc.book_batch(2)
    acc.add(p, torch.ones(6))
    acc.add(p, 2 * torch.ones(6))
    acc.add_examples(3)
    acc.add_examples(4)
    acc.add_norms("all", torch.tensor([1.0, 2.0]))
    acc.add_norms("all", torch.tensor([3.0]))
    result = acc.pop()
    torch.testing.assert_close(result.sums[p], torch.full((2, 3), 3.0))
    assert result.examples == 7
    torch.testing.assert_close(result.group_norms["all"], torch.tensor([1.0, 2.0, 3.0]))
    empty = acc.pop()
    assert empty.sums == {} and empty.examples == 0 and empty.group_norms == {}
    assert acc.book_batch(1)  # a new step may book batch 1 again
