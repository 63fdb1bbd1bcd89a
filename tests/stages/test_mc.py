"""VinePPO end to end on a hand-built round: Monte Carlo values from the real tiny model (the mc stage),
and the reward stage's step advantages from a values table worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import storage
from pipeline.stages.base import round_paths
from pipeline.stages.mc import mc_stage
from pipeline.stages.reward import reward_stage
from tests.toy_round import toy_config, write_round, write_rows

VINE = ("critique.enabled=false", "reward.estimator=vineppo", "reward.process_weight=0", "variant=vineppo")


def test_vineppo_advantages_from_a_values_table_worked_by_hand(tmp_path):
    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)  # A right (steps of 4, 1, 6 tokens), B wrong (2, 0, 5 tokens): one group
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 2,
         "n_correct": int(2 * v), "continuations": ["", ""], "correct": [False, False], "finish_reasons": ["stop"] * 2}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.5), ("B", 2, 0.0)]], "mc")
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    # V(S_0) is the group's other outcome: A 0 (B was wrong), B 1. V(S_3) = R.
    # A: V = 0, 0.5, 1.0, 1 -> step advantages 0.5, 0.5, 0.0; B: V = 1, 0.5, 0.0, 0 -> -0.5, -0.5, 0.0
    raw = [0.5] * 4 + [0.5] + [0.0] * 6 + [-0.5] * 2 + [0.0] * 5  # per token; B's step 1 owns no token
    mean = sum(raw) / 18  # (2.5 - 1.0) / 18
    std = (sum((x - mean) ** 2 for x in raw) / 17) ** 0.5
    want = [(x - mean) / (std + cfg.reward.eps) for x in raw]
    np.testing.assert_allclose(got["A"]["advantages"] + got["B"]["advantages"], want, rtol=1e-5)
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7  # C * r_v, no process penalty
    assert got["A"]["rule"] is None and got["A"]["n_penalized_tokens"] == 0

    # a table that misses a state the steps call for is refused, not read as a shorter response
    write_rows(cfg, "mc_values", [
        {"rollout_id": "A", "state_idx": 1, "token_end": 0, "value": 0.5, "n_continuations": 2, "n_correct": 1,
         "continuations": ["", ""], "correct": [True, False], "finish_reasons": ["stop"] * 2}], "mc")
    with pytest.raises(ValueError, match=r"holds states \[1\] of rollout A, which has 3 steps"):
        reward_stage(cfg, 1)


def test_the_mc_stage_continues_each_state_with_the_policy(tmp_path, tiny_model):
    cfg = toy_config(tmp_path, *VINE, f"rollout.policy={tiny_model}", "rollout.engine={type: transformers, dtype: float32}",
                     "rollout.sampling.max_tokens=24", "mc.continuations=2", "mc.max_states=3")
    write_round(cfg)
    res = mc_stage(cfg, 1)
    assert not res.skipped and res.rows == 4
    rows = storage.read_table(round_paths(cfg, 1)["mc_values"], "mc_values").to_pylist()
    # states S_1, S_2 of A and B (max_states 3: S_0 comes from the group); S_k ends where step k-1 ends
    assert [(r["rollout_id"], r["state_idx"], r["token_end"]) for r in rows] == [("A", 1, 4), ("A", 2, 5),
                                                                                  ("B", 1, 2), ("B", 2, 2)]
    for r in rows:
        assert r["n_continuations"] == 2 and len(r["continuations"]) == len(r["correct"]) == 2
        assert r["value"] == r["n_correct"] / 2 == sum(r["correct"]) / 2
        assert set(r["finish_reasons"]) <= {"stop", "length"} and all(isinstance(t, str) for t in r["continuations"])
    man = storage.read_manifest(round_paths(cfg, 1)["mc_values"])
    assert man["continuations"] == 8 and man["engine"]["generated_tokens"] > 0
    assert mc_stage(cfg, 1).skipped  # cached: training again samples nothing
    reward_stage(cfg, 1)  # the values feed the estimator
    adv = storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").column("advantages").to_pylist()
    flat = np.concatenate([np.asarray(a) for a in adv])
    assert len(flat) == 18 and abs(flat.mean()) < 1e-5  # whitened over the round's tokens


def test_mc_values_become_a_critic_eval_benchmark(tmp_path):
    from critic_eval.items import processbench_rows
    from pipeline.mc_labels import mc_label_records

    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)
    with pytest.raises(FileNotFoundError, match="run round 1 with reward.estimator=vineppo"):
        mc_label_records(cfg, 1)
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 2,
         "n_correct": int(2 * v), "continuations": ["", ""], "correct": [False, False], "finish_reasons": ["stop"] * 2}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.5), ("B", 2, 0.0)]], "mc")
    recs = {r["id"]: r for r in mc_label_records(cfg, 1, drop=0.5)}
    # A: V = 0 (B wrong), 0.5, 1.0, R 1: never falls -> -1. B: V = 1, 0.5, 0.0, R 0: falls 0.5 at step 0
    assert (recs["A"]["label"], recs["B"]["label"]) == (-1, 0)
    assert recs["B"]["step_values"] == [1.0, 0.5, 0.0, 0.0] and recs["B"]["steps"] == ["step 0", "step 1", "step 2"]
    assert recs["A"]["problem"].startswith("Sam has 6 apples") and recs["A"]["gold_answer"] == "5"
    rows = processbench_rows(list(recs.values()), "mc")  # critic-eval takes them as they are
    assert [(r["id"], r["label"], r["kind"]) for r in rows] == [("A", -1, "mc"), ("B", 0, "mc")]


def test_a_wrong_answer_whose_values_never_fall_is_left_out_of_the_labels(tmp_path):
    from pipeline.mc_labels import mc_label_records

    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)
    # B (wrong): V = 1 (A right), 0.75, 0.5, R 0: falls 0.25, 0.25, 0.5 -> step 2 at drop 0.5, none at 0.75
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 4,
         "n_correct": int(4 * v), "continuations": [""] * 4, "correct": [False] * 4, "finish_reasons": ["stop"] * 4}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.75), ("B", 2, 0.5)]], "mc")
    assert {r["id"]: r["label"] for r in mc_label_records(cfg, 1, drop=0.5)} == {"A": -1, "B": 2}
    assert {r["id"]: r["label"] for r in mc_label_records(cfg, 1, drop=0.75)} == {"A": -1}  # B: no place to blame
