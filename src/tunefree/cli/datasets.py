"""Loading private data sets from local files. Nothing is ever downloaded.

Every loader returns a :class:`LoadedData`: train and test tensors and what the default model needs to
know (image shape or feature count, number of classes). Pixel values are scaled by their known range
(public knowledge); no statistic is computed from the private data, since that would be an unaccounted
release. The set of class labels is read from the data and treated as public. Table features are
encoded by ``tables.py`` (one-hot categories, numeric columns by a public range or left for the
accounted private standardisation of ``scaling.py``).
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import pickletools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from . import tables
from .tables import DataError

SPLIT_SEED = 0  # the train/test split is fixed, independent of the training seed




@dataclass
class LoadedData:
    name: str
    kind: str  # "image" or "table"
    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images, (features,) for tables
    feature_names: tuple[str, ...] = ()  # tables: one per feature ("colour=red" for a one-hot indicator)
    to_scale: tuple[int, ...] = ()  # tables: numeric features with no public range, still raw
    categories_from_data: tuple[str, ...] = ()  # tables: columns whose category set was read from the data

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


def _labels_to_indices(name: str, y_train: np.ndarray, y_test: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, int]:
    """Class indices of the labels; the classes are those of the training split."""
    classes = np.unique(y_train)
    unseen = np.setdiff1d(np.unique(y_test), classes)
    if unseen.size:
        raise DataError(f"{name}: test labels {unseen[:10].tolist()} never occur in the training split, "
                        "so no model can predict them: drop those test examples or add training "
                        "examples of those classes")
    return np.searchsorted(classes, y_train), np.searchsorted(classes, y_test), len(classes)


def _make(name: str, kind: str, x_train, y_train, x_test, y_test, **table: tuple) -> LoadedData:
    if len(y_train) == 0:
        raise DataError(f"{name}: the training split holds no examples")
    if len(y_test) == 0:
        raise DataError(f"{name}: the test split holds no examples, so accuracy cannot be measured: "
                        "supply a non-empty test split, or more data (the held-out 20% of each class "
                        "rounds to zero below 3 examples per class)")
    y_train, y_test, num_classes = _labels_to_indices(name, np.asarray(y_train), np.asarray(y_test))
    if num_classes < 2:
        raise DataError(f"{name}: the labels take a single value; classification needs at least two")
    return LoadedData(
        name=name, kind=kind,
        train=TensorDataset(torch.as_tensor(x_train, dtype=torch.float32),
                            torch.as_tensor(y_train, dtype=torch.long)),
        test=TensorDataset(torch.as_tensor(x_test, dtype=torch.float32),
                           torch.as_tensor(y_test, dtype=torch.long)),
        num_classes=num_classes, input_shape=tuple(x_train.shape[1:]), **table,
    )


def load_digits_data() -> LoadedData:
    """scikit-learn's 8×8 digits (1,797 images shipped with the package), split 80/20."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (x / 16.0).reshape(-1, 1, 8, 8)
    return _make("digits", "image", *_split(images, y))


# ---------------------------------------------------------------------------- IDX (MNIST family)
IDX_CHUNK_BYTES = 1 << 24


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (plain or .gz) as a numpy array. The header's claimed size is checked against the
    file's size (plain) or against the bytes actually decompressed, read in chunks (.gz), before
    anything of that size is allocated."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        magic = f.read(4)
        if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
            raise DataError(f"{path} is not an IDX file (bad magic number)")
        dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
        if magic[2] not in dtypes:
            raise DataError(f"{path}: unknown IDX element type {magic[2]:#x}")
        header = f.read(4 * magic[3])
        if len(header) < 4 * magic[3]:
            raise DataError(f"{path}: the IDX header is cut short (expected {magic[3]} dimensions)")
        dims = struct.unpack(f">{magic[3]}I", header)
        dtype = np.dtype(dtypes[magic[2]])
        claimed = math.prod(dims) * dtype.itemsize
        if path.suffix != ".gz" and claimed > path.stat().st_size:
            raise DataError(f"{path}: IDX header says {dims} ({claimed} bytes) but the file holds only "
                            f"{path.stat().st_size} bytes")
        chunks, read = [], 0
        while read <= claimed and (chunk := f.read(IDX_CHUNK_BYTES)):
            chunks.append(chunk)
            read += len(chunk)
    if read != claimed:
        raise DataError(f"{path}: IDX header says {dims} ({claimed} bytes) but the file holds "
                        f"{'more' if read > claimed else read} bytes of data")
    return np.frombuffer(b"".join(chunks), dtype=dtype).reshape(dims)


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
class _BoundedArray(np.ndarray):
    """An array being unpickled: its state may not claim more bytes than the file holds, nor objects."""

    byte_budget: int

    def __setstate__(self, state) -> None:
        shape, dtype = state[-4], state[-3]  # (version,) shape, dtype, is_fortran, raw data
        _check_claim(shape, dtype, self.byte_budget)
        super().__setstate__(state)


