"""The command line's preprocessing under the neighbour test, on drawn tables and image data sets.

Invariant (issue 29, class 6): no preprocessing step of ``tunefree train`` branches on a private value
except through a release. So two data sets that differ in one example, their runs coupled on the same
released values (the first run's releases, made at noise 0, handed back to the second), must give the
same decisions — the public arguments of each
release, the keywords ``make_private`` gets, the model's parameter shapes — and the same features and
labels for every training example they share. A refusal (the data's owner reads it; nothing is trained)
is allowed on either side; training on both sides with different decisions is a finding.

A draw is a table (numeric, categorical and bool columns, string labels; optionally a schema) or a Hugging
Face image data set (arrays of a declared pixel type, [H, W] or [H, W, C]), and one example changed in
one of the ways that have made preprocessing branch before: an outlier, a value of another magnitude,
a new category or label, a pixel beyond the type's usual range, an image of one value.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tunefree.cli import main, releases, scaling
from tunefree.cli import training as training_module
from tunefree.cli.split import held_out, split_key, table_rows


class _Stop(Exception):
    """Raised in place of make_private: everything before training has been decided."""


@dataclass
class Outcome:
    """What `tunefree train` decided before training (``None`` fields: refused, with ``refusal``)."""

    calls: list = field(default_factory=list)
    keywords: str = ""
    shapes: list = field(default_factory=list)
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    refusal: str | None = None

    def summary(self) -> tuple:
        return (self.calls, self.keywords, self.shapes)


class _ZeroNoise:
    """A release's randomness with every draw 0: the release is then its exact value."""

    def normal(self, shape, device, dtype):
        return torch.zeros(shape, device=device, dtype=dtype)


class Decisions:
    """Runs `tunefree train` up to make_private. The first run (:meth:`of` with ``record=True``) makes each
    release at noise 0 and keeps its output; a later run gets those outputs back, in order, whatever its
    own data: the two runs are coupled on the same released values, so everything after a release is the
    same function of the same public values in both, and only a branch on the data itself can differ."""

    def __init__(self, monkeypatch):
        self.outcome, self.recorded, self.recording = Outcome(), [], True
        self._select_real, self._gaussian_real = releases.select_partitions, scaling.release_gaussian
        monkeypatch.setattr(releases, "select_partitions", self._select)
        monkeypatch.setattr(scaling, "release_gaussian", self._gaussian)
        monkeypatch.setattr(training_module, "make_private", self._stop)

    def _released(self, call: tuple, make) -> object:
        self.outcome.calls.append(call)
        if self.recording:
            self.recorded.append(make())
            return self.recorded[-1]
        index = len(self.outcome.calls) - 1
        if index >= len(self.recorded):
            raise AssertionError(f"the neighbour made a release the data set did not: {call}")
        return self.recorded[index]

    def _select(self, histograms, sigma, threshold_delta, randomness):
        kept, threshold, event = self._released(
            ("selection", len(histograms), sigma, threshold_delta),
            lambda: self._select_real(histograms, sigma, threshold_delta, _ZeroNoise()))
        return [dict(k) for k in kept], threshold, event

    def _gaussian(self, values, sensitivity, sigma, randomness):
        noisy, event = self._released(("gaussian", tuple(values.shape), sensitivity, sigma),
                                      lambda: self._gaussian_real(values, sensitivity, sigma, _ZeroNoise()))
        return noisy.clone(), event

    def _stop(self, model, optimizer, loader, **keywords):
        self.outcome.keywords = repr(keywords)
        self.outcome.shapes = [tuple(p.shape) for p in model.parameters()]
        self.outcome.x, self.outcome.y = (t.clone() for t in loader.dataset.tensors)
        raise _Stop

    def of(self, path: Path, flags: list[str], capsys, record: bool = False) -> Outcome:
        """``record``: this run's releases are the ones later runs get back."""
        self.outcome, self.recording = Outcome(), record
        if record:
            self.recorded = []
        capsys.readouterr()
        try:
            code = main(["train", "--dataset", str(path), "--seed", "0", "--steps", "1", "--batch-size", "8",
                         "--quiet", "--epsilon", "3", *flags])
        except _Stop:
            return self.outcome
        self.outcome.refusal = f"exit {code}: {capsys.readouterr().err.strip()[-400:]}"
        return self.outcome


# ------------------------------------------------------------------------------------------- tables
@dataclass
class TableDraw:
    frame: pd.DataFrame
    row: int
    changes: dict
    flags: list[str]
    schema: dict | None


def draw_table(seed: int) -> TableDraw:
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    rows = rng.randint(120, 260)
    frame, numeric = {}, []
    for k in range(rng.randint(1, 3)):
        name = f"n{k}"
        kind = rng.choice(["normal", "lognormal", "integer", "tiny"])
        frame[name] = {"normal": gen.normal(0, 1, rows), "lognormal": gen.lognormal(5, 2, rows).round(2),
                       "integer": gen.integers(0, 100, rows).astype(float),
                       "tiny": gen.normal(0, 1e-4, rows)}[kind]
        numeric.append(name)
    for k in range(rng.randint(0, 2)):
        values = [f"c{k}_{v}" for v in range(rng.randint(2, 5))]
        frame[f"c{k}"] = gen.choice(values, rows, p=_skewed(len(values), gen))
    if rng.random() < 0.4:
        frame["b"] = gen.random(rows) < 0.3
    labels = [f"L{v}" for v in range(rng.randint(2, 3))]
    frame["label"] = gen.choice(labels, rows, p=_skewed(len(labels), gen))
    frame = pd.DataFrame(frame)
    schema, flags = None, []
    if rng.random() < 0.4:
        declared = rng.sample(numeric, rng.randint(1, len(numeric)))
        schema = {"numeric": {c: [float(frame[c].min()) - 1, float(frame[c].max()) + 1] for c in declared}}
    if rng.random() < 0.3:
        flags += ["--labels", ",".join(labels)]
    test = held_out(table_rows([frame[c] for c in frame.columns]), split_key(0))
    training = [i for i in range(rows) if not test[i]]
    row = rng.choice(training) if rng.random() < 0.85 else rng.randrange(rows)
    column = rng.choice(numeric) if rng.random() < 0.5 else rng.choice(list(frame.columns))
    changes = {column: _changed_cell(frame, column, rng, labels)}
    return TableDraw(frame, row, changes, flags, schema)


