"""The GenORM baseline (paper §4): the critic's majority verdict on the final answer is r_v,
advantages are sequence-level GRPO, and the rule verifier's result is still recorded beside it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline import storage
from pipeline.stages.base import round_paths
from pipeline.stages.reward import reward_stage
from tests.toy_round import PID
from tests.toy_round import critique_row as _critique
from tests.toy_round import toy_config as _cfg
from tests.toy_round import write_round as _write_round
from tests.toy_round import write_rows as _write


def _outcome_critique(rid: str, k: int, verdict: bool | None) -> dict:
    return {**_critique(rid, k, None, 3), "mode": "outcome", "outcome_verdict": verdict,
            "parse_status": "ok" if verdict is not None else "not_yes_no"}


def test_genorm_majority_is_the_outcome_reward(tmp_path):
    cfg = _cfg(tmp_path, "critique.mode=outcome", "reward.outcome=genorm", "reward.estimator=grpo",
               "reward.process_weight=0", "variant=grpo-genorm")
    _write_round(cfg)  # rule verifier: A right, B wrong
    # GenORM verdicts: A 2 yes of 3 valid (one unparsable) -> 1; B 1 yes of 2 -> not a strict majority -> 0
    crit = [_outcome_critique("A", 0, True), _outcome_critique("A", 1, True), _outcome_critique("A", 2, False),
            _outcome_critique("A", 3, None), _outcome_critique("B", 0, True), _outcome_critique("B", 1, False)]
    _write(cfg, "critiques", crit, "critique")
    assert round_paths(cfg, 1)["critiques"].name == "genorm_critiques.parquet"
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    assert (got["A"]["outcome_reward"], got["B"]["outcome_reward"]) == (1.0, 0.0)
    assert (got["A"]["outcome_correct"], got["B"]["outcome_correct"]) == (True, False)  # rule verifier, recorded
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7
    # GRPO over the group's two sequence rewards [2, 0]: mean 1, std (ddof=1) sqrt(2); eps 1e-6
    a = (2 - 1) / (np.sqrt(2) + cfg.reward.eps)
    np.testing.assert_allclose(got["A"]["advantages"], [a] * 11, rtol=1e-6)
    np.testing.assert_allclose(got["B"]["advantages"], [-a] * 7, rtol=1e-6)
    assert got["A"]["rule"] is None and got["A"]["prompt_id"] == PID
    man = storage.read_manifest(round_paths(cfg, 1)["token_rewards"])
    assert man["genorm_agreement_with_rule"] == pytest.approx(1.0) and man["genorm_no_valid_verdict"] == 0


def test_genorm_outcome_overrides_the_rule_verifier_where_they_disagree(tmp_path):
    """The critic says the rule verifier's right answer A is wrong (1 yes of 3) and its wrong answer B
    right (2 yes of 2): the outcome rewards follow the critic, the rule's verdict stays recorded."""
    cfg = _cfg(tmp_path, "critique.mode=outcome", "reward.outcome=genorm", "reward.estimator=grpo",
               "reward.process_weight=0", "variant=grpo-genorm")
    _write_round(cfg)  # rule verifier: A right, B wrong
    crit = [_outcome_critique("A", 0, True), _outcome_critique("A", 1, False), _outcome_critique("A", 2, False),
            _outcome_critique("B", 0, True), _outcome_critique("B", 1, True)]
    _write(cfg, "critiques", crit, "critique")
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    assert (got["A"]["outcome_reward"], got["B"]["outcome_reward"]) == (0.0, 1.0)
    assert (got["A"]["outcome_correct"], got["B"]["outcome_correct"]) == (True, False)
    assert got["A"]["rewards"] == [0.0] * 11 and got["B"]["rewards"] == [2.0] * 7
    # sequence rewards [0, 2]: mean 1, std (ddof=1) sqrt(2) -> A -1/(sqrt(2) + 1e-6) = -0.70711, B +0.70711
    np.testing.assert_allclose(got["A"]["advantages"], [-1 / (math.sqrt(2) + cfg.reward.eps)] * 11, rtol=1e-6)
    np.testing.assert_allclose(got["B"]["advantages"], [1 / (math.sqrt(2) + cfg.reward.eps)] * 7, rtol=1e-6)
    man = storage.read_manifest(round_paths(cfg, 1)["token_rewards"])
    assert man["genorm_agreement_with_rule"] == pytest.approx(0.0)


def test_grpo_rule_baseline_needs_no_critiques(tmp_path):
    cfg = _cfg(tmp_path, "critique.enabled=false", "reward.estimator=grpo", "reward.process_weight=0", "variant=grpo")
    _write_round(cfg)
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7
    assert got["A"]["n_valid_critiques"] == 0 and got["A"]["n_penalized_tokens"] == 0
