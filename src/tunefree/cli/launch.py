"""``tunefree train --nproc-per-node N``: one private run in N data-parallel processes, through torchrun.

The launcher is torchrun's own (``torch.distributed.launcher``): it starts N copies of the same command,
``python -m tunefree.cli train …``, with torchrun's environment (``RANK``, ``WORLD_SIZE``, …). A copy that
finds that environment is a rank: it joins the process group (gloo: the command line trains on the CPU),
wraps the model in ``DistributedDataParallel`` and trains its shard of every Poisson batch. The same
command started by ``torchrun`` directly (several nodes, SLURM) runs the same way.

Privacy: the releases outside the training steps (the preprocessing's: class labels, category sets, the
standardisation of numeric columns) are made once, on rank 0, and their results broadcast; every rank
records their events in its ledger, so the ranks' ledgers are one ledger and ε is that of the one-process
run. Only rank 0 writes the run directory, the JSON result and the output. When a rank fails, torchrun stops
the others; a rank still in a step's all-reduce fails it before recording or applying anything
(``tunefree.distributed``).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")
BACKEND = "gloo"  # the command line trains on the CPU


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def check_parallel_options(thresholds: str, lr: float | str | None, audit_canaries: int | None = None
                           ) -> None:
    """Refuse, before launching, the options whose releases are not reduced across ranks yet."""
    unsupported = [flag for flag, used in (("--thresholds adaptive", thresholds == "adaptive"),
                                           ("--lr hyfreedp", lr == "hyfreedp"),
                                           ("--audit-canaries", audit_canaries is not None)) if used]
    if unsupported:
        raise ValueError(f"{' and '.join(unsupported)} cannot run in several processes yet (their releases "
                         "are not reduced across ranks): drop --nproc-per-node, or use fixed thresholds, "
                         "--lr auto or a number, and no audit")


def launch(argv: Sequence[str], nproc_per_node: int) -> int:
    """Run ``tunefree <argv>`` in ``nproc_per_node`` processes on this machine through torchrun's
    launcher (a standalone rendezvous on a free local port); the exit status of the run: 0, or the
    status of the first rank that failed (its error is on stderr)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "tunefree.cli", *argv)
    except ChildFailedError as error:
        failure = error.get_first_failure()[1]
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


@contextmanager
def process_group() -> Iterator[None]:
    """Join torchrun's process group for the duration of the run (``env://`` initialisation)."""
    dist.init_process_group(BACKEND)
    try:
        yield
    finally:
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Whether this process writes the run's outputs: rank 0, or the only process."""
    return world()[0] == 0


def data_parallel(model: nn.Module) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` inside a process group (rank 0's weights are
    broadcast to every rank), the model itself otherwise."""
    return DistributedDataParallel(model) if world()[1] > 1 else model


def once_on_rank_zero(release: Callable[[], T]) -> T:
    """``release()`` computed on rank 0 only, its result (or its error) sent to every rank: a private
    release made once, whatever the number of processes. Outside a process group, ``release()``."""
    rank, world_size = world()
    if world_size == 1:
        return release()
    payload: list[object] = [None]
    if rank == 0:
        try:
            payload[0] = release()
        except Exception as error:  # every rank raises it, instead of waiting for rank 0
            payload[0] = error
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    return payload[0]  # type: ignore[return-value]
