"""Conformance: every layer family × configuration (tests/support/conformance_cases.py) is exact against the
batch-size-1 loop under both groupings and both norm paths, or refused with its true message; every exact
case agrees with the loop under bfloat16 autocast too, to a few roundings; and docs/support-matrix.md is the
matrix those cases generate."""

from __future__ import annotations

import re

import pytest
import torch
from support.conformance_cases import CASES
from support.conformance_harness import run, run_in_autocast
from support.conformance_matrix import MATRIX_PATH, render


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_case(case):
    refusal = run(case)
    if case.refused is None:
        assert refusal is None, f"{case.id} was refused: {refusal}"
    else:
        assert refusal is not None, f"{case.id} was accepted; expected a refusal matching {case.refused!r}"
        assert re.search(case.refused, refusal, re.DOTALL), f"{case.id}: unexpected message: {refusal}"


EXACT = [case for case in CASES if case.refused is None]


@pytest.mark.parametrize("case", EXACT, ids=[case.id for case in EXACT])
def test_exact_case_under_bf16_autocast(case):
    """What trains under autocast in plain PyTorch trains privately too, every rule taking 16-bit inputs,
    states and output gradients (the recurrent cells once crashed on them)."""
    run_in_autocast(case, torch.bfloat16)


def test_support_matrix_is_generated_from_the_cases():
    assert MATRIX_PATH.read_text() == render(CASES), (
        "docs/support-matrix.md is stale: regenerate it with `python tests/support/conformance_matrix.py`"
    )
