"""The learning benchmark's final table (benchmarks/bench_learning.py), on hand-made per-seed results.

The rounds themselves are real in the benchmark; here only its arithmetic over finished runs: the
mean and max - min spread over seeds, the gain over the control against twice the spread, and the
change pooled over seeds with its interval for seeds and items (t on S - 1 degrees of freedom; the
arithmetic of the interval itself is worked by hand in test_significance.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_learning")


def _changes(per_item: list[int], n: int = 200) -> dict:
    """One run's item changes: the first ``per_item[0]`` items gained (+1), the next ``per_item[1]`` lost (-1)."""
    up, down = per_item
    d = [1.0] * up + [-1.0] * down + [0.0] * (n - up - down)
    return {"greedy": {("mawps", f"p{i}"): x for i, x in enumerate(d)}, "sampled": {}}


def test_summary_by_hand(bench):
    a = bench.parser().parse_args(["--arms", "grpo", "control", "--seeds", "0", "1", "--rounds", "2"])
    rows = [
        {"arm": arm, "seed": s, "round": k, "heldout_accuracy": acc}
        for arm, s, k, acc in [("grpo", 0, 0, 0.50), ("grpo", 1, 0, 0.50), ("grpo", 0, 2, 0.62),
                               ("grpo", 1, 2, 0.56), ("control", 0, 2, 0.50), ("control", 1, 2, 0.51)]
    ]
    # grpo: seed 0 gained 30 - 6 = 24 items of 200 (+12 points), seed 1 gained 20 - 8 = 12 (+6 points)
    changes = {("grpo", 0): _changes([30, 6]), ("grpo", 1): _changes([20, 8]),
               ("control", 0): _changes([0, 0]), ("control", 1): _changes([5, 3])}
    grpo, control = bench.summarize(a, rows, {}, changes)
    assert grpo["summary"] == "grpo" and grpo["seeds"] == 2
    # mean 0.59, spread 0.06; control mean 0.505, spread 0.01: gain 0.085 < 2 x 0.06 = 0.12 -> not beaten
    assert grpo["heldout_accuracy"] == pytest.approx(0.59) and grpo["spread"] == pytest.approx(0.06)
    assert grpo["gain_over_control"] == pytest.approx(0.085) and grpo["beats_control"] is False
    pooled = grpo["pooled_change_from_round0"]["greedy"]
    assert pooled["seeds"] == 2 and pooled["n"] == 200
    assert pooled["diff"] == pytest.approx(0.09) and pooled["per_seed"] == pytest.approx([0.12, 0.06])
    # two seeds 6 points apart: t(1) = 12.7 times the pooled se (>= the seeds' 0.03) spans 0
    assert pooled["lo"] < 0 < 0.12 < pooled["hi"] and pooled["significant"] is False
    assert "sampled" not in grpo["pooled_change_from_round0"]  # no --eval-samples: no sampled rates
    assert control["pooled_change_from_round0"]["greedy"]["diff"] == pytest.approx(0.005)
    assert control["pooled_change_from_round0"]["greedy"]["significant"] is False


def test_pooling_uses_the_items_every_seed_has_and_skips_unfinished_runs(bench):
    a = bench.parser().parse_args(["--arms", "grpo", "--seeds", "0", "1", "2"])
    one, two = _changes([4, 0], n=8), _changes([2, 0], n=8)
    del two["greedy"][("mawps", "p0")]  # seed 1 lacks an item (one it gained): pooled over the 7 both have
    pooled = bench.pooled_changes(a, "grpo", {("grpo", 0): one, ("grpo", 1): two, ("grpo", 2): None})
    assert pooled["greedy"]["seeds"] == 2 and pooled["greedy"]["n"] == 7
    assert pooled["greedy"]["per_seed"] == pytest.approx([3 / 7, 1 / 7])
    assert bench.pooled_changes(a, "grpo", {("grpo", 0): None}) == {}


