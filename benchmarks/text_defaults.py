"""The text command line's defaults at small N: which weights to train, what the head reads, the batch size
and the number of steps — measured on validation (test reported once, for the chosen default).

Data and model: ``benchmarks/text_task.py`` (Rotten Tomatoes snippets, all-MiniLM-L6-v2; 4,000 / 1,000 /
1,000 drawn with seed 0, the frozen encoder's states cached once). ``--train`` takes the first n training
snippets (1,900: the size at which the command line collapsed, RESULTS §5f). The trained model is a linear
head on the encoder's mean-pooled token states (the pooling the model was trained with), optionally
L2-normalised per example (its sentence-transformers ``Normalize`` module), under ``tunefree.make_private``
with AUTO-S, δ = 1/N^1.1 (the command line's default) and σ calibrated for ε; ``--lr auto`` keeps the averaged
weights, as the command line does.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/text_defaults.py --train 1900 4000 --epsilons 1 3 8 \
        --batches 256 1024 --epochs 3 10 30 --optimizers adamw-auto sgd-auto --seeds 0 1 2 --out runs.jsonl
    python benchmarks/text_defaults.py --summarise runs.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))


def features(train: int, normalise: bool, pooling: str = "mean"
             ) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    import text_task

    x, y = text_task.sentence_states(pooling)
    if normalise:
        x = F.normalize(x, dim=1)
    n, v, _ = text_task.SIZES
    return (TensorDataset(x[:train], y[:train]), TensorDataset(x[n:n + v], y[n:n + v]),
            TensorDataset(x[n + v:], y[n + v:]))


@functools.cache
def _sigma(epsilon: float, rate: float, epochs: float | None, steps: int | None, delta: float) -> float:
    """σ for ε (calibrated once per plan, as make_private(target_epsilon=...) would)."""
    from tunefree.data.poisson import planned_steps

    return tunefree.noise_multiplier(target_epsilon=epsilon, sample_rate=rate, delta=delta,
                                     steps=planned_steps(epochs, steps, rate))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def run(train: TensorDataset, valid: TensorDataset, test: TensorDataset, epsilon: float, batch: int,
        epochs: float | None, optimizer: str, seed: int, pooling: str = "mean", steps: int | None = None
        ) -> dict:
    """One private run of a linear head on mean-pooled states (``pooling`` "cls": the model's own pooler
    and a new classifier on the [CLS] state, as BertForSequenceClassification reads it); ``optimizer``
    is ``<name>-auto`` or ``<name>-<lr>``."""
    import text_task

    torch.manual_seed(seed)
    model = nn.Linear(train.tensors[0].shape[1], 2) if pooling == "mean" else text_task.head()
    name, lr = optimizer.split("-")
    auto = lr == "auto"
    make = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    inner = make(model.parameters(), lr=1.0 if auto else float(lr))
    n = len(train)
    engine = tunefree.make_private(model, inner, DataLoader(train, batch_size=batch),
                                   noise_multiplier=_sigma(epsilon, batch / n, epochs, steps, 1 / n ** 1.1),
                                   target_delta=1 / n ** 1.1, epochs=epochs, steps=steps,
                                   lr="auto" if auto else None,
                                   seed=seed)
    started = time.perf_counter()
    while engine.steps < engine.planned_steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            if len(y):
                F.cross_entropy(model(x), y).backward()
            engine.optimizer.step()
            if engine.steps >= engine.planned_steps:
                break
    engine.detach()
    if engine.lr_rule is not None:
        engine.lr_rule.apply_average()
    return {"valid": accuracy(model, valid), "test": accuracy(model, test), "spent": engine.epsilon(),
            "sigma": engine.noise_multiplier, "steps": engine.steps, "seconds": time.perf_counter() - started}


def summarise(path: str) -> None:
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    groups = defaultdict(list)
    for row in rows:
        key = (row.get("pooling", "mean"), row["train"], row["normalise"], round(row["epsilon"]),
               row["batch"], row["steps"], row["optimizer"])
        groups[key].append(row)
    print("| pooling | N | l2 | ε | batch | steps | optimizer | σ | seeds | valid (mean ± sd) "
          "| test (mean ± sd) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(groups, key=str):
        runs = groups[key]
        valid = [r["valid"] for r in runs]
        test = [r["test"] for r in runs]
        sd = statistics.stdev(valid) if len(valid) > 1 else 0.0
        test_sd = statistics.stdev(test) if len(test) > 1 else 0.0
        print(f"| {' | '.join(str(k) for k in key[:6])} | {key[6]} | {runs[0]['sigma']:.3g} | {len(runs)} | "
              f"{statistics.mean(valid):.3f} ± {sd:.3f} | {statistics.mean(test):.3f} ± {test_sd:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, nargs="+", default=[1900])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256])
    parser.add_argument("--epochs", type=float, nargs="+", default=[3.0])
    parser.add_argument("--optimizers", nargs="+", default=["adamw-auto"])
    parser.add_argument("--normalise", choices=["yes", "no", "both"], default="no")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--pooling", choices=["mean", "cls"], default="mean")
    parser.add_argument("--rule", action="store_true",
                        help="the batch size and length of tunefree.cli.text_defaults.schedule('head', N) "
                             "instead of --batches/--epochs")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarise", default=None)
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
        return
    torch.set_num_threads(1)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended to run by run
    for normalise in {"yes": [True], "no": [False], "both": [False, True]}[args.normalise]:
        for n in args.train:
            data = features(n, normalise, args.pooling)
            if args.rule:
                from tunefree.cli.text_defaults import schedule

                chosen = schedule("head", n, None, None, None)
                plans = [(chosen.batch_size, chosen.epochs, chosen.steps)]
            else:
                plans = [(min(b, n), e, None) for b in args.batches for e in args.epochs]
            for epsilon in args.epsilons:
                for batch, epochs, steps in plans:
                    for optimizer in args.optimizers:
                        for seed in args.seeds:
                            result = run(*data, epsilon, batch, epochs, optimizer, seed, args.pooling,
                                         steps)
                            row = {"train": n, "normalise": normalise, "epsilon": epsilon, "batch": batch,
                                   "epochs": epochs, "optimizer": optimizer, "seed": seed,
                                   "pooling": args.pooling, **result}
                            print(json.dumps(row), flush=True)
                            if out:
                                out.write(json.dumps(row) + "\n")
                                out.flush()


if __name__ == "__main__":
    main()
