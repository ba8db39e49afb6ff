"""Data-parallel step time and communication: tunefree DDP and FSDP2 against non-private DDP and FSDP2,
1 vs W processes.

Weak scaling: every process trains on the same expected local batch, so W processes take a global batch
W times larger. Each world size runs under torchrun (gloo on CPU, nccl on GPUs). Per configuration and
world size it reports rank 0's median step time (forward, backward, optimizer step; for tunefree the
per-sample clipping, the all-reduce of the clipped sums, the noise and the ledger record; secret noise
from os.urandom, and seeded noise for comparison) and the bytes
each rank hands to the collectives per step: for non-private DDP, counted in a DDP communication hook
(its gradient buckets); otherwise counted around ``torch.distributed``'s all-reduce, all-gather
(output, the gathered parameters) and reduce-scatter (input, the full-size gradients or clipped sums; a
list of chunks when the rows do not split evenly over the ranks).
FSDP2 shards each Linear layer and the root (``fully_shard``).

    OMP_NUM_THREADS=1 python benchmarks/distributed.py --worlds 1 2 --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

# "seeded" draws the noise from torch's generator instead of os.urandom: not for real runs (whoever knows
# the seed can remove the noise), here to separate the cost of the secret noise from the rest.
CONFIGS = ("non-private DDP", "tunefree DDP", "tunefree DDP seeded",
           "non-private FSDP2", "tunefree FSDP2", "tunefree FSDP2 seeded")
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "reduce_scatter")
COLUMNS = {"all-reduce": ("all_reduce",), "all-gather": ("all_gather_single",),
           "reduce-scatter": ("reduce_scatter_single", "reduce_scatter")}


def _model(width: int):
    from torch import nn

    return nn.Sequential(nn.Linear(256, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 10))


def _counting_ddp_hook(counter: dict):
    """DDP's default all-reduce of a gradient bucket, counting its bytes."""
    import torch.distributed as dist

    def hook(state, bucket):
        buffer = bucket.buffer()
        counter["all_reduce"] += buffer.numel() * buffer.element_size()
        future = dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True).get_future()
        return future.then(lambda f: f.value()[0])
    return hook


@contextlib.contextmanager
def _counting_collectives(counter: dict):
    """Within it, every all-reduce (its tensor), all-gather (its output) and reduce-scatter (its input,
    or its chunks) of ``torch.distributed`` counts its bytes under its name (FSDP2 and tunefree call
    them)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    counted_argument = {"all_reduce": "tensor", "all_gather_single": "output_tensor",
                        "reduce_scatter_single": "input", "reduce_scatter": "input_list"}

    def counting(name):
        signature = inspect.signature(originals[name])

        def counted(*args, **kwargs):
            tensors = signature.bind(*args, **kwargs).arguments[counted_argument[name]]
            counter[name] += sum(t.numel() * t.element_size()
                                 for t in (tensors if isinstance(tensors, list) else [tensors]))
            return originals[name](*args, **kwargs)
        return counted
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def _wrapped(config: str, width: int, device):
    """The model of ``config``: in DDP, or sharded by FSDP2 (each Linear layer, then the root)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = _model(width).to(device)
    if "FSDP2" not in config:
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import tunefree

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    examples = args.local_batch * world * 32  # q = 1/32 whatever the world size
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(examples, 256, generator=generator),
                         torch.randint(0, 10, (examples,), generator=generator))
    results = []
    for config in CONFIGS:
        torch.manual_seed(0)
        model = _wrapped(config, args.width, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        counter = dict.fromkeys(COLLECTIVES, 0)
        if config.startswith("non-private"):
            loader = DataLoader(data, batch_size=args.local_batch, sampler=DistributedSampler(data))
            step_optimizer, counting = optimizer, functools.partial(_counting_collectives, counter)
            if config == "non-private DDP":
                model.register_comm_hook(None, _counting_ddp_hook(counter))
                counting = contextlib.nullcontext
        else:
            global_batch = DataLoader(data, batch_size=args.local_batch * world)
            engine = tunefree.make_private(model, optimizer, global_batch, noise_multiplier=1.0,
                                           target_delta=1 / examples ** 1.1,
                                           seed=0 if config.endswith("seeded") else None)
            loader, step_optimizer = engine.data_loader, engine.optimizer
            counting = functools.partial(_counting_collectives, counter)
        batches = _endless(loader)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                counter.update(dict.fromkeys(COLLECTIVES, 0))
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            dist.barrier()
            start = time.perf_counter()
            with counting() if step >= args.warmup else contextlib.nullcontext():
                step_optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                step_optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results.append({"config": config, "world": world, "threads": args.threads,
                        "params": sum(p.numel() for p in model.parameters()),
                        "step_ms": 1000 * statistics.median(times[args.warmup:]),
                        **{name: count // args.steps for name, count in counter.items()}})
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--local-batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    rows = []
    for world in args.worlds:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", __file__,
                   "--worker", f"--steps={args.steps}", f"--warmup={args.warmup}",
                   f"--local-batch={args.local_batch}", f"--width={args.width}", f"--threads={args.threads}"]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{world} processes failed:\n{run.stderr[-3000:]}")
        output = run.stdout
        rows += json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
    print("| config | processes | threads/process | parameters | step (ms, median) | "
          "bytes/step/rank: all-reduce | all-gather | reduce-scatter |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['world']} | {row['threads']} | {row['params']} | "
              f"{row['step_ms']:.1f} | " + " | ".join(str(sum(row[name] for name in names))
                                                       for names in COLUMNS.values()) + " |")


if __name__ == "__main__":
    main()