def test_capo_minus_grpo_is_paired_by_seed_and_item(bench):
    a = bench.parser().parse_args(["--arms", "grpo", "capo", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": acc}
            for arm, acc in [("grpo", 0.55), ("capo", 0.70)] for s in (0, 1, 2)]
    # on 200 items: GRPO gained items 0-9 in each seed; CAPO gained items 0-39: CAPO - GRPO is +1 on
    # items 10-39 and 0 elsewhere, in every seed -> +15 points, and no seed variation: MS_seed = 0 =
    # MS_res, MS_item = 3 * (30 * 0.85^2 + 170 * 0.15^2) / 199 = 3 * 25.5 / 199, V = MS_item / 600,
    # se 0.025312; t(2) = 4.3027 -> 0.15 +- 0.10891
    changes = {(arm, s): _changes([up, 0]) for arm, up in [("grpo", 10), ("capo", 40)] for s in (0, 1, 2)}
    (head,) = [r for r in bench.summarize(a, rows, {}, changes) if "capo_minus_grpo" in r]
    assert head["metric"] == "heldout_accuracy" and head["capo_minus_grpo"] == pytest.approx(0.15)
    pooled = head["capo_minus_grpo_pooled"]
    assert pooled["seeds"] == 3 and pooled["diff"] == pytest.approx(0.15) and pooled["per_seed"] == pytest.approx([0.15] * 3)
    assert pooled["lo"] == pytest.approx(0.15 - 0.10891, abs=1e-4) and pooled["hi"] == pytest.approx(0.15 + 0.10891, abs=1e-4)
    assert pooled["significant"] and head["capo_ahead_of_grpo"] is True and head["capo_beat_grpo"] is True
    # ahead by half a point on the means, inside the interval: no win
    near = {(arm, s): _changes([up, 0]) for arm, up in [("grpo", 10), ("capo", 11)] for s in (0, 1, 2)}
    rows_near = [{**r, "heldout_accuracy": 0.555 if r["arm"] == "capo" else 0.55} for r in rows]
    (tie,) = [r for r in bench.summarize(a, rows_near, {}, near) if "capo_minus_grpo" in r]
    assert tie["capo_minus_grpo"] == pytest.approx(0.005) and tie["capo_ahead_of_grpo"] is True
    assert not tie["capo_minus_grpo_pooled"]["significant"] and tie["capo_beat_grpo"] is False
    (bare,) = [r for r in bench.summarize(a, rows, {}, {}) if "capo_minus_grpo" in r]  # no eval tables: no verdict
    assert bare["capo_ahead_of_grpo"] is True and bare["capo_beat_grpo"] is None
    # a seed only one arm finished is left out; no seed both finished: no pooled comparison
    assert bench.arm_minus_other(a, {**changes, ("grpo", 1): None}, "greedy")["seeds"] == 2
    assert bench.arm_minus_other(a, {("capo", 0): changes[("capo", 0)], ("grpo", 1): changes[("grpo", 1)]}, "greedy") is None



def test_capo_beat_grpo_needs_the_paired_interval_above_zero_on_each_metric(bench):
    """Greedy: CAPO gained items 0-39 and GRPO 0-9 in each of three seeds (+15 points, interval
    above 0: a win). Sampled: the other way round (-15 points, interval below 0: not a win, not
    ahead). One seed: no verdict."""
    def run(greedy_up: int, sampled_up: int) -> dict:
        return {"greedy": _changes([greedy_up, 0])["greedy"], "sampled": _changes([sampled_up, 0])["greedy"]}

    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": g, "heldout_sampled_accuracy": smp}
            for arm, g, smp in [("grpo", 0.55, 0.70), ("capo", 0.70, 0.55)] for s in (0, 1, 2)]
    changes = {(arm, s): run(*ups) for arm, ups in [("grpo", (10, 40)), ("capo", (40, 10))] for s in (0, 1, 2)}
    a = bench.parser().parse_args(["--arms", "grpo", "capo", "--seeds", "0", "1", "2", "--rounds", "2"])
    out = bench.summarize(a, rows, {}, changes)
    (greedy,) = [r for r in out if "capo_minus_grpo" in r]
    (sampled,) = [r for r in out if "sampled_capo_minus_grpo" in r]
    assert greedy["capo_minus_grpo_pooled"]["lo"] > 0 and greedy["capo_beat_grpo"] is True
    assert sampled["sampled_capo_minus_grpo"] == pytest.approx(-0.15)
    assert sampled["sampled_capo_minus_grpo_pooled"]["hi"] < 0
    assert sampled["sampled_capo_ahead_of_grpo"] is False and sampled["sampled_capo_beat_grpo"] is False
    one = bench.parser().parse_args(["--arms", "grpo", "capo", "--seeds", "0", "--rounds", "2"])
    out1 = bench.summarize(one, [r for r in rows if r["seed"] == 0], {}, {k: v for k, v in changes.items() if k[1] == 0})
    (greedy1,) = [r for r in out1 if "capo_minus_grpo" in r]
    assert greedy1["capo_minus_grpo_pooled"]["seeds"] == 1 and greedy1["capo_beat_grpo"] is None

def test_each_training_arm_is_compared_with_the_shuffled_outcome_control(bench):
    a = bench.parser().parse_args(["--arms", "grpo", "shuffled", "--seeds", "0", "1", "2", "--rounds", "2"])
    assert bench.parser().parse_args([]).arms == ["grpo", "capo", "control"]  # the control is asked for by name
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": acc}
            for arm, acc in [("grpo", 0.70), ("shuffled", 0.55)] for s in (0, 1, 2)]
    # as above: GRPO gained items 0-39 in each seed, the shuffled control items 0-9 -> +15 points
    changes = {(arm, s): _changes([up, 0]) for arm, up in [("grpo", 40), ("shuffled", 10)] for s in (0, 1, 2)}
    out = bench.summarize(a, rows, {}, changes)
    assert [r.get("summary") for r in out[:2]] == ["grpo", "shuffled"]
    (head,) = [r for r in out if "grpo_minus_shuffled" in r]
    assert head["grpo_minus_shuffled"] == pytest.approx(0.15)
    pooled = head["grpo_minus_shuffled_pooled"]
    assert pooled["seeds"] == 3 and pooled["per_seed"] == pytest.approx([0.15] * 3) and pooled["significant"]
    assert not [r for r in out if "capo_minus_shuffled" in r]  # no CAPO runs, no CAPO row
    cfg = bench.arm_config(a, "shuffled", 0, Path("train.jsonl"))
    assert cfg.reward.outcome == "shuffled" and cfg.reward.estimator == "grpo" and not cfg.critique.enabled


