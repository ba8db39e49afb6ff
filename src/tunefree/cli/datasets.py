"""Loading private data sets from local files. Nothing is ever downloaded.

Every loader returns a :class:`LoadedData`: train and test tensors and what the default model needs to
know (image shape or feature count, number of classes). Pixel values are scaled by their known range
(public knowledge); no statistic is computed from the private data, since that would be an unaccounted
release. The set of class labels is read from the data and treated as public.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

FORMATS = ("digits", "idx", "cifar10", "csv", "parquet", "hf")
SPLIT_SEED = 0  # the train/test split is fixed, independent of the training seed


class DataError(ValueError):
    """The data cannot be loaded; the message says what to do."""


@dataclass
class LoadedData:
    name: str
    kind: str  # "image" or "table"
    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images, (features,) for tables

    @property
    def num_train(self) -> int:
        return len(self.train)


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    """A stratified split with a fixed seed: the same examples are test examples in every run."""
    rng = np.random.default_rng(SPLIT_SEED)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        rng.shuffle(members)
        test[members[: int(round(test_fraction * len(members)))]] = True
    return x[~test], y[~test], x[test], y[test]


def _labels_to_indices(*label_arrays: np.ndarray) -> tuple[list[np.ndarray], int]:
    classes = np.unique(np.concatenate(label_arrays))
    return [np.searchsorted(classes, y) for y in label_arrays], len(classes)


def _make(name: str, kind: str, x_train, y_train, x_test, y_test) -> LoadedData:
    (y_train, y_test), num_classes = _labels_to_indices(np.asarray(y_train), np.asarray(y_test))
    if num_classes < 2:
        raise DataError(f"{name}: the labels take a single value; classification needs at least two")
    return LoadedData(
        name=name, kind=kind,
        train=TensorDataset(torch.as_tensor(x_train, dtype=torch.float32),
                            torch.as_tensor(y_train, dtype=torch.long)),
        test=TensorDataset(torch.as_tensor(x_test, dtype=torch.float32),
                           torch.as_tensor(y_test, dtype=torch.long)),
        num_classes=num_classes, input_shape=tuple(x_train.shape[1:]),
    )


def load_digits_data() -> LoadedData:
    """scikit-learn's 8×8 digits (1,797 images shipped with the package), split 80/20."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (x / 16.0).reshape(-1, 1, 8, 8)
    return _make("digits", "image", *_split(images, y))


# ---------------------------------------------------------------------------- IDX (MNIST family)
def read_idx(path: Path) -> np.ndarray:
    """An IDX file (plain or .gz) as a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if data[2] not in dtypes:
        raise DataError(f"{path}: unknown IDX element type {data[2]:#x}")
    dims = struct.unpack(f">{data[3]}I", data[4: 4 + 4 * data[3]])
    array = np.frombuffer(data, dtype=dtypes[data[2]], offset=4 + 4 * data[3])
    if array.size != int(np.prod(dims)):
        raise DataError(f"{path}: IDX header says {dims} but the file holds {array.size} values")
    return array.reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz",
                      directory / stem.replace("-idx", ".idx")):
        if candidate.exists():
            return candidate
    raise DataError(f"{directory} has no {stem} (or {stem}.gz): an MNIST-style directory holds "
                    "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
                    "t10k-labels-idx1-ubyte")


def load_idx(directory: Path) -> LoadedData:
    """MNIST / Fashion-MNIST IDX files in ``directory`` (the official train/test split)."""
    parts = [read_idx(_find(directory, stem)) for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    x_train, y_train, x_test, y_test = parts
    if x_train.ndim != 3 or len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise DataError(f"{directory}: images must be [N, H, W] with one label each")
    scale = 255.0 if x_train.dtype == np.uint8 else 1.0
    return _make(directory.name, "image", x_train[:, None] / scale, y_train,
                 x_test[:, None] / scale, y_test)


# ---------------------------------------------------------------------------- CIFAR-10
class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a crafted file cannot run code."""

    ALLOWED = {(package, name) for package in ("numpy.core.multiarray", "numpy._core.multiarray")
               for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise DataError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only "
                        "arrays, lists and bytes")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError) as error:
        raise DataError(f"{path} is not a CIFAR-10 python batch: {error}") from error
    if not isinstance(batch, dict):
        raise DataError(f"{path} is not a CIFAR-10 python batch (not a dict)")
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if data is None or labels is None:
        raise DataError(f"{path} is not a CIFAR-10 python batch (no data/labels)")
    return np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(labels)


def load_cifar10(directory: Path) -> LoadedData:
    """The CIFAR-10 python pickles (``cifar-10-batches-py``: data_batch_1..5, test_batch)."""
    train_files = sorted(directory.glob("data_batch_*"))
    test_file = directory / "test_batch"
    if not train_files or not test_file.exists():
        raise DataError(f"{directory} has no data_batch_* and test_batch files: point --dataset at "
                        "the extracted cifar-10-batches-py directory")
    xs, ys = zip(*(_cifar_batch(p) for p in train_files))
    x_test, y_test = _cifar_batch(test_file)
    return _make(directory.name, "image", np.concatenate(xs) / 255.0, np.concatenate(ys),
                 x_test / 255.0, y_test)


