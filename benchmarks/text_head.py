"""The text command line's head on frozen features against a non-private logistic regression on the same
features, on generated short reviews (``text_reviews.py``, imbalanced about 65/35 to 75/25): what limits the
default, and the recipe chosen on validation (benchmarks/RESULTS.md §5i).

    OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/text_features.py     # embed once (cached)
    OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/text_head.py --epsilons 3 8 --seeds 0 1 2 \
        --out head.jsonl
    python benchmarks/text_head.py --summarise head.jsonl

Features: the packaged all-MiniLM-L6-v2's mean-pooled states (``text_features.py``, the command line's own
loading and tokenisation), averaged over layers 1–6 as ``text_models.mean_pooled`` does (``--states mean``,
the default) or of one layer (``--states 6``: the last, the command line's input before this benchmark). Each
data set is split 60/20/20 (train / valid / test); every choice is made on validation, test is reported for
the chosen recipe. Every private run goes through ``tunefree.make_private`` as the command line's head does:
AUTO-S, δ = 1/N^1.1, the batch and length of ``text_defaults.schedule("head", N)`` (or a variant's), σ
calibrated on the whole ledger — the run's prior releases are the command line's defaults: the label selection
(5%), the token-length quantile (5%) and, for the centred inputs, ``text_head.release_centre`` (5%, its real
noise) — and ``lr="auto"`` keeping the averaged weights. Variants:

- ``before``: the raw mean-pooled states, AdamW ``lr="auto"`` (the default before this benchmark);
- ``unit-centred-sgd`` / ``-adamw``: ``text_head.head_inputs`` (unit length, privately centred, ×√d),
  SGD / AdamW ``lr="auto"``;
- ``unit-sgd``: unit length ×√d, not centred (no release);
- ``unit-centred-sgd-long``: 300 steps of batch N/4;
- ``unit-centred-sgd-<lr>``: SGD at a fixed rate (the grid the automatic rate is judged against);
- ``logistic``: scikit-learn's logistic regression on the raw states, non-private, C chosen on validation
  (the level the head should reach minus what the noise costs);
- a variant at ε = ∞ is the same recipe without noise (the command line's reference run).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections import defaultdict

import text_features
import text_reviews
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.cli import text_defaults, text_head
from tunefree.cli.releases import LENGTH_SHARE, SELECTION_SHARE, Budget
from tunefree.privacy.mechanisms import threshold_event

# σ of a share of the budget, calibrated once per budget and share (each release of a run draws its own noise)
Budget.noise = functools.cache(Budget.noise)

VARIANTS = ("before", "unit-centred-sgd", "unit-centred-adamw", "unit-sgd", "unit-centred-sgd-long",
            "unit-centred-adamw-long",
            "unit-centred-sgd-1", "unit-centred-sgd-3", "unit-centred-sgd-10")


def _prior(budget: Budget, centred: bool) -> list:
    """The ledger's preprocessing events of a default run: label selection, token length, the centre."""
    import dp_accounting as dpa

    if not budget.private:
        return []
    selection = budget.noise(SELECTION_SHARE, delta_share=0.5)
    events = [threshold_event(selection, SELECTION_SHARE * 0.5 * budget.delta),
              dpa.GaussianDpEvent(budget.noise(LENGTH_SHARE))]
    if centred:
        events.append(dpa.GaussianDpEvent(budget.noise(text_head.CENTRE_SHARE)))
    return events


@functools.cache
def _sigma(epsilon: float, n: int, batch: int, steps: int, centred: bool) -> float:
    """σ of the training steps so that the whole ledger (prior releases and steps) spends ε."""
    budget = Budget(epsilon, 1 / n ** 1.1)
    model = nn.Linear(1, 2)
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                   DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=batch),
                                   target_epsilon=epsilon, target_delta=budget.delta, steps=steps,
                                   prior_releases=_prior(budget, centred))
    sigma = engine.noise_multiplier
    engine.detach()
    return sigma


def inputs(variant: str, states: torch.Tensor, train: torch.Tensor, epsilon: float, seed: int
           ) -> torch.Tensor:
    n = len(train)
    if variant == "before":
        return states
    if variant == "unit-sgd":
        return text_head.head_inputs(states, torch.zeros(states.shape[1], dtype=torch.float64))
    centre, _ = text_head.release_centre(states, train, Budget(epsilon, 1 / n ** 1.1), seed)
    return text_head.head_inputs(states, centre)


