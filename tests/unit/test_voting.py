"""Voting critiques into per-step weights (pipeline/core/voting.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.voting import VOTING_RULES, flag_counts, vote

# CAPO Figure 2: four critiques of a 4-step response.
PAPER_CRITIQUES = [(1, 3), (1, 2, 3), (1, 3), (2, 3)]


def test_registry_names():
    assert sorted(VOTING_RULES) == ["average", "intersection", "majority", "union"]


def test_flag_counts_paper_example():
    n_valid, n_flagged = flag_counts(PAPER_CRITIQUES, 4)
    assert n_valid == 4
    # step 0: none; step 1: critiques 0,1,2; step 2: 1,3; step 3: all four
    assert n_flagged.tolist() == [0, 3, 2, 4]
    assert n_flagged.dtype == np.int32


def test_flag_counts_failed_critiques_do_not_vote():
    n_valid, n_flagged = flag_counts([None, (0,), None, ()], 2)
    assert n_valid == 2
    assert n_flagged.tolist() == [1, 0]
    assert flag_counts([None, None], 3)[0] == 0
    assert flag_counts([], 3)[1].tolist() == [0, 0, 0]


def test_flag_counts_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        flag_counts([(0, 2)], 2)


@pytest.mark.parametrize(
    "rule,expected",
    [
        ("majority", [0, 1, 0, 1]),  # 3/4 > 1/2 and 4/4 > 1/2; 2/4 is not > 1/2
        ("union", [0, 1, 1, 1]),
        ("intersection", [0, 0, 0, 1]),
        ("average", [0 / 4, 3 / 4, 2 / 4, 4 / 4]),
    ],
)
def test_paper_example(rule, expected):
    n_valid, n_flagged = flag_counts(PAPER_CRITIQUES, 4)
    weights = vote(n_flagged, n_valid, rule)
    assert weights.dtype == np.float32
    np.testing.assert_allclose(weights, np.array(expected, dtype=np.float32))


@pytest.mark.parametrize("rule", sorted(VOTING_RULES))
def test_no_valid_critique_means_no_penalty(rule):
    n_valid, n_flagged = flag_counts([None, None, None], 3)
    assert vote(n_flagged, n_valid, rule).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("rule", sorted(VOTING_RULES))
def test_unanimous_votes_agree_across_rules(rule):
    n_valid, n_flagged = flag_counts([(0, 2), (0, 2), (2, 0)], 3)
    assert vote(n_flagged, n_valid, rule).tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("rule", sorted(VOTING_RULES))
def test_one_critique_is_taken_as_is(rule):
    n_valid, n_flagged = flag_counts([None, (1,)], 3)
    assert vote(n_flagged, n_valid, rule).tolist() == [0.0, 1.0, 0.0]


def test_majority_threshold_is_strict_and_configurable():
    n_flagged, n_valid = np.array([1, 2, 3]), 4
    assert vote(n_flagged, n_valid, "majority", 0.5).tolist() == [0, 0, 1]  # 1/4, 2/4, 3/4
    assert vote(n_flagged, n_valid, "majority", 0.25).tolist() == [0, 1, 1]
    assert vote(n_flagged, n_valid, "majority", 0.0).tolist() == [1, 1, 1]


def test_vote_broadcasts_flat_batch_of_steps():
    # three responses' steps in one flat array: n_valid per step
    n_flagged = np.array([2, 0, 1, 1, 0])
    n_valid = np.array([2, 2, 3, 3, 0])
    np.testing.assert_allclose(
        vote(n_flagged, n_valid, "average"), [2 / 2, 0 / 2, 1 / 3, 1 / 3, 0.0], rtol=1e-6
    )
    assert vote(n_flagged, n_valid, "intersection").tolist() == [1, 0, 0, 0, 0]


def test_vote_errors_list_valid_choices():
    with pytest.raises(ValueError, match="'mean'.*average.*intersection.*majority.*union"):
        vote(np.array([0]), 1, "mean")
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            vote(np.array([0]), 1, "majority", bad)
    with pytest.raises(ValueError, match="step 0 has n_flagged 3 and n_valid 2"):
        vote(np.array([3]), 2, "union")


critique_lists = st.integers(1, 6).flatmap(
    lambda n_steps: st.tuples(
        st.just(n_steps),
        st.lists(
            st.one_of(st.none(), st.sets(st.integers(0, n_steps - 1)).map(tuple)), max_size=8
        ),
    )
)


@given(critique_lists, st.floats(0.0, 0.99))
def test_rules_are_nested_and_average_is_the_share(case, threshold):
    n_steps, critiques = case
    n_valid, n_flagged = flag_counts(critiques, n_steps)
    inter = vote(n_flagged, n_valid, "intersection")
    major = vote(n_flagged, n_valid, "majority", threshold)
    union = vote(n_flagged, n_valid, "union")
    avg = vote(n_flagged, n_valid, "average")
    assert np.all(inter <= major) and np.all(major <= union)  # intersection ⊆ majority ⊆ union
    assert np.all((avg >= 0) & (avg <= 1))
    valid = [set(c) for c in critiques if c is not None]
    for s in range(n_steps):
        share = sum(s in c for c in valid) / len(valid) if valid else 0.0
        assert avg[s] == pytest.approx(share, abs=1e-6)
        assert inter[s] == float(bool(valid) and all(s in c for c in valid))
        assert union[s] == float(any(s in c for c in valid))


def test_step_scores_become_weights_as_the_rule_says():
    from pipeline.core.voting import score_weights

    q = np.array([0.9, 0.5, 0.81, 0.0])
    # average keeps the score; the yes/no rules flag a score strictly above the threshold
    np.testing.assert_allclose(score_weights(q, "average", 0.8), [0.9, 0.5, 0.81, 0.0], rtol=1e-6)
    for rule in ("majority", "intersection", "union"):
        np.testing.assert_array_equal(score_weights(q, rule, 0.8), [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(score_weights(q, "majority", 0.5), [1.0, 0.0, 1.0, 0.0])  # 0.5 is not above 0.5
    with pytest.raises(ValueError, match=r"unknown voting rule 'mean'; valid rules: \['average', "):
        score_weights(q, "mean", 0.5)


def test_the_config_accepts_exactly_the_registered_rules():
    from pipeline.config import VoteConfig

    for rule in VOTING_RULES:
        assert VoteConfig(rule=rule).rule == rule
    with pytest.raises(ValueError, match="'intersection', 'union', 'majority' or 'average'"):
        VoteConfig(rule="mean")
