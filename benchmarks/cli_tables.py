"""``tunefree train``'s default (SGD, ``--lr auto``) against a small fixed-lr grid, through the command line's
own training function, on generated tables and on digits (benchmarks/RESULTS.md §5e, issue 25 item 4).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/cli_tables.py --data forty --epsilons 1 3 8 \
        --seeds 0 1 2 --out forty.jsonl
    python benchmarks/cli_tables.py --summarise forty.jsonl

Each run goes through ``tunefree.cli.training.train``: the command line's CSV reading, private preprocessing
(category selection, standardisation, in the ledger), default MLP, batch 256, δ = 1/N^1.1. 20% of the command
line's training split (a seeded permutation) is held out as validation; every choice (the grid point) is made
on validation, and test accuracy is computed for the chosen grid point and the automatic rules only, once.

The tables are generated at run time (nothing downloaded); their formulas are in :func:`forty_columns` and
:func:`mixed_table`. ``--input-scale c`` multiplies every numeric feature after the command line's private
standardisation by ``c`` (the same table with inputs of another scale; the standardisation itself is run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import TensorDataset

from tunefree.cli import training

SGD_GRID = (0.3, 1.0, 3.0, 10.0)
ADAM_GRID = (0.001, 0.003, 0.01, 0.03)
DIGITS_SGD_GRID = (0.3, 1.0, 3.0)
VALID_FRACTION = 0.2


def forty_columns(path: str, rows: int = 30_000, seed: int = 2026) -> None:
    """40 numeric columns, 6 classes. With ``rng = numpy.random.default_rng(seed)``: latent z ~ N(0, I₄₀);
    column j is ``o_j + s_j·z_j`` with offsets o_j ~ U(−5, 5) and scales s_j ~ U(0.5, 3); the label is drawn
    from softmax(5·tanh(z A / √40) B) with A ~ N(0, 1)^{40×16}, B ~ N(0, 1)^{16×6} (a random teacher,
    sampled so that the Bayes accuracy is below 1). Written as CSV with columns x0..x39, label."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, 40))
    offsets, scales = rng.uniform(-5, 5, 40), rng.uniform(0.5, 3, 40)
    a, b = rng.standard_normal((40, 16)), rng.standard_normal((16, 6))
    logits = 5 * np.tanh(z @ a / math.sqrt(40)) @ b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    labels = (p.cumsum(1) > rng.uniform(size=(rows, 1))).argmax(1)
    _write(path, {**{f"x{j}": offsets[j] + scales[j] * z[:, j] for j in range(40)},
                  "label": [f"c{k}" for k in labels]})


def mixed_table(path: str, rows: int = 20_000, seed: int = 2026) -> None:
    """3 numeric and 3 text columns, 2 classes. With ``rng = numpy.random.default_rng(seed)``: age ~
    N(40, 12), income ~ lognormal(10, 0.5), hours ~ U(10, 60); colour of {red, green, blue}, city of 8 and
    plan of {basic, plus, pro} uniform; label = [0.05(age − 40) + [red] + 0.3 ln(income/2e4) + 0.02(hours −
    35) + 0.4·[plan = pro] − 0.1·city index/7 + N(0, 1) > 0.3]. CSV with those columns and label."""
    rng = np.random.default_rng(seed)
    age, income, hours = rng.normal(40, 12, rows), rng.lognormal(10, 0.5, rows), rng.uniform(10, 60, rows)
    colour = rng.choice(["red", "green", "blue"], rows)
    city = rng.integers(0, 8, rows)
    plan = rng.choice(["basic", "plus", "pro"], rows)
    score = (0.05 * (age - 40) + (colour == "red") + 0.3 * np.log(income / 2e4) + 0.02 * (hours - 35)
             + 0.4 * (plan == "pro") - 0.1 * city / 7 + rng.standard_normal(rows))
    _write(path, {"age": age.round(1), "income": income.round(0), "hours": hours.round(1), "colour": colour,
                  "city": [f"city{c}" for c in city], "plan": plan,
                  "label": np.where(score > 0.3, "yes", "no")})


