"""Token rewards and group-normalized advantages (pipeline/core/rewards.py)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.rewards import (
    broadcast_to_tokens,
    check_reward_weights,
    group_token_advantages,
    grpo_sequence_advantages,
    shuffle_within_groups,
    token_rewards,
)

# --- token_rewards ----------------------------------------------------------------------------


def test_reward_table_c2_p1():
    # four one-token responses: (right, clean), (right, flawed), (wrong, clean), (wrong, flawed)
    outcome = np.array([1, 1, 0, 0])
    weight = np.array([0.0, 1.0, 0.0, 1.0])
    offsets = np.array([0, 1, 2, 3, 4])
    rewards = token_rewards(outcome, weight, offsets, C=2.0, P=1.0)
    assert rewards.dtype == np.float32
    assert rewards.tolist() == [2 * 1 - 1 * 0, 2 * 1 - 1 * 1, 2 * 0 - 1 * 0, 2 * 0 - 1 * 1]
    assert rewards.tolist() == [2, 1, 0, -1]


def test_rewards_follow_response_boundaries_and_soft_weights():
    outcome = np.array([1, 0])
    weight = np.array([0.0, 0.75, 0.75, 0.5, 0.0])  # response 0: 3 tokens, response 1: 2
    rewards = token_rewards(outcome, weight, np.array([0, 3, 5]), C=2.0, P=1.0)
    np.testing.assert_allclose(rewards, [2 - 0, 2 - 0.75, 2 - 0.75, 0 - 0.5, 0 - 0])


def test_p_zero_is_plain_outcome_reward():
    outcome = np.array([1, 0, 1])
    weight = np.array([1.0, 0.5, 1.0, 0.0])
    rewards = token_rewards(outcome, weight, np.array([0, 2, 3, 4]), C=3.0, P=0.0)
    assert rewards.tolist() == [3 * 1, 3 * 1, 3 * 0, 3 * 1]


@given(
    st.lists(st.tuples(st.integers(0, 1), st.lists(st.floats(0, 1), max_size=6)), max_size=6),
    st.floats(0, 10),
    st.floats(0, 10),
)
def test_reward_bounds(rows, C, P):
    outcome = np.array([r for r, _ in rows], dtype=np.int64)
    weight = np.array([w for _, ws in rows for w in ws], dtype=np.float64)
    offsets = np.concatenate([[0], np.cumsum([len(ws) for _, ws in rows])]).astype(np.int64)
    rewards = token_rewards(outcome, weight, offsets, C, P).astype(np.float64)
    r_v = np.repeat(outcome, np.diff(offsets))
    tol = 1e-5 * (1 + C + P)
    assert np.all(C * r_v - P - tol <= rewards) and np.all(rewards <= C * r_v + tol)


def test_token_rewards_validation():
    with pytest.raises(ValueError, match="offsets"):
        token_rewards(np.array([1]), np.array([0.0, 0.0]), np.array([0, 1]), 2.0, 1.0)
    with pytest.raises(ValueError, match="token_weight must lie in"):
        token_rewards(np.array([1]), np.array([1.5]), np.array([0, 1]), 2.0, 1.0)
    with pytest.raises(ValueError, match="P=-1"):
        token_rewards(np.array([1]), np.array([0.0]), np.array([0, 1]), 2.0, -1.0)


def test_check_reward_weights():
    check_reward_weights(2.0, 1.0)
    check_reward_weights(1.0, 0.0)
    for C, P in ((1.0, 1.0), (1.0, 2.0)):
        with pytest.raises(ValueError, match="keep C > P"):
            check_reward_weights(C, P)


# --- group_token_advantages -------------------------------------------------------------------


def test_advantages_by_hand_two_responses_one_group():
    # response 0 right, step weights per token [0, 1] -> R = [2, 1]
    # response 1 wrong, weights [0, 0, 1]            -> R = [0, 0, -1]
    rewards = np.array([2.0, 1.0, 0.0, 0.0, -1.0])
    mean = (2 + 1 + 0 + 0 - 1) / 5  # 0.4
    sq_dev = (2 - mean) ** 2 + (1 - mean) ** 2 + 2 * (0 - mean) ** 2 + (-1 - mean) ** 2
    std = math.sqrt(sq_dev / (5 - 1))
    assert std == pytest.approx(math.sqrt(5.2 / 4))
    eps = 1e-6
    adv = group_token_advantages(rewards, np.array([0, 2, 5]), np.array([7, 7]), eps=eps)
    assert adv.dtype == np.float32
    expected = [(2 - 0.4) / (std + eps), (1 - 0.4) / (std + eps), (0 - 0.4) / (std + eps),
                (0 - 0.4) / (std + eps), (-1 - 0.4) / (std + eps)]
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    # no std scaling (Dr.GRPO): just centered
    centered = group_token_advantages(rewards, np.array([0, 2, 5]), np.array([7, 7]), False)
    np.testing.assert_allclose(centered, [1.6, 0.6, -0.4, -0.4, -1.4], rtol=1e-6)


def test_advantages_keep_groups_apart():
    # group "a": one response [2, 2, 1]; group "b": one response with one token [0]
    rewards = np.array([2.0, 2.0, 1.0, 0.0])
    adv = group_token_advantages(rewards, np.array([0, 3, 4]), np.array(["a", "b"]), eps=1e-6)
    mean_a = 5 / 3
    std_a = math.sqrt(((2 - mean_a) ** 2 * 2 + (1 - mean_a) ** 2) / 2)
    np.testing.assert_allclose(
        adv[:3], [(2 - mean_a) / (std_a + 1e-6)] * 2 + [(1 - mean_a) / (std_a + 1e-6)], rtol=1e-6
    )
    assert adv[3] == 0.0  # a group with one token: std 0, advantage (0 - 0) / eps = 0


def test_group_of_one_response_and_constant_rewards_give_zero():
    adv = group_token_advantages(np.array([1.0, 1.0, 1.0]), np.array([0, 3]), np.array([0]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_empty_responses_are_allowed():
    adv = group_token_advantages(np.array([1.0, 0.0]), np.array([0, 0, 1, 1, 2]), np.zeros(4))
    np.testing.assert_allclose(adv, [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])


def naive_token_advantages(rewards, offsets, group_ids, scale_by_std, eps):
    """Reference: for each token, gather every token of its group with plain Python loops."""
    out = []
    for b in range(len(offsets) - 1):
        pool = []
        for other in range(len(offsets) - 1):
            if group_ids[other] == group_ids[b]:
                pool.extend(rewards[offsets[other] : offsets[other + 1]])
        mean = sum(pool) / len(pool)
        n = len(pool)
        std = math.sqrt(sum((x - mean) ** 2 for x in pool) / (n - 1)) if n > 1 else 0.0
        for t in range(offsets[b], offsets[b + 1]):
            out.append((rewards[t] - mean) / (std + eps) if scale_by_std else rewards[t] - mean)
    return np.array(out)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_vectorized_matches_naive_loop(seed, scale_by_std):
    rng = np.random.default_rng(seed)
    n_groups, group_size = rng.integers(1, 5), rng.integers(1, 6)
    B = n_groups * group_size
    lengths = rng.integers(0, 9, size=B)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    group_ids = rng.permutation(np.repeat(np.arange(n_groups) * 10 + 3, group_size))
    outcome = rng.integers(0, 2, size=B)
    weight = rng.choice([0.0, 0.25, 1.0], size=offsets[-1])
    rewards = token_rewards(outcome, weight, offsets, C=2.0, P=1.0)
    got = group_token_advantages(rewards, offsets, group_ids, scale_by_std, eps=1e-6)
    want = naive_token_advantages(
        rewards.astype(np.float64), offsets, group_ids, scale_by_std, eps=1e-6
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_group_ids_shape_checked():
    with pytest.raises(ValueError, match=r"expected \(B,\) = \(2,\)"):
        group_token_advantages(np.zeros(3), np.array([0, 1, 3]), np.array([0, 0, 0]))


# --- grpo_sequence_advantages / broadcast -----------------------------------------------------


def trl_grpo_advantages(rewards: torch.Tensor, G: int, scale: bool) -> torch.Tensor:
    """TRL GRPOTrainer's formula, written out."""
    mean_grouped = rewards.view(-1, G).mean(dim=1).repeat_interleave(G, dim=0)
    std_grouped = rewards.view(-1, G).std(dim=1).repeat_interleave(G, dim=0)
    advantages = rewards - mean_grouped
    if scale:
        advantages = advantages / (std_grouped + 1e-4)
    return advantages


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_trl(seed, scale_by_std):
    rng = np.random.default_rng(seed)
    G, n_prompts = int(rng.integers(2, 9)), int(rng.integers(1, 5))
    r = rng.integers(0, 2, size=G * n_prompts).astype(np.float32)
    group_ids = np.repeat(np.arange(n_prompts), G)
    ours = grpo_sequence_advantages(r, group_ids, scale_by_std=scale_by_std)
    trl = trl_grpo_advantages(torch.from_numpy(r), G, scale_by_std).numpy()
    np.testing.assert_allclose(ours, trl, rtol=1e-5, atol=1e-6)


