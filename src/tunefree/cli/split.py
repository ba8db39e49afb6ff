"""The train/test split of data that comes without one: a keyed hash of each row's content.

A row is a test row when the keyed hash (BLAKE2b) of its cells falls in the lowest ``TEST_FRACTION`` of
its range. The decision for a row depends on that row and the key alone, so removing (or adding) one row
of the file moves no other row between the splits: the training set of a neighbouring file differs by at
most that one row, which is what the guarantee of the training run is about. (A seeded shuffle would
re-draw the whole split when one row goes.)

The key comes from the run's randomness: secret (``os.urandom``) by default, derived from ``--seed`` for
a reproducible run. Equal rows fall on the same side; the split sizes are binomial, not exactly 80/20.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

TEST_FRACTION = 0.2
KEY_BYTES = 16
_SEPARATOR = "\x1f"  # unit separator: no cell text makes two rows' joined texts collide by accident


def split_key(seed: int | None) -> bytes:
    """The split's key: secret when ``seed`` is ``None``, else derived from the seed (reproducible)."""
    if seed is None:
        return os.urandom(KEY_BYTES)
    return hashlib.blake2b(f"tunefree train/test split {int(seed)}".encode(), digest_size=KEY_BYTES).digest()


def cell_text(value) -> str:
    """A cell as text, the same whatever type the file's reader gave it (3, 3.0 and "3" are one)."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    if isinstance(value, np.generic):
        value = value.item()
    return str(value)


def table_rows(columns: Sequence[Sequence]) -> list[bytes]:
    """Each row's content as bytes, from the table's columns (label included), cell by cell."""
    return [_SEPARATOR.join(cell_text(v) for v in row).encode() for row in zip(*columns)]


def array_rows(x: np.ndarray, y: np.ndarray) -> list[bytes]:
    """Each example's content as bytes: its array (dtype, shape and values) and its label."""
    x = np.ascontiguousarray(x)
    return [x[i].tobytes() + _SEPARATOR.encode() + cell_text(y[i]).encode() for i in range(len(x))]


def held_out(rows: Iterable[bytes], key: bytes) -> np.ndarray:
    """Whether each row is a test row: its keyed hash, as a number in [0, 1), is below ``TEST_FRACTION``."""
    cut = int(TEST_FRACTION * 2 ** 64)
    return np.array([int.from_bytes(hashlib.blake2b(row, key=key, digest_size=8).digest(), "little") < cut
                     for row in rows], dtype=bool)
