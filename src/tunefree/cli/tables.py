"""Feature columns of a table as numbers, without learning anything silently from the private rows.

* Categorical columns (text, or bool) are one-hot encoded. Their category sets come from a public schema
  (``--schema``) when it declares them; bool columns have the public set {False, True}; otherwise the set
  is read from the data and **treated as public** (as the set of class labels is), and the caller is told
  which columns, so that it can say so.
* Numeric columns declared with a public range in the schema are mapped from that range onto [-1, 1].
  The others are returned as they are and listed in ``to_scale``: the caller standardises them by a
  private estimate accounted in the ledger (``scaling.py``) or, if the user asks, leaves them raw.
* A missing value in any feature column is refused, naming the column and the row.

A schema is a JSON file: ``{"categorical": {"colour": ["red", "green"]}, "numeric": {"age": [0, 120]}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


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
            if not isinstance(values, list) or not values or len(set(map(_key, values))) != len(values):
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


@dataclass
class EncodedFeatures:
    """The feature matrices of both splits and what was done to each column."""

    train: np.ndarray
    test: np.ndarray
    names: list[str]  # one per feature: "age", or "colour=red" for a one-hot indicator
    to_scale: list[int]  # feature indices of numeric columns with no public range
    categories_from_data: list[str]  # categorical columns whose category set was read from the data


def _key(value: Any) -> str:
    """Categories compare by their text, so that 3 in a schema matches the CSV cell 3 or "3"."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _kind(series) -> str:
    from pandas.api.types import is_bool_dtype, is_numeric_dtype, is_object_dtype, is_string_dtype

    if is_bool_dtype(series):
        return "bool"
    if is_numeric_dtype(series):
        return "numeric"
    if is_object_dtype(series) or is_string_dtype(series) or str(series.dtype) == "category":
        return "categorical"
    return str(series.dtype)


def check_no_missing(features, name: str) -> None:
    """Refuse a missing (or infinite) feature value, naming the column and the data row (from 1)."""
    import pandas as pd

    for column in features.columns:
        values = features[column]
        missing = pd.isna(values).to_numpy()
        if _kind(values) == "numeric":
            missing = missing | ~np.isfinite(values.to_numpy(dtype=np.float64, na_value=np.nan))
        if missing.any():
            row = int(np.flatnonzero(missing)[0]) + 1
            raise DataError(f"{name}: column {column!r} is missing or infinite in data row {row} (counting "
                             "from 1 after the header): fill in or drop such rows")


def _one_hot(values, categories: list[Any], column: str, name: str) -> np.ndarray:
    index = {_key(c): i for i, c in enumerate(categories)}
    keys = [_key(v) for v in values]
    unknown = [k for k in keys if k not in index]
    if unknown:
        raise DataError(f"{name}: column {column!r} holds {unknown[0]!r}, which is not among its declared "
                         f"categories {categories[:10]}: add it to the schema")
    encoded = np.zeros((len(keys), len(categories)))
    encoded[np.arange(len(keys)), [index[k] for k in keys]] = 1.0
    return encoded


def _scaled_by_range(values: np.ndarray, bounds: tuple[float, float], column: str, name: str
                     ) -> np.ndarray:
    low, high = bounds
    outside = (values < low) | (values > high)
    if outside.any():
        raise DataError(f"{name}: column {column!r} holds {float(values[outside][0]):g}, outside its "
                        f"declared range [{low:g}, {high:g}]: widen the range in the schema")
    return (values - (low + high) / 2) / ((high - low) / 2)


def encode(train, test, name: str, schema: Schema | None = None) -> EncodedFeatures:
    """Encode the feature columns of the train and test frames (the label already dropped) the same way."""
    schema = schema or Schema()
    absent = sorted((set(schema.categorical) | set(schema.numeric)) - set(train.columns))
    if absent:
        raise DataError(f"{name}: the schema names columns {absent} that the table does not have")
    if train.shape[1] == 0:
        raise DataError(f"{name}: no feature columns besides the label")
    for frame in (train, test):
        check_no_missing(frame, name)
    blocks: list[tuple[np.ndarray, np.ndarray]] = []
    names: list[str] = []
    to_scale: list[int] = []
    from_data: list[str] = []
    for column in train.columns:
        kind = _kind(train[column])
        if column in schema.numeric and kind != "numeric":
            raise DataError(f"{name}: column {column!r} is declared numeric in the schema but holds {kind} "
                             "values: declare it categorical or drop its range")
        if column in schema.categorical or kind in ("categorical", "bool"):
            categories = schema.categorical.get(column)
            if categories is None and kind == "bool":
                categories = [False, True]
            if categories is None:
                seen = {_key(v): v for v in (*train[column], *test[column])}
                categories = [seen[k] for k in sorted(seen)]
                from_data.append(column)
            blocks.append((_one_hot(train[column], categories, column, name),
                           _one_hot(test[column], categories, column, name)))
            names += [f"{column}={c}" for c in categories]
        elif kind == "numeric":
            x_train = train[column].to_numpy(dtype=np.float64)
            x_test = test[column].to_numpy(dtype=np.float64)
            if column in schema.numeric:
                bounds = schema.numeric[column]
                x_train = _scaled_by_range(x_train, bounds, column, name)
                x_test = _scaled_by_range(x_test, bounds, column, name)
            else:
                to_scale.append(len(names))
            blocks.append((x_train[:, None], x_test[:, None]))
            names.append(column)
        else:
            raise DataError(f"{name}: column {column!r} has type {kind}, neither numeric nor text: convert "
                             "it to numbers or to text categories")
    return EncodedFeatures(train=np.concatenate([b[0] for b in blocks], axis=1),
                           test=np.concatenate([b[1] for b in blocks], axis=1),
                           names=names, to_scale=to_scale, categories_from_data=from_data)
