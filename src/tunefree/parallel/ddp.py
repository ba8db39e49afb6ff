"""Data-parallel private training on ``torch.distributed`` (DDP under ``torchrun``).

Each rank Poisson-samples its shard of the data set (``data.poisson``), clips its own examples and books
their clipped sums as in one process. At the step, the release (:meth:`DataParallel.noisy_sum`) adds the
Gaussian noise of every coordinate on exactly one rank (secret: each rank its own slice; seeded: rank 0)
and all-reduces the sums in flat buckets launched asynchronously, so that every rank receives
``Σ (clipped sums of all ranks) + one noise draw``: the release of one process on the union batch, with
total noise variance σ²S² whatever the world size. The step components' few numbers (clip counts, loss
sums) are summed and noised once the same way (:meth:`DataParallel.noisy_values`). Each example sits on
one rank, so the sensitivity is that of one process, and every rank records the same event in its
ledger. DDP's own gradient synchronisation is switched off
while tunefree owns the model: the engine takes the parameters out of autograd's graph, so DDP has no
raw gradient to reduce; the clipped sums are reduced here instead. DDP still broadcasts rank 0's
weights at wrapping.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..clipping.groups import ClipGroup
from ..dtypes import accumulation_dtype
from ..errors import PrivacyError
from ..persample.accumulator import LocalSums, Sink
from ..privacy.mechanisms import add_bucket_noise, clipped_sum
from ..privacy.randomness import NoiseSource
from .base import DDP, DataParallelBase

# The size of one all-reduce bucket, DDP's default (bucket_cap_mb=25).
BUCKET_BYTES = 25 * 2**20


class DataParallel(DataParallelBase):
    """A ``DistributedDataParallel`` model taken over by tunefree (a :class:`~.base.Parallelism`): the
    wrapped module is hooked, and DDP's own gradient synchronisation is off from :meth:`take_over` to
    :meth:`release_model`. DDP reduces raw gradients, and there are none: the engine keeps the parameters
    out of autograd's graph. Switched off, DDP does no reducer bookkeeping per pass, and a raw gradient
    that reached a parameter anyway is refused by the engine's leak check on this rank, never averaged
    across ranks first.

    Args:
        wrapper: the DDP model.
        bucket_bytes: the size of one all-reduce of the release.
    """

    kind = DDP

    def __init__(self, wrapper: DistributedDataParallel, bucket_bytes: int = BUCKET_BYTES):
        if not dist.is_initialized():
            raise ValueError("the model is wrapped in DistributedDataParallel but torch.distributed is "
                             "not initialised: call torch.distributed.init_process_group first")
        self.wrapper, self.module = wrapper, wrapper.module
        self.group = wrapper.process_group
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._synced = wrapper.require_backward_grad_sync
        self.bucket_bytes = bucket_bytes
        self._buckets: tuple[tuple[int, ...], list[list[nn.Parameter]]] | None = None

    def take_over(self) -> None:
        """Switch DDP's gradient synchronisation off: tunefree reduces the clipped sums instead."""
        self.wrapper.require_backward_grad_sync = False

    def release_model(self) -> None:
        """Give DDP its gradient synchronisation back (the model is a plain DDP model again)."""
        self.wrapper.require_backward_grad_sync = self._synced

    def sink(self, groups: Sequence[ClipGroup]) -> Sink:
        """Each rank keeps its sums whole until the step, where they are all-reduced in buckets."""
        return LocalSums()

    def noisy_sum(self, sums: Mapping[nn.Parameter, torch.Tensor], stds: Sequence[tuple[nn.Parameter, float]],
                  randomness: NoiseSource) -> dict[nn.Parameter, torch.Tensor]:
        """The noisy sum of every rank's clipped sums (identical on every rank), all-reduced in flat buckets
        launched asynchronously (the noise of a bucket is drawn while the previous ones travel). Who draws
        the noise (``privacy.mechanisms.add_bucket_noise``, asking the source's ``owned_range``): with a
        secret source, each rank its own 1/W slice of every bucket; with a replayable (seeded) one, rank 0
        all of it, as one process with that seed would. A rank that fails or never arrives makes the
        collective fail (after the process group's timeout) before anything is released or recorded."""
        std_of = dict(stds)
        in_flight = []
        for bucket in self.buckets([p for p, _ in stds]):
            flat = torch.cat([clipped_sum(p, sums.get(p)).reshape(-1) for p in bucket])
            add_bucket_noise(flat, [(p, std_of[p]) for p in bucket], randomness, self.shard)
            in_flight.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        noisy = {}
        for bucket, flat, work in in_flight:
            work.wait()
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                noisy[p] = piece.view(p.shape)
        return noisy

    def noisy_values(self, values: torch.Tensor, noise: torch.Tensor,
                     randomness: NoiseSource) -> torch.Tensor:
        """Every rank's ``values`` summed, each coordinate's noise added by the rank that owns it."""
        return reduce_values(values, noise, randomness, self.shard, self.group, self._collective_device())

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every rank (a collective)."""
        return all_ranks(flag, self.group, self._collective_device())

    def from_first(self, value: int) -> int:
        """Rank 0's ``value``, on every rank (a collective)."""
        return first_rank(value, self.group)

    def buckets(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """The release's all-reduce buckets of ``params`` (in release order), made once."""
        key = tuple(id(p) for p in params)
        if self._buckets is None or self._buckets[0] != key:
            self._buckets = (key, _buckets(params, self.bucket_bytes))
        return self._buckets[1]

    def bytes_per_step(self, groups: Sequence[ClipGroup]) -> int:
        """Bytes each rank contributes to the all-reduce of one step (the size of the sums)."""
        return sum(p.numel() * accumulation_dtype(p.dtype).itemsize for g in groups for p in g.params)

    def _collective_device(self) -> torch.device:
        """Where the process group communicates: the parameters' device (NCCL: a GPU)."""
        return next(self.module.parameters()).device


def reduce_values(values: torch.Tensor, noise: torch.Tensor, randomness: NoiseSource, shard: tuple[int, int],
                  group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """``values`` (float64, CPU) summed over the ranks of ``group``, plus ``noise`` counted once: each rank
    adds the noise of the coordinates it owns (``NoiseSource.owned_range``: a secret source's own slice, a
    replayable source's all on rank 0, as one process adds them) before the all-reduce."""
    low, high = randomness.owned_range(values.numel(), shard)
    local = values.to(torch.float64).clone().reshape(-1)
    local[low:high] += noise.reshape(-1)[low:high]
    local = local.to(device)
    dist.all_reduce(local, group=group)
    return local.cpu().reshape(values.shape)


def first_rank(value: int, group: dist.ProcessGroup) -> int:
    """Rank 0 of ``group``'s ``value``, on every rank of it (a collective)."""
    shared = [value]
    dist.broadcast_object_list(shared, group_src=0, group=group)
    return int(shared[0])


def all_ranks(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``flag`` is True on every rank of ``group`` (a collective: every rank must call it)."""
    agreed = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def data_parallel(model: nn.Module) -> DataParallel | None:
    """The data-parallel setting of ``model``: a :class:`DataParallel` for a DDP model, ``None`` for a
    plain module (which trains as one process, with a warning if several processes are running).
    ``nn.DataParallel`` is refused; sharded models (FSDP2) are ``distributed_fsdp``'s."""
    if isinstance(model, nn.DataParallel):
        raise ValueError("torch.nn.DataParallel (threads over the GPUs of one process) is not supported: "
                         "wrap the model in DistributedDataParallel and launch with torchrun "
                         "(docs/distributed.md)")
    if not dist.is_available():
        return None
    if isinstance(model, DistributedDataParallel):
        return DataParallel(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"torch.distributed runs {dist.get_world_size()} processes but the model is not wrapped in "
            "DistributedDataParallel: each process trains its own private model on the whole data set. "
            "Wrap it in DistributedDataParallel for one private run across the processes",
            stacklevel=3)
    return None


def _buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one device and accumulation dtype, at most ``bucket_bytes`` a bucket
    (a larger parameter is a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        dtype = accumulation_dtype(p.dtype)
        nbytes = p.numel() * dtype.itemsize
        last = buckets[-1] if buckets else None
        if (last is None or size + nbytes > bucket_bytes or last[0].device != p.device
                or accumulation_dtype(last[0].dtype) != dtype):
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets


def check_same_run(parallel: DataParallel, identity: Mapping[str, Any]) -> None:
    """Refuse to start unless every rank describes the same run (``identity``: the plan's description,
    the clip groups and the parameters' shapes): the ranks' ledgers must be one ledger, and a rank with
    another model or noise would release something nobody accounted."""
    gathered: list[Any] = [None] * parallel.world_size
    dist.all_gather_object(gathered, dict(identity), group=parallel.group)
    mine = gathered[parallel.rank]
    for rank, theirs in enumerate(gathered):
        if theirs != mine:
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise PrivacyError(
                f"rank {rank} was set up differently from rank {parallel.rank} (it differs in {keys}): "
                "every rank must call make_private with the same model, data set and privacy settings")


def run_identity(description: Mapping[str, Any], groups: Sequence[ClipGroup],
                 randomness: NoiseSource) -> dict[str, Any]:
    """What every rank must agree on: the plan's description, the shapes and dtypes of the clip groups'
    parameters, in order, and the noise source (replayable or not, and its seed): a rank of a secret
    source noises its own slice of the coordinates and one of a replayable source leaves all of them to
    rank 0 (``NoiseSource.owned_range``), so a mix would leave coordinates without noise."""
    layout = [[g.name, [[list(p.shape), str(p.dtype)] for p in g.params]] for g in groups]
    return {**description, "parameter layout": layout, "randomness": [randomness.replayable, randomness.seed]}