def imbalanced_table(path: str, rows: int = 4_877, seed: int = 2026) -> None:
    """A binary table where most of the accuracy is the majority class (about 68% 'no'), like a credit or
    churn table: 4 numeric columns (two skewed) and 3 text columns. With ``rng =
    numpy.random.default_rng(seed)``: income ~ lognormal(10, 0.8), age ~ N(45, 14), debt ratio ~ Beta(2, 5),
    months ~ U(1, 120) rounded; region of 6, product of {a, b, c, d} and channel of {web, shop, phone}
    uniform; label 'yes' when 0.6·z(debt) − 0.4·z(ln income) + 0.3·[product = d] + 0.2·[channel = web]
    − 0.15·z(age) + N(0, 2.5²) is above its 68.4% quantile (z: the standardised column), else 'no': a weak
    signal, a few points above the majority rate."""
    rng = np.random.default_rng(seed)
    income, age = rng.lognormal(10, 0.8, rows), rng.normal(45, 14, rows)
    debt, months = rng.beta(2, 5, rows), rng.uniform(1, 120, rows).round()
    region = rng.integers(0, 6, rows)
    product, channel = rng.choice(list("abcd"), rows), rng.choice(["web", "shop", "phone"], rows)

    def z(v):
        return (v - v.mean()) / v.std()

    score = (0.6 * z(debt) - 0.4 * z(np.log(income)) + 0.3 * (product == "d") + 0.2 * (channel == "web")
             - 0.15 * z(age) + rng.normal(0, 2.5, rows))
    _write(path, {"income": income.round(0), "age": age.round(0), "debt_ratio": debt.round(3),
                  "months": months, "region": [f"r{r}" for r in region], "product": product,
                  "channel": channel, "label": np.where(score > np.quantile(score, 0.684), "yes", "no")})


def diamonds_like(path: str, rows: int = 53_940, seed: int = 2026) -> None:
    """A table shaped like the classic diamonds data, predicting the cut (5 classes: Fair 3%, Good 9%,
    Very Good 22%, Premium 26%, Ideal 40%) from carat, colour (7), clarity (8), depth, table, price and the
    three dimensions. With ``rng = numpy.random.default_rng(seed)``: cut drawn with those shares; depth
    and table drawn around a cut's own centre (Ideal 61.7 / 56, Premium 61.3 / 58.7, Very Good 61.8 /
    58, Good 62.4 / 58.7, Fair 64.1 / 59.1; deviations 0.7–1.9 / 1.2–3.9); carat ~ lognormal(−0.4,
    0.55); price = 4000·carat^1.7 times colour's and clarity's factors and a lognormal(0, 0.15) noise,
    bonus 5% for Ideal; x, y ≈ 6.4·carat^⅓, z ≈ depth%·x. Written as CSV with column 'cut' as the
    label ('label')."""
    rng = np.random.default_rng(seed)
    cuts = ["Fair", "Good", "Very Good", "Premium", "Ideal"]
    cut = rng.choice(5, rows, p=[0.03, 0.09, 0.224, 0.256, 0.40])
    depth_mean, depth_sd = np.array([64.1, 62.4, 61.8, 61.3, 61.7]), np.array([1.9, 1.9, 1.4, 1.2, 0.7])
    table_mean, table_sd = np.array([59.1, 58.7, 58.0, 58.7, 56.0]), np.array([3.9, 2.9, 2.1, 1.5, 1.2])
    depth = rng.normal(depth_mean[cut], depth_sd[cut])
    table = rng.normal(table_mean[cut], table_sd[cut]).round()
    carat = rng.lognormal(-0.4, 0.55, rows).clip(0.2, 5).round(2)
    colour, clarity = rng.integers(0, 7, rows), rng.integers(0, 8, rows)
    price = (4000 * carat ** 1.7 * (1 - 0.04 * colour) * (1 + 0.06 * clarity) * rng.lognormal(0, 0.15, rows)
             * (1 + 0.05 * (cut == 4))).round()
    x = (6.4 * carat ** (1 / 3) * rng.normal(1, 0.01, rows)).round(2)
    y = (x * rng.normal(1, 0.01, rows)).round(2)
    _write(path, {"carat": carat, "color": [list("DEFGHIJ")[c] for c in colour],
                  "clarity": [["I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF"][c] for c in clarity],
                  "depth": depth.round(1), "table": table, "price": price, "x": x, "y": y,
                  "z": (depth / 100 * x).round(2), "label": [cuts[c] for c in cut]})


