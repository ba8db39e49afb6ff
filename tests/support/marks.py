"""Marks on single cases of a ``parametrize`` list."""

from __future__ import annotations

import pytest


def slow_case(*values):
    """One case of a ``parametrize`` list marked ``slow`` (left out of ``make test-fast``)."""
    return pytest.param(*values, marks=pytest.mark.slow)
