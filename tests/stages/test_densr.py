"""DenseR end to end on a hand-built round: hidden-state divergences from the real tiny model (the
densr stage), and the reward stage's token advantages from a divergence table worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import storage
from pipeline.stages.base import round_paths
from pipeline.stages.densr import densr_stage
from pipeline.stages.reward import reward_stage
from tests.toy_round import toy_config, write_round, write_rows

DENSR = ("critique.enabled=false", "reward.estimator=densr", "reward.process_weight=0", "variant=densr")


def _divergence_rows(a, b):
    return [{"rollout_id": "A", "prompt_id": "toy-train-00000", "outcome_correct": True, "layer": -1, "n_opposite": 1,
             "divergence": a},
            {"rollout_id": "B", "prompt_id": "toy-train-00000", "outcome_correct": False, "layer": -1,
             "n_opposite": 1, "divergence": b}]


def test_densr_advantages_from_a_divergence_table_worked_by_hand(tmp_path):
    cfg = toy_config(tmp_path, *DENSR, "densr.mix=0.5")
    write_round(cfg)  # A right (11 tokens), B wrong (7 tokens): one group
    # A: d = 0 on 9 tokens, 1.1 on 2 (mean 0.2) -> ratio 0 / 5.5; B: 0.7 on the last token only (mean 0.1) -> 0 / 7
    write_rows(cfg, "token_divergence", _divergence_rows([0.0] * 9 + [1.1, 1.1], [0.0] * 6 + [0.7]), "densr")
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    a = 1.0 / (2 ** 0.5 + cfg.reward.eps)  # GRPO: rewards 2, 0 -> (2 - 1) / (std sqrt(2) + eps), -the same
    # mix 0.5: w = 0.5 + 0.5 * ratio -> A 0.5 (x9), 3.25 (x2); B 0.5 (x6), 4.0
    np.testing.assert_allclose(got["A"]["advantages"], [0.5 * a] * 9 + [3.25 * a] * 2, rtol=1e-5)
    np.testing.assert_allclose(got["B"]["advantages"], [-0.5 * a] * 6 + [-4.0 * a], rtol=1e-5)
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7
    # the size of each response's update is GRPO's
    assert abs(sum(abs(x) for x in got["A"]["advantages"]) - 11 * a) < 1e-4

    # another mix is another reward key: recomputed from the same divergences, no model read
    mix1 = toy_config(tmp_path, *DENSR, "densr.mix=1.0")
    res = reward_stage(mix1, 1)
    assert not res.skipped and "densr" in res.reason
    a1 = storage.read_table(round_paths(mix1, 1)["token_rewards"], "token_rewards").to_pylist()[0]["advantages"]
    np.testing.assert_allclose(a1, [0.0] * 9 + [5.5 * a] * 2, rtol=1e-5)  # all of it on the two parting tokens

    write_rows(cfg, "token_divergence", _divergence_rows([0.0] * 10, [0.0] * 7), "densr")  # A is 11 tokens
    with pytest.raises(ValueError, match="holds 10 divergences for rollout A of 11 tokens"):
        reward_stage(cfg, 1)
    write_rows(cfg, "token_divergence", _divergence_rows([0.0] * 11, [0.0] * 7), "densr")
    with pytest.raises(ValueError, match=r"computed at layer\(s\) \[-1\], not densr.layer=-2"):
        reward_stage(toy_config(tmp_path, *DENSR, "densr.layer=-2"), 1)


def test_the_densr_stage_reads_the_policys_hidden_states(tmp_path, tiny_model):
    cfg = toy_config(tmp_path, *DENSR, f"rollout.policy={tiny_model}", "rollout.engine={type: transformers, dtype: float32}")
    write_round(cfg)
    rows = storage.read_table(round_paths(cfg, 1)["rollouts"], "rollouts").to_pylist()
    # B (wrong) repeats A's first 4 tokens, then parts: a causal model's states are equal on the shared prefix
    b = next(r for r in rows if r["rollout_id"] == "B")
    a = next(r for r in rows if r["rollout_id"] == "A")
    b["response_token_ids"] = a["response_token_ids"][:4] + [500, 501, 2]
    write_rows(cfg, "rollouts", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in rows], "rollout")
    res = densr_stage(cfg, 1)
    assert not res.skipped and res.rows == 2
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_divergence"],
                                                          "token_divergence").to_pylist()}
    dA, dB = np.asarray(got["A"]["divergence"]), np.asarray(got["B"]["divergence"])
    assert len(dA) == 11 and len(dB) == 7 and got["A"]["n_opposite"] == got["B"]["n_opposite"] == 1
    assert dA[:4].max() < 1e-3 and dB[:4].max() < 1e-3  # the shared prefix: no divergence
    assert dB[4] > 0.05 and dA[4] > 0.05  # where they part
    assert densr_stage(cfg, 1).skipped  # cached: another mix reads no model
    reward_stage(cfg, 1)
    adv = {r["rollout_id"]: np.asarray(r["advantages"]) for r in
           storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    assert np.all(adv["A"] >= 0) and np.all(adv["B"] <= 0)  # GRPO's sign, reweighted
    assert abs(adv["B"][:4]).max() < 0.05 * abs(adv["B"]).max()  # the shared prefix is barely blamed
    with pytest.raises(ValueError, match=r"densr.layer=99 is out of range: the policy has 31 hidden states"):
        densr_stage(toy_config(tmp_path, *DENSR, f"rollout.policy={tiny_model}", "densr.layer=99",
                               "rollout.engine={type: transformers, dtype: float32}"), 1)