def sklearn_table(name: str):
    """A generator writing one of scikit-learn's shipped tables (breast_cancer, wine, iris) as CSV."""
    def write(path: str) -> None:
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, f"load_{name}")()
        columns = {f"x{j}": bunch.data[:, j] for j in range(bunch.data.shape[1])}
        _write(path, {**columns, "label": [str(bunch.target_names[t]) for t in bunch.target]})
    return write


def _write(path: str, columns: dict) -> None:
    names = list(columns)
    with open(path, "w") as out:
        out.write(",".join(names) + "\n")
        for row in zip(*(columns[n] for n in names)):
            out.write(",".join(str(v) for v in row) + "\n")


# generator, epochs (40: the command line's default)
DATA = {"forty": (forty_columns, 10), "mixed": (mixed_table, 10), "digits": (None, 40),
        "imbalanced": (imbalanced_table, 40), "diamonds": (diamonds_like, 40),
        "breast_cancer": (sklearn_table("breast_cancer"), 40), "wine": (sklearn_table("wine"), 40)}


def prepared(name: str, epsilon: float, seed: int, folder: str, input_scale: float = 1.0,
             epochs: float | None = None):
    """The command line's prepared data (its releases made at ``epsilon``), with 20% of its training rows
    held out as validation: (train + valid as 'test', train + real test)."""
    generator, default_epochs = DATA[name]
    epochs = epochs or default_epochs
    dataset = "digits"
    if generator is not None:
        dataset = os.path.join(folder, f"{name}.csv")
        if not os.path.exists(dataset):
            generator(dataset)
    config = training.TrainConfig(dataset=dataset, epsilon=epsilon, epochs=epochs, seed=seed, quiet=True)
    data = training._prepared(config)
    x, y = data.train.tensors
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = len(y) - int(VALID_FRACTION * len(y))
    scale = _numeric_scale(data, input_scale)
    train = TensorDataset(x[order[:cut]] * scale, y[order[:cut]])
    valid = TensorDataset(x[order[cut:]] * scale, y[order[cut:]])
    test = TensorDataset(data.test.tensors[0] * scale, data.test.tensors[1])
    return config, replace(data, train=train, test=valid), replace(data, train=train, test=test)


def public_rms(data, input_scale: float) -> float | None:
    """The features' root mean square that the encoding makes public (``TableEncoder.public_input_rms``),
    with this benchmark's multiplier of the numeric columns folded in."""
    rms = training.public_input_rms(data)
    if rms is None or input_scale == 1.0:
        return rms
    names = data.feature_names
    groups = {name.split("=", 1)[0] for name in names if "=" in name}
    numeric = len(names) - sum("=" in name for name in names)
    return math.sqrt((input_scale ** 2 * numeric + len(groups)) / len(names))


def _numeric_scale(data, input_scale: float) -> torch.Tensor | float:
    """A multiplier for the numeric features (one-hot indicators and images keep their scale)."""
    if input_scale == 1.0 or data.kind != "table":
        return 1.0
    return torch.tensor([1.0 if "=" in name else input_scale for name in data.feature_names])


