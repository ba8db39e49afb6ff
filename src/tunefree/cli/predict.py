"""``tunefree predict``: the predictions of a model trained by ``tunefree train --out DIR`` on new rows or
images, prepared exactly as the training data were.

What the run directory holds says which model it is (:func:`run_kind`): ``model.json`` and ``model.pt``
for table and image models, ``model/`` for text models. ``model.json`` holds everything the preprocessing
decided — a table's column encodings (category order, ``(other)``, public ranges), the released
standardisation, an image's pixel scale, the class order — and the model's architecture. All of it is
public or released, so predicting reads nothing of the training rows. In Python::

    predictor = load("runs/churn")                      # a TablePredictor or an ImagePredictor
    labels = predictor.predict(pandas.read_csv("new.csv"))

Tables and images are served by a loader in :data:`LOADERS`; text runs by the text mode
(``cli/text.py``, ``predict_command``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import models, tables
from .datasets import image_array, pixel_scale, read_digits, read_frame
from .releases import OTHER
from .scaling import Standardisation
from .split import cell_text
from .tables import DataError, TableEncoder

PREDICT_REMEDY = "fill it in, or drop the rows that lack a value (the model needs every column)"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def run_kind(run: str | Path) -> str:
    """``"table"``, ``"image"`` or ``"text"``: the kind of model the run directory holds."""
    run = Path(run)
    if (run / "model.json").is_file():
        return json.loads((run / "model.json").read_text())["kind"]
    if (run / "model").is_dir():
        return "text"
    raise DataError(f"{run} holds no model.json (table and image runs) and no model/ (text runs): give the "
                    "--out directory of a `tunefree train` run")


def _description(run: Path) -> dict[str, Any]:
    return json.loads((run / "model.json").read_text())


def _model(run: Path, description: dict[str, Any]) -> nn.Module:
    model = models.build(description["model"], description["kind"], tuple(description["input_shape"]),
                         len(description["classes"]),
                         None if description["hidden"] is None else tuple(description["hidden"]))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    return model.eval()


@torch.no_grad()
def _classes_of(model: nn.Module, x: torch.Tensor, classes: list[str], batch: int = 1024) -> list[str]:
    indices = torch.cat([model(x[i:i + batch]).argmax(1) for i in range(0, len(x), batch)]) if len(x) \
        else torch.zeros(0, dtype=torch.long)
    return [classes[i] for i in indices.tolist()]


@dataclass
class TablePredictor:
    """A trained table model with the encoding of its inputs and classes."""

    model: nn.Module
    encoder: TableEncoder

    @classmethod
    def load(cls, run: str | Path) -> TablePredictor:
        """The model of the run directory ``run`` (``model.json`` and ``model.pt``)."""
        run = Path(run)
        description = _description(run)
        return cls(_model(run, description), TableEncoder.from_dict(description["table"]))

    def prepare(self, frame, na_values: tuple[str, ...] = ()):
        """``frame`` read as in training: ``na_values`` cells missing, text columns of numbers as numbers
        (the model's categorical columns stay text)."""
        categorical = {c.name: list(c.categories) for c in self.encoder.columns if c.kind == "categorical"}
        return tables.clean(frame, na_values, tables.Schema(categorical=categorical))

    def features(self, frame, source: str = "the rows") -> torch.Tensor:
        """The model's inputs for the rows of ``frame`` (a DataFrame with the training columns)."""
        present = [c.name for c in self.encoder.columns if c.name in frame.columns]
        tables.check_no_missing(frame[present], source, PREDICT_REMEDY)
        for column in self.encoder.columns:
            if column.kind == "numeric" and column.name in frame.columns:
                _check_numbers(frame[column.name], column.name, source)
        x = torch.as_tensor(self.encoder.features(frame, source, training=False), dtype=torch.float64)
        if self.encoder.standardisation is not None:
            x = Standardisation.from_dict(self.encoder.standardisation).apply(x)
        return x.to(torch.float32)

    def predict(self, frame, source: str = "the rows") -> list[str]:
        """The predicted class of each row (its name; ``(other)`` for the labels not selected)."""
        return _classes_of(self.model, self.features(frame, source), self.encoder.class_names)

    def unseen(self, frame) -> dict[str, int]:
        """Per categorical column with an ``(other)`` category: how many rows hold a value the training
        selection did not keep (they are encoded as ``(other)``)."""
        counts = {}
        for column in self.encoder.columns:
            if column.kind == "categorical" and column.other and column.name in frame.columns:
                known = set(column.categories)
                counts[column.name] = sum(cell_text(v) not in known for v in frame[column.name])
        return {name: count for name, count in counts.items() if count}

    def run(self, args: argparse.Namespace) -> tuple[Any, list[str]]:
        frame = self.prepare(read_frame(Path(args.data)), _marks(args.na_values))
        name = Path(args.data).name
        frame["prediction"] = self.predict(frame, name)
        notes = [f"column {column!r}: {count} of {len(frame)} rows hold values the training rows' private "
                 f"selection did not keep; they are encoded as {OTHER!r}"
                 for column, count in self.unseen(frame).items()]
        return frame, notes


def _check_numbers(values, column: str, source: str) -> None:
    """Refuse text in a column the model takes as numbers, naming the row and the value."""
    if tables._kind(values) == "numeric":
        return
    row = next(i for i, v in enumerate(values) if not tables._is_number(v))
    raise DataError(f"{source}: column {column!r} holds {values.iloc[row]!r} in data row {row + 1} (counting "
                    "from 1 after the header), and the model takes numbers there: fix the cell, or pass "
                    f"--na-values {str(values.iloc[row]).strip()!r} if it marks a missing value (then drop "
                    "such rows)")


def _marks(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


@dataclass
class ImagePredictor:
    """A trained image model: images of its size, scaled by their storage type's range as in training."""

    model: nn.Module
    input_shape: tuple[int, ...]
    classes: list[str]

    @classmethod
    def load(cls, run: str | Path) -> ImagePredictor:
        run = Path(run)
        description = _description(run)
        return cls(_model(run, description), tuple(description["input_shape"]), description["classes"])

    def predict(self, images: np.ndarray, source: str = "the images") -> list[str]:
        """The predicted class of each image of ``images`` ([N, C, H, W], already scaled to [0, 1])."""
        if tuple(images.shape[1:]) != self.input_shape:
            raise DataError(f"{source}: the images are {list(images.shape[1:])} (channels, height, width), "
                            f"and the model takes {list(self.input_shape)}: give images of that size")
        return _classes_of(self.model, torch.as_tensor(images, dtype=torch.float32), self.classes)

    def read(self, spec: str) -> tuple[list[str], np.ndarray]:
        """The images of ``spec`` with a name each: ``digits`` (the built-in 8×8 digits), a ``.npy`` array
        ([N, H, W], [N, C, H, W] or [N, H, W, C]) or a directory of image files (converted to grey or RGB
        as the model's channels say)."""
        if spec == "digits":
            raw = read_digits()
            return [str(i) for i in range(len(raw.x))], raw.x
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise DataError(f"{path} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
            from PIL import Image

            mode = {1: "L", 3: "RGB"}.get(self.input_shape[0])
            if mode is None:
                raise DataError(f"the model takes {self.input_shape[0]} channels: give a .npy array")
            arrays = [np.asarray(Image.open(f).convert(mode)) for f in files]
            scale = pixel_scale(arrays[0].dtype, str(path))
            return [f.name for f in files], image_array(arrays, str(path), scale)
        if path.suffix.lower() == ".npy" and path.is_file():
            array = np.load(path, allow_pickle=False)
            if array.ndim not in (3, 4) or len(array) == 0:
                raise DataError(f"{path}: expected an array of images [N, H, W] or [N, C, H, W], got "
                                f"{list(array.shape)}")
            x = image_array(list(array), str(path), pixel_scale(array.dtype, str(path)))
            return [str(i) for i in range(len(x))], x
        raise DataError(f"{spec}: give 'digits', a .npy array of images or a directory of image files")

    def run(self, args: argparse.Namespace) -> tuple[Any, list[str]]:
        import pandas as pd

        if args.na_values:
            raise DataError("--na-values marks missing cells of a table, and this run's model takes images: "
                            "drop it")
        names, images = self.read(args.data)
        return pd.DataFrame({"image": names, "prediction": self.predict(images, str(args.data))}), []


# What serves each kind of run directory (run_kind); a text run is served by cli/text.py's predict_command.
LOADERS: dict[str, Callable[[Path], Any]] = {"table": TablePredictor.load, "image": ImagePredictor.load}


def load(run: str | Path) -> TablePredictor | ImagePredictor:
    """The predictor of the run directory ``run``, whatever model it holds; refused, with the reason, for
    a kind ``tunefree predict`` does not serve."""
    run = Path(run)
    kind = run_kind(run)
    if kind not in LOADERS:
        raise DataError(f"{run} holds a {kind} model, which `tunefree predict` serves through the text "
                        "mode: run `tunefree predict --run DIR --data FILE`")
    return LOADERS[kind](run)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    predict = commands.add_parser(
        "predict", help="predict with a model trained by `tunefree train --out DIR`",
        description="The predicted class of each row of a table or of each image, by the model of a run "
                    "directory; the inputs are encoded and scaled exactly as the training data were "
                    "(model.json).")
    predict.add_argument("--run", type=Path, required=True, help="the run directory (--out of the run)")
    predict.add_argument("--data", required=True,
                         help="table models: a .csv, .jsonl or .parquet table with the training columns "
                              "(the label column may be absent); image models: 'digits', a .npy array of "
                              "images or a directory of image files")
    predict.add_argument("--na-values", default="",
                         help="table models: comma-separated cell texts that mark a missing value, as in "
                              "training")
    predict.add_argument("--output", type=Path, default=None,
                         help="write the inputs (a table's rows, an image's name) with a 'prediction' "
                              "column here (.csv; default: stdout)")
    return predict


def run(args: argparse.Namespace) -> int:
    if run_kind(args.run) == "text":
        from . import text  # the text mode's own predictor (it needs transformers)

        return text.predict_command(args)
    frame, notes = load(args.run).run(args)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output is None:
        frame.to_csv(sys.stdout, index=False)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.output, index=False)
        print(f"{len(frame)} predictions written to {args.output}")
    return 0
