"""Atomic file writes: a failed write leaves the earlier file whole."""

import pytest

from stp.files import replacing, write_text_atomic


def test_a_completed_write_replaces_the_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_write_keeps_the_earlier_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("good")
    with pytest.raises(OSError), replacing(path) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert path.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
