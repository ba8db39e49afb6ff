"""Every local data format, on small files the tests write themselves. ``preprocess.load`` prepares without
noise by default (ε = ∞): what is tested here is reading and encoding; the private releases are tested in
test_cli_private.py."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pandas as pd
import pytest
import torch

from tunefree.cli import datasets, preprocess, tables
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
    data = preprocess.load(str(tmp_path), labels=tuple("0123456789"))
    assert data.kind == "image" and data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 30 and len(data.test) == 10
    x, y = data.train.tensors
    assert x.min() >= 0 and x.max() <= 1 and y.tolist() == [i % 10 for i in range(30)]
    # classes no one declares are selected (here exactly: ε = ∞), and an "(other)" class follows them
    selected = preprocess.load(str(tmp_path))
    assert selected.classes == (*"0123456789", "(other)") and selected.num_classes == 11


def test_bad_idx_file_is_reported(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="not an IDX file"):
        datasets.read_idx(tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(DataError, match="t10k"):
        datasets.read_idx_directory(_with_train_only(tmp_path))



@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("payload, match", [
    (bytes([0, 0, 8, 3, 0]), "the IDX header is cut short"),
    (bytes([0, 0, 8, 3]) + struct.pack(">3I", 10 ** 6, 10 ** 3, 10 ** 3) + b"abc",
     r"\(1000000000000 bytes\) but the file holds (only \d+ bytes|3 bytes of data)"),
    (bytes([0, 0, 8, 1]) + struct.pack(">I", 2) + b"abc", r"\(2 bytes\) but the file holds more"),
])
def test_idx_header_claims_are_checked_before_allocating(tmp_path, compress, payload, match):
    path = tmp_path / ("x.gz" if compress else "x")
    path.write_bytes(gzip.compress(payload) if compress else payload)
    with pytest.raises(DataError, match=match):
        datasets.read_idx(path)

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
    data = preprocess.load(str(tmp_path))
    assert data.input_shape == (3, 32, 32) and len(data.train) == 20 and len(data.test) == 6


def test_cifar_pickle_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    with pytest.raises(DataError, match="refusing to unpickle builtins.print"):
        preprocess.load(str(tmp_path))



class _Reconstructed:
    """Pickles as numpy does (``_reconstruct`` then ``__setstate__``), with whatever claims we like."""

    def __init__(self, shape, state=None):
        self.shape, self.state = shape, state

    def __reduce__(self):
        from numpy.core.multiarray import _reconstruct

        args = (_reconstruct, (np.ndarray, self.shape, b"B"))
        return args if self.state is None else (*args, self.state)


def _bytes8_claim(length):
    """A pickle {b'data': <bytes8 that claims ``length`` bytes but holds 3>}, written opcode by opcode."""
    return (b"\x80\x04}" + b"C\x04data" + b"\x8e" + struct.pack("<Q", length) + b"abc" + b"s.")


@pytest.mark.parametrize("payload, match", [
    (lambda: _bytes8_claim(10 ** 12), "expected 1000000000000 bytes in a bytes8, but only 5 remain"),
    (lambda: pickle.dumps({b"data": _Reconstructed((10 ** 12,)), b"labels": [0]}, protocol=4),
     r"an array claims 1000000000000 bytes but the file holds only \d+"),
    (lambda: pickle.dumps({b"data": _Reconstructed((0,), (1, (10 ** 6, 10 ** 6), np.dtype("u1"), False,
                                                          b"abc")), b"labels": [0]}, protocol=4),
     r"an array claims 1000000000000 bytes but the file holds only \d+"),
    (lambda: pickle.dumps({b"data": _Reconstructed((0,), (1, (10 ** 12,), np.dtype("O"), False,
                                                          [1])), b"labels": [0]}, protocol=4),
     "refusing an array of Python objects"),
])
def test_cifar_pickle_claiming_a_huge_array_is_refused_before_allocating(tmp_path, payload, match):
    (tmp_path / "data_batch_1").write_bytes(payload())
    (tmp_path / "test_batch").write_bytes(payload())
    with pytest.raises(DataError, match=match):
        preprocess.load(str(tmp_path))


@pytest.mark.parametrize("batch, match", [
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, r"shape \[N, 3072\] with N = 1"),
    ({b"data": np.zeros((1, 3072), np.float64), b"labels": [0]}, "must be uint8"),
    ({b"data": [[0] * 3072], b"labels": [0]}, "needs a 'data' array"),
    ({b"data": np.zeros((1, 3072), np.uint8), b"labels": [[0]]}, "whole numbers"),
])
def test_cifar_batch_of_the_wrong_shape_is_reported(tmp_path, batch, match):
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps(batch))
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch))
    with pytest.raises(DataError, match=match):
        preprocess.load(str(tmp_path))

def _table(n=50):
    rng = np.random.default_rng(1)
    return pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n),
                         "target": np.where(np.arange(n) % 3 == 0, "yes", "no")})


def test_csv_with_label_column(tmp_path):
    _table().to_csv(tmp_path / "data.csv", index=False)
    data = preprocess.load(str(tmp_path / "data.csv"), label_column="target", labels=("no", "yes"),
                         numeric_scaling="none", seed=3)
    assert data.kind == "table" and data.input_shape == (2,) and data.num_classes == 2
    assert len(data.train) + len(data.test) == 50
    # the keyed split is the same for the same seed
    again = preprocess.load(str(tmp_path / "data.csv"), label_column="target", labels=("no", "yes"),
                          numeric_scaling="none", seed=3)
    assert (data.test.tensors[0] == again.test.tensors[0]).all()


def test_parquet(tmp_path):
    _table().to_parquet(tmp_path / "data.parquet")
    data = preprocess.load(str(tmp_path / "data.parquet"), label_column="target")
    assert data.input_shape == (2,)


@pytest.mark.parametrize("problem,match", [
    ("missing_label", "label column 'label' not found"),
    ("nan", "missing or infinite"),
    ("one_class", r"every training row has the label 'same': a classifier needs training rows of at least "
                  "two classes"),
])
def test_table_errors(tmp_path, problem, match):
    frame = _table().rename(columns={"target": "label"})
    if problem == "missing_label":
        frame = frame.drop(columns=["label"])
    elif problem == "nan":
        frame.loc[3, "a"] = np.nan
    else:
        frame["label"] = "same"
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=match):
        preprocess.load(str(tmp_path / "t.csv"))



@pytest.mark.parametrize("numeric_labels", [False, True])
def test_empty_label_cell_is_refused_naming_column_and_row(tmp_path, numeric_labels):
    labels = ["0", "1", "0", "", "1", "0", "1", "0", "1", ""] if numeric_labels else [
        "yes", "no", "yes", "", "no", "yes", "no", "yes", "no", ""]
    rows = [f"{i},{i * 2},{label}" for i, label in enumerate(labels)]
    (tmp_path / "t.csv").write_text("a,b,target\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"t.csv: column 'target' is empty in data row\(s\) \[4, 10\]"):
        preprocess.load(str(tmp_path / "t.csv"), label_column="target")


@pytest.mark.parametrize("column", ["b", "colour"])
def test_missing_feature_is_refused_naming_column_and_row(tmp_path, column):
    (tmp_path / "t.csv").write_text("a,b,colour,label\n1,2,red,0\n3,4,blue,1\n5,6,red,0\n")
    frame = pd.read_csv(tmp_path / "t.csv")
    frame.loc[1, column] = None
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=f"column '{column}' is missing or infinite in data row 2"):
        preprocess.load(str(tmp_path / "t.csv"))


def _mixed(n=40):
    rng = np.random.default_rng(3)
    return pd.DataFrame({"colour": rng.choice(["red", "blue"], n), "size": rng.normal(size=n) * 50,
                         "member": rng.choice([True, False], n), "label": np.arange(n) % 2})


def test_text_and_bool_columns_are_one_hot_and_numeric_ones_left_for_scaling(tmp_path):
    frame = _mixed()
    frame.to_csv(tmp_path / "t.csv", index=False)
    data = preprocess.load(str(tmp_path / "t.csv"), numeric_scaling="none")
    # every set is selected (exactly here, at ε = ∞) and has an "(other)" indicator; bool's too: one row's
    # "maybe" would make it a text column, so its cells decide nothing about its encoding
    assert data.feature_names == ("colour=blue", "colour=red", "colour=(other)", "size", "member=False",
                                  "member=True", "member=(other)")
    assert data.encoder.unscaled() == [3]  # no public range: the private standardisation's job
    x = torch.cat([data.train.tensors[0], data.test.tensors[0]])
    assert (x[:, [0, 1, 2]].sum(1) == 1).all() and (x[:, [4, 5, 6]].sum(1) == 1).all()
    assert sorted(x[:, 3].tolist()) == pytest.approx(sorted(frame["size"].tolist()))  # raw, unscaled
    reds = x[:, 1] == 1
    assert int(reds.sum()) == int((frame["colour"] == "red").sum())


def test_json_lines_load_like_csv(tmp_path):
    frame = _mixed()
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    from_csv = preprocess.load(str(tmp_path / "t.csv"), numeric_scaling="none", seed=0)
    from_jsonl = preprocess.load(str(tmp_path / "t.jsonl"), numeric_scaling="none", seed=0)
    assert from_jsonl.feature_names == from_csv.feature_names

    def rows(data):  # every row, whichever split its cells' text put it in (JSON keeps 10 digits)
        x = torch.cat([data.train.tensors[0], data.test.tensors[0]])
        return x[torch.argsort(x[:, 3])]

    assert torch.allclose(rows(from_jsonl), rows(from_csv))


def test_a_schema_declares_categories_and_ranges(tmp_path):
    _mixed().to_parquet(tmp_path / "t.parquet")
    schema = tables.Schema.from_dict({"categorical": {"colour": ["red", "green", "blue"]},
                                      "numeric": {"size": [-500, 500]}})
    data = preprocess.load(str(tmp_path / "t.parquet"), schema=schema, seed=0)
    assert data.feature_names[:4] == ("colour=red", "colour=green", "colour=blue", "size")
    assert data.encoder.unscaled() == [] and not data.encoder.columns[0].other
    raw = preprocess.load(str(tmp_path / "t.parquet"), numeric_scaling="none", seed=0)
    size = raw.feature_names.index("size")
    assert torch.allclose(data.train.tensors[0][:, 3], raw.train.tensors[0][:, size] / 500)
    assert (data.train.tensors[0][:, 1] == 0).all()  # "green" is declared but never occurs


def test_a_column_neither_numeric_nor_text_is_refused(tmp_path):
    frame = _mixed()
    frame["when"] = pd.Timestamp("2020-01-01")
    frame.to_parquet(tmp_path / "t.parquet")
    with pytest.raises(DataError, match="column 'when' has type datetime64.*neither numeric nor text"):
        preprocess.load(str(tmp_path / "t.parquet"))


def test_empty_test_split_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("a,label\n1,0\n")  # one row: one of the splits is empty
    with pytest.raises(DataError, match="put none in the (test|training) split"):
        preprocess.load(str(tmp_path / "t.csv"))
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (6, 4, 4)))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(6) % 2)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((0, 4, 4)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(0))
    with pytest.raises(DataError, match="the test split holds no examples"):
        preprocess.load(str(tmp_path))


def test_test_labels_not_among_the_classes_are_other_or_refused(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (6, 4, 4)))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(6) % 3)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (4, 4, 4)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([0, 7, 9, 7]))
    with pytest.raises(DataError, match=r"labels \['7', '9'\] are not among the declared classes"):
        preprocess.load(str(tmp_path), labels=("0", "1", "2"))
    selected = preprocess.load(str(tmp_path))  # selected classes: 7 and 9 are the "(other)" class
    assert selected.classes == ("0", "1", "2", "(other)")
    assert selected.test.tensors[1].tolist() == [0, 3, 3, 3]


@pytest.mark.parametrize("name, content, match", [
    ("empty.csv", b"", "empty.csv cannot be read as CSV"),
    ("header.csv", b"a,label\n", "header.csv: the table holds no rows"),
    ("quote.csv", b'a,label\n1,0\n2,"x\n', "quote.csv cannot be read as CSV"),
    ("bad.parquet", b"garbage", "bad.parquet cannot be read as Parquet"),
])
def test_unreadable_tables_are_reported(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=match):
        preprocess.load(str(tmp_path / name))

def test_hugging_face_directories(tmp_path):
    import datasets as hf

    rng = np.random.default_rng(2)
    images = hf.Dataset.from_dict({"image": [rng.integers(0, 256, (8, 8)).astype(np.uint8)
                                             for _ in range(20)],
                                   "label": [i % 4 for i in range(20)]})
    hf.DatasetDict({"train": images, "test": images.select(range(5))}).save_to_disk(tmp_path / "img")
    data = preprocess.load(str(tmp_path / "img"))
    assert data.kind == "image" and data.input_shape == (1, 8, 8) and len(data.test) == 5
    no_rows = images.filter(lambda example: False)
    hf.DatasetDict({"train": images, "test": no_rows}).save_to_disk(tmp_path / "no_test")
    with pytest.raises(DataError, match="the test split holds no examples"):
        preprocess.load(str(tmp_path / "no_test"))
    hf.DatasetDict({"train": images, "test": images.select([])}).save_to_disk(tmp_path / "no_shard")
    with pytest.raises(DataError, match="load_from_disk could not read it"):  # the library's IndexError
        preprocess.load(str(tmp_path / "no_shard"))
    table = hf.Dataset.from_pandas(_table().rename(columns={"target": "label"}))
    table.save_to_disk(tmp_path / "tab")
    data = preprocess.load(str(tmp_path / "tab"))
    assert data.kind == "table" and len(data.train) + len(data.test) == 50


def test_unknown_inputs_are_reported(tmp_path):
    with pytest.raises(DataError, match="not found"):
        preprocess.load(str(tmp_path / "missing.csv"))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="unknown file format"):
        preprocess.load(str(tmp_path / "x.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="cannot tell the format"):
        preprocess.load(str(tmp_path / "empty"))


def test_digits_split_is_keyed_by_the_seed():
    data = preprocess.load("digits", seed=0)
    assert len(data.train) + len(data.test) == 1797 and 0.15 < len(data.test) / 1797 < 0.25
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10 and data.releases == ()
    assert sorted(set(data.test.tensors[1].tolist())) == list(range(10))
    assert torch.equal(preprocess.load("digits", seed=0).test.tensors[0], data.test.tensors[0])
    secret = [preprocess.load("digits").test.tensors[0] for _ in range(2)]  # a secret key per run
    assert secret[0].shape != secret[1].shape or not torch.equal(*secret)
