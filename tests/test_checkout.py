"""The check that keeps the test suite out of the checkout (tests/conftest.py)."""

from __future__ import annotations

from conftest import changes, snapshot


def test_a_file_written_changed_or_removed_is_named(tmp_path):
    (tmp_path / "kept.txt").write_text("a")
    (tmp_path / "gone.txt").write_text("b")
    (tmp_path / ".git").mkdir()
    before = snapshot(tmp_path)
    (tmp_path / "gone.txt").unlink()
    (tmp_path / "kept.txt").write_text("longer")
    (tmp_path / "data" / "stats").mkdir(parents=True)
    (tmp_path / "data" / "stats" / "stats.csv").write_text("x")
    (tmp_path / ".git" / "index").write_text("ignored")
    assert changes(before, snapshot(tmp_path)) == [
        "written: data/stats/stats.csv", "changed: kept.txt", "removed: gone.txt"]


def test_an_untouched_tree_has_no_changes(tmp_path):
    (tmp_path / "a").write_text("a")
    assert changes(snapshot(tmp_path), snapshot(tmp_path)) == []