def test_grpo_by_hand():
    # one group: rewards [1, 0, 0, 0]; mean 1/4; std = sqrt((0.75^2 + 3 * 0.25^2) / 3)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # = 0.5
    adv = grpo_sequence_advantages(np.array([1, 0, 0, 0]), np.zeros(4, dtype=int))
    np.testing.assert_allclose(adv, [0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3, rtol=1e-6)
    # a group of one: 0 (TRL would give NaN from torch.std of one value)
    assert grpo_sequence_advantages(np.array([1.0]), np.array([0])).tolist() == [0.0]


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(np.array([0.5, -1.0, 2.0], dtype=np.float32), np.array([0, 2, 2, 5]))
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match="B\\+1"):
        broadcast_to_tokens(np.array([1.0]), np.array([0, 1, 2]))


# ------------------------------------------------------------ DAPO soft overlong punishment (eq. 13)
def test_overlong_penalty_by_hand():
    from pipeline.core.rewards import overlong_penalty

    # L_max 100, L_cache 20: free up to 80 tokens, then linear to -factor at 100 and beyond
    got = overlong_penalty(np.array([50, 80, 81, 90, 100, 120]), 100, 20)
    np.testing.assert_allclose(got, [0, 0, -0.05, -0.5, -1, -1], rtol=1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(overlong_penalty(np.array([90, 100]), 100, 20, factor=0.5), [-0.25, -0.5], rtol=1e-6)


@pytest.mark.parametrize("buffer, factor, match", [(0, 1.0, "buffer=0 must lie in"), (100, 1.0, "buffer=100 must lie in"),
                                                   (20, -1.0, "factor=-1.0 must be >= 0")])
def test_overlong_penalty_rejects_bad_settings(buffer, factor, match):
    from pipeline.core.rewards import overlong_penalty

    with pytest.raises(ValueError, match=match):
        overlong_penalty(np.array([10]), 100, buffer, factor)


# --- shuffle_within_groups (the shuffled-outcome control) -------------------------------------


def test_shuffle_within_groups_keeps_each_groups_values():
    values = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    groups = np.array([0, 0, 1, 1, 1, 2])  # group 2 has one response: it cannot move
    outs = [shuffle_within_groups(values, groups, [s, 1]) for s in range(30)]
    for out in outs:
        assert sorted(out[:2]) == [0.0, 1.0] and sorted(out[2:5]) == [0.0, 1.0, 1.0] and out[5] == 5.0
    # by hand: group 0 has 2 orders, group 1 has 3 (where its 0 lands); 30 seeds see them all
    assert {tuple(o[:2]) for o in outs} == {(1.0, 0.0), (0.0, 1.0)}
    assert {int(np.argmin(o[2:5])) for o in outs} == {0, 1, 2}
    np.testing.assert_array_equal(shuffle_within_groups(values, groups, [3, 1]), outs[3])  # seeded
    # groups need not be contiguous: interleaved rows keep their own group's values
    inter = shuffle_within_groups(np.array([1, 7, 0, 7]), np.array([0, 1, 0, 1]), 0)
    assert sorted(inter[[0, 2]]) == [0, 1] and list(inter[[1, 3]]) == [7, 7]


def test_shuffle_within_groups_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"values \(3,\) and group_ids \(2,\)"):
        shuffle_within_groups(np.zeros(3), np.zeros(2, int), 0)


