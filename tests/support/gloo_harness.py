"""Run a scenario in several forked gloo processes inside a test, with a deadline so that a hang fails
the test instead of blocking the suite. Each rank returns a dict, saved and loaded back here."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, scenario: Callable[[int], dict], port: int, out: str, world: int,
           collective_timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    try:
        torch.save(scenario(rank), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_processes(scenario: Callable[[int], dict], tmp_path: Path, *, world: int, deadline_s: float,
                  collective_timeout_s: float) -> list[dict]:
    """``scenario(rank)`` in ``world`` forked processes; each rank's returned dict. Forked, the ranks
    start with this process's imports (torch's optimizers import torch._dynamo on first use, seconds on a
    loaded machine: import it here once instead of in every rank)."""
    import torch._dynamo  # noqa: F401

    context = mp.start_processes(_entry, args=(scenario, free_port(), str(tmp_path), world,
                                               collective_timeout_s),
                                 nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world}-process scenario did not finish within {deadline_s} s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
