"""The budget recheck of learning runs (benchmarks/bench_budget.py), on hand-made eval rows.

The evals themselves are real in the benchmark; here only its arithmetic: the paired change, the
shares cut at the budget, the accuracy among finished answers, the arm labels that decide which
runs are pooled, and the pooled change over seeds.
"""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_budget")


def _rows(spec: str) -> list[dict]:
    """One greedy row per character: R right, W wrong (finished), C cut at the budget (wrong)."""
    return [{"benchmark": "mawps", "prompt_id": f"p{i}", "decoding": "greedy", "correct": c == "R",
             "finish_reason": "length" if c == "C" else "stop"} for i, c in enumerate(spec)]


def test_budget_change_by_hand(bench):
    # round 0: R R W C C C W R (3 right of 8; 3 cut; 3 right of the 5 finished)
    # round K: R R W R R C W W (4 right of 8; 1 cut; 4 right of the 7 finished)
    before, after = _rows("RRWCCCWR"), _rows("RRWRRCWW")
    before.append({**before[0], "decoding": "sample"})  # sampled rows are not greedy items
    c = bench.budget_change(before, after)
    assert c["n"] == 8 and c["acc_a"] == pytest.approx(3 / 8) and c["acc_b"] == pytest.approx(4 / 8)
    assert c["diff"] == pytest.approx(1 / 8)
    assert (c["n01"], c["n10"]) == (2, 1)  # p3, p4 wrong -> right; p7 right -> wrong
    assert c["p_mcnemar"] == pytest.approx(1.0)  # 3 discordant pairs split 2/1: two-sided exact p = 1
    assert c["cut_a"] == pytest.approx(3 / 8) and c["cut_b"] == pytest.approx(1 / 8)
    assert c["finished_acc_a"] == pytest.approx(3 / 5) and c["finished_acc_b"] == pytest.approx(4 / 7)
    assert c["item_change"] == {"mawps/p0": 0.0, "mawps/p1": 0.0, "mawps/p2": 0.0, "mawps/p3": 1.0,
                                "mawps/p4": 1.0, "mawps/p5": 0.0, "mawps/p6": 0.0, "mawps/p7": -1.0}


def test_budget_change_names_tables_without_common_items(bench):
    other = [{**r, "prompt_id": "q" + r["prompt_id"]} for r in _rows("RW")]
    with pytest.raises(ValueError, match="no greedy item in common.*2 and 2 greedy rows"):
        bench.budget_change(_rows("RW"), other)
    assert bench.budget_change(_rows("CC"), _rows("CC"))["finished_acc_a"] is None


def test_arm_labels_separate_the_configurations(bench):
    rc = {"train": {"learning_rate": 5e-6, "kl_coef": 0.0}, "rollout": {"dynamic_sampling": True},
          "reward": {"overlong_buffer": 0}}
    assert bench.arm_label("grpo", rc) == "grpo lr=5e-06 ds"
    rc2 = {"train": {"learning_rate": 1e-5, "kl_coef": 0.04}, "rollout": {"dynamic_sampling": False},
           "reward": {"overlong_buffer": 32}}
    assert bench.arm_label("capo", rc2) == "capo lr=1e-05 kl=0.04 overlong=32"


def test_pooled_over_seeds_on_shared_items(bench):
    # two seeds, identical changes on the two shared items (+1, 0): mean +0.5; the crossed bootstrap
    # resamples items only in effect, so the interval is the item bootstrap's [0, 1]
    s0 = {"a": 1.0, "b": 0.0, "only0": 1.0}
    s1 = {"a": 1.0, "b": 0.0}
    p = bench.pooled([s0, s1])
    assert p["n"] == 2 and p["diff"] == pytest.approx(0.5)
    assert p["lo"] == pytest.approx(0.0) and p["hi"] == pytest.approx(1.0)
    assert bench.pooled([]) is None and bench.pooled([{"a": 1.0}, {"b": 1.0}]) is None
