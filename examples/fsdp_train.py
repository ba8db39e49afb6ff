"""Private sharded training (FSDP2) on the 8x8 digits, one private run across all processes.

    torchrun --nproc-per-node 2 examples/fsdp_train.py            # CPU (gloo), or one process per GPU (nccl)
    torchrun --nproc-per-node 2 examples/fsdp_train.py --epochs 5 --save runs/fsdp.pt

Each Linear layer and then the root are sharded with ``fully_shard`` (FSDP2's recipe): every rank holds
1/W of every parameter and of the optimizer state. Every rank holds the whole training set; tunefree
Poisson-samples each rank's share of every batch, clips it, reduce-scatters the clipped sums into the
shards and adds the noise of each coordinate once in total. Every rank records the same ledger, so rank
0 alone reports. It reports the accuracy on held-out digits, never on the training set: a training metric
is computed from the private data without noise, outside the guarantee. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import tunefree

HELD_OUT = 297  # the last digits: never trained on, the only data the reported accuracy reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=128, help="expected global batch size")
    parser.add_argument("--save", help="where rank 0 saves the full (gathered) weights")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
    train = TensorDataset(x[:-HELD_OUT], y[:-HELD_OUT])  # the private data
    x_held_out, y_held_out = x[-HELD_OUT:], y[-HELD_OUT:]
    torch.manual_seed(0)  # the same initial weights on every rank: each keeps its own shard of them
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)  # over the sharded parameters
    engine = tunefree.make_private(model, optimizer, DataLoader(train, batch_size=args.batch_size),
                                   target_epsilon=args.epsilon, target_delta=1e-5, epochs=args.epochs)

    for epoch in range(args.epochs):
        for xb, yb in engine.data_loader:  # this rank's share of the Poisson batch: sizes vary, may be 0
            engine.optimizer.zero_grad()
            F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
            engine.optimizer.step()  # clip, reduce-scatter, noise once, record in the ledger, step Adam
        with torch.no_grad():  # every rank: each forward gathers the layers' parameters from all ranks
            model.eval()
            accuracy = (model(x_held_out.to(device)).argmax(1).cpu() == y_held_out).float().mean()
            model.train()
        if rank == 0:
            print(f"epoch {epoch + 1}: held-out accuracy {accuracy:.4f}, ε = {engine.epsilon():.3f}",
                  flush=True)

    weights = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}  # every rank gathers
    if rank == 0:
        print(f"{dist.get_world_size()} processes: {engine.guarantee()}")
        if args.save:
            os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
            torch.save({"model": weights, "privacy": engine.state_dict()}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
