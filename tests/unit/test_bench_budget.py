"""The budget recheck of learning runs (benchmarks/bench_budget.py), on hand-made eval rows.

The evals themselves are real in the benchmark; here only its arithmetic: the paired change, the
shares cut at the budget, the accuracy among finished answers, the arm labels that decide which
runs are pooled, and the pooled change over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    c = bench.budget_change(bench.greedy_items(before), bench.greedy_items(after))
    assert c["n"] == 8 and c["acc_a"] == pytest.approx(3 / 8) and c["acc_b"] == pytest.approx(4 / 8)
    assert c["diff"] == pytest.approx(1 / 8)
    assert (c["n01"], c["n10"]) == (2, 1)  # p3, p4 wrong -> right; p7 right -> wrong
    assert c["p_mcnemar"] == pytest.approx(1.0)  # 3 discordant pairs split 2/1: two-sided exact p = 1
    assert c["cut_a"] == pytest.approx(3 / 8) and c["cut_b"] == pytest.approx(1 / 8)
    assert c["finished_acc_a"] == pytest.approx(3 / 5) and c["finished_acc_b"] == pytest.approx(4 / 7)
    assert c["item_change"] == {"mawps/p0": 0.0, "mawps/p1": 0.0, "mawps/p2": 0.0, "mawps/p3": 1.0,
                                "mawps/p4": 1.0, "mawps/p5": 0.0, "mawps/p6": 0.0, "mawps/p7": -1.0}


def test_budget_change_names_evals_without_common_items(bench):
    other = [{**r, "prompt_id": "q" + r["prompt_id"]} for r in _rows("RW")]
    items = bench.greedy_items
    with pytest.raises(ValueError, match="no greedy item in common.*2 and 2 greedy items"):
        bench.budget_change(items(_rows("RW")), items(other))
    assert bench.budget_change(items(_rows("CC")), items(_rows("CC")))["finished_acc_a"] is None


def test_arm_labels_separate_the_configurations(bench):
    rc = {"train": {"learning_rate": 5e-6, "kl_coef": 0.0}, "rollout": {"dynamic_sampling": True},
          "reward": {"overlong_buffer": 0}}
    assert bench.arm_label("grpo", rc) == "grpo lr=5e-06 ds"
    rc2 = {"train": {"learning_rate": 1e-5, "kl_coef": 0.04}, "rollout": {"dynamic_sampling": False},
           "reward": {"overlong_buffer": 32}}
    assert bench.arm_label("capo", rc2) == "capo lr=1e-05 kl=0.04 overlong=32"


def test_pooled_over_seeds_on_shared_items(bench):
    # two seeds, identical changes on the two shared items (+1, 0): mean +0.5; MS_item = 2 * (0.25 +
    # 0.25) / 1 = 1, no seed or residual part: V = 1 / 4, t(1) * 0.5 = 6.35 -> the whole range [-1, 1]
    s0 = {"a": 1.0, "b": 0.0, "only0": 1.0}
    s1 = {"a": 1.0, "b": 0.0}
    p = bench.pooled([s0, s1])
    assert p["n"] == 2 and p["diff"] == pytest.approx(0.5)
    assert (p["lo"], p["hi"], p["significant"]) == (-1.0, 1.0, False)
    assert bench.pooled([]) is None and bench.pooled([{"a": 1.0}, {"b": 1.0}]) is None


def test_run_names_with_dashed_arms(bench):
    assert bench.parse_run_name("learn-random-credit-s2-1a2b3c4d") == ("random-credit", 2)
    assert bench.parse_run_name("learn-capo-s0-175a5b96") == ("capo", 0)
    with pytest.raises(ValueError, match="'budget-512' is not a learning run's name"):
        bench.parse_run_name("budget-512")


def _boxed_rows(spec: str) -> list[dict]:
    """One greedy row per character: B right and boxed, b wrong and boxed, P right as a program
    (no box), C cut at the budget (wrong)."""
    text = {"B": "so \\boxed{3}", "b": "so \\boxed{4}", "P": "```python\nprint(3)\n```", "C": "and then"}
    return [{"benchmark": "mawps", "prompt_id": f"p{i}", "decoding": "greedy", "correct": c in "BP",
             "finish_reason": "length" if c == "C" else "stop", "response_text": text[c]} for i, c in enumerate(spec)]


def test_budget_change_within_boxed_answers_by_hand(bench):
    # round 0: P P b B C (2 boxed: 1 right); round K: B B b b B (5 boxed: 3 right, p0, p1, p4)
    # the gain on p0, p1 (program -> boxed) and p4 (cut -> boxed) is format: within answers boxed at
    # both ends (p2, p3) the change is 0 and -1
    c = bench.budget_change(bench.greedy_items(_boxed_rows("PPbBC")), bench.greedy_items(_boxed_rows("BBbbB")))
    assert c["acc_a"] == pytest.approx(3 / 5) and c["acc_b"] == pytest.approx(3 / 5)
    assert c["boxed_a"] == pytest.approx(2 / 5) and c["boxed_b"] == pytest.approx(1.0)
    assert c["boxed_acc_a"] == pytest.approx(1 / 2) and c["boxed_acc_b"] == pytest.approx(3 / 5)
    assert c["boxed_item_change"] == {"mawps/p2": 0.0, "mawps/p3": -1.0}


def _run(name: str, arm: str, seed: int) -> dict:
    return {"name": name, "arm": arm, "seed": seed, "round": 10, "budget": 320}


def test_run_record_is_compact_and_reads_back(bench):
    items = bench.greedy_items
    evals = {"round_0": items(_boxed_rows("BPbC")), "round_k": items(_boxed_rows("BBbB")),
             "start": items(_boxed_rows("BPbb")), "final": items(_boxed_rows("BBBb")[:3])}  # p3 not evaluated
    rec = bench.run_record(_run("learn-capo-s1-abc", "capo lr=2e-06 ds", 1), 512, evals)
    assert rec["ids"] == ["mawps/p0", "mawps/p1", "mawps/p2"]  # the items all four share
    assert rec["round_0"] == {"greedy": "110", "format": "bpb"} and rec["final"] == {"greedy": "111", "format": "bbb"}
    assert (rec["record"], rec["arm"], rec["seed"], rec["round"], rec["budget"], rec["max_tokens"]) == (
        "learn-capo-s1-abc", "capo lr=2e-06 ds", 1, 10, 320, 512)
    back = json.loads(json.dumps(rec))
    assert bench.record_items(back, "round_0") == {k: v for k, v in evals["round_0"].items() if k != "mawps/p3"}
    assert bench.budget_change(bench.record_items(back, "start"), bench.record_items(back, "final"))["diff"] == (
        pytest.approx(1 / 3))  # p2: wrong -> right
    with pytest.raises(ValueError, match="needs the evals"):
        bench.run_record(_run("x", "capo", 0), 512, {"start": evals["start"]})
    with pytest.raises(ValueError, match="'learn-capo-s1-abc': eval 'final' does not match its 3 ids"):
        bench.record_items({**back, "final": {"greedy": "11", "format": "bb"}}, "final")
    with pytest.raises(ValueError, match=r"results other than 0/1: \['x'\].*: \['z'\]"):
        bench.record_items({**back, "final": {"greedy": "1x1", "format": "bzb"}}, "final")


def _record(name: str, arm: str = "grpo lr=2e-06 ds", seed: int = 0, round_: int = 10) -> dict:
    return {"bench": "budget", "record": name, "arm": arm, "seed": seed, "round": round_, "budget": 320,
            "max_tokens": 512, "ids": ["mawps/p0"], **{k: {"greedy": "1", "format": "b"}
                                                        for k in ("round_0", "round_k", "start", "final")}}


def test_carried_records_refuse_what_they_would_overwrite(bench, tmp_path):
    rec = _record("learn-grpo-s0-abc")
    f = tmp_path / "budget.jsonl"
    assert bench.carried_records(f, 512) == {}  # no file yet
    f.write_text(json.dumps({"bench": "budget", "summary": "grpo"}) + "\n" + json.dumps(rec) + "\n")
    assert bench.carried_records(f, 512) == {"learn-grpo-s0-abc": rec}  # the printed summary is recomputed
    with pytest.raises(SystemExit, match=r"budget.jsonl:2 holds learn-grpo-s0-abc at 512 tokens, not 768"):
        bench.carried_records(f, 768)
    f.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(SystemExit, match=r"budget.jsonl:2 is a second record of learn-grpo-s0-abc"):
        bench.carried_records(f, 512)
    # another benchmark's file, an older record format, a torn line: named, never overwritten
    for line, match in [(json.dumps({"bench": "learning", "items": "capo"}), r"budget.jsonl:1 is not a run record"),
                        (json.dumps({"bench": "budget", "items": "start", "max_tokens": 512}), "is not a run record"),
                        ('{"bench": "budg', r"budget.jsonl:1 is not a JSON line"),
                        (json.dumps({k: v for k, v in rec.items() if k != "final"}), r"lacks \['final'\]")]:
        f.write_text(line + "\n")
        with pytest.raises(SystemExit, match=match):
            bench.carried_records(f, 512)


def test_merged_records_keep_the_later_round_and_refuse_a_seed_twice(bench, caplog):
    done = _record("learn-grpo-s0-abc", round_=10)
    partial = _record("learn-grpo-s0-abc", round_=5)
    assert bench.merge_records({"learn-grpo-s0-abc": done}, {"learn-grpo-s0-abc": partial}) == {"learn-grpo-s0-abc": done}
    assert "records round 10, here only round 5" in caplog.text
    newer = _record("learn-grpo-s0-abc", round_=10)
    newer["final"] = {"greedy": "0", "format": "b"}
    assert bench.merge_records({"learn-grpo-s0-abc": done}, {"learn-grpo-s0-abc": newer})["learn-grpo-s0-abc"] is newer
    with pytest.raises(SystemExit, match="learn-grpo-s0-abc and learn-grpo-s0-def are both seed 0 of 'grpo lr=2e-06 ds'"):
        bench.merge_records({"learn-grpo-s0-abc": done}, {"learn-grpo-s0-def": _record("learn-grpo-s0-def")})


def test_main_carries_runs_recorded_elsewhere(bench, tmp_path, monkeypatch, capsys):
    """The whole benchmark with the evals stood in for (they are the expensive boundary): a run
    recorded in the evidence file and absent here is pooled with the local one and kept in the file;
    the local run's record is written beside it; its verdict pairs seeds 0 and 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(spec: str, name: str) -> Path:
        rows = [{**r, "policy": "/models/start"} for r in _boxed_rows(spec)]
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path

    local = {**_run("learn-capo-s1-abc", "capo lr=2e-06 ds", 1), "eval0": table("bbbbb", "e0"),
             "evalK": table("BBbbb", "ek"), "checkpoint": tmp_path / "ck"}
    monkeypatch.setattr(bench, "finished_runs", lambda runs_dir: [local])
    evaluated = []

    def evaluate(policy, config_of, max_tokens, out):
        evaluated.append(policy)
        return _boxed_rows("bbbbb" if policy == "/models/start" else "BBBbb")

    monkeypatch.setattr(bench, "evaluate", evaluate)
    items = bench.greedy_items
    elsewhere = bench.run_record(_run("learn-capo-s0-def", "capo lr=2e-06 ds", 0), 512,
                                 {"round_0": items(_boxed_rows("bbbbb")), "round_k": items(_boxed_rows("Bbbbb")),
                                  "start": items(_boxed_rows("bbbbb")), "final": items(_boxed_rows("BBbbb"))})
    evidence = tmp_path / "budget-512.jsonl"
    evidence.write_text(json.dumps(elsewhere) + "\n")
    bench.main(["--runs-dir", str(tmp_path), "--max-tokens", "512", "--evidence", str(evidence)])
    assert evaluated == ["/models/start", str(tmp_path / "ck")]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    per_run = {x["run"]: x for x in lines if "run" in x}
    assert per_run["learn-capo-s0-def"]["carried"] and not per_run["learn-capo-s1-abc"]["carried"]
    assert per_run["learn-capo-s1-abc"]["at_512"]["diff"] == pytest.approx(3 / 5)
    assert per_run["learn-capo-s1-abc"]["at_320"]["diff"] == pytest.approx(2 / 5)
    summary = next(x for x in lines if x.get("summary") == "capo lr=2e-06 ds")
    assert summary["seeds"] == 2 and summary["pooled_at_512"]["diff"] == pytest.approx((2 / 5 + 3 / 5) / 2)
    kept = bench.carried_records(evidence, 512)
    assert sorted(kept) == ["learn-capo-s0-def", "learn-capo-s1-abc"] and kept["learn-capo-s0-def"] == elsewhere
    monkeypatch.setattr(bench, "finished_runs", lambda runs_dir: [])  # a machine with no run: the file alone
    bench.main(["--runs-dir", str(tmp_path), "--max-tokens", "512", "--evidence", str(evidence)])
    assert bench.carried_records(evidence, 512) == kept
    # seed 1 of the same arm again under another name: it stops, and what it evaluated is in the file
    monkeypatch.setattr(bench, "finished_runs", lambda runs_dir: [{**local, "name": "learn-capo-s1-xyz"}])
    with pytest.raises(SystemExit, match="learn-capo-s1-abc and learn-capo-s1-xyz are both seed 1"):
        bench.main(["--runs-dir", str(tmp_path), "--max-tokens", "512", "--evidence", str(evidence)])
    assert sorted(bench.carried_records(evidence, 512)) == ["learn-capo-s0-def", "learn-capo-s1-abc", "learn-capo-s1-xyz"]


