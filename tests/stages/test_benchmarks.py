"""Eval sets read from the real wheels: counts, field mapping, and golds math-verify can grade."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.assets import benchmarks
from pipeline.assets.benchmarks import (
    BENCHMARKS,
    clean_latex_gold,
    ensure_benchmark,
    last_boxed,
    number_text,
)
from pipeline.assets.prompts import PROMPTS_SCHEMA, read_prompts
from pipeline.grading import verify_answer

COUNTS = {"gsm8k": 1319, "math500": 500, "minerva": 272, "aime24": 30, "svamp": 1000, "asdiv": 2215, "mawps": 2065}


@pytest.fixture(scope="module")
def tables(tmp_path_factory, data_dir) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for name in BENCHMARKS:
        path = ensure_benchmark(name, root, cache_dir=data_dir / "cache")
        assert path == root / f"{name}.parquet"
        table = read_prompts(path)
        assert table.schema.equals(PROMPTS_SCHEMA, check_metadata=False)
        out[name] = table.to_pylist()
    return out


def test_counts(tables):
    assert {n: len(rows) for n, rows in tables.items()} == COUNTS
    for name, rows in tables.items():
        assert {(r["source"], r["split"]) for r in rows} == {(name, "test")}
        assert len({r["prompt_id"] for r in rows}) == len(rows)
        assert all(r["question"].strip() and r["gold_answer"].strip() for r in rows)


def test_field_mapping_first_rows(tables):
    first = {n: rows[0] for n, rows in tables.items()}
    assert first["gsm8k"]["prompt_id"] == "gsm8k-test-00000"
    assert first["gsm8k"]["gold_answer"] == str((16 - 3 - 4) * 2)  # Janet's ducks
    assert first["math500"]["gold_answer"] == r"\left( 3, \frac{\pi}{2} \right)"  # LaTeX kept as LaTeX
    assert first["math500"]["gold_solution"].startswith("We have that $r = \\sqrt{0^2 + 3^2} = 3.$")
    assert first["minerva"]["gold_answer"] == "1.6"  # last \boxed{} of the solution
    assert first["minerva"]["question"].startswith("Each of the two Magellan telescopes")
    assert first["svamp"]["question"] == ("There are 87 oranges and 290 bananas in Philip's collection. If the bananas are "
                                          "organized into 2 groups and oranges are organized into 93 groups. "
                                          "How big is each group of bananas?")  # Body + "." + Question
    assert first["svamp"]["gold_answer"] == str(290 // 2)  # 145.0 -> "145"
    assert first["asdiv"]["question"] == ("Seven red apples and two green apples are in the basket. "
                                          "How many apples are in the basket?")
    assert first["asdiv"]["gold_answer"] == str(7 + 2)  # "9 (apples)"
    assert first["mawps"]["gold_answer"] == str(70 - 27)  # Joan's seashells
    assert first["mawps"]["gold_solution"] is None
    assert first["aime24"]["gold_answer"] == "204" and first["aime24"]["question"].startswith("Every morning Aya")
    assert [r["prompt_id"] for r in tables["aime24"]] == [f"aime24-test-{i:05d}" for i in range(30)]


def test_golds_that_needed_cleaning(tables):
    by_id = {r["prompt_id"]: r for rows in tables.values() for r in rows}
    assert by_id["math500-test-00459"]["gold_answer"] == "18.90"  # was \$18.90
    assert by_id["math500-test-00242"]["gold_answer"] == r"32,\!348"  # was \$32,\!348
    assert by_id["minerva-test-00072"]["gold_answer"] == r"x_{0} \cos (\omega t)+ \dot{x}_{0} \sin (\omega t) / \omega"
    assert by_id["minerva-test-00086"]["gold_answer"] == r"I(0) e^{-\frac{t}{R C}}"  # trailing newline gone
    assert by_id["mawps-test-00205"]["gold_answer"] == str(17 / 2 + 6 / 2)  # 11.5 half-dollars
    assert by_id["asdiv-test-00029"]["gold_answer"] == "Mrs. Hilt"  # non-numeric golds are kept


def test_golds_are_gradable(tables):
    """A response boxing the gold is right, for the cleaned rows and a seeded sample of every set."""
    tricky = {"math500-test-00242", "math500-test-00459", "math500-test-00488", "minerva-test-00072", "minerva-test-00086"}
    rng = np.random.default_rng(0)
    for name, rows in tables.items():
        picked = [rows[i] for i in rng.choice(len(rows), size=min(25, len(rows)), replace=False)]
        picked += [r for r in rows if r["prompt_id"] in tricky]
        for r in picked:
            _, ok, status = verify_answer(r["gold_answer"], f"So the answer is \\boxed{{{r['gold_answer']}}}.")
            assert ok, (r["prompt_id"], r["gold_answer"], status)


def test_helpers():
    assert last_boxed(r"a \boxed{1} then $\boxed{\frac{1}{2}}$ cm") == r"\frac{1}{2}"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unclosed") is None
    assert clean_latex_gold(" \\$1,\\!000 \n") == "1,\\!000"
    assert (number_text(145.0), number_text(11.5), number_text(-3)) == ("145", "11.5", "-3")


def test_unknown_name_lists_valid(tmp_path):
    with pytest.raises(ValueError, match=r"unknown benchmark 'gsm9k'; valid: \['aime24', 'asdiv', 'gsm8k'"):
        ensure_benchmark("gsm9k", tmp_path)


def test_count_check_and_reuse(tmp_path, data_dir, monkeypatch):
    path = ensure_benchmark("aime24", tmp_path, cache_dir=data_dir / "cache")
    mtime = path.stat().st_mtime_ns
    assert ensure_benchmark("aime24", tmp_path, cache_dir=data_dir / "cache") == path
    assert path.stat().st_mtime_ns == mtime  # reused, not rewritten
    monkeypatch.setitem(benchmarks.BENCHMARKS, "aime24", dataclasses.replace(BENCHMARKS["aime24"], expected_rows=31))
    with pytest.raises(ValueError, match="aime24: .* gave 30 problems, expected 31"):
        ensure_benchmark("aime24", tmp_path / "other", cache_dir=data_dir / "cache")
