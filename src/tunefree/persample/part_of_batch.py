"""A model input with fewer rows than the loader's batch: manual micro-batching, told apart by its rows.

A loop that cuts the Poisson batch into parts itself (a forward and backward per part, to fit memory)
gives the model an input with k < n rows. The engine takes a step's examples from the batch the loader
handed out, so it cannot attribute such a call (it looks like a statistic over the batch, and the parts'
backward passes like a second pass over the same examples); under a mean loss each part would also weigh
its examples by the part's size. The refusal used to say "a statistic over the batch" without the fix
(issue 29). On the checked steps (where the loader's values are kept) an input whose every row is a row
of the loader's tensor is called what it is, with ``physical_batch_size`` as the fix; an input that is not
(a part of a transformed batch) gets both causes.
"""

from __future__ import annotations

import torch

from ..data.provenance import HandedOut

_COMPARED = 1 << 22  # elements compared at once


def part_of_the_batch(name: str, x: torch.Tensor, record: HandedOut, indices: set[int], root: int
                      ) -> str | None:
    """Why ``x`` (a model input derived from the loader's tensors ``indices``, its examples in dimension
    ``root``) with fewer rows than the batch must not train; ``None`` unless 0 < its rows < the batch's,
    and, when its rows are not the loader's own, unless no dimension holds the batch's size (a time-major
    input is the engine's layout checks' to refuse)."""
    n = record.examples
    if x.dim() <= root or not 0 < x.shape[root] < n:
        return None
    k, shape = x.shape[root], tuple(x.shape)
    fix = (f"let tunefree cut it: make_private(..., physical_batch_size={k}) hands out each Poisson batch in "
           "physical batches of at most that many examples; run the forward, the backward and "
           "engine.optimizer.step() on each (the step releases once, at the end of the logical batch)")
    loader = [*(record.leaves[i] for i in sorted(indices) if i in record.leaves),
              *(record.values[i] for i in sorted(indices) if i in record.values)]
    rows = x.detach().movedim(root, 0)
    if any(_rows_among(rows, t.detach(), n, root) for t in loader):
        return (f"model input {name} (shape {shape}) holds {k} of the {n} examples of the loader's batch: "
                "the model was called on part of the batch (a forward and backward per part of it: manual "
                "micro-batching). tunefree takes a step's examples from the batch the loader handed out and "
                "cannot attribute a call on part of it (it cannot tell it from a statistic over the batch, "
                "nor the parts' backward passes from a second pass over the same examples; under a mean loss "
                "each part would also weigh its examples by the part's size, not the batch's). To train a "
                f"batch in parts (when it does not fit in memory), {fix}")
    if n in shape:
        return None  # the examples may be in another dimension (time-major): the layout checks say so
    return (f"model input {name} (shape {shape}) is computed from the loader's batch but has {k} rows where "
            f"the batch holds {n} examples: if you cut the batch into parts yourself (a forward and backward "
            f"per part: manual micro-batching), {fix}. Otherwise it carries several "
            "examples' data into each row (a statistic over the batch, a flattened batch): give the model "
            "one row per example, computed from that example alone")


def _rows_among(rows: torch.Tensor, loader: torch.Tensor, n: int, root: int) -> bool:
    """Whether every row of ``rows`` (examples first) equals a row of the loader's tensor ``loader`` (its
    examples in dimension ``root`` or 0), value for value."""
    dim = next((d for d in dict.fromkeys((root, 0)) if loader.dim() > d and loader.shape[d] == n), None)
    if dim is None:
        return False
    theirs = loader.movedim(dim, 0).reshape(n, -1).to(rows.device)
    mine = rows.reshape(rows.shape[0], -1)
    if mine.shape[1] != theirs.shape[1] or mine.shape[1] == 0:
        return False
    chunk = max(1, _COMPARED // max(1, n * mine.shape[1]))
    for start in range(0, mine.shape[0], chunk):
        if not (mine[start:start + chunk, None] == theirs[None]).all(-1).any(1).all():
            return False
    return True