# --- the estimator registry ---------------------------------------------------------------------
def test_estimators_by_hand_on_one_group():
    """One group of two responses: A right in 2 steps of 1 and 3 tokens, the second step flagged;
    B wrong, one run of 2 tokens. C = 2, P = 1."""
    from pipeline.config import RewardConfig
    from pipeline.core.rewards import ADVANTAGE_ESTIMATORS, RoundRewards

    assert sorted(ADVANTAGE_ESTIMATORS) == ["capo-token-group", "densr", "fipo", "grpo", "grpo-lambda", "vineppo"]
    assert set(ADVANTAGE_ESTIMATORS) == set(RewardConfig.model_fields["estimator"].annotation.__args__)
    # token rewards: A's step 1: C = 2; A's step 2: C - P = 1; B: 0
    r = RoundRewards(run_rewards=np.array([2.0, 1.0, 0.0]), run_lengths=np.array([1, 3, 2]),
                     run_response=np.array([0, 0, 1]), outcome=np.array([1.0, 0.0]), length_penalty=np.zeros(2),
                     groups=np.array([0, 0]), correct_weight=2.0, scale_by_std=True, eps=0.0)
    # capo: tokens 2,1,1,1,0,0: mean 5/6; squares of deviations 49/36 + 3 * 1/36 + 2 * 25/36 = 102/36,
    # var (ddof 1) = 102/180 = 17/30; A = (R - 5/6) / sqrt(17/30)
    sd = math.sqrt(17 / 30)
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["capo-token-group"](r),
                               [(2 - 5 / 6) / sd, (1 - 5 / 6) / sd, (0 - 5 / 6) / sd], rtol=1e-5)
    # grpo: sequence rewards 2 and 0: mean 1, std (ddof 1) sqrt(2); the flagged step changes nothing
    s2 = math.sqrt(2)
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["grpo"](r), [1 / s2, 1 / s2, -1 / s2], rtol=1e-5)
    # grpo-lambda: GRPO's advantage with negative values raised to -0.1
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["grpo-lambda"](r), [1 / s2, 1 / s2, -0.1], rtol=1e-5)
    # fipo: GRPO's (its future-KL weights act in the loss)
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS["fipo"](r), [1 / s2, 1 / s2, -1 / s2], rtol=1e-5)


