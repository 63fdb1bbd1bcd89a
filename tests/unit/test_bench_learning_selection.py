"""``bench_learning.py --selection``: train on a given file of problems, never overwrite another."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_learning")


def _args(bench, tmp_path: Path, selection) -> object:
    a = bench.parser().parse_args(["--max-tokens", "320", "--data-dir", str(tmp_path / "data"),
                                   "--runs-dir", str(tmp_path / "runs")]
                                  + (["--selection", str(selection)] if selection else []))
    return a


def test_selection_is_copied_to_the_usual_path(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    out = bench.select_training_items(_args(bench, tmp_path, shipped))
    assert out.name == shipped.name and out.parent == (tmp_path / "data" / "prompts").resolve()
    assert out.read_bytes() == shipped.read_bytes()
    assert sum(1 for _ in out.open()) == 42
    assert bench.select_training_items(_args(bench, tmp_path, shipped)) == out  # the same file again: fine


def test_selection_never_overwrites_another(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    existing = tmp_path / "data" / "prompts" / shipped.name
    existing.parent.mkdir(parents=True)
    existing.write_text('{"question": "1+1?", "gold_answer": "2"}\n')
    with pytest.raises(SystemExit, match="differs from the selection already at"):
        bench.select_training_items(_args(bench, tmp_path, shipped))
    assert existing.read_text() == '{"question": "1+1?", "gold_answer": "2"}\n'
    with pytest.raises(SystemExit, match="no such file"):
        bench.select_training_items(_args(bench, tmp_path, tmp_path / "missing.jsonl"))


def test_selection_for_other_settings_is_refused(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    a = bench.parser().parse_args(["--max-tokens", "192", "--data-dir", str(tmp_path / "data"),
                                   "--selection", str(shipped)])
    with pytest.raises(SystemExit, match="made for other settings"):
        bench.select_training_items(a)
    assert not (tmp_path / "data" / "prompts").exists() or not any((tmp_path / "data" / "prompts").iterdir())
