"""Private pipeline-parallel training on the 8x8 digits: two stages, per-device clipping.

    torchrun --nproc-per-node 2 examples/pipeline_train.py          # CPU (gloo), or one GPU per stage (nccl)
    torchrun --nproc-per-node 2 examples/pipeline_train.py --allocation equal-budget --thresholds adaptive

Rank k holds stage k of the model and clips its own parameters at its own threshold Rₖ inside its own
backward pass: no per-sample norm leaves a stage. Stage 0 draws each Poisson batch and feeds the
micro-batches' inputs; stage 1 gets the activations, computes the loss against the labels and sends the
activations' gradients back. Each stage adds its own share of the noise; together the stages' releases
are one Gaussian mechanism on the sensitivity √(R₀² + R₁²), which both ledgers record. The last stage
reports the accuracy on held-out digits (``stage.predict``), never the training loss: the losses ``step``
returns are computed from the private data without noise, outside the guarantee. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree

STAGES = 2
HELD_OUT = 297  # the last digits: never trained on, the only data the reported accuracy reads


def stage_module(index: int) -> nn.Module:
    """Stage ``index`` of the model Linear(64, 128) → Tanh → Linear(128, 10)."""
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh()) if index == 0 else nn.Linear(128, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size")
    parser.add_argument("--micro-batch", type=int, default=32, help="micro-batch size of the pipeline")
    parser.add_argument("--allocation", default="global", choices=["global", "equal-budget", "weighted"])
    parser.add_argument("--thresholds", default="fixed", choices=["fixed", "adaptive"])
    parser.add_argument("--save", help="a folder where each stage saves its weights and privacy state")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != STAGES:
        raise SystemExit(f"run with torchrun --nproc-per-node {STAGES}: one process per stage")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
    train = TensorDataset(x[:-HELD_OUT], y[:-HELD_OUT])  # the private data
    x_held_out, y_held_out = x[-HELD_OUT:], y[-HELD_OUT:]
    module = stage_module(rank).to(device)
    optimizer = torch.optim.Adam(module.parameters(), lr=2e-3)
    stage = tunefree.make_private_pipeline(
        module, optimizer, DataLoader(train, batch_size=args.batch_size), stage_index=rank,
        num_stages=STAGES, loss_fn=F.cross_entropy if rank == STAGES - 1 else None,
        target_epsilon=args.epsilon, target_delta=1e-5, epochs=args.epochs,
        max_grad_norm=1 / math.sqrt(STAGES), physical_batch_size=args.micro_batch,
        noise_allocation=args.allocation, thresholds=args.thresholds)

    steps_per_epoch = round(len(train) / args.batch_size)
    for epoch in range(args.epochs):
        for _ in range(steps_per_epoch):
            stage.step()  # every stage steps together
        logits = stage.predict(x_held_out)  # every stage forwards together; the last one gets the logits
        thresholds = stage.stage_thresholds()  # released: given, or noisy quantile estimates
        if rank == STAGES - 1:
            accuracy = (logits.argmax(1).cpu() == y_held_out).float().mean()
            print(f"epoch {epoch + 1}: held-out accuracy {accuracy:.4f}, ε = {stage.epsilon():.3f}, "
                  f"thresholds {[round(r, 4) for r in thresholds]}", flush=True)
    sensitivity = stage.sensitivity
    if rank == STAGES - 1:
        print(f"{STAGES} stages, sensitivity √ΣRₖ² = {sensitivity:.4g}: {stage.engine.guarantee()}")
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        torch.save({"model": module.state_dict(), "privacy": stage.engine.state_dict()},
                   os.path.join(args.save, f"stage{rank}.pt"))
    dist.barrier()  # a stage whose last message is still in flight must not see its peer leave (gloo aborts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
