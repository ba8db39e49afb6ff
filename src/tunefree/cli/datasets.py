"""Reading private data sets from local files, as they are. Nothing is ever downloaded.

Every reader returns :class:`Raw` rows: image arrays or a table (a pandas DataFrame with its label
column), with the data set's own test split when it has one (MNIST, CIFAR-10, a Hugging Face
``DatasetDict``, or ``--test-data``). Pixel values are divided by the range of their storage type
(:func:`pixel_scale`: 255 for uint8), public knowledge, never by anything read from the pixels.
Nothing here is computed from the private rows: ``preprocess.py`` splits, encodes and scales them, each
value it learns from the training rows declared public or released privately.
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
from typing import Any

import numpy as np
from torch.utils.data import TensorDataset

from .tables import DataError

TABLE_FORMATS = ("csv", "jsonl", "parquet")
PUBLIC_DIGITS = tuple(str(d) for d in range(10))  # the classes of digits and of the CIFAR-10 format


@dataclass
class Raw:
    """Rows as read. Images: ``x`` an array [N, C, H, W] in [0, 1] and ``y`` the labels. Tables: ``x`` the
    DataFrame with every column (the label one included) and ``y`` None. ``test_x``/``test_y``: the data
    set's own test split, if any. ``classes``: a class set public by the data set's definition."""

    name: str
    kind: str  # "image" or "table"
    x: Any
    y: np.ndarray | None = None
    test_x: Any = None
    test_y: np.ndarray | None = None
    classes: tuple[str, ...] | None = None
    pixel_scale: float | None = None  # images: what every pixel was divided by (public: the storage type)

    @property
    def has_test_split(self) -> bool:
        return self.test_x is not None


@dataclass
class LoadedData:
    """Data ready for training: tensors of both splits and what the model needs to know, with every
    preprocessing release made on the training rows (``releases``, for the ledger)."""

    name: str
    kind: str  # "image" or "table"
    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images, (features,) for tables
    classes: tuple[str, ...] = ()  # the model's outputs in order ("(other)": labels not selected)
    feature_names: tuple[str, ...] = ()  # tables: one per feature ("colour=red" for a one-hot indicator)
    releases: tuple = ()  # releases.Release of the preprocessing, in the order they were made
    encoder: Any = None  # tables: the TableEncoder that makes new rows into features
    notes: tuple[str, ...] = ()  # what the output must say about how the data were prepared
    pixel_scale: float | None = None  # images: what every pixel was divided by (public: the storage type)

    @property
    def num_train(self) -> int:
        return len(self.train)


def read_digits() -> Raw:
    """scikit-learn's 8×8 digits (1,797 images shipped with the package), classes 0–9."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return Raw("digits", "image", (x / DIGITS_SCALE).reshape(-1, 1, 8, 8), y, classes=PUBLIC_DIGITS,
               pixel_scale=DIGITS_SCALE)


DIGITS_SCALE = 16.0  # the 8×8 digits' pixels count 0–16 (the data set's definition)
PIXEL_SCALES = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0, np.dtype(np.bool_): 1.0}


def pixel_scale(dtype: np.dtype, source: str) -> float:
    """What every pixel of images stored as ``dtype`` is divided by: the type's range (uint8: 255), 1 for
    floats (taken to be in [0, 1] already). Public: it reads the storage type, never a pixel. Other
    integer types have no range to go by and are refused."""
    dtype = np.dtype(dtype)
    if dtype in PIXEL_SCALES:
        return PIXEL_SCALES[dtype]
    if np.issubdtype(dtype, np.floating):
        return 1.0
    raise DataError(f"{source}: pixels stored as {dtype} have no public range to scale them by: store them "
                    "as uint8 (0–255), uint16, or floats already in [0, 1]")


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


