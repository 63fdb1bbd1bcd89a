"""DenseR's divergences, weights and advantages (pipeline/core/densr.py, rewards.densr), worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.densr import aligned_divergence, densr_weights
from pipeline.core.rewards import RoundRewards, densr


def _loop_divergence(hidden, correct, groups):
    """The definition, one token and one opposite response at a time."""
    out = []
    for i, h_i in enumerate(hidden):
        opp = [j for j in range(len(hidden)) if groups[j] == groups[i] and correct[j] != correct[i] and len(hidden[j])]
        d = []
        for t in range(len(h_i)):
            if not opp:
                d.append(float("nan"))
                continue
            best = -2.0
            for j in opp:
                v = hidden[j][min(t, len(hidden[j]) - 1)]
                cos = float(np.dot(h_i[t], v) / (np.linalg.norm(h_i[t]) * np.linalg.norm(v)))
                best = max(best, cos)
            d.append(min(max(1.0 - best, 0.0), 2.0))
        out.append(np.array(d))
    return out


def test_divergence_is_zero_on_a_shared_prefix_and_large_where_responses_part():
    # right A and wrong B agree on tokens 0, 1 and part at token 2; B is one token longer
    A = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    B = np.array([[2.0, 0.0], [0.0, 3.0], [1.0, -1.0], [0.0, 1.0]])
    dA, dB = aligned_divergence([A, B], np.array([True, False]), np.array([0, 0]))
    # A: cos 1, 1, and (1,1).(1,-1) = 0 -> d 0, 0, 1
    np.testing.assert_allclose(dA, [0.0, 0.0, 1.0], atol=1e-7)
    # B: token 3 (0,1) meets A's last token (1,1): cos 1/sqrt(2) -> d 1 - 0.70711
    np.testing.assert_allclose(dB, [0.0, 0.0, 1.0, 1 - 1 / np.sqrt(2)], atol=1e-6)


def test_divergence_takes_the_nearest_response_of_the_other_outcome_and_only_within_the_group():
    right = np.array([[1.0, 0.0]])
    wrong1 = np.array([[0.0, 1.0]])  # cos 0 with right
    wrong2 = np.array([[1.0, 1.0]])  # cos 1/sqrt(2) with right: the nearest
    other_group = np.array([[1.0, 0.0]])  # identical to right, but another prompt: not compared
    d = aligned_divergence([right, wrong1, wrong2, other_group], np.array([True, False, False, False]),
                           np.array([0, 0, 0, 1]))
    np.testing.assert_allclose(d[0], [1 - 1 / np.sqrt(2)], atol=1e-6)
    np.testing.assert_allclose(d[1], [1.0], atol=1e-7)  # wrong1's only opposite is right
    assert np.isnan(d[3]).all()  # alone in its group: no contrast


def test_vectorized_divergence_matches_the_definition_on_random_groups():
    rng = np.random.default_rng(0)
    for _ in range(20):
        B = int(rng.integers(2, 7))
        hidden = [rng.normal(size=(int(rng.integers(0, 6)), 5)) for _ in range(B)]
        correct, groups = rng.random(B) < 0.5, rng.integers(0, 2, B)
        got = aligned_divergence(hidden, correct, groups)
        want = _loop_divergence(hidden, correct, groups)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5)


def test_weights_average_one_per_response_and_mix_toward_flat():
    # response 0: d = 0, 0, 1, 1 (mean 0.5) -> 0, 0, 2, 2; response 1: no contrast -> 1, 1
    # response 2: all 0 -> 1, 1, 1
    d = np.array([0.0, 0.0, 1.0, 1.0, np.nan, np.nan, 0.0, 0.0, 0.0])
    off = np.array([0, 4, 6, 9])
    np.testing.assert_allclose(densr_weights(d, off), [0, 0, 2, 2, 1, 1, 1, 1, 1])
    # mix 0.25: 0.75 + 0.25 * (0, 0, 2, 2) = 0.75, 0.75, 1.25, 1.25
    np.testing.assert_allclose(densr_weights(d, off, mix=0.25), [0.75, 0.75, 1.25, 1.25, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(densr_weights(d, off, mix=0.0), np.ones(9))
    # equal hidden states: cosine rounding leaves divergences of ~1e-16, which must not become weights
    # (2.2e-16 / 9.2e-17 = 2.4 would be); the mean, 5.5e-16 / 6, is below FLAT_BELOW, so flat
    rounding = np.array([0.0, 0.0, 2.2e-16, 2.2e-16, 1.1e-16, 0.0])
    np.testing.assert_allclose(densr_weights(rounding, np.array([0, 6])), np.ones(6))
    # a response that never parts from its opposite (a prefix of it) in bf16: two forward passes over
    # one prefix differ by 1e-6 ... 1e-5, which divided by its own mean would be weights 0.5, 1.5, 1.0;
    # below NOISE_BELOW they count as 0, so flat
    np.testing.assert_allclose(densr_weights(np.array([1e-6, 3e-6, 2e-6]), np.array([0, 3])), np.ones(3))
    # a response that parts: its shared prefix's rounding counts as 0, the parting tokens take the weight
    # d = 2e-6, 0.3, 0.1 -> 0, 0.3, 0.1 (mean 0.4 / 3) -> 0, 2.25, 0.75
    np.testing.assert_allclose(densr_weights(np.array([2e-6, 0.3, 0.1]), np.array([0, 3])), [0.0, 2.25, 0.75], rtol=1e-6)
    with pytest.raises(ValueError, match="mix=1.5 must lie in"):
        densr_weights(d, off, mix=1.5)
    with pytest.raises(ValueError, match="divergences must be >= 0"):
        densr_weights(np.array([-0.1]), np.array([0, 1]))


def test_densr_advantage_reweights_grpo_and_keeps_each_responses_total():
    # one group, A right (3 tokens), B wrong (2 tokens); GRPO: r = 2, 0 -> mean 1, std sqrt(2)
    outcome = np.array([1.0, 0.0])
    w = np.array([0.5, 0.5, 2.0, 1.5, 0.5], np.float32)  # mean 1 over A and over B
    r = RoundRewards(run_rewards=np.array([2, 2, 2, 0, 0], np.float32), run_lengths=np.ones(5, np.int64),
                     run_response=np.array([0, 0, 0, 1, 1]), outcome=outcome, length_penalty=np.zeros(2, np.float32),
                     groups=np.array([0, 0]), correct_weight=2.0, scale_by_std=True, eps=1e-6, token_weights=w)
    a = 1.0 / (np.sqrt(2.0) + 1e-6)  # (2 - 1) / (std + eps)
    got = densr(r)
    np.testing.assert_allclose(got, [0.5 * a, 0.5 * a, 2 * a, -1.5 * a, -0.5 * a], rtol=1e-6)
    # each response's total magnitude is GRPO's: A 3 tokens x a = 2.12132, B 2 tokens x a = 1.41421
    assert np.abs(got[:3]).sum() == pytest.approx(2.12132, abs=1e-5) and np.abs(got[3:]).sum() == pytest.approx(1.41421, abs=1e-5)
    with pytest.raises(ValueError, match="needs the round's hidden-state divergences"):
        densr(RoundRewards(**{**r.__dict__, "token_weights": None}))
