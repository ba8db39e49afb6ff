"""The Poisson loader's fast path for in-memory tensor data sets hands out exactly the generic path's
batches (same examples, same order, same tensors, same physical cuts, empty batches included)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from tunefree.data.poisson import StepSchedule, from_loader
from tunefree.privacy.randomness import SeededSource


class SameTensorDataset(TensorDataset):
    """A TensorDataset whose ``__getitem__`` is overridden (identically): the loader must take the
    generic path, one ``__getitem__`` per example."""

    def __getitem__(self, index):
        return super().__getitem__(index)


def tensors(n=30):
    g = torch.Generator().manual_seed(1)
    return (torch.arange(n), torch.randn(n, 3, 2, generator=g), torch.randint(0, 5, (n,), generator=g),
            torch.randn(n, 4, generator=g).double())


def batches(dataset, seed, batch_size, physical=None, epochs=3, **loader_kwargs):
    """Every batch of ``epochs`` passes with each one's place in its logical batch."""
    schedule = StepSchedule()
    loader = from_loader(DataLoader(dataset, batch_size=batch_size, **loader_kwargs), SeededSource(seed),
                         schedule, max_physical_batch_size=physical)
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append((batch, schedule.ends_logical, schedule.batch_examples))
            schedule.on_step()
    return loader, out


def test_a_tensor_dataset_is_gathered_in_one_index_with_the_generic_paths_batches():
    data = tensors()
    for batch_size, physical in ((3, None), (12, 5), (1, None)):  # batch 1 of 30: most steps are empty
        fast_loader, fast = batches(TensorDataset(*data), 7, batch_size, physical)
        slow_loader, slow = batches(SameTensorDataset(*data), 7, batch_size, physical)
        assert fast_loader.gathers and not slow_loader.gathers
        assert len(fast) == len(slow) > 0
        if batch_size == 1:
            assert any(examples == 0 for _, _, examples in fast)  # empty batches are covered
        for (a, a_ends, a_n), (b, b_ends, b_n) in zip(fast, slow):
            assert type(a) is type(b) is list and len(a) == len(b) == 4
            assert (a_ends, a_n) == (b_ends, b_n) and len(a[0]) == a_n
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_the_gathered_indices_are_the_steps_poisson_sample_in_order():
    data = tensors(50)
    randomness = SeededSource(11)
    _, out = batches(TensorDataset(*data), 11, 10, epochs=1)
    for step, (batch, _, _) in enumerate(out):
        expected = torch.nonzero(randomness.inclusion(step, 50, 10 / 50)).flatten()
        assert torch.equal(batch[0], expected)
        assert torch.equal(batch[1], data[1][expected])


def test_other_data_sets_and_settings_take_the_generic_path_and_still_work():
    class Records(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "id": i}

    loader, out = batches(Records(), 5, 6, epochs=1)
    assert not loader.gathers
    randomness = SeededSource(5)
    for step, (batch, _, examples) in enumerate(out):
        expected = torch.nonzero(randomness.inclusion(step, 20, 6 / 20)).flatten()
        assert torch.equal(batch["id"], expected) and batch["x"].shape == (examples, 2)
        assert torch.equal(batch["x"][:, 0], expected.float())
    data = TensorDataset(*tensors())
    for kwargs in ({"collate_fn": lambda b: default_collate(b)}, {"num_workers": 1}):
        loader, custom = batches(data, 7, 3, epochs=1, **kwargs)
        _, fast = batches(data, 7, 3, epochs=1)
        assert not loader.gathers
        assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(custom, fast)) and len(custom) == len(fast)
