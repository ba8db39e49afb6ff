"""Feature columns of a table as numbers, without learning anything silently from the private rows.

* **Kinds.** A column is numeric when its cells are numbers, categorical when they are text or bool (or
  when the schema declares it so). A column of numbers with a few text cells (``?``, ``N/A``, a typo) is
  refused, naming the column, the row and the value: ``--na-values`` names the texts that mark a missing
  value, ``--drop-rows-with-missing`` drops such rows, and a column meant as categories is declared in
  the schema.
* **Categorical columns are one-hot encoded.** Their category sets come from a public schema
  (``--schema``); any other set (bool columns' too) is selected privately from the training rows
  (``releases.select_categories``), and values not selected share one ``(other)`` indicator. A column
  no value of which is selected (an identifier, free text) is refused.
* **Numeric columns** declared with a public range are mapped from it onto [-1, 1]; the others are left
  for the private standardisation (``scaling.py``) or, if the user asks, fed as they are.
* A missing value is refused, naming the column and the row, unless such rows are dropped.

No encoding decision branches on the private rows except through a release: a column's kind is read
from its cells, but changing one row either keeps it or makes the column a refused mix (a refusal ends
the run before anything is trained, and its message is for the data's owner).

The encoding is a :class:`TableEncoder`: saved with the model (``model.json``), it encodes new
rows the same way (``tunefree predict``).

A schema is a JSON file: ``{"categorical": {"colour": ["red", "green"]}, "numeric": {"age": [0, 120]}}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .releases import OTHER
from .split import cell_text


class DataError(ValueError):
    """The data (or its schema) cannot be loaded; the message says what to do."""


@dataclass(frozen=True)
class Schema:
    """Public knowledge about the feature columns, declared by the user: category sets and value ranges.
    Nothing declared here is computed from the data, so nothing declared here costs privacy."""

    categorical: dict[str, list[Any]] = field(default_factory=dict)
    numeric: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise DataError(f"schema {path} cannot be read as JSON: {error}") from error
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "schema") -> Schema:
        if not isinstance(raw, dict) or set(raw) - {"categorical", "numeric"}:
            raise DataError(f"{source}: a schema is an object with the keys 'categorical' (column → list "
                             "of categories) and 'numeric' (column → [low, high])")
        categorical = raw.get("categorical", {})
        numeric = raw.get("numeric", {})
        if not isinstance(categorical, dict) or not isinstance(numeric, dict):
            raise DataError(f"{source}: 'categorical' and 'numeric' must be objects keyed by column name")
        for column, values in categorical.items():
            if not isinstance(values, list) or not values or len(set(map(cell_text, values))) != len(values):
                raise DataError(f"{source}: the categories of {column!r} must be a non-empty list of "
                                 "distinct values")
        ranges = {}
        for column, bounds in numeric.items():
            if (not isinstance(bounds, list) or len(bounds) != 2
                    or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
                    or not all(math.isfinite(b) for b in bounds) or not bounds[0] < bounds[1]):
                raise DataError(f"{source}: the range of {column!r} must be [low, high] with low < high, "
                                 f"got {bounds!r}")
            ranges[column] = (float(bounds[0]), float(bounds[1]))
        both = set(categorical) & set(ranges)
        if both:
            raise DataError(f"{source}: columns {sorted(both)} are declared both categorical and numeric")
        return cls(categorical={c: list(v) for c, v in categorical.items()}, numeric=ranges)


MISTYPED_SHARE = 0.5  # a text column whose cells are at least this share numbers is refused as mistyped


def _kind(series) -> str:
    from pandas.api.types import is_bool_dtype, is_numeric_dtype, is_object_dtype, is_string_dtype

    if is_bool_dtype(series):
        return "bool"
    if is_numeric_dtype(series):
        return "numeric"
    if is_object_dtype(series) or is_string_dtype(series) or str(series.dtype) == "category":
        return "categorical"
    return str(series.dtype)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def mark_missing(frame, na_values: Sequence[str] = (), schema: Schema | None = None):
    """``frame`` with the cells of its text columns that are one of ``na_values`` (exactly, after
    stripping spaces) made missing (a column the schema declares categorical is left as it is)."""
    frame = frame.copy()
    marks = {str(v).strip() for v in na_values}
    declared = set(schema.categorical) if schema else set()
    if not marks:
        return frame
    for column in frame.columns:
        if _kind(frame[column]) == "categorical" and column not in declared:
            frame[column] = frame[column].map(lambda v: np.nan if isinstance(v, str) and v.strip() in marks
                                              else v)
    return frame


def read_numbers(frame, schema: Schema | None = None):
    """``frame`` with each text column whose present cells are all numbers read as numbers (unless the
    schema declares it categorical). A column's kind is a function of its cells: one row changed either
    leaves it or makes the column mixed, which :func:`check_kinds` refuses."""
    import pandas as pd

    frame = frame.copy()
    declared = set(schema.categorical) if schema else set()
    for column in frame.columns:
        values = frame[column]
        if _kind(values) != "categorical" or column in declared:
            continue
        present = values[~pd.isna(values)]
        if len(present) and all(_is_number(v) for v in present):
            frame[column] = pd.to_numeric(values)
    return frame


def clean(frame, na_values: Sequence[str] = (), schema: Schema | None = None):
    """:func:`mark_missing`, then :func:`read_numbers`."""
    return read_numbers(mark_missing(frame, na_values, schema), schema)


def check_kinds(frame, name: str, schema: Schema) -> None:
    """Refuse a column of numbers with a few text cells (naming the column, the row and the value), a
    column declared numeric that holds text, and a column neither numeric, bool nor text."""
    import pandas as pd

    for column in frame.columns:
        kind = _kind(frame[column])
        if column in schema.numeric and kind != "numeric":
            raise DataError(f"{name}: column {column!r} is declared numeric in the schema but holds {kind} "
                            "values: declare it categorical or drop its range")
        if kind not in ("numeric", "categorical", "bool"):
            raise DataError(f"{name}: column {column!r} has type {kind}, neither numeric nor text: convert "
                            "it to numbers or to text categories")
        if kind != "categorical" or column in schema.categorical:
            continue
        values = frame[column]
        present = np.flatnonzero(~pd.isna(values).to_numpy())
        numbers = np.array([_is_number(values.iloc[i]) for i in present], dtype=bool)
        if numbers.any() and numbers.mean() >= MISTYPED_SHARE:
            row = int(present[np.flatnonzero(~numbers)[0]])
            raise DataError(
                f"{name}: column {column!r} holds numbers except in some rows, e.g. data row {row + 1} "
                f"(counting from 1 after the header): {values.iloc[row]!r}. If that marks a missing value, "
                f"pass --na-values {str(values.iloc[row]).strip()!r} (and --drop-rows-with-missing to drop "
                "such rows); if the column holds categories, declare it categorical in --schema; "
                "otherwise fix the cell")


def missing_rows(frame) -> np.ndarray:
    """Which rows have a missing (or infinite) value in any column."""
    import pandas as pd

    missing = np.zeros(len(frame), dtype=bool)
    for column in frame.columns:
        values = frame[column]
        missing |= pd.isna(values).to_numpy()
        if _kind(values) == "numeric":
            missing |= ~np.isfinite(values.to_numpy(dtype=np.float64, na_value=np.nan))
    return missing


TRAINING_REMEDY = "fill in or drop such rows, or pass --drop-rows-with-missing"


def check_no_missing(features, name: str, remedy: str = TRAINING_REMEDY) -> None:
    """Refuse a missing (or infinite) feature value, naming the column and the data row (from 1);
    ``remedy``: what to do, in the words of the command that reads the rows."""
    for column in features.columns:
        missing = missing_rows(features[[column]])
        if missing.any():
            row = int(np.flatnonzero(missing)[0]) + 1
            raise DataError(f"{name}: column {column!r} is missing or infinite in data row {row} (counting "
                            f"from 1 after the header): {remedy}")


@dataclass(frozen=True)
class Column:
    """How one feature column becomes numbers. ``categories`` (cell texts, in order) one-hot encode a
    categorical column, with one more ``(other)`` indicator when ``other`` (a privately selected set);
    ``None`` until the set is known. A numeric column with ``bounds`` is mapped from them onto [-1, 1],
    one without is fed raw (the private standardisation may then scale it)."""

    name: str
    kind: str  # "categorical" or "numeric"
    categories: tuple[str, ...] | None = None
    other: bool = False
    bounds: tuple[float, float] | None = None

    @property
    def feature_names(self) -> list[str]:
        if self.kind == "numeric":
            return [self.name]
        return [f"{self.name}={c}" for c in (*self.categories, *((OTHER,) if self.other else ()))]

    def encode(self, values, source: str, training: bool = True) -> np.ndarray:
        """The column's features for ``values``, shape [n, width]; ``training``: the rows are a run's
        (else new rows of ``tunefree predict``, whose messages cannot send the user to the schema)."""
        if self.kind == "numeric":
            x = np.asarray(values, dtype=np.float64)
            if self.bounds is None:
                return x[:, None]
            low, high = self.bounds
            outside = (x < low) | (x > high)
            if outside.any():
                fix = ("widen the range in the schema" if training else "the model maps the column from "
                       "that range, so such rows cannot be encoded: drop them")
                raise DataError(f"{source}: column {self.name!r} holds {float(x[outside][0]):g}, outside its "
                                f"declared range [{low:g}, {high:g}]: {fix}")
            return ((x - (low + high) / 2) / ((high - low) / 2))[:, None]
        index = {c: i for i, c in enumerate(self.categories)}
        keys = [cell_text(v) for v in values]
        other = len(self.categories)
        if not self.other:
            unknown = [k for k in keys if k not in index]
            if unknown:
                fix = ("add it to the schema" if training else "the model knows only those (declared at "
                       "training), so such rows cannot be encoded: drop them")
                raise DataError(f"{source}: column {self.name!r} holds {unknown[0]!r}, which is not among "
                                f"its declared categories {list(self.categories)[:10]}: {fix}")
        encoded = np.zeros((len(keys), other + int(self.other)))
        encoded[np.arange(len(keys)), [index.get(k, other) for k in keys]] = 1.0
        return encoded


@dataclass
class TableEncoder:
    """Everything that turns rows of the table into the model's inputs and its classes into indices;
    all of it public (declared) or released privately, so it is saved with the model."""

    columns: tuple[Column, ...]
    label_column: str
    classes: tuple[str, ...]
    other_class: bool = False  # the last class is "(other)": labels not among the selected ones
    standardisation: dict[str, list[float] | list[int]] | None = None  # scaling.Standardisation.to_dict()

    @property
    def feature_names(self) -> list[str]:
        return [name for column in self.columns for name in column.feature_names]

    @property
    def class_names(self) -> list[str]:
        return [*self.classes, *((OTHER,) if self.other_class else ())]

    def unscaled(self) -> list[int]:
        """Feature indices of the numeric columns with no public range."""
        indices, position = [], 0
        for column in self.columns:
            if column.kind == "numeric" and column.bounds is None:
                indices.append(position)
            position += len(column.feature_names)
        return indices

    def public_input_rms(self) -> float | None:
        """The root mean square of the features where the encoding fixes it, whatever the rows: a
        categorical column's one-hot block holds exactly one 1 per row, a standardised numeric column has
        unit variance by the standardisation's design; ``None`` when a numeric column is mapped from a
        declared range or fed raw (its scale is the data's). Public: it reads the columns' kinds only."""
        standardised = set(self.standardisation["columns"]) if self.standardisation else set()
        position = 0
        for column in self.columns:
            if column.kind == "numeric" and position not in standardised:
                return None
            position += len(column.feature_names)
        return math.sqrt(len(self.columns) / position) if position else None

    def features(self, frame, source: str, training: bool = True) -> np.ndarray:
        """The encoded features of ``frame``'s rows (before any standardisation); ``training`` as for
        :meth:`Column.encode`."""
        absent = [c.name for c in self.columns if c.name not in frame.columns]
        if absent:
            raise DataError(f"{source}: columns {absent} are missing (the model was trained on "
                            f"{[c.name for c in self.columns]})")
        return np.concatenate([c.encode(frame[c.name], source, training) for c in self.columns], axis=1)

    def class_indices(self, labels, source: str) -> np.ndarray:
        return class_indices(labels, self.classes, self.other_class, source)

    def to_dict(self) -> dict[str, Any]:
        return {"columns": [asdict(c) for c in self.columns], "label_column": self.label_column,
                "classes": list(self.classes), "other_class": self.other_class,
                "standardisation": self.standardisation}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TableEncoder:
        columns = tuple(Column(name=c["name"], kind=c["kind"],
                               categories=None if c["categories"] is None else tuple(c["categories"]),
                               other=c["other"], bounds=None if c["bounds"] is None else tuple(c["bounds"]))
                        for c in raw["columns"])
        return cls(columns, raw["label_column"], tuple(raw["classes"]), raw["other_class"],
                   raw["standardisation"])


def class_indices(labels, classes: Sequence[str], other: bool, source: str) -> np.ndarray:
    """Class index of each label (compared as cell text); a label not among ``classes`` is the class after
    them, ``(other)``, or refused when the classes were declared (``other`` false)."""
    index = {c: i for i, c in enumerate(classes)}
    keys = [cell_text(v) for v in labels]
    if not other:
        unknown = sorted({k for k in keys if k not in index})
        if unknown:
            raise DataError(f"{source}: labels {unknown[:10]} are not among the declared classes "
                            f"{list(classes)[:10]}: add them to --labels")
    return np.array([index.get(k, len(classes)) for k in keys], dtype=np.int64)


def plan_columns(frame, schema: Schema) -> list[Column]:
    """Each feature column's encoding as far as public knowledge goes: schema sets and ranges; a categorical
    column (text or bool) with ``categories=None`` waits for the private selection. A bool column is not
    given the set {False, True}: one row's ``maybe`` would turn it into a text column, and so decide
    without a release whether its set is released."""
    absent = sorted((set(schema.categorical) | set(schema.numeric)) - set(frame.columns))
    if absent:
        raise DataError(f"the schema names columns {absent} that the table does not have")
    if frame.shape[1] == 0:
        raise DataError("no feature columns besides the label")
    columns = []
    for name in frame.columns:
        kind = _kind(frame[name])
        if name in schema.categorical:
            columns.append(Column(name, "categorical", tuple(cell_text(c) for c in schema.categorical[name])))
        elif kind in ("bool", "categorical"):  # one rule for both: a cell decides no column's encoding
            columns.append(Column(name, "categorical", None, other=True))
        else:
            columns.append(Column(name, "numeric", bounds=schema.numeric.get(name)))
    return columns
