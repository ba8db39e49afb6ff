"""Why ``tunefree train``'s default sits at the majority rate on a weak, imbalanced table where SGD at a fixed
lr of 3 does not (issue 30 item 7; benchmarks/RESULTS.md §15e).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/imbalanced_cause.py \
        '{"kind": "pocket", "tseeds": [0, 1, 2]}' sgd:auto,sgd:2,sgd:3,sgd:autok8 3 0,1,2

Arguments: a table (JSON: the keywords of :func:`weak_table`, with ``tseeds`` the tables' seeds, or
``{"table": NAME}`` for one of ``cli_tables.py``'s generated tables at its epochs), the methods (comma-
separated), the ε's and the run seeds. Each run goes through ``tunefree.cli.training.train`` on the command
line's prepared data with 20% of its training split held out as validation (``cli_tables.prepared``'s split);
every figure printed is **validation** accuracy, beside the validation rows' majority rate, the share of
validation rows predicted as each class by the model the run keeps, and that share for the minority class
every fourth epoch (``hist``).

A method is ``OPTIMIZER:LR`` — ``sgd:3`` (a fixed rate), ``inf:3`` (SGD at lr 3 without noise, ε = ∞), or
``sgd:auto`` (the default) and its diagnostic variants: ``autok<κ>`` (the noise budget κ instead of 4),
``autonob`` (no noise budget), ``autowm0`` (DoG's walk margin 0), ``autonoavg`` (the last weights kept, not
the average), ``autohead<f>`` (the MLP's last layer initialised × f), ``autoprior`` (its bias initialised at
the log of the training rows' class shares), ``autocw`` (the loss weighted by the inverse class shares) —
then optionally ``@field=value`` overrides of the run's ``TrainConfig`` (``@clipping=abadi``,
``@model=linear``, ``@epochs=120``) and ``@prior=1`` (the prior bias for any method). The variants that
read the class shares of the training rows (``prior``, ``cw``) are diagnoses, not private runs: they use
the rows' exact shares.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_tables as ct  # noqa: E402

from tunefree.cli import models, training  # noqa: E402
from tunefree.components import dog  # noqa: E402


def weak_table(path: str, rows: int = 4_877, seed: int = 0, kind: str = "linear", noise: float = 2.5,
               n_cat: int = 3, card: int = 4, n_num: int = 4, majority: float = 0.684, pocket: float = 0.06,
               pocket_rate: float = 0.8) -> None:
    """A binary table with 68.4% 'no' and a weak signal. With ``rng = numpy.random.default_rng(seed)``:
    numeric columns n_j ~ N(0, 1) for even j and lognormal(0, 0.8) for odd j; ``n_cat`` text columns c_j
    uniform over ``card`` values. ``kind="linear"``: 'yes' when Σ_j 0.5·(−1)^j·z(n_j or ln n_j) + Σ_j
    0.3·[c_j = v0] + N(0, noise²) is above its ``majority`` quantile. ``kind="pocket"``: the rows with
    c0 = v0 and n0 above its (1 − pocket·card) quantile (about ``pocket`` of the rows) are 'yes' with
    probability ``pocket_rate``, the others with the probability that makes the overall share of 'yes'
    1 − ``majority`` (0.285 by default): all the signal is one interaction held by 6% of the rows."""
    rng = np.random.default_rng(seed)
    num = {f"n{j}": rng.lognormal(0, 0.8, rows) if j % 2 else rng.normal(0, 1, rows) for j in range(n_num)}
    cat = {f"c{j}": rng.integers(0, card, rows) for j in range(n_cat)}

    def z(v):
        return (v - v.mean()) / v.std()

    if kind == "linear":
        score = sum(0.5 * z(np.log(v) if j % 2 else v) * (-1) ** j for j, v in enumerate(num.values()))
        score = score + sum(0.3 * (c == 0) for c in cat.values()) + rng.normal(0, noise, rows)
        y = score > np.quantile(score, majority)
    else:
        first = num["n0"]
        inside = (cat["c0"] == 0) & (first > np.quantile(first, 1 - pocket * card))
        base = (1 - majority - inside.mean() * pocket_rate) / (1 - inside.mean())
        y = rng.uniform(size=rows) < np.where(inside, pocket_rate, base)
    ct._write(path, {**{k: v.round(3) for k, v in num.items()},
                     **{k: [f"v{x}" for x in v] for k, v in cat.items()}, "label": np.where(y, "yes", "no")})


SEEN: dict = {}


@torch.no_grad()
def accuracy_and_predictions(model, data, batch_size: int = 1024) -> float:
    """``training.accuracy``, also keeping the share of rows predicted as each class."""
    was = model.training
    model.eval()
    x, y = data.tensors
    predicted = model(x).argmax(1)
    SEEN["rates"] = torch.bincount(predicted, minlength=int(y.max()) + 1).float().div(len(y)).tolist()
    SEEN.setdefault("history", []).append(round(SEEN["rates"][1], 3))
    model.train(was)
    return float((predicted == y).float().mean())


training.accuracy = accuracy_and_predictions


def class_shares(data) -> torch.Tensor:
    labels = data.train.tensors[1]
    return (torch.bincount(labels, minlength=data.num_classes).float() / len(labels)).clamp_min(1e-3)


def run(config, data, optimizer: str, lr, rms, prior: bool = False) -> dict:
    """One run of ``one_run`` with the method's variant patched in (and out again)."""
    SEEN["history"] = []
    variant = None
    if isinstance(lr, str) and lr.startswith("auto"):
        variant, lr = lr[4:], "auto"
    saved = (training.TrainConfig.auto_lr, training._model_kept, dog.DistanceOverGradients.apply_average,
             models.build, training.F, dog.WALK_MARGIN)
    build = models.build

    def with_budget(kappa):
        return lambda self, input_rms=None: dog.DoG(input_rms=input_rms, noise_budget=kappa)

    if variant == "nob":
        training.TrainConfig.auto_lr = with_budget(None)
    if variant == "wm0":
        dog.WALK_MARGIN = 0.0
    if variant and variant.startswith("k"):
        training.TrainConfig.auto_lr = with_budget(float(variant[1:]))
    if variant and variant.startswith("head"):
        factor = float(variant[4:])

        def build_head(*args, **kwargs):
            model = build(*args, **kwargs)
            with torch.no_grad():
                model[-1].weight.mul_(factor)
            return model
        training.models.build = build_head
    if variant == "cw":
        shares = class_shares(data)
        weight = (1 / shares) / (1 / shares)[shares > 1e-3].mean()

        class Weighted:
            @staticmethod
            def cross_entropy(logits, labels, **kwargs):
                return F.cross_entropy(logits, labels, weight=weight, **kwargs)
        training.F = Weighted
    if variant == "prior" or prior:
        shares = class_shares(data)

        def build_prior(*args, **kwargs):
            model = build(*args, **kwargs)
            with torch.no_grad():
                model[-1].bias.copy_(shares.log() - shares.log().mean())
            return model
        training.models.build = build_prior
    if variant == "noavg":
        training._model_kept = lambda engine, config: contextlib.nullcontext()
        dog.DistanceOverGradients.apply_average = lambda self, params=None: None
    try:
        result = ct.one_run(config, data, optimizer, lr, rms)
    finally:
        (training.TrainConfig.auto_lr, training._model_kept, dog.DistanceOverGradients.apply_average,
         training.models.build, training.F, dog.WALK_MARGIN) = saved
    return {**result, "rates": SEEN.get("rates"), "history": SEEN["history"][::4]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    methods = sys.argv[2].split(",")
    epsilons = [float(e) for e in sys.argv[3].split(",")]
    seeds = [int(s) for s in sys.argv[4].split(",")]
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="imbalanced_cause_")
    name = "g_" + "_".join(f"{k}{v}" for k, v in spec.items())
    table = spec.pop("table", None)
    epochs = ct.DATA[table][1] if table else 40
    for table_seed in spec.pop("tseeds", [0]):
        path = os.path.join(folder, f"{name}_{table_seed}.csv")
        if table:
            ct.DATA[table][0](path)
        else:
            weak_table(path, seed=table_seed, **spec)
        for epsilon in epsilons:
            for seed in seeds:
                config = training.TrainConfig(dataset=path, epsilon=epsilon, epochs=epochs, seed=seed,
                                              quiet=True)
                data = training._prepared(config)
                x, y = data.train.tensors
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
                cut = len(y) - int(ct.VALID_FRACTION * len(y))
                valid = TensorDataset(x[order[cut:]], y[order[cut:]])
                validation = replace(data, train=TensorDataset(x[order[:cut]], y[order[:cut]]), test=valid)
                rms = training.public_input_rms(validation)
                majority = float(torch.bincount(valid.tensors[1]).max()) / len(valid)
                for method in methods:
                    method, *overrides = method.split("@")
                    fields = dict(o.split("=") for o in overrides)
                    fields = {k: (float(v) if k == "epochs" else v) for k, v in fields.items()}
                    prior = bool(fields.pop("prior", False))
                    optimizer, lr = method.split(":")
                    lr = lr if lr.startswith("auto") else float(lr)
                    target = math.inf if optimizer == "inf" else epsilon
                    run_config = replace(config, epsilon=target, **fields)
                    started = time.time()
                    result = run(run_config, validation, "sgd" if optimizer == "inf" else optimizer, lr,
                                 rms if isinstance(lr, str) else None, prior)
                    print(json.dumps({
                        "gen": name, "tseed": table_seed, "eps": epsilon, "seed": seed, "d": x.shape[1],
                        "method": method + (str(fields) if fields else "") + ("+prior" if prior else ""),
                        "valid": round(result["accuracy"], 4), "valid_major": round(majority, 4),
                        "pred": [round(v, 3) for v in result["rates"]], "lr": result["lr_text"][26:60],
                        "hist": result["history"], "s": round(time.time() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
