"""From rows as read to tensors ready for private training, learning from the training rows only what is
declared public or released privately (``releases.py``).

1. **Clean** (tables): ``--na-values`` cells become missing; rows with a missing value are refused (naming
   the column and the row) or, with ``--drop-rows-with-missing``, dropped; mistyped columns are refused.
2. **Split** (data without a test split): a keyed hash of each row's content (``split.py``), so that
   removing one row moves no other.
3. **Select** the category sets of text columns no schema declares and the class labels no ``--labels``
   (or data set) declares: one private partition selection; values not selected go to ``(other)``.
4. **Standardise** numeric columns with no public range by the private estimate of ``scaling.py``.

Every refusal that needs no release comes before the first release. The releases are returned with the
data (``LoadedData.releases``); their events are the run's ``prior_releases`` (``make_private``): in its
ledger before the first step, and in the calibration of its training noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from . import datasets, scaling, tables
from .datasets import LoadedData, Raw
from .releases import OTHER, Budget, Release, delta_choice, select_categories, select_sets
from .split import array_rows, cell_text, held_out, split_key, table_rows
from .tables import DataError, Schema, TableEncoder

NUMERIC_SCALINGS = ("private", "none")


@dataclass(frozen=True)
class DataOptions:
    """How to read and prepare the data: the flags of ``tunefree train`` about data."""

    label_column: str = "label"
    schema: Schema | None = None
    labels: tuple[str, ...] | None = None  # --labels: the classes, declared public
    na_values: tuple[str, ...] = ()
    drop_missing: bool = False
    test_data: str | None = None
    numeric_scaling: str = "private"


def load(spec: str, epsilon: float = math.inf, delta: float | None = None, accountant: str = "pld",
         seed: int | None = None, **options: Any) -> LoadedData:
    """Read ``spec`` and prepare it within the budget (ε, δ); ``options`` are :class:`DataOptions`."""
    data_options = DataOptions(**options)
    raw = datasets.read(spec, data_options.label_column, data_options.test_data)
    return prepare(raw, data_options, epsilon, delta, accountant, seed)


def prepare(raw: Raw, options: DataOptions, epsilon: float, delta: float | None, accountant: str,
            seed: int | None) -> LoadedData:
    """The tensors of ``raw``'s training and test rows; ``delta`` None is δ = 1/N^1.1 for the N
    training rows; ``seed`` keys the split and seeds the releases (None: secret)."""
    if options.numeric_scaling not in NUMERIC_SCALINGS:
        raise ValueError(f"--numeric-scaling must be one of {', '.join(NUMERIC_SCALINGS)}, "
                         f"got {options.numeric_scaling!r}")
    if raw.kind == "table":
        return _prepare_table(raw, options, epsilon, delta, accountant, seed)
    return _prepare_images(raw, options, epsilon, delta, accountant, seed)


# ---------------------------------------------------------------------------- shared steps
def _split(rows: list[bytes], seed: int | None, name: str) -> np.ndarray:
    """Which rows are test rows (the keyed hash split); refused if either side is empty."""
    test = held_out(rows, split_key(seed))
    if test.all() or not test.any():
        side = "training" if test.all() else "test"
        raise DataError(f"{name}: the 80/20 split of its {len(rows)} rows put none in the {side} split: add "
                        "rows" + (", or give the test rows with --test-data" if side == "test" else ""))
    return test


def _check_sizes(name: str, train: int, test: int) -> None:
    if train == 0:
        raise DataError(f"{name}: the training split holds no examples")
    if test == 0:
        raise DataError(f"{name}: the test split holds no examples, so accuracy cannot be measured: supply "
                        "a non-empty test split, or more data")


def _check_two_classes(labels, declared: tuple[str, ...] | None, name: str) -> None:
    """Refuse training rows that hold fewer than two classes (declared or not), before any release: no
    classifier learns from one class, and with the classes declared such a run would report the accuracy
    of predicting that class. The message, like every refusal, is for the data's owner; nothing is
    trained or written."""
    if declared is not None and len(declared) < 2:
        raise DataError(f"{name}: --labels declares a single class {list(declared)}; classification needs "
                        "at least two")
    present = sorted({cell_text(v) for v in labels})
    if len(present) < 2:
        among = f" of the declared {list(declared)[:10]}" if declared is not None else ""
        raise DataError(f"{name}: every training row has the label {present[0]!r}{among}: a classifier "
                        "needs training rows of at least two classes — add rows of the other classes")


def _classes(selected: list[str] | None, declared: tuple[str, ...] | None, name: str,
             release: Release | None) -> tuple[tuple[str, ...], bool]:
    """The classes and whether an ``(other)`` class follows them (the selected ones); refused when the
    selection kept fewer than two (the training rows hold two or more: checked before)."""
    if declared is not None:
        return tuple(declared), False
    classes = tuple(selected)
    if len(classes) < 2:
        raise DataError(
            f"{name}: only {len(classes)} class label(s) {list(classes)} had enough training rows to be "
            f"selected privately (a label needs a noisy count of {release.released['threshold']:.0f} "
            "rows at this ε): declare the classes with --labels (public, free), or train with more rows "
            "or a larger ε")
    return classes, True


def _share_text(release: Release) -> str:
    return f"{release.share:.0%} of the budget's μ², in the ledger" if release.noise_multiplier > 0 \
        else "exact: no privacy"


def _class_note(classes: tuple[str, ...], other: bool, source: str, release: Release | None) -> str:
    listed = f"{list(classes)[:10]}{' …' if len(classes) > 10 else ''}"
    if not other:
        return f"the classes {listed} are {source}"
    released = release.released
    column = released["columns"][0]
    return (f"the classes {listed} were selected privately from the training rows' labels (a noisy count "
            f"of at least {released['threshold']:.0f} rows; {_share_text(release)}); the other labels, "
            f"about {released['other_rows'][column]} training rows by the noisy counts, are merged into the "
            f"class {OTHER!r} (the model's last output). Declare the classes with --labels to spend nothing "
            "on this")


def _tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long))


# ---------------------------------------------------------------------------- images
def _prepare_images(raw: Raw, options: DataOptions, epsilon: float, delta: float | None, accountant: str,
                    seed: int | None) -> LoadedData:
    if options.schema is not None:
        raise DataError(f"--schema describes the columns of a table, and {raw.name} holds images: drop it")
    for labels in (raw.y, raw.test_y):
        if labels is not None:
            _check_no_missing_labels(labels, raw.name, "label")
    if raw.has_test_split:
        x_train, y_train, x_test, y_test = raw.x, raw.y, raw.test_x, raw.test_y
    else:
        test = _split(array_rows(raw.x, raw.y), seed, raw.name)
        x_train, y_train, x_test, y_test = raw.x[~test], raw.y[~test], raw.x[test], raw.y[test]
    _check_sizes(raw.name, len(y_train), len(y_test))
    declared = options.labels if options.labels is not None else raw.classes
    _check_two_classes(y_train, declared, raw.name)
    releases, selected, release = [], None, None
    if declared is None:
        budget = Budget(epsilon, delta_choice(delta, len(y_train))[0], accountant)
        sets, release = select_sets({"label": y_train}, budget, seed)
        releases.append(release)
        selected = sets["label"]
    classes, other = _classes(selected, declared, raw.name, release)
    source = "given by --labels" if options.labels is not None else "the data set's own (public)"
    y_train = tables.class_indices(y_train, classes, other, raw.name)
    y_test = tables.class_indices(y_test, classes, other, raw.name)
    names = (*classes, *((OTHER,) if other else ()))
    return LoadedData(raw.name, "image", _tensors(x_train, y_train), _tensors(x_test, y_test), len(names),
                      tuple(x_train.shape[1:]), classes=names, releases=tuple(releases),
                      notes=(_class_note(classes, other, source, release),) if other else (),
                      pixel_scale=raw.pixel_scale)


# ---------------------------------------------------------------------------- tables
def _check_no_missing_labels(labels, name: str, label_column: str) -> None:
    """Refuse empty label cells, naming the rows (counted from 1, after any header)."""
    import pandas as pd

    missing = np.flatnonzero(pd.isna(np.asarray(labels, dtype=object)))
    if missing.size:
        rows = (missing[:10] + 1).tolist()
        raise DataError(f"{name}: column {label_column!r} is empty in data row(s) {rows} (counting from 1 "
                        "after the header): fill in or drop those rows, or pass --drop-rows-with-missing")


def _clean_frame(frame, name: str, options: DataOptions, schema: Schema):
    """The table's features and labels, cleaned and checked (or with incomplete rows dropped)."""
    label = options.label_column
    if label not in frame.columns:
        raise DataError(f"{name}: label column {label!r} not found; columns are "
                        f"{list(frame.columns)[:20]} — pass --label-column")
    frame = tables.mark_missing(frame, options.na_values, schema)
    if options.drop_missing:  # before the kinds are read: a dropped row has no say in them
        frame = frame[~tables.missing_rows(frame)].reset_index(drop=True)
        if len(frame) == 0:
            raise DataError(f"{name}: every row has a missing value (--drop-rows-with-missing dropped them "
                            "all)")
    frame = tables.read_numbers(frame, schema)
    features = frame.drop(columns=[label])
    if features.shape[1] == 0:
        raise DataError(f"{name}: no feature columns besides the label")
    _check_no_missing_labels(frame[label].to_numpy(), name, label)
    tables.check_no_missing(features, name)
    tables.check_kinds(features, name, schema)
    return frame


