"""Memory of the clipped sums per rank in an FSDP2 run: tunefree (all-layer and per-layer groups) against
non-private FSDP2, on W processes (gloo on CPU, one thread each by default).

The model is ``--layers`` Linear layers of ``--width`` x ``--width`` (Tanh between), each sharded with
``fully_shard``, then the root. Per configuration and rank it reports:

- the peak bytes of clipped sums alive at once: every storage handed to the step's accumulator or to a
  reduce-scatter counts from then until it is freed (a weak reference to the storage, so a tensor still
  holding it anywhere keeps it counted). It reads the code path, whatever the version of tunefree on
  ``PYTHONPATH``: run it against an older checkout to compare;
- the process's peak resident memory during the measured steps, above its resident memory when they start
  (``VmHWM`` reset through ``/proc/self/clear_refs``; the workers run with ``MALLOC_MMAP_THRESHOLD_`` fixed,
  so that large freed tensors go back to the system at once);
- the median step time.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_memory.py --world 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import weakref

CONFIGS = ("non-private FSDP2", "tunefree FSDP2 all-layer", "tunefree FSDP2 per-layer")
MIB = 2**20


class LiveSums:
    """Bytes of clipped sums alive at once: storages counted from their hand-over until freed."""

    def __init__(self):
        self.alive: dict[int, int] = {}
        self.peak = 0

    def track(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.alive:
                self.alive[storage.data_ptr()] = storage.nbytes()
                weakref.finalize(storage, self.alive.pop, storage.data_ptr(), None)
        self.peak = max(self.peak, sum(self.alive.values()))


@contextlib.contextmanager
def watching(accumulator: type, live: LiveSums):
    """Within it, ``live`` tracks every sum booked into ``accumulator`` (the class) and every input of
    ``torch.distributed``'s reduce-scatters."""
    import torch.distributed as dist

    add, single, chunked = accumulator.add, dist.reduce_scatter_single, dist.reduce_scatter

    def watched_add(self, p, contribution):
        if contribution is not None:
            live.track([contribution])
        add(self, p, contribution)

    def watched(function, inputs_of):
        def call(*args, **kwargs):
            live.track(inputs_of(*args, **kwargs))
            return function(*args, **kwargs)
        return call

    accumulator.add = watched_add
    dist.reduce_scatter_single = watched(single, lambda output, input, **_: [input])
    dist.reduce_scatter = watched(chunked, lambda output, inputs, **_: list(inputs))
    try:
        yield
    finally:
        accumulator.add, dist.reduce_scatter_single, dist.reduce_scatter = add, single, chunked


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def _model(layers: int, width: int):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(width, width), nn.Tanh())])
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    return fully_shard(model)


def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import tunefree

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(args.threads)
    examples = args.local_batch * world * 32  # q = 1/32
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(examples, args.width, generator=generator),
                         torch.randint(0, args.width, (examples,), generator=generator))
    results = []
    for config in CONFIGS:
        torch.manual_seed(0)
        model = _model(args.layers, args.width)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        live = LiveSums()
        if config.startswith("non-private"):
            loader = DataLoader(data, batch_size=args.local_batch, sampler=DistributedSampler(data))
            step_optimizer, watched = optimizer, None
        else:
            global_batch = DataLoader(data, batch_size=args.local_batch * world)
            engine = tunefree.make_private(model, optimizer, global_batch, noise_multiplier=1.0,
                                           target_delta=1 / examples ** 1.1, groups=config.rsplit(" ", 1)[1])
            loader, step_optimizer = engine.data_loader, engine.optimizer
            watched = type(engine.optimizer.accumulator)
        batches = iter(loader)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                dist.barrier()
                rss_start = _status_kib("VmRSS")
                _reset_peak_rss()
            x, y = next(batches)
            start = time.perf_counter()
            with watching(watched, live) if watched and step >= args.warmup else contextlib.nullcontext():
                step_optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                step_optimizer.step()
            times.append(time.perf_counter() - start)
        peak_rss = _status_kib("VmHWM") - rss_start
        mine = {"sums_peak": live.peak, "rss_peak": peak_rss * 1024,
                "step_ms": 1000 * statistics.median(times[args.warmup:])}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        results.append({"config": config, "world": world,
                        "params": sum(p.numel() for p in model.parameters()),
                        **{key: max(rank[key] for rank in everyone) for key in mine}})
        del model, optimizer, loader, step_optimizer
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--local-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.world}", __file__,
               "--worker", f"--layers={args.layers}", f"--width={args.width}",
               f"--local-batch={args.local_batch}", f"--steps={args.steps}", f"--warmup={args.warmup}",
               f"--threads={args.threads}"]
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    run = subprocess.run(command, capture_output=True, text=True, env=environment)
    if run.returncode != 0:
        sys.exit(f"the workers failed:\n{run.stderr[-3000:]}")
    rows = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"{args.layers} Linear layers of {args.width} x {args.width}, {args.world} processes, "
          f"{args.threads} thread(s) each, expected batch {args.local_batch} per rank; the largest of "
          "each figure over the ranks")
    print("| config | parameters | full-size sums of the model (MiB) | peak clipped sums alive per rank "
          "(MiB) | peak RSS above the steps' start (MiB) | step (ms, median) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['params']} | {4 * row['params'] / MIB:.1f} | "
              f"{row['sums_peak'] / MIB:.1f} | {row['rss_peak'] / MIB:.1f} | {row['step_ms']:.0f} |")


if __name__ == "__main__":
    main()
