"""VinePPO's Monte Carlo step advantages (pipeline/core/mc.py), with numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.mc import (
    first_error_from_values,
    leave_one_out_means,
    mc_step_advantages,
    mc_step_advantages_loop,
    whiten_runs,
)
from pipeline.core.rewards import ADVANTAGE_ESTIMATORS, RoundRewards


def _example():
    # A: 3 steps, 3 valued states V = 0.5, 0.25, 1.0, R = 1: A_k = V(S_k) - V(S_{k-1}), V(S_3) = R
    #    -> [0.25 - 0.5, 1.0 - 0.25, 1 - 1.0] = [-0.25, 0.75, 0.0]
    # B: 4 steps, capped at 2 states V = 0.5, 0.0, R = 1: V(S_2..S_4) = R = 1
    #    -> [0.0 - 0.5, 1 - 0.0, 1 - 1, 1 - 1] = [-0.5, 1.0, 0.0, 0.0]
    # C: 1 step, the prompt's value only, V = 1/3, R = 0 -> [0 - 1/3]
    values = np.array([0.5, 0.25, 1.0, 0.5, 0.0, 1 / 3])
    return values, np.array([3, 2, 1]), np.array([3, 4, 1]), np.array([1.0, 1.0, 0.0])


def test_step_advantages_worked_by_hand():
    adv = mc_step_advantages(*_example())
    np.testing.assert_allclose(adv, [-0.25, 0.75, 0.0, -0.5, 1.0, 0.0, 0.0, -1 / 3])
    # they telescope: each response's advantages sum to R - V(S_0)
    np.testing.assert_allclose([adv[:3].sum(), adv[3:7].sum(), adv[7:].sum()], [1 - 0.5, 1 - 0.5, 0 - 1 / 3])


def test_the_vectorized_advantages_equal_the_loop_of_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(50):
        B = int(rng.integers(1, 6))
        n_steps = rng.integers(1, 7, B)
        n_states = np.array([rng.integers(1, n + 1) for n in n_steps])
        values = rng.random(int(n_states.sum()))
        final = rng.integers(0, 2, B).astype(float) - 0.25 * rng.integers(0, 2, B)
        np.testing.assert_allclose(mc_step_advantages(values, n_states, n_steps, final),
                                   mc_step_advantages_loop(values, n_states, n_steps, final), atol=1e-12)


def test_bad_shapes_and_state_counts_are_named():
    values, n_states, n_steps, final = _example()
    with pytest.raises(ValueError, match="response 1 has 5 valued states and 4 steps"):
        mc_step_advantages(values, np.array([3, 5, 1]), n_steps, final)
    with pytest.raises(ValueError, match=r"state_values has shape \(5,\); expected \(6,\)"):
        mc_step_advantages(values[:5], n_states, n_steps, final)


def test_the_prompt_value_is_the_mean_of_the_groups_other_outcomes():
    # group 0 outcomes [1, 1, 0, 0]: (2 - 1) / 3 = 1/3 for the right ones, (2 - 0) / 3 = 2/3 for the wrong;
    # group 1 [1, 0]: 0 and 1
    got = leave_one_out_means(np.array([1, 1, 0, 0, 1, 0.0]), np.array([0, 0, 0, 0, 1, 1]))
    np.testing.assert_allclose(got, [1 / 3, 1 / 3, 2 / 3, 2 / 3, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"groups \[1\] have one response"):
        leave_one_out_means(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]))


def test_whitening_is_over_tokens():
    # values [1, -1] over 1 and 3 tokens: mean (1 - 3) / 4 = -0.5; unbiased var (1.5^2 + 3 * 0.5^2) / 3 = 1
    np.testing.assert_allclose(whiten_runs(np.array([1.0, -1.0]), np.array([1, 3]), eps=0.0), [1.5, -0.5])
    assert whiten_runs(np.array([2.0]), np.array([1])).tolist() == [0.0]
    with pytest.raises(ValueError, match=r"values \(3,\) and lengths \(1,\) must be 1-D"):
        whiten_runs(np.array([1.0, 2.0, 3.0]), np.array([2]))  # broadcast silently before


def test_vineppo_refuses_a_process_penalty_and_an_outcome_other_than_the_rule():
    from pathlib import Path

    from pipeline.config import load_config

    default = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    with pytest.raises(ValueError, match="reward.outcome='shuffled', set it to 'rule'"):
        load_config(default, ["reward.outcome=shuffled"], preset="vineppo")
    with pytest.raises(ValueError, match="would ignore the process reward"):
        load_config(default, ["reward.process_weight=1", "critique.enabled=true"], preset="vineppo")


def test_the_vineppo_estimator_reads_the_runs_as_steps():
    values, n_states, n_steps, final = _example()
    run_response = np.repeat(np.arange(3), n_steps)
    lengths = np.array([2, 1, 1, 1, 1, 1, 1, 4])
    r = RoundRewards(np.zeros(8), lengths, run_response, final, np.zeros(3), np.array([0, 0, 0]), 2.0, True, 1e-8,
                     values, n_states)
    adv = np.array([-0.25, 0.75, 0.0, -0.5, 1.0, 0.0, 0.0, -1 / 3])
    mean = (adv * lengths).sum() / 12
    std = np.sqrt((lengths * (adv - mean) ** 2).sum() / 11)
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["vineppo"](r), (adv - mean) / std, rtol=1e-5)
    with pytest.raises(ValueError, match="needs the round's Monte Carlo state values"):
        ADVANTAGE_ESTIMATORS["vineppo"](RoundRewards(np.zeros(8), lengths, run_response, final, np.zeros(3),
                                                     np.zeros(3, int), 2.0, True, 1e-8))


def test_the_vineppo_estimator_takes_the_overlong_penalty_in_units_of_a_right_answer():
    # response 3's overlong penalty -1.0 with correct_weight 2 (a right answer is worth 2): r_v + (-1.0 / 2)
    # = -0.5, so its step advantage is -0.5 - 1/3 = -5/6 (not -1 - 1/3: values are in units of a right answer)
    values, n_states, n_steps, final = _example()
    run_response = np.repeat(np.arange(3), n_steps)
    lengths = np.array([2, 1, 1, 1, 1, 1, 1, 4])
    r = RoundRewards(np.zeros(8), lengths, run_response, final, np.array([0.0, 0.0, -1.0]), np.array([0, 0, 0]),
                     2.0, True, 1e-8, values, n_states)
    adv = np.array([-0.25, 0.75, 0.0, -0.5, 1.0, 0.0, 0.0, -5 / 6])
    mean = (adv * lengths).sum() / 12
    std = np.sqrt((lengths * (adv - mean) ** 2).sum() / 11)
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["vineppo"](r), (adv - mean) / std, rtol=1e-5)
    with pytest.raises(ValueError, match="overlong penalty needs correct_weight > 0"):
        ADVANTAGE_ESTIMATORS["vineppo"](RoundRewards(**{**r.__dict__, "correct_weight": 0.0}))


def test_first_error_is_the_first_fall_of_value_by_drop():
    # V = 0.75, 0.5, 0.0, R = 0: falls 0.25 then 0.5 -> step 1 at drop 0.5, step 0 at drop 0.25
    assert first_error_from_values([0.75, 0.5, 0.0], 0.0, 0.5) == 1
    assert first_error_from_values([0.75, 0.5, 0.0], 0.0, 0.25) == 0
    # V = 0.5, 1.0, R = 1: never falls -> -1; R = 0 after 1.0: the last step is the error
    assert first_error_from_values([0.5, 1.0], 1.0, 0.5) == -1
    assert first_error_from_values([0.5, 1.0], 0.0, 0.5) == 1
    with pytest.raises(ValueError, match=r"drop must be in \(0, 1\], got 0"):
        first_error_from_values([0.5], 1.0, 0)