def _check_claim(shape, dtype, byte_budget: int) -> None:
    """Refuse an array whose claimed size exceeds ``byte_budget`` (the file's size), before allocating."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise DataError("refusing an array of Python objects: a CIFAR-10 batch holds numbers only")
    claimed = math.prod(int(n) for n in shape) * dtype.itemsize
    if claimed > byte_budget:
        raise DataError(f"an array claims {claimed} bytes but the file holds only {byte_budget}: the "
                        "file is corrupt or crafted")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a crafted file cannot run code, nor make the
    loader allocate more memory than the file's size."""

    RECONSTRUCT = {(package, "_reconstruct") for package in ("numpy.core.multiarray",
                                                             "numpy._core.multiarray")}
    ALLOWED = {(package, "scalar") for package in ("numpy.core.multiarray", "numpy._core.multiarray")
               } | {("numpy", "ndarray"), ("numpy", "dtype")}

    def __init__(self, payload: bytes):
        super().__init__(io.BytesIO(payload), encoding="bytes")
        self.byte_budget = len(payload)

    def find_class(self, module: str, name: str):
        if (module, name) in self.RECONSTRUCT:
            return self._reconstruct
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise DataError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only "
                        "arrays, lists and bytes")

    def _reconstruct(self, subtype, shape, dtype) -> _BoundedArray:
        if subtype is not np.ndarray:
            raise DataError(f"refusing to rebuild a {subtype!r}: a CIFAR-10 batch holds plain arrays")
        _check_claim(shape, dtype, self.byte_budget)
        array = np.ndarray.__new__(_BoundedArray, shape, dtype)
        array.byte_budget = self.byte_budget
        return array


def _check_lengths(payload: bytes) -> None:
    """Walk the pickle's opcodes without building anything: a byte string that claims more bytes than
    remain in the file is refused here, before the unpickler would allocate it."""
    for _ in pickletools.genops(io.BytesIO(payload)):
        pass


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    payload = path.read_bytes()
    try:
        _check_lengths(payload)
        batch = _NumpyOnlyUnpickler(payload).load()
    except DataError as error:
        raise DataError(f"{path}: {error}") from error
    except Exception as error:  # whatever a malformed pickle raises, it is not a CIFAR-10 batch
        raise DataError(f"{path} is not a CIFAR-10 python batch: {error}") from error
    if not isinstance(batch, dict):
        raise DataError(f"{path} is not a CIFAR-10 python batch (not a dict)")
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if not isinstance(data, np.ndarray) or not isinstance(labels, list):
        raise DataError(f"{path} is not a CIFAR-10 python batch (needs a 'data' array and a "
                        "'labels' list)")
    if not all(isinstance(label, (int, np.integer)) for label in labels):
        raise DataError(f"{path}: the labels must be whole numbers")
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape != (len(labels), 3 * 32 * 32):
        raise DataError(f"{path}: 'data' must be uint8 of shape [N, 3072] with N = {len(labels)} "
                        f"labels, got {data.dtype} {data.shape}")
    return data.reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.int64)


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
def _check_no_missing_labels(labels, name: str, label_column: str) -> None:
    """Refuse empty label cells, naming the rows (counted from 1, after any header)."""
    import pandas as pd

    missing = np.flatnonzero(pd.isna(np.asarray(labels, dtype=object)))
    if missing.size:
        rows = (missing[:10] + 1).tolist()
        raise DataError(f"{name}: column {label_column!r} is empty in data row(s) {rows} (counting from 1 "
                        "after the header): fill in or drop those rows")


def _feature_frame(frame, name: str, label_column: str):
    """The feature columns of a table and its labels, both checked for missing values."""
    if label_column not in frame.columns:
        raise DataError(f"{name}: label column {label_column!r} not found; columns are "
                        f"{list(frame.columns)[:20]} — pass --label-column")
    labels = frame[label_column].to_numpy()
    _check_no_missing_labels(labels, name, label_column)
    features = frame.drop(columns=[label_column])
    if features.shape[1] == 0:
        raise DataError(f"{name}: no feature columns besides the label")
    tables.check_no_missing(features, name)
    return features, labels


def _encoded(name: str, train, y_train, test, y_test, schema: tables.Schema | None) -> LoadedData:
    features = tables.encode(train, test, name, schema)
    return _make(name, "table", features.train, y_train, features.test, y_test,
                 feature_names=tuple(features.names), to_scale=tuple(features.to_scale),
                 categories_from_data=tuple(features.categories_from_data))


