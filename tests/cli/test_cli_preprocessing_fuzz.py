"""The command line's preprocessing on drawn tables and image data sets: one example changed decides
nothing without a release (``tests/support/cli_fuzz.py`` says what is drawn and checked). Seeds 0–23 of
each kind run in the suite (about 10 s in all, one thread)."""

from __future__ import annotations

import pytest
import torch
from support.cli_fuzz import (
    Decisions,
    Outcome,
    draw_images,
    draw_table,
    neighbour_frame,
    table_training_position,
    write_images,
    write_table,
)

SEEDS = range(24)


def _same_decisions(full: Outcome, other: Outcome, shared: list[int], what: str) -> None:
    if other.refusal:
        assert "tunefree: error:" in other.refusal, other.refusal  # a refusal, not a crash
        return  # the data's owner reads why; nothing is trained
    assert other.summary() == full.summary(), what
    assert torch.equal(other.x[shared], full.x[shared]), f"{what}: another example's features changed"
    assert torch.equal(other.y[shared], full.y[shared]), f"{what}: another example's label changed"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_changed_row_of_a_drawn_table_decides_nothing_else(tmp_path, monkeypatch, capsys, seed):
    draw = draw_table(seed)
    neighbour = neighbour_frame(draw)
    assert neighbour is not None, "no tweak keeps the row on its side of the split"
    decisions = Decisions(monkeypatch)
    full = decisions.of(tmp_path / "d.csv", draw.flags + write_table(draw.frame, tmp_path / "d.csv",
                                                                      draw.schema), capsys, record=True)
    assert full.refusal is None, f"the drawn table itself was refused: {full.refusal}"
    other = decisions.of(tmp_path / "n.csv", draw.flags + write_table(neighbour, tmp_path / "n.csv",
                                                                       draw.schema), capsys)
    position = table_training_position(draw)
    shared = [i for i in range(len(full.x)) if i != position]
    _same_decisions(full, other, shared, f"seed {seed}: row {draw.row} changed to {draw.changes}")


@pytest.mark.parametrize("seed", SEEDS)
def test_a_changed_image_of_a_drawn_data_set_decides_nothing_else(tmp_path, monkeypatch, capsys, seed):
    draw = draw_images(seed)
    decisions = Decisions(monkeypatch)
    write_images(draw.images, draw.labels, draw.dtype, tmp_path / "full")
    full = decisions.of(tmp_path / "full", draw.flags, capsys, record=True)
    assert full.refusal is None, f"the drawn images were refused: {full.refusal}"
    changed = list(draw.images)
    changed[draw.index] = draw.changed
    write_images(changed, draw.labels, draw.dtype, tmp_path / "neighbour")
    other = decisions.of(tmp_path / "neighbour", draw.flags, capsys)
    shared = [i for i in range(len(draw.images)) if i != draw.index]
    _same_decisions(full, other, shared, f"seed {seed}: {draw.dtype} image {draw.index} changed")