def read_idx_directory(directory: Path) -> Raw:
    """MNIST / Fashion-MNIST IDX files in ``directory`` (the official train/test split)."""
    parts = [read_idx(_find(directory, stem)) for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    x_train, y_train, x_test, y_test = parts
    if x_train.ndim != 3 or len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise DataError(f"{directory}: images must be [N, H, W] with one label each")
    scale = pixel_scale(x_train.dtype, str(directory))
    return Raw(directory.name, "image", x_train[:, None] / scale, y_train, x_test[:, None] / scale, y_test,
               pixel_scale=scale)


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


def read_cifar10(directory: Path) -> Raw:
    """The CIFAR-10 python pickles (``cifar-10-batches-py``: data_batch_1..5, test_batch), classes 0–9."""
    train_files = sorted(directory.glob("data_batch_*"))
    test_file = directory / "test_batch"
    if not train_files or not test_file.exists():
        raise DataError(f"{directory} has no data_batch_* and test_batch files: point --dataset at "
                        "the extracted cifar-10-batches-py directory")
    xs, ys = zip(*(_cifar_batch(p) for p in train_files))
    x_test, y_test = _cifar_batch(test_file)
    return Raw(directory.name, "image", np.concatenate(xs) / 255.0, np.concatenate(ys), x_test / 255.0,
               y_test, classes=PUBLIC_DIGITS, pixel_scale=255.0)  # the format's data are uint8


# ---------------------------------------------------------------------------- tables
def _read_table(reader, path: Path, kind: str):
    try:
        return reader(path)
    except Exception as error:  # pandas' and pyarrow's parse errors have many types
        raise DataError(f"{path.name} cannot be read as {kind}: {error}") from error


def read_frame(path: Path):
    """A ``.csv``, ``.jsonl`` (one JSON object per line) or ``.parquet`` table as a DataFrame."""
    import pandas as pd

    fmt = detect_format(str(path))
    if fmt not in TABLE_FORMATS:
        raise DataError(f"{path}: a table must be a .csv, .jsonl or .parquet file, got {fmt} data")
    readers = {"csv": pd.read_csv, "parquet": pd.read_parquet,
               "jsonl": lambda file: pd.read_json(file, lines=True, dtype=False)}
    frame = _read_table(readers[fmt], path, {"csv": "CSV", "jsonl": "JSON lines", "parquet": "Parquet"}[fmt])
    if len(frame) == 0:
        raise DataError(f"{path.name}: the table holds no rows")
    return frame


# ---------------------------------------------------------------------------- Hugging Face datasets
def read_hf(directory: Path, label_column: str) -> Raw:
    """A ``datasets`` directory written by ``save_to_disk`` (a Dataset or a DatasetDict with train and
    test splits); image columns (PIL images or arrays) or table columns."""
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
    if len(train_frame) == 0 or (test_frame is not None and len(test_frame) == 0):
        raise DataError(f"{directory}: the {'train' if len(train_frame) == 0 else test_name} split holds "
                        "no examples")
    image_column = next((c for c in ("image", "img", "pixel_values")
                         if c in train_frame.column_names), None)
    if image_column is None:
        return Raw(directory.name, "table", train_frame.to_pandas(),
                   test_x=None if test_frame is None else test_frame.to_pandas())

    declared = _declared_pixel_type(train_frame.features[image_column])

    def images(split, which: str) -> np.ndarray:
        arrays = [np.asarray(img, dtype=declared) for img in split[image_column]]
        return image_array(arrays, f"{directory} ({which})", scale)

    first = np.asarray(train_frame[0][image_column], dtype=declared)
    scale = pixel_scale(first.dtype, str(directory))  # one type for every image, checked in image_array
    x, y = images(train_frame, "train"), np.asarray(train_frame[label_column])
    if test_frame is None:
        return Raw(directory.name, "image", x, y, pixel_scale=scale)
    return Raw(directory.name, "image", x, y, images(test_frame, test_name),
               np.asarray(test_frame[label_column]), pixel_scale=scale)


def _declared_pixel_type(feature: Any) -> np.dtype | None:
    """The pixel type a Hugging Face feature declares (nested lists and arrays of a ``Value``); ``None``
    for an ``Image`` feature, whose decoded images carry their own (uint8 for 8-bit modes)."""
    while not hasattr(feature, "dtype") and hasattr(feature, "feature"):  # List, Sequence
        feature = feature.feature
    try:
        return np.dtype(getattr(feature, "dtype", None) or "")
    except TypeError:  # an Image feature's "PIL.Image.Image"
        return None


def image_array(arrays: list[np.ndarray], source: str, scale: float) -> np.ndarray:
    """Images of one storage type and one shape as an array [N, C, H, W] divided by ``scale``; a
    channel-last layout ([H, W, C] with C of 1, 3 or 4) is moved first. Images of another type or shape
    than the others are refused (naming the first), so that no image decides how the others are read."""
    first = arrays[0]
    odd = next((i for i, a in enumerate(arrays) if a.dtype != first.dtype or a.shape != first.shape), None)
    if odd is not None:
        raise DataError(f"{source}: image {odd} is {arrays[odd].dtype} {arrays[odd].shape}, unlike the first "
                        f"({first.dtype} {first.shape}): every image must have one pixel type and one size")
    x = np.stack(arrays).astype(np.float64)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4:
        raise DataError(f"{source}: images must be [H, W] or [H, W, C] arrays, got {first.shape}")
    return x / scale


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


def read(spec: str, label_column: str = "label", test_data: str | None = None) -> Raw:
    """Read ``--dataset``: ``digits`` or a local path in one of the supported formats. ``test_data``: a
    table of the same columns to test on (then every row of ``spec`` is a training row)."""
    fmt = detect_format(spec)
    if test_data is not None and fmt not in TABLE_FORMATS:
        raise DataError(f"--test-data gives the test rows of a table, and {spec} is {fmt} data: drop it")
    if fmt == "digits":
        return read_digits()
    path = Path(spec)
    if fmt == "idx":
        return read_idx_directory(path)
    if fmt == "cifar10":
        return read_cifar10(path)
    if fmt == "hf":
        return read_hf(path, label_column)
    test = None if test_data is None else read_frame(Path(test_data))
    return Raw(path.name, "table", read_frame(path), test_x=test)