def _table(frame, name: str, label_column: str, schema: tables.Schema | None = None) -> LoadedData:
    if len(frame) == 0:
        raise DataError(f"{name}: the table holds no rows")
    features, labels = _feature_frame(frame, name, label_column)
    train_rows, y_train, test_rows, y_test = _split(np.arange(len(frame)), labels)
    return _encoded(name, features.iloc[train_rows], y_train, features.iloc[test_rows], y_test, schema)


def _read_table(reader, path: Path, kind: str):
    try:
        return reader(path)
    except Exception as error:  # pandas' and pyarrow's parse errors have many types
        raise DataError(f"{path.name} cannot be read as {kind}: {error}") from error


def load_csv(path: Path, label_column: str, schema: tables.Schema | None = None) -> LoadedData:
    import pandas as pd

    return _table(_read_table(pd.read_csv, path, "CSV"), path.name, label_column, schema)


def load_json_lines(path: Path, label_column: str, schema: tables.Schema | None = None) -> LoadedData:
    """A JSON-lines file: one JSON object per line, one key per column."""
    import pandas as pd

    def read(file: Path):
        return pd.read_json(file, lines=True, dtype=False)

    return _table(_read_table(read, path, "JSON lines"), path.name, label_column, schema)


def load_parquet(path: Path, label_column: str, schema: tables.Schema | None = None) -> LoadedData:
    import pandas as pd

    return _table(_read_table(pd.read_parquet, path, "Parquet"), path.name, label_column, schema)


# ---------------------------------------------------------------------------- Hugging Face datasets
def load_hf(directory: Path, label_column: str, schema: tables.Schema | None = None) -> LoadedData:
    """A ``datasets`` directory written by ``save_to_disk`` (a Dataset or a DatasetDict with train and
    test splits); image columns (PIL images or arrays) or numeric feature columns."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(directory))
    except Exception as error:  # the library's own failures (e.g. a split saved empty: IndexError)
        raise DataError(f"{directory}: datasets.load_from_disk could not read it "
                        f"({type(error).__name__}: {error}); a split saved with no rows cannot be "
                        "read back: drop it or add examples") from error
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
        if test_frame is None:
            return _table(train_frame.to_pandas(), directory.name, label_column, schema)
        train, y_train = _feature_frame(train_frame.to_pandas(), directory.name, label_column)
        test, y_test = _feature_frame(test_frame.to_pandas(), directory.name, label_column)
        return _encoded(directory.name, train, y_train, test, y_test, schema)

    def images(split) -> np.ndarray:
        arrays = [np.asarray(img, dtype=np.float64) for img in split[image_column]]
        x = np.stack(arrays)
        if x.ndim == 3:
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
        return x / 255.0 if x.max() > 1.0 else x

    def labels(split) -> np.ndarray:
        values = np.asarray(split[label_column])
        _check_no_missing_labels(values, directory.name, label_column)
        return values

    if len(train_frame) == 0 or (test_frame is not None and len(test_frame) == 0):
        raise DataError(f"{directory}: the {'train' if len(train_frame) == 0 else test_name} split holds "
                        "no examples")
    x, y = images(train_frame), labels(train_frame)
    if test_frame is None:
        return _make(directory.name, "image", *_split(x, y))
    return _make(directory.name, "image", x, y, images(test_frame), labels(test_frame))


# ---------------------------------------------------------------------------- dispatch
def detect_format(spec: str) -> str:
    """The format of ``--dataset`` from the path: a directory's contents or a file's suffix."""
    if spec == "digits":
        return "digits"
    path = Path(spec)
    if not path.exists():
        raise DataError(f"dataset {spec!r} not found: give 'digits' or a path to local data "
                        "(an MNIST IDX directory, cifar-10-batches-py, a .csv, .jsonl or .parquet file, or a "
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
    if suffixes.endswith((".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")):
        return "jsonl"
    raise DataError(f"{path}: unknown file format {path.suffix!r}; use .csv, .jsonl or .parquet")


def load(spec: str, label_column: str = "label", schema: tables.Schema | None = None) -> LoadedData:
    """Load ``--dataset``: ``digits`` or a local path in one of the supported formats. ``schema``
    declares public category sets and value ranges of a table's columns (see ``tables.py``)."""
    fmt = detect_format(spec)
    if schema is not None and fmt not in ("csv", "jsonl", "parquet", "hf"):
        raise DataError(f"--schema describes the columns of a table, and {spec} is {fmt} data: drop it")
    if fmt == "digits":
        return load_digits_data()
    path = Path(spec)
    if fmt == "idx":
        return load_idx(path)
    if fmt == "cifar10":
        return load_cifar10(path)
    if fmt == "csv":
        return load_csv(path, label_column, schema)
    if fmt == "jsonl":
        return load_json_lines(path, label_column, schema)
    if fmt == "parquet":
        return load_parquet(path, label_column, schema)
    return load_hf(path, label_column, schema)
