"""Pipeline stages (``make_private_pipeline``): a model cut into K stages, one process each, as a
:class:`~.base.Parallelism`.

Stage k holds one clip group of the run, its own parameters, with its own threshold Rₖ: the run's clip
groups are spread over the processes instead of held by each (as one process, DDP and FSDP2 hold them).
Everything else follows from that:

- **the release**: each stage noises its own parameters (as one process would), with the standard
  deviation the noise allocation gives its group among *all* stages' groups (``all_groups``: their
  thresholds and sizes), so that the K releases together are one Gaussian mechanism of multiplier σ on
  the sensitivity √(Σₖ Rₖ²), recorded by every stage;
- **adaptive thresholds**: each stage's count is one of the K counts of the joint count release (its
  noise is that of one of K counts), and the estimates are exchanged for the common scale;
- **the sample**: the first stage draws each step's Poisson sample and broadcasts it (``sampling``);
  every stage trains on every example of it (``shard`` is ``(0, 1)``);
- **the transport** (not part of the protocol): a micro-batch's activations go forward and their
  gradients back point to point, each tensor after a header with its dtype and shape, since Poisson
  batches vary in size.

Nothing else crosses a stage boundary: no per-sample norm, no clipped or noisy sum. The stages' public
facts (each stage's plan, threshold and size) are exchanged once, by :meth:`Stages.join`, which refuses
stages set up differently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..clipping.groups import ClipGroup
from ..errors import PrivacyError
from ..persample.accumulator import LocalSums, Sink
from ..privacy.mechanisms import OneProcess
from ..privacy.randomness import NoiseSource
from .base import STAGES
from .ddp import all_ranks, first_rank

_MAX_DIMS = 8  # dimensions of an activation that the shape header carries
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Stages(OneProcess):
    """This process's stage of a pipeline (a :class:`~.base.Parallelism`), made by :meth:`join`.

    Args:
        index, num_stages: this stage's position in the pipeline.
        group: the pipeline's process group (``None``: the default group).
        device: where the process group communicates (NCCL: the GPU).
        groups: every stage's clip group as set up: ``(name, threshold, size)`` in stage order.
        thresholds_move: whether the thresholds change from step to step (adaptive thresholds); if so,
            the stages exchange their current ones at every release instead of using the setup's.
    """

    kind = STAGES
    shard = (0, 1)  # every stage trains on every example of each (shared) sample

    def __init__(self, index: int, num_stages: int, group: Any, device: torch.device,
                 groups: Sequence[tuple[str, float, int]], thresholds_move: bool):
        self.index, self.num_stages, self.group, self.device = index, num_stages, group, device
        self.groups = tuple(groups)
        self.thresholds_move = thresholds_move

    @classmethod
    def join(cls, index: int, num_stages: int, group: Any, device: torch.device, own: ClipGroup,
             description: Mapping[str, Any], thresholds_move: bool) -> Stages:
        """This stage, after every stage has told the others its plan ``description`` (which must be the
        same on every stage: their ledgers are to be one ledger), its clip group's name, threshold and size
        (a collective: every stage calls it)."""
        facts = {"run": dict(description), "group": [own.name, float(own.threshold), own.size]}
        gathered: list[Any] = [None] * num_stages
        dist.all_gather_object(gathered, facts, group=group)
        mine = gathered[index]["run"]
        for stage, facts in enumerate(gathered):
            theirs = facts["run"]
            if theirs != mine:
                keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise PrivacyError(
                    f"stage {stage} was set up differently from stage {index} (it differs in {keys}): every "
                    "stage must call make_private_pipeline with the same data set and privacy settings")
        groups = [(str(name), float(threshold), int(size)) for name, threshold, size in
                  (facts["group"] for facts in gathered)]
        return cls(index, num_stages, group, device, groups, thresholds_move)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    # ------------------------------------------------------------------ the Parallelism protocol
    def sink(self, groups: Sequence[ClipGroup]) -> Sink:
        """Each stage keeps its own parameters' sums until the step."""
        return LocalSums()

    def all_groups(self, own: Mapping[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
        """Every stage's clip group in stage order with its current value and size: this stage's from
        ``own``, the others' from the setup while the thresholds stay fixed, else exchanged (a collective:
        every stage calls it at the same point of each step)."""
        if not self.thresholds_move:
            everyone = {name: (threshold, size) for name, threshold, size in self.groups}
            return {**everyone, **own}
        gathered: list[Any] = [None] * self.num_stages
        dist.all_gather_object(gathered, dict(own), group=self.group)
        return {name: (float(value), int(size)) for part in gathered for name, (value, size) in part.items()}

    def sampling(self, randomness: NoiseSource) -> _FirstStageSample:
        """Each step's Poisson sample is the first stage's, broadcast to the others (a secret source
        cannot be replayed on another process)."""
        return _FirstStageSample(randomness, self)

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every stage (a collective)."""
        return all_ranks(flag, self.group, self.device)

    def from_first(self, value: int) -> int:
        """The first stage's ``value``, on every stage (a collective)."""
        return first_rank(value, self.group)

    def take_over(self) -> None:
        """A stage is a plain module: nothing to take over."""

    def release_model(self) -> None:
        """Nothing to give back."""

    # ------------------------------------------------------------------ the transport
    def send(self, tensor: torch.Tensor, stage: int) -> None:
        """Send ``tensor`` to ``stage``, after a header with its dtype and shape (sizes vary per batch)."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"a stage output must be one floating tensor of at most {_MAX_DIMS} dimensions "
                             f"(dtypes {_DTYPES}), got {tensor.dtype} of shape {tuple(tensor.shape)}")
        shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
        header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64,
                              device=tensor.device)
        dist.send(header, group_dst=stage, group=self.group)
        dist.send(tensor.detach().contiguous(), group_dst=stage, group=self.group)

    def receive(self, stage: int) -> torch.Tensor:
        """Receive what :meth:`send` sent from ``stage``."""
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, group_src=stage, group=self.group)
        code, dims, *shape = header.tolist()
        tensor = torch.empty(shape[:dims], dtype=_DTYPES[code], device=self.device)
        dist.recv(tensor, group_src=stage, group=self.group)
        return tensor


class _FirstStageSample:
    """The Poisson sample of each step, drawn by the first stage and broadcast to the others, so that
    every stage trains on the same examples."""

    def __init__(self, randomness: NoiseSource, stages: Stages):
        self.randomness, self.stages = randomness, stages

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        mask = torch.zeros(num_examples, dtype=torch.uint8)
        if self.stages.is_first:
            mask = self.randomness.inclusion(step, num_examples, sample_rate).to(torch.uint8)
        mask = mask.to(self.stages.device)  # where the backend communicates (NCCL: the GPU)
        dist.broadcast(mask, group_src=0, group=self.stages.group)
        return mask.cpu().bool()