def test_trace_credit_is_the_traced_loss_gradient_at_ratio_1():
    """GRPO-λ's credit column. By hand, one response with A = 1, 1, -2, kappa 0.5, recent: token 0
    gets 1 + 0.5 * 1 + 0.25 * -2 = 1.0, token 1 gets 1 + 0.5 * -2 = 0.0, token 2 gets -2. Both:
    w(t, j) = max(0.5^(t-j), 0.5^j); token 0: 1 + max(0.5, 1) * 1 + max(0.25, 1) * -2 = 0, token 1:
    1 + max(0.5, 0.5) * -2 = 0. On random responses of different lengths it equals
    -d(loss)/d(logp) x tokens of the trainer's PPO loss with the traced ratio, at ratio 1."""
    from pipeline.core.rewards import trace_credit
    from train.loss import ppo_clip_loss

    A, off = np.array([1.0, 1.0, -2.0, 0.5]), np.array([0, 3, 4])  # a second response of one token
    np.testing.assert_allclose(trace_credit(A, off, 0.5), [1.0, 0.0, -2.0, 0.5])
    np.testing.assert_allclose(trace_credit(A, off, 0.5, "both"), [0.0, 0.0, -2.0, 0.5])
    np.testing.assert_allclose(trace_credit(A, off, 0.0), A)  # no trace: the advantage
    # GRPO's flat advantage under the recent trace: A * (1 - kappa^(T - j)) / (1 - kappa)
    np.testing.assert_allclose(trace_credit(np.full(4, 0.5), np.array([0, 4]), 0.9),
                               [0.5 * (1 - 0.9 ** (4 - j)) / 0.1 for j in range(4)], rtol=1e-6)
    rng = np.random.default_rng(1)
    lengths = [7, 3, 3, 1, 0]
    off = np.concatenate([[0], np.cumsum(lengths)])
    A = rng.normal(size=off[-1])
    T = max(lengths)
    adv = torch.zeros(len(lengths), T, dtype=torch.float64)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        adv[b, :n] = torch.from_numpy(A[off[b]:off[b + 1]])
        mask[b, :n] = True
    old = -torch.rand(len(lengths), T, dtype=torch.float64)
    for style in ("recent", "both"):
        lp = old.clone().requires_grad_(True)
        ppo_clip_loss(lp, old, adv, mask, loss_agg_mode="token-mean", ratio_trace=(0.8, style)).loss.backward()
        want = (-lp.grad * mask.sum())[mask].numpy()  # (N,), responses end to end
        np.testing.assert_allclose(trace_credit(A, off, 0.8, style), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kappa=1.5"):
        trace_credit(A, off, 1.5)
    with pytest.raises(ValueError, match="unknown ratio trace style 'old'"):
        trace_credit(A, off, 0.5, "old")
    with pytest.raises(ValueError, match=r"offsets must rise from 0 to 14 \(the number of advantages\), got \[0, 5\]"):
        trace_credit(A, np.array([0, 5]), 0.5)


def test_group_run_advantages_by_hand():
    """Runs (value, length) (2, 1), (1, 3), (0, 2), (7, 0) in one group: 6 tokens, mean 5/6; squares
    about it (7/6)^2 + 3 (1/6)^2 + 2 (5/6)^2 = 102/36, variance (ddof 1) 102/180 = 17/30, std
    0.752773. Advantages (2 - 5/6)/std = 1.54983, (1 - 5/6)/std = 0.22140, (0 - 5/6)/std = -1.10702;
    the empty run weighs nothing in the mean and std but gets (7 - 5/6)/std = 8.19193. A second group
    of one token has std 0: its advantage is 0."""
    from pipeline.core.rewards import group_run_advantages

    got = group_run_advantages(np.array([2.0, 1.0, 0.0, 7.0, 5.0]), np.array([1, 3, 2, 0, 1]),
                               np.array(["g", "g", "g", "g", "h"]))
    std = math.sqrt(17 / 30)
    assert round(std, 6) == 0.752773
    np.testing.assert_allclose(got, [1.54983, 0.22140, -1.10702, 8.19193, 0.0], atol=1e-5)