def _prepare_table(raw: Raw, options: DataOptions, epsilon: float, delta: float | None, accountant: str,
                   seed: int | None) -> LoadedData:
    schema = options.schema or Schema()
    label = options.label_column
    frame = _clean_frame(raw.x, raw.name, options, schema)
    if raw.has_test_split:
        test_frame = _clean_frame(raw.test_x, f"{raw.name} (test)", options, schema)
        train_frame = frame
    else:
        test = _split(table_rows([frame[c] for c in frame.columns]), seed, raw.name)
        train_frame = frame[~test].reset_index(drop=True)
        test_frame = frame[test].reset_index(drop=True)
    _check_sizes(raw.name, len(train_frame), len(test_frame))
    try:
        columns = tables.plan_columns(train_frame.drop(columns=[label]), schema)
    except DataError as error:
        raise DataError(f"{raw.name}: {error}") from error
    _check_two_classes(train_frame[label], options.labels, raw.name)
    budget = Budget(epsilon, delta_choice(delta, len(train_frame))[0], accountant)
    to_select = {c.name: train_frame[c.name] for c in columns
                 if c.kind == "categorical" and c.categories is None}
    unscaled = [c.name for c in columns if c.kind == "numeric" and c.bounds is None]
    standardise = bool(unscaled) and options.numeric_scaling == "private"
    scaling_share = scaling.share_for_table(budget, len(train_frame), len(unscaled)) if standardise else 0.0
    scaling_noise = scaling.noise_for_share(budget, scaling_share) if standardise else 0.0
    if standardise:  # the last refusal that needs no release
        scaling.check_enough_rows(len(train_frame), len(unscaled), scaling_noise, epsilon)

    releases: list[Release] = []
    label_release, selected = None, None
    if options.labels is None:
        label_sets, label_release = select_sets({label: train_frame[label]}, budget, seed)
        releases.append(label_release)
        selected = label_sets[label]
    category_release = None
    if to_select:
        sets, category_release = select_categories(to_select, budget, seed)
        releases.append(category_release)
        columns = [replace(c, categories=tuple(sets[c.name])) if c.name in to_select else c for c in columns]
    empty = [c.name for c in columns if c.kind == "categorical" and not c.categories]
    if empty:
        raise DataError(
            f"{raw.name}: no value of column(s) {empty} is shared by enough training rows to be a category "
            f"(a noisy count of {category_release.released['threshold']:.0f} rows at this ε): a column with "
            "a distinct value per row is an identifier or free text, not a category — drop it, or declare "
            "its categories in --schema")
    classes, other = _classes(selected, options.labels, raw.name, label_release)
    encoder = TableEncoder(tuple(columns), label, classes, other)
    x_train = torch.as_tensor(encoder.features(train_frame, raw.name), dtype=torch.float64)
    x_test = torch.as_tensor(encoder.features(test_frame, raw.name), dtype=torch.float64)
    y_train = encoder.class_indices(train_frame[label], raw.name)
    y_test = encoder.class_indices(test_frame[label], raw.name)
    if standardise:
        released = scaling.release(x_train, encoder.unscaled(), scaling_noise,
                                   scaling.secret_randomness(seed))
        x_train, x_test = released.apply(x_train), released.apply(x_test)
        encoder.standardisation = released.to_dict()
        releases.append(scaling.release_record(released, encoder.feature_names, scaling_share))
    notes = _table_notes(encoder, unscaled, label_release, category_release, releases)
    return LoadedData(raw.name, "table", _tensors(x_train.numpy(), y_train), _tensors(x_test.numpy(), y_test),
                      len(encoder.class_names), (x_train.shape[1],), classes=tuple(encoder.class_names),
                      feature_names=tuple(encoder.feature_names), releases=tuple(releases), encoder=encoder,
                      notes=tuple(notes))