def _skewed(k: int, gen: np.random.Generator) -> np.ndarray:
    p = gen.dirichlet(np.ones(k)) + 0.15
    return p / p.sum()


def _changed_cell(frame: pd.DataFrame, column: str, rng: random.Random, labels: list[str]) -> object:
    if column == "label":
        return rng.choice(labels + ["L_new"])
    if column == "b":
        return rng.choice([True, False])
    if column.startswith("c"):
        return rng.choice(list(frame[column].unique()) + [f"{column}_new"])
    return rng.choice([1e12, -1e12, 0.0, 1e-12, -5.0, float(frame[column].max()) * 1000, 7.5])


def neighbour_frame(draw: TableDraw) -> pd.DataFrame | None:
    """The frame with the draw's row changed and, if the change moved the row across the keyed split, a
    numeric cell of the same row tweaked until it is back on its side (``None`` if no tweak does)."""
    key = split_key(0)
    frame = draw.frame
    side = held_out(table_rows([frame.loc[[draw.row], c] for c in frame.columns]), key)[0]
    spare = next((c for c in frame.columns if c.startswith("n") and c not in draw.changes), None)
    for salt in range(200):
        changed = frame.copy().astype(object)
        for column, value in draw.changes.items():
            changed.loc[draw.row, column] = value
        if salt:
            if spare is None:
                return None
            changed.loc[draw.row, spare] = float(salt) / 7
        if held_out(table_rows([changed.loc[[draw.row], c] for c in changed.columns]), key)[0] == side:
            return changed
    return None


def table_training_position(draw: TableDraw) -> int | None:
    """The draw's row's place among the training rows, ``None`` if it is a test row."""
    frame = draw.frame
    test = held_out(table_rows([frame[c] for c in frame.columns]), split_key(0))
    return None if test[draw.row] else int((~test[:draw.row]).sum())


def write_table(frame: pd.DataFrame, path: Path, schema: dict | None) -> list[str]:
    frame.to_csv(path, index=False)
    if schema is None:
        return []
    schema_path = path.with_suffix(".schema.json")
    schema_path.write_text(json.dumps(schema))
    return ["--schema", str(schema_path)]


# ------------------------------------------------------------------------------------------- images
PIXEL_TYPES = {"uint8": (0, 255), "uint16": (0, 65535), "float16": (0.0, 1.0), "float32": (0.0, 1.0),
               "float64": (0.0, 1.0)}


@dataclass
class ImageDraw:
    images: list[np.ndarray]
    labels: list[int]
    changed: np.ndarray
    index: int
    dtype: str
    flags: list[str]


def draw_images(seed: int) -> ImageDraw:
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    dtype = rng.choice(list(PIXEL_TYPES))
    low, high = PIXEL_TYPES[dtype]
    shape = rng.choice([(6, 6), (5, 7, 1), (6, 6, 3)])
    n = rng.randint(40, 70)
    if dtype.startswith("float"):
        images = [gen.uniform(low, high, shape).astype(dtype) for _ in range(n)]
    else:  # often a narrow range (binary images, 12-bit data in 16 bits): the cases that once decided a scale
        top = rng.choice([1, high // 16, high])
        images = [gen.integers(0, top + 1, shape).astype(dtype) for _ in range(n)]
    classes = rng.randint(2, 3)
    labels = [i % classes for i in range(n)]
    index = rng.randrange(n)
    changed = images[index].copy()
    extreme = {"uint8": 255, "uint16": 65535, "float16": rng.choice([5.0, -3.0, 6e4]),
               "float32": rng.choice([5.0, -3.0, 1e6]),
               "float64": rng.choice([5.0, -3.0, 1e6])}[dtype]
    if rng.random() < 0.5:
        changed.flat[rng.randrange(changed.size)] = extreme
    else:
        changed[...] = extreme
    flags = ["--labels", ",".join(str(c) for c in range(classes))] if rng.random() < 0.5 else []
    return ImageDraw(images, labels, changed, index, dtype, flags)


def write_images(images: list[np.ndarray], labels: list[int], dtype: str, path: Path) -> None:
    import datasets as hf

    hf.disable_progress_bars()
    features = hf.Features({"image": hf.Array3D(shape=images[0].shape, dtype=dtype) if images[0].ndim == 3
                            else hf.Array2D(shape=images[0].shape, dtype=dtype),
                            "label": hf.Value("int64")})
    train = hf.Dataset.from_dict({"image": images, "label": labels}, features=features)
    hf.DatasetDict({"train": train, "test": train.select(range(10))}).save_to_disk(str(path))
