"""``tunefree predict``: the predictions of a table model trained by ``tunefree train --out DIR`` on new
rows, prepared exactly as the training rows were.

``DIR/model.json`` holds everything the preprocessing decided — each column's encoding (category order,
``(other)``, public ranges), the released standardisation and the class order — and the model's
architecture; ``DIR/model.pt`` its weights. All of it is public or released, so predicting reads nothing
of the training rows. :class:`Predictor` is the same in Python::

    predictor = Predictor.load("runs/churn")
    labels = predictor.predict(pandas.read_csv("new.csv"))
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import models, tables
from .scaling import Standardisation
from .tables import DataError, TableEncoder


@dataclass
class Predictor:
    """A trained table model with the encoding of its inputs and classes."""

    model: nn.Module
    encoder: TableEncoder

    @classmethod
    def load(cls, run: str | Path) -> Predictor:
        """The model of the run directory ``run`` (``model.json`` and ``model.pt``)."""
        run = Path(run)
        try:
            description = json.loads((run / "model.json").read_text())
        except OSError as error:
            raise DataError(f"{run} holds no model.json: give the --out directory of a `tunefree train` "
                            "run") from error
        if description["table"] is None:
            raise DataError(f"{run} holds a model trained on {description['kind']} data: `tunefree predict` "
                            "applies table models (load model.pt with tunefree.cli.models.build and "
                            "model.json's model, input_shape and classes)")
        encoder = TableEncoder.from_dict(description["table"])
        model = models.build(description["model"], "table", tuple(description["input_shape"]),
                             len(description["classes"]),
                             None if description["hidden"] is None else tuple(description["hidden"]))
        model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
        return cls(model.eval(), encoder)

    def features(self, frame, source: str = "the rows") -> torch.Tensor:
        """The model's inputs for the rows of ``frame`` (a DataFrame with the training columns)."""
        tables.check_no_missing(frame[[c.name for c in self.encoder.columns if c.name in frame.columns]],
                                source)
        x = torch.as_tensor(self.encoder.features(frame, source), dtype=torch.float64)
        if self.encoder.standardisation is not None:
            x = Standardisation.from_dict(self.encoder.standardisation).apply(x)
        return x.to(torch.float32)

    @torch.no_grad()
    def predict(self, frame, source: str = "the rows") -> list[str]:
        """The predicted class of each row (its name; ``(other)`` for the labels not selected)."""
        logits = self.model(self.features(frame, source))
        names = self.encoder.class_names
        return [names[i] for i in logits.argmax(1).tolist()]


def add_parser(commands: Any) -> argparse.ArgumentParser:
    predict = commands.add_parser(
        "predict", help="predict with a table model trained by `tunefree train --out DIR`",
        description="The predicted class of each row of a table, by the model of a run directory; the "
                    "rows are encoded and scaled exactly as the training rows were (model.json).")
    predict.add_argument("--run", type=Path, required=True, help="the run directory (--out of the run)")
    predict.add_argument("--data", required=True,
                         help="a .csv, .jsonl or .parquet table with the training columns (the label "
                              "column may be absent)")
    predict.add_argument("--na-values", default="",
                         help="comma-separated cell texts that mark a missing value, as in training")
    predict.add_argument("--output", type=Path, default=None,
                         help="write the table with a 'prediction' column here (.csv; default: stdout)")
    return predict


def run(args: argparse.Namespace) -> int:
    from . import text
    from .datasets import read_frame

    if text.holds_text_model(args.run):
        return text.predict_command(args)
    predictor = Predictor.load(args.run)
    frame = read_frame(Path(args.data))
    marks = tuple(v.strip() for v in args.na_values.split(",") if v.strip())
    categorical = {c.name: list(c.categories) for c in predictor.encoder.columns if c.kind == "categorical"}
    frame = tables.clean(frame, marks, tables.Schema(categorical=categorical))  # as in training
    frame["prediction"] = predictor.predict(frame, Path(args.data).name)
    if args.output is None:
        frame.to_csv(sys.stdout, index=False)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.output, index=False)
        print(f"{len(frame)} predictions written to {args.output}")
    return 0
