"""benchmarks/bench_structured.py on the tests' real tokenizer: the compile rows and the solutions it
decodes (the timings themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import load_benchmark


def test_compile_rows_for_each_bound_and_step_count(tiny_model):
    bench = load_benchmark("bench_structured")
    rows = bench.compile_times(Path(tiny_model), [1, 3], [None, 12], repeats=1)
    assert [(r["reason_chars"], r["steps"]) for r in rows] == [(None, 1), (None, 3), (12, 1), (12, 3)]
    for r in rows:
        assert r["part"] == "compile" and r["compile_s"] >= 0 and r["repeats"] == 1
        assert isinstance(r["over_vllm_timeout_5s"], bool)
    # the regex grows with the steps: the increasing wrong-step list is quadratic in them
    assert rows[1]["regex_chars"] > rows[0]["regex_chars"]


def test_solutions_have_exactly_the_asked_step_counts(data_dir):
    from pipeline.core.segment import split_steps

    bench = load_benchmark("bench_structured")
    sols = bench.solutions([1, 4, 12], 2, data_dir)
    assert [s["S"] for s in sols] == [1, 1, 4, 4, 12, 12]
    for s in sols:
        assert len(s["steps"]) == s["S"] and all(step.strip() for step in s["steps"])
        assert "\n".join(s["steps"]).count("\n") == s["S"] - 1
        assert not any(re.search(r"\n", step) for step in s["steps"])
    assert len(split_steps("\n".join(sols[-1]["steps"]), "line")) == 12