# ---------------------------------------------------------------------------- tables
def _table_arrays(frame, name: str, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    """Numeric features and labels of a table."""
    if label_column not in frame.columns:
        raise DataError(f"{name}: label column {label_column!r} not found; columns are "
                        f"{list(frame.columns)[:20]} — pass --label-column")
    features = frame.drop(columns=[label_column])
    from pandas.api.types import is_numeric_dtype

    non_numeric = [c for c in features.columns if not is_numeric_dtype(features[c])]
    if non_numeric:
        raise DataError(f"{name}: columns {non_numeric[:10]} are not numeric; encode them as "
                        "numbers first")
    if features.shape[1] == 0:
        raise DataError(f"{name}: no feature columns besides the label")
    x = features.to_numpy(dtype=np.float64)
    if not np.isfinite(x).all():
        raise DataError(f"{name}: the features contain missing or infinite values; fill them first")
    return x, frame[label_column].to_numpy()


def _table(frame, name: str, label_column: str) -> LoadedData:
    return _make(name, "table", *_split(*_table_arrays(frame, name, label_column)))


def load_csv(path: Path, label_column: str) -> LoadedData:
    import pandas as pd

    return _table(pd.read_csv(path), path.name, label_column)


def load_parquet(path: Path, label_column: str) -> LoadedData:
    import pandas as pd

    return _table(pd.read_parquet(path), path.name, label_column)


# ---------------------------------------------------------------------------- Hugging Face datasets
def load_hf(directory: Path, label_column: str) -> LoadedData:
    """A ``datasets`` directory written by ``save_to_disk`` (a Dataset or a DatasetDict with train and
    test splits); image columns (PIL images or arrays) or numeric feature columns."""
    import datasets

    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{directory}: the DatasetDict has no 'train' split ({list(loaded)})")
        test_name = next((s for s in ("test", "validation") if s in loaded), None)
        train_frame = loaded["train"]
        test_frame = loaded[test_name] if test_name else None
    else:
        train_frame, test_frame = loaded, None
    if label_column not in train_frame.column_names:
        raise DataError(f"{directory}: label column {label_column!r} not found; columns are "
                        f"{train_frame.column_names} — pass --label-column")
    image_column = next((c for c in ("image", "img", "pixel_values")
                         if c in train_frame.column_names), None)
    if image_column is None:
        train = _table_arrays(train_frame.to_pandas(), directory.name, label_column)
        if test_frame is None:
            return _make(directory.name, "table", *_split(*train))
        test = _table_arrays(test_frame.to_pandas(), directory.name, label_column)
        return _make(directory.name, "table", *train, *test)

    def images(split) -> np.ndarray:
        arrays = [np.asarray(img, dtype=np.float64) for img in split[image_column]]
        x = np.stack(arrays)
        if x.ndim == 3:
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
        return x / 255.0 if x.max() > 1.0 else x

    x, y = images(train_frame), np.asarray(train_frame[label_column])
    if test_frame is None:
        return _make(directory.name, "image", *_split(x, y))
    return _make(directory.name, "image", x, y, images(test_frame),
                 np.asarray(test_frame[label_column]))


# ---------------------------------------------------------------------------- dispatch
def detect_format(spec: str) -> str:
    """The format of ``--dataset`` from the path: a directory's contents or a file's suffix."""
    if spec == "digits":
        return "digits"
    path = Path(spec)
    if not path.exists():
        raise DataError(f"dataset {spec!r} not found: give 'digits' or a path to local data "
                        "(an MNIST IDX directory, cifar-10-batches-py, a .csv or .parquet file, or a "
                        "Hugging Face save_to_disk directory)")
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        if any(n.startswith("train-images") for n in names):
            return "idx"
        if "test_batch" in names or any(n.startswith("data_batch_") for n in names):
            return "cifar10"
        if names & {"dataset_dict.json", "dataset_info.json", "state.json"}:
            return "hf"
        raise DataError(f"{path}: cannot tell the format of this directory (expected MNIST IDX "
                        "files, CIFAR-10 batches or a Hugging Face save_to_disk directory)")
    suffixes = "".join(path.suffixes).lower()
    if suffixes.endswith(".csv") or suffixes.endswith(".csv.gz"):
        return "csv"
    if suffixes.endswith(".parquet") or suffixes.endswith(".pq"):
        return "parquet"
    raise DataError(f"{path}: unknown file format {path.suffix!r}; use .csv or .parquet")


def load(spec: str, label_column: str = "label") -> LoadedData:
    """Load ``--dataset``: ``digits`` or a local path in one of the supported formats."""
    fmt = detect_format(spec)
    if fmt == "digits":
        return load_digits_data()
    path = Path(spec)
    if fmt == "idx":
        return load_idx(path)
    if fmt == "cifar10":
        return load_cifar10(path)
    if fmt == "csv":
        return load_csv(path, label_column)
    if fmt == "parquet":
        return load_parquet(path, label_column)
    return load_hf(path, label_column)
