"""Where a traced ratio (GRPO-λ) puts the credit: the reward stage's ``credit`` column on a hand-built
round, worked by hand, beside the flat advantage the loss multiplies by the traced ratio."""

from __future__ import annotations

import numpy as np

from pipeline import storage
from pipeline.stages.base import round_paths
from pipeline.stages.reward import reward_stage
from tests.toy_round import toy_config, write_round

LAMBDA = ("critique.enabled=false", "reward.estimator=grpo-lambda", "reward.process_weight=0", "variant=grpo-lambda")


def _table(cfg) -> dict[str, dict]:
    return {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}


def test_grpo_lambda_credit_worked_by_hand(tmp_path):
    cfg = toy_config(tmp_path, *LAMBDA, "train.ratio_trace={kappa: 0.5, style: recent}")
    write_round(cfg)  # A right (11 tokens), B wrong (7 tokens): one group
    reward_stage(cfg, 1)
    got = _table(cfg)
    a = 1.0 / (2 ** 0.5 + cfg.reward.eps)  # GRPO: rewards 2, 0 -> +a, -a; GRPO-λ floors -a at -0.1
    np.testing.assert_allclose(got["A"]["advantages"], [a] * 11, rtol=1e-5)
    np.testing.assert_allclose(got["B"]["advantages"], [-0.1] * 7, rtol=1e-5)
    # credit_j = A * (1 - 0.5^(T - j)) / (1 - 0.5): 2A on the first tokens, A on the last
    np.testing.assert_allclose(got["A"]["credit"], [a * (1 - 0.5 ** (11 - j)) / 0.5 for j in range(11)], rtol=1e-5)
    np.testing.assert_allclose(got["B"]["credit"], [-0.1 * (1 - 0.5 ** (7 - j)) / 0.5 for j in range(7)], rtol=1e-5)
    assert got["A"]["credit"][-1] == got["A"]["advantages"][-1]

    # another trace is another reward key; a variant without a trace writes no credit (its advantages are it)
    res = reward_stage(toy_config(tmp_path, *LAMBDA, "train.ratio_trace={kappa: 0.9, style: recent}"), 1)
    assert not res.skipped and "ratio_trace" in res.reason
    grpo = toy_config(tmp_path, "critique.enabled=false", "reward.process_weight=0", "variant=grpo")
    reward_stage(grpo, 1)
    assert all(r["credit"] is None for r in _table(grpo).values())