def test_capo_is_compared_with_its_own_signal_on_random_steps(bench):
    """CAPO gained items 0-39 in each of three seeds, the random-credit control items 0-9: +15 points,
    paired interval above 0, so CAPO beat random credit; without that arm the row says so."""
    a = bench.parser().parse_args(["--arms", "capo", "random-credit", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": acc}
            for arm, acc in [("capo", 0.70), ("random-credit", 0.55)] for s in (0, 1, 2)]
    changes = {(arm, s): _changes([up, 0]) for arm, up in [("capo", 40), ("random-credit", 10)] for s in (0, 1, 2)}
    out = bench.summarize(a, rows, {}, changes)
    (head,) = [r for r in out if "capo_minus_random_credit" in r]
    assert head["capo_minus_random_credit"] == pytest.approx(0.15)
    assert head["capo_minus_random_credit_pooled"]["lo"] > 0 and head["capo_beat_random_credit"] is True
    alone = bench.summarize(a, [r for r in rows if r["arm"] == "capo"], {}, {k: v for k, v in changes.items()
                                                                            if k[0] == "capo"})
    assert [r["capo_beat_random_credit"] for r in alone if "capo_beat_random_credit" in r] == ["not run"]
    cfg = bench.arm_config(a, "random-credit", 0, Path("train.jsonl"))
    assert cfg.vote.random_credit and cfg.critique.enabled and cfg.reward.process_weight > 0 and cfg.variant == "random-credit"


def _row(pid: str, decoding: str, text: str, correct: bool, finish: str = "stop") -> dict:
    return {"benchmark": "mawps", "prompt_id": pid, "decoding": decoding, "response_text": text,
            "finish_reason": finish, "correct": correct}


def test_format_breakdown_by_hand(bench):
    """Four sampled answers: a right boxed one, a wrong boxed one, a program with a box (boxed), a
    bare program, and one cut at the budget: shares and accuracy within boxed answers by hand."""
    rows = [_row("a", "sample", "so \\boxed{5}", True),
            _row("a", "sample", "so \\boxed{6}", False),
            _row("b", "sample", "```python\nprint(2 + 3)\n```\nThe answer is \\boxed{5}", True),
            _row("b", "sample", "def f():\n    return 5", False),
            _row("b", "sample", "Let me think step by step and", False, "length"),
            _row("a", "greedy", "\\boxed{5}", True)]
    assert [bench.answer_format(r["response_text"], r["finish_reason"]) for r in rows] == \
        ["boxed", "boxed", "boxed", "program", "cut", "boxed"]
    f = bench.format_breakdown(rows, "sample")
    assert f["n"] == 5 and f["share_cut"] == 0.2 and f["share_boxed"] == 0.6 and f["share_program"] == 0.4
    assert f["share_finished_unboxed"] == 0.2 and f["accuracy"] == 0.4
    assert f["accuracy_boxed"] == pytest.approx(2 / 3)  # 2 of the 3 boxed answers are right
    assert bench.format_breakdown(rows, "greedy")["accuracy_boxed"] == 1.0
    assert bench.format_breakdown([r for r in rows if r["decoding"] == "sample"], "greedy") is None


def test_verdicts_within_boxed_answers_say_not_run_without_the_other_arm(bench):
    """A run that learned to box its answers: sampled accuracy up, accuracy within boxed answers
    unchanged. The boxed verdicts come out per metric, "not run" where random credit is missing."""
    a = bench.parser().parse_args(["--arms", "grpo", "capo", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": 0.6, "heldout_sampled_accuracy": 0.5}
            for arm in ("grpo", "capo") for s in (0, 1, 2)]
    items = [("mawps", f"p{i}") for i in range(100)]
    same = {i: 0.0 for i in items}
    # CAPO: +1 on 20 items within boxed answers in each seed; GRPO: nothing (MS_item = 3 * 16 / 99,
    # se 0.0402, t(2) * se = 0.173: [0.027, 0.373])
    capo = {"greedy": same, "sampled": same, "greedy_boxed": {i: float(n < 20) for n, i in enumerate(items)},
            "sampled_boxed": same}
    grpo = {"greedy": same, "sampled": same, "greedy_boxed": same, "sampled_boxed": same}
    changes = {(arm, s): run for arm, run in [("capo", capo), ("grpo", grpo)] for s in (0, 1, 2)}
    out = [r for r in bench.summarize(a, rows, {}, changes) if r.get("metric", "").endswith("_boxed")]
    by = {k: v for r in out for k, v in r.items() if "_capo_beat_" in k}
    assert by == {"greedy_boxed_capo_beat_grpo": True, "greedy_boxed_capo_beat_random_credit": "not run",
                  "sampled_boxed_capo_beat_grpo": False, "sampled_boxed_capo_beat_random_credit": "not run"}
    head = next(r for r in out if "greedy_boxed_capo_minus_grpo_pooled" in r)
    assert head["greedy_boxed_capo_minus_grpo_pooled"]["diff"] == pytest.approx(0.2)
    # without sampled answers (--eval-samples 1) there is no sampled verdict, not a None one
    greedy_only = [{k: v for k, v in r.items() if k != "heldout_sampled_accuracy"} for r in rows]
    keys = {k for r in bench.summarize(a, greedy_only, {}, changes) for k in r}
    assert "greedy_boxed_capo_beat_grpo" in keys and not any(k.startswith("sampled_boxed") for k in keys)


def test_sampled_gain_is_held_to_the_noise_floor_of_sample_seeds(bench):
    """The start sampled again under other seeds moved 3 points (spread 0.03): a pooled sampled
    change whose interval starts above 0.03 is beyond the noise, one that starts below is not."""
    a = bench.parser().parse_args(["--arms", "grpo", "capo", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": 0.6} for arm in ("grpo", "capo") for s in (0, 1, 2)]
    items = [("mawps", f"p{i}") for i in range(200)]

    def run(up: int) -> dict:  # the first `up` items gained a whole sample share, the rest nothing
        d = {i: float(n < up) for n, i in enumerate(items)}
        return {"greedy": {i: 0.0 for i in items}, "sampled": d}

    changes = {("grpo", s): run(10) for s in (0, 1, 2)} | {("capo", s): run(40) for s in (0, 1, 2)}
    noise = {"sample": {"accuracy": [0.45, 0.47, 0.48], "spread": 0.03, "sd": 0.0153}}
    by = {r["summary"]: r for r in bench.summarize(a, rows, {}, changes, noise) if "summary" in r}
    # capo: +20 points, the same in each seed: MS_item = 3 * 32 / 199, se 0.0284, t(2) * se = 0.122
    # -> lower end 0.078 > 0.03
    assert by["capo"]["sampled_beyond_noise"] is True
    # grpo: +5 points, se 0.0155, lower end 0.05 - 0.0665 < 0.03
    assert by["grpo"]["pooled_change_from_round0"]["sampled"]["lo"] < 0.03
    assert by["grpo"]["sampled_beyond_noise"] is False
    assert {r["summary"]: r for r in bench.summarize(a, rows, {}, changes) if "summary" in r}["capo"]["sampled_beyond_noise"] is None
    # one seed: no verdict, as beats_control gives none below 2 seeds
    one = bench.parser().parse_args(["--arms", "capo", "--seeds", "0", "--rounds", "2"])
    (alone,) = [r for r in bench.summarize(one, [r for r in rows if r["seed"] == 0], {}, {("capo", 0): run(40)}, noise)
                if "summary" in r]
    assert alone["sampled_beyond_noise"] is None


def test_item_records_recompute_the_paired_figures(bench, monkeypatch):
    """The per-item evidence lines of one run: greedy right/format per problem and, per problem, the
    samples right, boxed, and right among the boxed; round 0's and round K's, on sorted ids."""
    a = bench.parser().parse_args(["--arms", "capo", "--seeds", "0", "--rounds", "3"])
    rows0 = [_row("b", "greedy", "def f():\n    return 5", False), _row("a", "greedy", "x", False, "length"),
             _row("a", "sample", "\\boxed{5}", True), _row("a", "sample", "\\boxed{6}", False),
             _row("b", "sample", "so 5", True), _row("b", "sample", "cut", False, "length")]
    rowsk = [_row("a", "greedy", "\\boxed{5}", True), _row("b", "greedy", "\\boxed{5}", True),
             _row("a", "sample", "\\boxed{5}", True), _row("a", "sample", "\\boxed{5}", True),
             _row("b", "sample", "\\boxed{4}", False), _row("b", "sample", "\\boxed{5}", True)]
    monkeypatch.setattr(bench, "eval_tables", lambda *args: (rows0, rowsk))
    r0, rk = bench.item_records(a, "capo", 0, Path("train.jsonl"))
    assert (r0["items"], r0["seed"], r0["round"], rk["round"]) == ("capo", 0, 0, 3)
    assert r0["ids"] == ["mawps/a", "mawps/b"] and r0["greedy"] == "00" and r0["greedy_format"] == "cp"
    assert r0["samples"] == 2 and r0["sampled_right"] == [1, 1] and r0["sampled_boxed"] == [2, 0]
    assert r0["sampled_boxed_right"] == [1, 0]
    assert rk["greedy"] == "11" and rk["greedy_format"] == "bb" and rk["sampled_right"] == [2, 1]
    assert rk["sampled_boxed"] == [2, 2] and rk["sampled_boxed_right"] == [2, 1]
    # the per-item changes the verdicts use, from those two records:
    ch = bench.changes_from_records([r0, rk])
    assert ch["greedy"] == {"mawps/a": 1.0, "mawps/b": 1.0}  # 0 -> 1 on both
    assert ch["greedy_boxed"] == {}  # no greedy answer was boxed at round 0
    assert ch["sampled"] == {"mawps/a": 2 / 2 - 1 / 2, "mawps/b": 1 / 2 - 1 / 2}
    # a: 1 of 2 boxed right -> 2 of 2; b had no boxed sample at round 0, so it is left out
    assert ch["sampled_boxed"] == {"mawps/a": 2 / 2 - 1 / 2}
    with pytest.raises(ValueError, match=r"rounds \[3, 0\]"):
        bench.changes_from_records([rk, r0])
    monkeypatch.setattr(bench, "eval_tables", lambda *args: None)
    assert bench.item_records(a, "capo", 0, Path("train.jsonl")) == []


def _evidence(bench, a, train_file: Path, path: Path, settings: dict | None = None) -> None:
    """An evidence file as ``--evidence`` writes it: capo seed 0 finished (rounds 0 and 2 per item),
    grpo seed 0 finished under other settings, random-credit seed 0 stopped after round 0's eval."""
    import json

    rec = {"ids": ["mawps/a", "mawps/b"], "greedy_format": "bb", "samples": 2, "sampled_right": [1, 1],
           "sampled_boxed": [2, 2], "sampled_boxed_right": [1, 1]}
    lines = [{"bench": "learning", "arm": "capo", "seed": 0, "round": k, "heldout_accuracy": acc, "cpu_model": "elsewhere"}
             for k, acc in ((0, 0.5), (1, None), (2, 1.0))]
    lines += [{"bench": "learning", "noise_floor": {"sample_seeds": [0, 1, 2], "sample": {"spread": 0.02}}},
              {"bench": "learning", "summary": "capo", "paired_change_from_round0": {"0": {"diff": 0.5}}},
              {"bench": "learning", "plot": "x.png", "rounds": 2, "policy": a.policy, "dataset": a.dataset,
               "eval_size": a.eval_size, "eval_samples": a.eval_samples,
               "run_ids": {n: bench.run_id(a, n.split("-s")[0], 0, train_file) for n in ("capo-s0", "grpo-s0")}},
              {"bench": "learning", "items": "capo", "seed": 0, "round": 0, "greedy": "10", **rec},
              {"bench": "learning", "items": "capo", "seed": 0, "round": 2, "greedy": "11", **rec},
              {"bench": "learning", "items": "grpo", "seed": 0, "round": 0, "greedy": "10", **rec},
              {"bench": "learning", "items": "grpo", "seed": 0, "round": 2, "greedy": "00", **rec},
              {"bench": "learning", "items": "random-credit", "seed": 0, "round": 0, "greedy": "10", **rec}]
    if settings is not None:
        lines[5]["settings"] = settings
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))


def test_runs_finished_elsewhere_count_through_their_committed_evidence(bench, tmp_path):
    """The matrix resumes across machines run by run: a finished run's lines in the evidence file
    stand in for its tables when its settings are this invocation's; an unfinished run or a run
    finished here carries nothing; a finished run the invocation would drop (other settings, other
    arms, another number of rounds) stops it before anything is overwritten."""
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    a = bench.parser().parse_args(["--arms", "capo", "grpo", "random-credit", "--seeds", "0", "--rounds", "2",
                                   "--runs-dir", str(tmp_path / "runs"), "--noise-seeds", "1", "2"])
    ev = tmp_path / "learning.jsonl"
    ids = {arm: bench.settings_id(a, arm, 0, train) for arm in ("capo", "grpo")}
    assert ids["capo"].startswith("learn-capo-s0-") and ids["capo"] != ids["grpo"]
    # the portable id holds no path: another checkout with a copy of the training file gets the same one
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "train.jsonl").write_bytes(train.read_bytes())
    b = bench.parser().parse_args(["--arms", "capo", "--seeds", "0", "--rounds", "2", "--runs-dir", str(other / "runs"),
                                   "--data-dir", str(other / "data")])
    assert bench.settings_id(b, "capo", 0, other / "train.jsonl") == ids["capo"]
    assert bench.run_id(b, "capo", 0, other / "train.jsonl") != bench.run_id(a, "capo", 0, train)

    _evidence(bench, a, train, ev, settings={"capo-s0": ids["capo"], "grpo-s0": ids["grpo"]})
    runs, noise = bench.carried_runs(a, ev, train, local=set())
    assert set(runs) == {("capo", 0), ("grpo", 0)}  # random credit stopped after round 0: it runs here
    capo = runs[("capo", 0)]
    assert [r["round"] for r in capo["rows"]] == [0, 1, 2] and capo["rows"][0]["cpu_model"] == "elsewhere"
    assert capo["paired"] == {"diff": 0.5} and [r["round"] for r in capo["items"]] == [0, 2]
    assert bench.changes_from_records(capo["items"])["greedy"] == {"mawps/a": 0.0, "mawps/b": 1.0}
    assert noise == {"sample_seeds": [0, 1, 2], "sample": {"spread": 0.02}}
    # finished here: the local tables win
    assert set(bench.carried_runs(a, ev, train, local={("capo", 0)})[0]) == {("grpo", 0)}
    # a file written before settings ids were recorded is matched by run id
    _evidence(bench, a, train, ev)
    assert set(bench.carried_runs(a, ev, train, local=set())[0]) == {("capo", 0), ("grpo", 0)}
    # other noise seeds: no noise floor carried
    c = bench.parser().parse_args(["--arms", "capo", "grpo", "--seeds", "0", "--rounds", "2",
                                   "--runs-dir", str(tmp_path / "runs"), "--noise-seeds", "5"])
    assert bench.carried_runs(c, ev, train, local=set())[1] is None
    # nothing finished is overwritten: a run under other settings, outside the arms, another --rounds
    _evidence(bench, a, train, ev, settings={"capo-s0": ids["capo"], "grpo-s0": "learn-grpo-s0-other"})
    with pytest.raises(ValueError, match=r"would drop .*grpo-s0 \(other settings"):
        bench.carried_runs(a, ev, train, local=set())
    only_capo = bench.parser().parse_args(["--arms", "capo", "--seeds", "0", "--rounds", "2", "--runs-dir", str(tmp_path / "runs")])
    with pytest.raises(ValueError, match=r"grpo-s0 \(not among --arms capo --seeds 0\)"):
        bench.carried_runs(only_capo, ev, train, local=set())
    longer = bench.parser().parse_args(["--arms", "capo", "grpo", "--seeds", "0", "--rounds", "3", "--runs-dir", str(tmp_path / "runs")])
    with pytest.raises(ValueError, match=r"capo-s0 \(its 2 rounds, not --rounds 3\)"):
        bench.carried_runs(longer, ev, train, local=set())
    more_samples = bench.parser().parse_args(["--arms", "capo", "grpo", "--seeds", "0", "--rounds", "2",
                                              "--runs-dir", str(tmp_path / "runs"), "--eval-samples", "8"])
    with pytest.raises(ValueError, match=r"capo-s0 \(evaluated with --eval-samples 4, not 8"):
        bench.carried_runs(more_samples, ev, train, local=set())
    _evidence(bench, a, train, ev)  # matched by run id: another checkout's paths make other ids
    moved = bench.parser().parse_args(["--arms", "capo", "grpo", "--seeds", "0", "--rounds", "2",
                                       "--runs-dir", str(other / "runs")])
    with pytest.raises(ValueError, match=r"capo-s0 \(the file's run id learn-capo-s0-\w+, this invocation's learn-capo-s0-\w+"):
        bench.carried_runs(moved, ev, train, local=set())
    # --carry-from (read, not written): runs outside the arms are passed over, runs under other settings
    # are passed over and named, instead of stopping
    _evidence(bench, a, train, ev, settings={"capo-s0": ids["capo"], "grpo-s0": "learn-grpo-s0-other"})
    assert set(bench.carried_runs(a, ev, train, local=set(), strict=False)[0]) == {("capo", 0)}
    assert set(bench.carried_runs(only_capo, ev, train, local=set(), strict=False)[0]) == {("capo", 0)}
    assert bench.carried_runs(only_capo, ev, train, local={("capo", 0)}, strict=False)[0] == {}
    _evidence(bench, a, train, ev)
    lines = ev.read_text().splitlines()
    ev.write_text("\n".join(lines + [lines[-1]]) + "\n")  # random credit's round-0 record twice
    with pytest.raises(ValueError, match=r"random-credit seed 0 has item records of rounds \[0, 0\]"):
        bench.carried_runs(a, ev, train, local=set())
    assert bench.carried_runs(a, tmp_path / "none.jsonl", train, local=set()) == ({}, None)
    ev.write_text(ev.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"learning.jsonl:13: not a JSON line"):
        bench.carried_runs(a, ev, train, local=set())


def test_a_finished_run_gives_back_its_final_training_state(bench, tmp_path):
    """Round K's training state (7.6 GB for the 0.5B policy) goes once round K is trained and
    evaluated; the checkpoint stays, the manifest stays marked pruned; not before, not with
    --keep-final-state, not with --until short of K."""
    from pipeline import storage
    from pipeline.stages.base import round_paths

    args = ["--arms", "grpo", "--seeds", "0", "--rounds", "2", "--runs-dir", str(tmp_path)]
    a = bench.parser().parse_args(args)
    cfg = bench.arm_config(a, "grpo", 0, Path("train.jsonl"))
    p = round_paths(cfg, 2)
    for d in (p["train_state"], p["checkpoint"]):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
        storage.commit_manifest(d, stage="train", key={"k": 1}, rows=None)
    assert bench._prune_final_state(a, cfg) is False  # round 2 not trained yet: nothing goes
    for name in ("train_metrics", "eval"):
        p[name].write_bytes(b"")
        storage.commit_manifest(p[name], stage=name, key={"k": 1}, rows=0)
    for extra in (["--keep-final-state"], ["--until", "1"]):
        assert bench._prune_final_state(bench.parser().parse_args(args + extra), cfg) is False
    assert p["train_state"].is_dir()
    assert bench._prune_final_state(a, cfg) is True
    assert not p["train_state"].exists() and storage.read_manifest(p["train_state"])["pruned"] is True
    assert (p["checkpoint"] / "model.safetensors").exists()


def test_the_grpo_lambda_arm_runs_its_preset(bench):
    a = bench.parser().parse_args(["--arms", "grpo", "grpo-lambda", "--seeds", "0"])
    lam, grpo = (bench.arm_config(a, arm, 0, Path("train.jsonl")) for arm in ("grpo-lambda", "grpo"))
    assert lam.variant == "grpo-lambda" and lam.reward.estimator == "grpo-lambda" and lam.train.ratio_trace.kappa == 0.99
    assert grpo.train.ratio_trace is None and not lam.critique.enabled
    assert bench.run_id(a, "grpo-lambda", 0, Path("t")) != bench.run_id(a, "grpo", 0, Path("t"))
    fipo = bench.arm_config(bench.parser().parse_args(["--arms", "fipo", "--seeds", "0"]), "fipo", 0, Path("t"))
    assert fipo.variant == "fipo" and fipo.train.future_kl is not None and fipo.train.ratio_trace is None
    vine = bench.arm_config(bench.parser().parse_args(["--arms", "vineppo", "--seeds", "0"]), "vineppo", 0, Path("t"))
    assert vine.variant == "vineppo" and vine.reward.estimator == "vineppo" and not vine.critique.enabled
    dense = bench.arm_config(bench.parser().parse_args(["--arms", "densr", "--seeds", "0"]), "densr", 0, Path("t"))
    assert dense.variant == "densr" and dense.reward.estimator == "densr" and dense.densr.mix == 1.0
    assert not dense.critique.enabled and dense.reward.process_weight == 0


def test_the_matrix_resumes_from_its_committed_evidence_and_keeps_every_finished_run(bench, tmp_path, monkeypatch):
    """The whole invocation, its rounds and eval tables stood in for: CAPO seed 0 finished elsewhere
    (in the evidence file) is not run again and stays in the file; GRPO seed 0 runs here, and the
    file is written once it finishes and again at the end, with both runs' records and the verdict
    computed from both; an invocation without CAPO's arm stops before running anything."""
    import json
    import sys

    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    argv = ["--arms", "capo", "grpo", "--seeds", "0", "--rounds", "2", "--runs-dir", str(tmp_path / "runs"),
            "--no-heldout-dedup", "--noise-seeds", "--plot", str(tmp_path / "p.png")]
    a = bench.parser().parse_args(argv)
    ev = tmp_path / "learning.jsonl"
    _evidence(bench, a, train, ev, settings={"capo-s0": bench.settings_id(a, "capo", 0, train)})
    ev.write_text("".join(ln + "\n" for ln in ev.read_text().splitlines()
                          if json.loads(ln).get("items") != "grpo"))  # GRPO seed 0 has not finished anywhere
    before = [json.loads(ln) for ln in ev.read_text().splitlines() if '"items": "capo"' in ln]

    monkeypatch.setattr(bench, "shipped_selection", lambda a: str(train))
    monkeypatch.setattr(bench, "select_training_items", lambda a: train)
    ran, writes, finished = [], [], set()
    rows0 = [_row("a", "greedy", "\\boxed{5}", True), _row("b", "greedy", "\\boxed{6}", False)]
    rowsk = [_row("a", "greedy", "\\boxed{5}", True), _row("b", "greedy", "\\boxed{5}", True)]

    def run_arm(a, arm, seed, train_file, round0):
        ran.append((arm, seed))
        finished.add((arm, seed))
        return [{"arm": arm, "seed": seed, "round": 1, "stage": "train", "seconds": 1.0}]

    monkeypatch.setattr(bench, "run_arm", run_arm)
    monkeypatch.setattr(bench, "eval_tables", lambda a, arm, seed, tf: (rows0, rowsk) if (arm, seed) in finished else None)
    monkeypatch.setattr(bench, "round_metrics", lambda a, arm, seed, tf: [
        {"bench": "learning", "arm": arm, "seed": seed, "round": k, "heldout_accuracy": acc}
        for k, acc in ((0, 0.5), (2, 1.0))] if (arm, seed) in finished else [])
    monkeypatch.setattr(bench, "paired_change", lambda *args: {"diff": 0.25})  # not the carried run's 0.5
    real_write = bench.write_evidence
    monkeypatch.setattr(bench, "write_evidence", lambda path, lines: (writes.append(len(lines)), real_write(path, lines)))
    rechecked = []
    monkeypatch.setattr(bench, "recheck_budget", lambda a, run: rechecked.append(run))
    monkeypatch.setattr(sys, "argv", ["bench_learning.py", *argv, "--evidence", str(ev),
                                      "--budget-evidence", str(tmp_path / "budget.jsonl")])
    bench.main()

    assert ran == [("grpo", 0)] and len(writes) == 2  # after GRPO finished, and at the end
    assert rechecked == [bench.run_id(a, "grpo", 0, train)]  # the run whose checkpoint is here, not the carried one
    monkeypatch.setattr(sys, "argv", ["bench_learning.py", *argv, "--evidence", str(ev)])
    out = [json.loads(ln) for ln in ev.read_text().splitlines()]
    assert [r for r in out if r.get("items") == "capo"] == before  # carried as committed
    grpo = [r for r in out if r.get("items") == "grpo"]
    assert [(r["round"], r["greedy"]) for r in grpo] == [(0, "10"), (2, "11")]
    final = next(r for r in out if "run_ids" in r)
    assert final["carried_from_evidence"] == ["capo-s0"] and set(final["settings"]) == {"capo-s0", "grpo-s0"}
    assert next(r for r in out if r.get("arm") == "capo" and r["round"] == 0)["cpu_model"] == "elsewhere"
    capo = next(r for r in out if r.get("summary") == "capo")
    assert capo["paired_change_from_round0"]["0"] == {"diff": 0.5}  # carried from the file, not recomputed
    assert next(r for r in out if r.get("summary") == "grpo")["paired_change_from_round0"]["0"] == {"diff": 0.25}
    assert capo["pooled_change_from_round0"]["greedy"]["per_seed"] == [0.5]  # b: 0 -> 1 of 2 problems
    # both arms gained +0.5 on the same items: CAPO minus GRPO is 0 on greedy accuracy
    head = next(r for r in out if "capo_minus_grpo_pooled" in r)
    assert head["capo_minus_grpo_pooled"]["diff"] == 0.0

    # read back again: both runs are finished now, nothing runs; without CAPO's arm, nothing starts
    ran.clear()
    finished.clear()
    bench.main()
    assert ran == [] and [r for r in map(json.loads, ev.read_text().splitlines()) if r.get("items") == "grpo"] == grpo
    monkeypatch.setattr(sys, "argv", ["bench_learning.py", "--arms", "grpo", *argv[3:], "--evidence", str(ev)])
    with pytest.raises(SystemExit, match=r"capo-s0 \(not among --arms grpo"):
        bench.main()
    assert ran == []


def test_a_finished_run_is_rechecked_at_the_larger_budget_once(bench, tmp_path, monkeypatch, caplog):
    """--budget-evidence: bench_budget.py runs on the finished run (its evals are the expensive
    boundary, stood in for by the subprocess), not again once the file records it; a failed recheck
    is logged with its command and the matrix goes on."""
    import json
    import subprocess

    budget = tmp_path / "budget.jsonl"
    a = bench.parser().parse_args(["--runs-dir", str(tmp_path / "runs"), "--budget-evidence", str(budget),
                                   "--budget-tokens", "768"])
    calls = []

    def run(cmd, check, cwd, stdout):
        calls.append(cmd)
        name = cmd[cmd.index("--runs") + 1]
        if name.startswith("learn-bad"):
            raise subprocess.CalledProcessError(2, cmd)
        with budget.open("a") as f:
            f.write(json.dumps({"bench": "budget", "record": name, "max_tokens": 768}) + "\n")

    monkeypatch.setattr(subprocess, "run", run)
    assert bench.recheck_budget(a, "learn-grpo-s0-abc") is True
    assert calls[0][1].endswith("benchmarks/bench_budget.py") and calls[0][2:] == [
        "--runs-dir", str(tmp_path / "runs"), "--runs", "learn-grpo-s0-abc", "--max-tokens", "768", "--evidence", str(budget)]
    assert bench.recheck_budget(a, "learn-grpo-s0-abc") is True and len(calls) == 1  # recorded: not evaluated again
    assert bench.recheck_budget(a, "learn-bad-s0-abc") is False and len(calls) == 2
    assert "budget recheck of learn-bad-s0-abc failed (exit 2)" in caplog.text


def test_each_rival_is_compared_with_grpo_and_with_capo(bench):
    """GRPO-λ gained items 0-39 in each of three seeds, GRPO items 0-9, CAPO items 0-39: GRPO-λ minus
    GRPO is +1 on items 10-39 (+15 points, interval above 0: ahead); minus CAPO 0 on every item (no
    difference shown). One seed gives no verdict; an arm not run gives no row."""
    a = bench.parser().parse_args(["--arms", "grpo", "capo", "grpo-lambda", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows = [{"arm": arm, "seed": s, "round": 2, "heldout_accuracy": 0.6} for arm in ("grpo", "capo", "grpo-lambda")
            for s in (0, 1, 2)]
    changes = {(arm, s): _changes([up, 0]) for arm, up in [("grpo", 10), ("capo", 40), ("grpo-lambda", 40)]
               for s in (0, 1, 2)}
    rival = [r for r in bench.summarize(a, rows, {}, changes) if "rival" in r]
    assert [(r["rival"], r["against"], r["metric"]) for r in rival] == [("grpo-lambda", "grpo", "greedy"),
                                                                     ("grpo-lambda", "capo", "greedy")]
    vs_grpo, vs_capo = rival
    assert vs_grpo["rival_minus_other_pooled"]["diff"] == pytest.approx(0.15) and vs_grpo["verdict"] == "ahead"
    assert vs_capo["rival_minus_other_pooled"]["diff"] == 0.0 and vs_capo["verdict"] == "no difference shown"
    one = bench.parser().parse_args(["--arms", "grpo", "grpo-lambda", "--seeds", "0", "--rounds", "2"])
    out1 = [r for r in bench.summarize(one, rows, {}, changes) if "rival" in r]
    assert [(r["against"], r["verdict"]) for r in out1] == [("grpo", None)]  # no CAPO arm: no row against it
    # a control that trains is set beside GRPO and CAPO the same way
    ctl = bench.parser().parse_args(["--arms", "grpo", "capo", "random-credit", "--seeds", "0", "1", "2", "--rounds", "2"])
    rows_c = [{**r, "arm": "random-credit"} for r in rows if r["arm"] == "grpo-lambda"] + rows
    changes_c = {**changes, **{("random-credit", s): _changes([10, 0]) for s in (0, 1, 2)}}
    out_c = [r for r in bench.summarize(ctl, rows_c, {}, changes_c) if "rival" in r]
    assert [(r["rival"], r["against"], r["verdict"]) for r in out_c] == [("random-credit", "grpo", "no difference shown"),
                                                                       ("random-credit", "capo", "behind")]


def test_no_noise_floor_without_a_sample_seed_other_than_the_evals(bench, tmp_path, monkeypatch):
    """``--noise-seeds 0`` with the eval's seed 0: the start sampled again under the same seed
    measures nothing (spread 0, and a one-value sd that is NaN, not JSON): no floor, no verdict."""
    from pipeline import storage

    round0 = tmp_path / "eval.parquet"
    round0.write_bytes(b"")
    monkeypatch.setattr(storage, "read_manifest", lambda p: {"resolved_config": {"eval": {"seed": 0}}})
    a = bench.parser().parse_args(["--noise-seeds", "0", "--eval-samples", "4", "--runs-dir", str(tmp_path)])
    assert bench.noise_floor(a, round0) is None


def test_a_carried_noise_floor_keeps_the_machine_it_was_measured_on(bench, tmp_path):
    ev = tmp_path / "ev.jsonl"
    ev.write_text(json.dumps({"bench": "learning", "hygiene": {}}) + "\n"
                  + json.dumps({"bench": "learning", "noise_floor": {}, "cpu_model": "AMD EPYC", "cores": 2}) + "\n")
    here = {"cpu_model": "Intel(R) Xeon(R) Processor", "cores": 2, "gpu": None}
    assert bench.noise_machine(ev, here) == {"cpu_model": "AMD EPYC", "cores": 2, "gpu": None}
