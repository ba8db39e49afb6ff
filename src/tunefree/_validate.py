"""One check per kind of value, shared by every option and constructor: each names the option it checks
(as the caller spelt it) and what a valid value is."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any


def _number(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{option} must be a number, got {value!r}")
    return float(value)


def positive(option: str, value: Any) -> float:
    """A finite number > 0."""
    if not (_number(option, value) > 0 and math.isfinite(value)):
        raise ValueError(f"{option} must be a positive finite number, got {value}")
    return float(value)


def non_negative(option: str, value: Any) -> float:
    """A finite number ≥ 0."""
    if not (_number(option, value) >= 0 and math.isfinite(value)):
        raise ValueError(f"{option} must be a finite number ≥ 0, got {value!r}")
    return float(value)


def fraction(option: str, value: Any) -> float:
    """A number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{option} must be in (0, 1), got {value!r}")
    return float(value)


def count(option: str, value: Any) -> int:
    """An int ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{option} must be ≥ 1, got {value}")
    return value


def flag(option: str, value: Any) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{option} must be True or False, got {value!r}")
    return value


def one_of(option: str, value: Any, choices: Collection[str]) -> str:
    """One of ``choices`` (a name)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {option} {value!r}: use one of {', '.join(map(str, choices))}")
    return value