def test_verdicts_pair_capo_with_its_rivals_by_seed_and_item(bench):
    def seed(change: dict, boxed: dict) -> dict:
        return {"big": {"item_change": change, "boxed_item_change": boxed}}

    # two seeds, 4 items: CAPO gains 2 items per seed, GRPO 0 -> a paired difference of +0.5 per item
    # mean; MS_item = 2 * 4 * 0.25 / 3 = 2/3, V = (2/3) / 8, t(1) * 0.289 = 3.67: [-1, 1], no win
    up = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}
    flat = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}
    per_arm = {"capo lr=2e-06 ds": {"seeds": {0: seed(up, {"a": 1.0}), 1: seed(up, {"a": 1.0})}},
               "grpo lr=2e-06 ds": {"seeds": {0: seed(flat, {"a": 0.0}), 1: seed(flat, {"a": 1.0})}}}
    v = {r["verdict"]: r for r in bench.verdicts(per_arm, 512)}
    g = v["capo_vs_grpo"]
    assert g["seeds"] == [0, 1] and g["capo_minus_grpo"]["diff"] == pytest.approx(0.5)
    assert g["capo_minus_grpo"]["lo"] == -1.0 and g["capo_beat_grpo"] is False
    assert g["boxed_capo_minus_grpo"]["diff"] == pytest.approx(0.5)  # item a: +1 - 0 and +1 - 1
    assert v["capo_vs_random_credit"]["capo_beat_random_credit"] == "not run"
    # one shared seed: a difference, no verdict
    per_arm["grpo lr=2e-06 ds"]["seeds"].pop(1)
    assert bench.verdicts(per_arm, 512)[0]["capo_beat_grpo"] is None


