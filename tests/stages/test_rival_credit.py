"""The rival credit methods' token rewards on a hand-built round (no model): GRPO-λ's and FIPO's worked
by hand, and every rival's recomputed from the tables (:func:`tests.toy_round.rival_credit_by_hand`, the
check tests/slow/test_round_integration.py applies to a real round, whose tiny policy may give every
response one outcome and so all-zero credit; here every method's credit is non-zero)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline import storage
from pipeline.stages.base import round_paths
from pipeline.stages.reward import reward_stage
from tests.toy_round import rival_credit_by_hand, toy_config, write_round, write_rows

# each rival as its preset sets it (configs/presets/<name>.yaml), on the hand-built round
RIVALS = {
    "grpo-lambda": ("train.ratio_trace={kappa: 0.99, style: recent}",),
    "fipo": ("train.future_kl={half_life: 32.0, eps: 0.2}",),
    "vineppo": ("mc.max_states=3",),
    "densr": ("densr.mix=1.0",),
}


def _rival_round(tmp_path, estimator: str):
    cfg = toy_config(tmp_path, "critique.enabled=false", f"reward.estimator={estimator}", "reward.process_weight=0",
                     f"variant={estimator}", *RIVALS[estimator])
    write_round(cfg)  # A right (11 tokens; steps of 4, 1, 6), B wrong (7 tokens; steps of 2, 0, 5): one group
    if estimator == "vineppo":
        write_rows(cfg, "mc_values", [
            {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 4,
             "n_correct": int(4 * v), "continuations": [""] * 4, "correct": [False] * 4, "finish_reasons": ["stop"] * 4}
            for rid, k, v in [("A", 1, 0.25), ("A", 2, 0.75), ("B", 1, 0.5), ("B", 2, 0.25)]], "mc")
    if estimator == "densr":
        rows = [("A", True, [0.0, 0.0, 0.3, 0.3, 0.6, 0.6, 0.9, 0.9, 1.2, 1.2, 1.5]),
                ("B", False, [0.0, 0.2, 0.2, 0.4, 0.4, 0.8, 0.8])]
        write_rows(cfg, "token_divergence", [
            {"rollout_id": rid, "prompt_id": "toy-train-00000", "outcome_correct": ok, "layer": -1, "n_opposite": 1,
             "divergence": d} for rid, ok, d in rows], "densr")
    reward_stage(cfg, 1)
    table = storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards")
    got = {r["rollout_id"]: r for r in table.to_pylist()}
    return cfg, got


@pytest.mark.parametrize("estimator", ["grpo-lambda", "fipo"])
def test_grpo_lambda_and_fipo_write_grpos_advantage_their_credit_acts_in_the_loss(tmp_path, estimator):
    """Rewards C * r_v = 2, 0; GRPO's advantage (2 - 1) / (sqrt(2) + eps) = ±0.7071 on every token of A and
    B. GRPO-λ raises B's to -0.1 (its credit over tokens is the traced ratio in the loss); FIPO keeps it (its
    future-KL weights act in the loss): docs/method.md."""
    cfg, got = _rival_round(tmp_path, estimator)
    a = 1 / (math.sqrt(2) + cfg.reward.eps)
    b = -0.1 if estimator == "grpo-lambda" else -a
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7
    np.testing.assert_allclose(got["A"]["advantages"], [a] * 11, rtol=1e-6)
    np.testing.assert_allclose(got["B"]["advantages"], [b] * 7, rtol=1e-6)
    assert (got["A"]["rule"], got["A"]["n_penalized_tokens"], got["B"]["outcome_reward"]) == (None, 0, 0.0)


@pytest.mark.parametrize("estimator", list(RIVALS))
def test_each_rivals_credit_recomputed_from_the_tables_is_what_the_reward_stage_wrote(tmp_path, estimator):
    cfg, got = _rival_round(tmp_path, estimator)
    want_r, want_a = rival_credit_by_hand(cfg, estimator)
    assert set(got) == set(want_a) == {"A", "B"}
    for rid, r in got.items():
        np.testing.assert_allclose(r["rewards"], want_r[rid], rtol=0, atol=1e-6)
        np.testing.assert_allclose(r["advantages"], want_a[rid], rtol=1e-6, atol=1e-6, err_msg=rid)
        assert np.abs(want_a[rid]).max() >= 0.1  # the check has credit to compare (GRPO-λ floors B at -0.1)
        if estimator in ("vineppo", "densr"):  # credit over tokens: it varies along each response
            assert np.ptp(want_a[rid]) > 0.1, (rid, want_a[rid])