def one_run(config, data, optimizer: str, lr, input_rms: float | None = None) -> dict:
    """``tunefree train`` on ``data``; an automatic rate's budget sees ``input_rms`` (``None``: unknown)."""
    run_config = replace(config, optimizer=optimizer, lr=lr)
    original = training.public_input_rms
    training.public_input_rms = lambda _: input_rms
    try:
        result = training.train(run_config, data)
    finally:
        training.public_input_rms = original
    return {"accuracy": result["test_accuracy"], "epsilon": result["epsilon"], "steps": result["steps"],
            "lr_text": result["learning_rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="forty", choices=list(DATA))
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--input-scale", type=float, default=1.0)
    parser.add_argument("--epochs", type=float, default=None, help="the run's length (default: the data's)")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--budget", default="public", choices=["public", "unknown"],
                        help="the --lr auto runs' noise budget sees the inputs' public scale (the "
                             "default) or not (the rule before: κ(1 + ‖x₀‖) whatever the inputs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115
    folder = tempfile.mkdtemp(prefix="cli_tables_")
    grid = [] if args.skip_grid else (
        [("sgd", lr) for lr in (DIGITS_SGD_GRID if args.data == "digits" else SGD_GRID)]
        + [("adamw", lr) for lr in ADAM_GRID])
    for epsilon in args.epsilons:
        for seed in args.seeds:
            config, validation, testing = prepared(args.data, epsilon, seed, folder, args.input_scale,
                                                  args.epochs)
            where = {"data": args.data, "input_scale": args.input_scale, "epochs": config.epochs,
                     "epsilon": epsilon, "seed": seed}
            for optimizer, lr in grid:
                record = {**where, "method": f"{optimizer} {lr:g}",
                          "valid": one_run(config, validation, optimizer, lr)["accuracy"]}
                _emit(record, sink)
            rms = public_rms(validation, args.input_scale) if args.budget == "public" else None
            valid = one_run(config, validation, "sgd", "auto", rms)
            test = one_run(config, testing, "sgd", "auto", rms)
            _emit({**where, "method": f"auto ({args.budget} scale)", "input_rms": rms,
                   "valid": valid["accuracy"], "test": test["accuracy"],
                   "lr_text": test["lr_text"], "epsilon_spent": test["epsilon"]}, sink)
    if sink:
        sink.close()


def test_chosen(path: str) -> None:
    """Test accuracy of each setting's valid-chosen grid point (a run per seed), appended to ``path``."""
    rows = _read(path)
    chosen = _chosen_grid(rows)
    folder = tempfile.mkdtemp(prefix="cli_tables_")
    with open(path, "a") as sink:
        for (data, scale, epsilon), method in chosen.items():
            if any(r.get("chosen") and (r["data"], r["input_scale"], r["epsilon"]) == (data, scale, epsilon)
                   for r in rows):
                continue
            optimizer, lr = method.split()
            seeds = sorted({r["seed"] for r in rows if (r["data"], r["input_scale"], r["epsilon"])
                            == (data, scale, epsilon) and r["method"] == method})
            for seed in seeds:
                config, _, testing = prepared(data, epsilon, seed, folder, scale)
                test = one_run(config, testing, optimizer, float(lr))["accuracy"]
                _emit({"data": data, "input_scale": scale, "epsilon": epsilon, "seed": seed, "method": method,
                       "chosen": True, "test": test}, sink)


def _chosen_grid(rows: list[dict]) -> dict:
    valids: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if "valid" in r and r["method"].split()[0] in ("sgd", "adamw"):
            valids.setdefault((r["data"], r["input_scale"], r["epsilon"]), {}).setdefault(
                r["method"], []).append(r["valid"])
    return {key: max(methods, key=lambda m: statistics.mean(methods[m])) for key, methods in valids.items()}


def summarise(path: str) -> None:
    """Per setting: the valid-chosen grid point (valid / test) and each rule (valid / test, Δ test)."""
    rows = _read(path)
    chosen = _chosen_grid(rows)

    def cell(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"

    rules = sorted({r["method"] for r in rows if r["method"].split()[0] not in ("sgd", "adamw")})
    print("| data | input scale | ε | grid point (valid-chosen): valid / test | "
          + " | ".join(f"{rule}: valid / test, Δ test (Δ valid)" for rule in rules) + " |")
    print("|---|---|---|---|" + "---|" * len(rules))
    for key, method in sorted(chosen.items()):
        here = [r for r in rows if (r["data"], r["input_scale"], r["epsilon"]) == key]
        valid = [r["valid"] for r in here if r["method"] == method and "valid" in r]
        test = [r["test"] for r in here if r["method"] == method and "test" in r]
        cells = [key[0], f"{key[1]:g}", f"{key[2]:g}",
                 f"{method}: {statistics.mean(valid):.3f} / {cell(test) if test else '–'}"]
        for rule in rules:
            mine = [r for r in here if r["method"] == rule]
            if not mine:
                cells.append("–")
                continue
            rv, rt = [r["valid"] for r in mine], [r["test"] for r in mine]
            dt = 100 * (statistics.mean(rt) - statistics.mean(test)) if test else math.nan
            dv = 100 * (statistics.mean(rv) - statistics.mean(valid))
            cells.append(f"{statistics.mean(rv):.3f} / {cell(rt)}, {dt:+.1f} ({dv:+.1f})")
        print("| " + " | ".join(cells) + " |")


def _read(path: str) -> list[dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines]


def _emit(record: dict, sink) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")
        sink.flush()


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--summarise":
        summarise(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--test-chosen":
        test_chosen(sys.argv[2])
    else:
        main()