def _table_notes(encoder: TableEncoder, unscaled: list[str], label_release: Release | None,
                 category_release: Release | None, releases: list[Release]) -> list[str]:
    """What the output says about how the table's features and classes were made."""
    notes = []
    if category_release is not None:
        released = category_release.released
        merged = {column: rows for column, rows in released["other_rows"].items() if rows}
        notes.append(f"the category sets of columns {released['columns']} were selected privately from "
                     f"the training rows (values with a noisy count of at least {released['threshold']:.0f} "
                     "rows; "
                     f"{_share_text(category_release)}); the other values are the category {OTHER!r}"
                     + (f", about {merged} training rows by the noisy counts" if merged else "")
                     + ". Declare the sets in --schema to spend nothing on this")
    if encoder.other_class:
        notes.append(_class_note(encoder.classes, True, "", label_release))
    standardisation = next((r for r in releases if r.name == "standardisation"), None)
    if standardisation is not None:
        notes.append(f"numeric columns {unscaled} were standardised by a private estimate ("
                     f"{_share_text(standardisation)}: 2 Gaussian releases, σ = "
                     f"{standardisation.noise_multiplier:.3g}); declare their ranges in --schema to spend "
                     "nothing on it")
    elif unscaled:
        notes.append(f"numeric columns {unscaled} reach the model unscaled (--numeric-scaling none)")
    return notes
