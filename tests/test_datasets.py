"""Every local data format, on small files the tests write themselves."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pandas as pd
import pytest

from tunefree.cli import datasets
from tunefree.cli.datasets import DataError


def write_idx(path, array, type_code=0x08, compress=False):
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(">u1" if type_code == 0x08 else ">i4").tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_directory(tmp_path, compress):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)),
                  compress=compress)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, compress=compress)
    data = datasets.load(str(tmp_path))
    assert data.kind == "image" and data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 30 and len(data.test) == 10
    x, y = data.train.tensors
    assert x.min() >= 0 and x.max() <= 1 and y.tolist() == [i % 10 for i in range(30)]


def test_bad_idx_file_is_reported(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="not an IDX file"):
        datasets.read_idx(tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(DataError, match="t10k"):
        datasets.load_idx(_with_train_only(tmp_path))


def _with_train_only(directory):
    rng = np.random.default_rng(0)
    write_idx(directory / "train-images-idx3-ubyte", rng.integers(0, 256, (5, 4, 4)))
    write_idx(directory / "train-labels-idx1-ubyte", np.arange(5))
    return directory


def test_cifar10_pickles(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 12), ("data_batch_2", 8), ("test_batch", 6)):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": list(np.arange(n) % 10)}
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    data = datasets.load(str(tmp_path))
    assert data.input_shape == (3, 32, 32) and len(data.train) == 20 and len(data.test) == 6


def test_cifar_pickle_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    with pytest.raises(DataError, match="refusing to unpickle builtins.print"):
        datasets.load(str(tmp_path))


def _table(n=50):
    rng = np.random.default_rng(1)
    return pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n),
                         "target": np.where(np.arange(n) % 3 == 0, "yes", "no")})


def test_csv_with_label_column(tmp_path):
    _table().to_csv(tmp_path / "data.csv", index=False)
    data = datasets.load(str(tmp_path / "data.csv"), label_column="target")
    assert data.kind == "table" and data.input_shape == (2,) and data.num_classes == 2
    assert len(data.train) + len(data.test) == 50
    # stratified and fixed: both classes in the test split, the same split every time
    again = datasets.load(str(tmp_path / "data.csv"), label_column="target")
    assert (data.test.tensors[0] == again.test.tensors[0]).all()
    assert set(data.test.tensors[1].tolist()) == {0, 1}


def test_parquet(tmp_path):
    _table().to_parquet(tmp_path / "data.parquet")
    data = datasets.load(str(tmp_path / "data.parquet"), label_column="target")
    assert data.input_shape == (2,)


@pytest.mark.parametrize("problem,match", [
    ("missing_label", "label column 'label' not found"),
    ("text_feature", "not numeric"),
    ("nan", "missing or infinite"),
    ("one_class", "single value"),
])
def test_table_errors(tmp_path, problem, match):
    frame = _table().rename(columns={"target": "label"})
    if problem == "missing_label":
        frame = frame.drop(columns=["label"])
    elif problem == "text_feature":
        frame["c"] = "x"
    elif problem == "nan":
        frame.loc[3, "a"] = np.nan
    else:
        frame["label"] = "same"
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=match):
        datasets.load(str(tmp_path / "t.csv"))


def test_hugging_face_directories(tmp_path):
    import datasets as hf

    rng = np.random.default_rng(2)
    images = hf.Dataset.from_dict({"image": [rng.integers(0, 256, (8, 8)).astype(np.uint8)
                                             for _ in range(20)],
                                   "label": [i % 4 for i in range(20)]})
    hf.DatasetDict({"train": images, "test": images.select(range(5))}).save_to_disk(tmp_path / "img")
    data = datasets.load(str(tmp_path / "img"))
    assert data.kind == "image" and data.input_shape == (1, 8, 8) and len(data.test) == 5
    table = hf.Dataset.from_pandas(_table().rename(columns={"target": "label"}))
    table.save_to_disk(tmp_path / "tab")
    data = datasets.load(str(tmp_path / "tab"))
    assert data.kind == "table" and len(data.train) + len(data.test) == 50


def test_unknown_inputs_are_reported(tmp_path):
    with pytest.raises(DataError, match="not found"):
        datasets.load(str(tmp_path / "missing.csv"))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="unknown file format"):
        datasets.load(str(tmp_path / "x.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="cannot tell the format"):
        datasets.load(str(tmp_path / "empty"))


def test_digits_split_is_fixed_and_stratified():
    data = datasets.load("digits")
    assert len(data.train) + len(data.test) == 1797
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert sorted(set(data.test.tensors[1].tolist())) == list(range(10))
