"""Data reading: one rule for every local text (the hub WikiText builder's), so calibration
and evaluation read the same rows on a machine with the shared data as on one with the hub."""

from __future__ import annotations

import pytest

from kvlab.data import calibration_text, calibration_text_id, data_root, local_rows


def test_local_rows_follow_the_hub_builder_rule(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(" = Title = \n \n First line .\nlast line without a break")
    assert local_rows(path) == [" = Title = \n", "", " First line .\n", "last line without a break"]


def test_calibration_text_keeps_line_breaks(tmp_path):
    """Rows joined as they come: lines never glue together (they did: 'line .next')."""
    path = tmp_path / "calibration.txt"
    path.write_text("a line .\n\nnext line\n")
    assert calibration_text(str(path)) == "a line .\nnext line\n"
    first = calibration_text_id(str(path))
    path.write_text("a line .\nnext line, changed\n")
    assert calibration_text_id(str(path)) != first


@pytest.mark.skipif(data_root() is None, reason="no local data root (../shared/data)")
def test_wikitext_validation_reads_as_the_hub_rows():
    text = calibration_text("wikitext2-valid")
    assert text.startswith(" = Homarus gammarus = \n Homarus gammarus , known as")
    assert "\n\n" not in text  # whitespace-only lines are empty rows, as on the hub


def test_unknown_calibration_source_names_what_is_allowed(tmp_path):
    with pytest.raises(FileNotFoundError, match="wikitext2-valid or a local text file"):
        calibration_text(str(tmp_path / "missing.txt"))