def test_capo_labels_name_their_signal_and_still_meet_the_critic_free_arms(bench):
    rc = {"train": {"learning_rate": 2e-6, "kl_coef": 0.0}, "rollout": {"dynamic_sampling": True},
          "reward": {"overlong_buffer": 0}, "critique": {"enabled": True, "num_critiques": 0},
          "vote": {"sources": ["arithmetic", "logprob"]}}
    assert bench.arm_label("capo", rc) == "capo lr=2e-06 signal=arithmetic+logprob,N=0 ds"
    assert bench.arm_label("grpo", {**rc, "critique": {"enabled": False}}) == "grpo lr=2e-06 ds"
    same = {"big": {"item_change": {"a": 0.0}, "boxed_item_change": {}}}
    per_arm = {"capo lr=2e-06 signal=arithmetic+logprob,N=0 ds": {"seeds": {0: same}},
               "grpo lr=2e-06 ds": {"seeds": {0: same}},
               "random-credit lr=2e-06 signal=arithmetic+logprob,N=0 ds": {"seeds": {0: same}}}
    v = {r["verdict"]: r for r in bench.verdicts(per_arm, 512)}
    assert v["capo_vs_grpo"]["seeds"] == [0] and v["capo_vs_random_credit"]["seeds"] == [0]
    assert v["capo_vs_fipo"]["capo_beat_fipo"] == "not run"