def head_run(variant: str, x: torch.Tensor, y: torch.Tensor, train, valid, test, epsilon: float,
             seed: int) -> dict:
    n = len(train)
    plan = text_defaults.schedule("head", n, None, None, None)
    batch, steps = plan.batch_size, plan.steps
    if variant.endswith("-long"):
        batch, steps = min(n, max(64, n // 4)), 300
    optimizer, lr = ("adamw", "auto") if variant == "before" or "adamw" in variant else ("sgd", "auto")
    if variant.split("-")[-1].replace(".", "").isdigit():
        lr = float(variant.split("-")[-1])
    torch.manual_seed(seed)
    model = nn.Linear(x.shape[1], int(y.max()) + 1)
    make = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    inner = make(model.parameters(), lr=1.0 if lr == "auto" else lr)
    centred = "centred" in variant
    sigma = _sigma(epsilon, n, batch, steps, centred) if math.isfinite(epsilon) else 0.0
    loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=batch)
    engine = tunefree.make_private(model, inner, loader,
                                   noise_multiplier=sigma, target_delta=1 / n ** 1.1, steps=steps,
                                   lr="auto" if lr == "auto" else None, seed=seed)
    started = time.perf_counter()
    while engine.steps < steps:
        for xb, yb in engine.data_loader:
            engine.optimizer.zero_grad()
            if len(yb):
                F.cross_entropy(model(xb), yb).backward()
            engine.optimizer.step()
            if engine.steps >= steps:
                break
    engine.detach()
    if engine.dog_lr is not None:
        engine.dog_lr.apply_average()
    with torch.no_grad():
        acc = {split: float((model(x[rows]).argmax(1) == y[rows]).float().mean())
               for split, rows in (("valid", valid), ("test", test))}
    return {**acc, "sigma": sigma, "batch": batch, "steps": steps, "seconds": time.perf_counter() - started}


def logistic(states, y, train, valid, test) -> dict:
    from sklearn.linear_model import LogisticRegression

    best = None
    for c in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0):
        fit = LogisticRegression(C=c, max_iter=5000).fit(states[train].numpy(), y[train].numpy())
        scores = {split: float((fit.predict(states[rows].numpy()) == y[rows].numpy()).mean())
                  for split, rows in (("valid", valid), ("test", test))}
        if best is None or scores["valid"] > best["valid"]:
            best = {**scores, "C": c}
    return best


def summarise(path: str) -> None:
    with open(path) as lines:
        rows = [json.loads(line) for line in dict.fromkeys(lines)]  # a row written twice counts once
    groups = defaultdict(list)
    for row in rows:
        states = f" (states {row['states']})" if "states" in row else ""
        groups[(row["data"], row["epsilon"], row["variant"] + states)].append(row)
    print("| data | ε | variant | seeds | valid (mean ± sd) | test (mean ± sd) |")
    print("|---|---|---|---|---|---|")

    def order(key):
        name = key[2].split(" ")[0]
        variant = (VARIANTS.index(name) if name in VARIANTS else -1, key[2])
        return key[0], float(key[1]) if key[1] != "-" else -1.0, variant

    for key in sorted(groups, key=order):
        runs = groups[key]
        cells = []
        for split in ("valid", "test"):
            values = [r[split] for r in runs]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ± {sd:.3f}")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {len(runs)} | {cells[0]} | {cells[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", default=list(text_reviews.DATASETS))
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--states", default="mean",
                        help="which layer's mean-pooled states: 0-6 (6: the last; rows written without a "
                             "'states' key are the last layer's) or 'mean' (the mean of layers 1-6, the "
                             "command line's) (default: mean)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarise", default=None)
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
        return
    torch.set_num_threads(1)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended to run by run

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    def emit_states(row: dict) -> None:
        emit({**row, "states": args.states} if args.states != "6" else row)

    for name in args.data:
        saved = text_features.features(name)
        layers = saved["layers"]
        states = layers[:, 1:].mean(1) if args.states == "mean" else layers[:, int(args.states)]
        y = saved["labels"]
        train, valid, test = saved["train"], saved["valid"], saved["test"]
        majority = {split: max(float(y[rows].float().mean()), 1 - float(y[rows].float().mean()))
                    for split, rows in (("valid", valid), ("test", test))}
        emit_states({"data": name, "epsilon": "-", "variant": "majority", "seed": 0, **majority})
        emit_states({"data": name, "epsilon": "inf", "variant": "logistic", "seed": 0,
              **logistic(states, y, train, valid, test)})
        for epsilon in args.epsilons:
            for variant in args.variants:
                for seed in args.seeds:
                    x = inputs(variant, states, train, epsilon, seed)
                    emit_states({"data": name, "epsilon": epsilon, "variant": variant, "seed": seed,
                          **head_run(variant, x, y, train, valid, test, epsilon, seed)})


if __name__ == "__main__":
    main()
