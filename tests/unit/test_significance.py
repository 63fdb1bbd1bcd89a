"""Paired significance of accuracy changes (pipeline/core/significance.py), numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.significance import compare, mcnemar_exact, paired_bootstrap


def test_mcnemar_exact_by_hand():
    a = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    b = [1, 1, 0, 1, 1, 1, 1, 1, 0, 0]
    # n10 = 1 (item 2), n01 = 5 (items 3..7): p = 2 * P(Bin(6, 1/2) <= 1) = 2 * (1 + 6) / 64
    assert mcnemar_exact(a, b) == pytest.approx(14 / 64)
    assert mcnemar_exact([0] * 10, [1] * 10) == pytest.approx(2 / 1024)  # 10 of 10 discordant one way
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == 1.0  # nothing changed
    assert mcnemar_exact([1, 0], [0, 1]) == 1.0  # one each way: min(1, 2 * 3/4)


def test_bootstrap_by_hand_and_against_the_normal_approximation():
    diff, lo, hi = paired_bootstrap([0] * 8, [1] * 8)
    assert (diff, lo, hi) == (1.0, 1.0, 1.0)  # every resample has every item improved
    rng = np.random.default_rng(0)
    n = 2000
    u = rng.random(n)  # 30 % of items wrong->right, 10 % right->wrong, the rest unchanged
    a = np.where(u < 0.3, 0, np.where(u < 0.4, 1, rng.integers(0, 2, n)))
    b = np.where(u < 0.3, 1, np.where(u < 0.4, 0, a))
    diff, lo, hi = paired_bootstrap(a, b, seed=1)
    d = b.astype(float) - a
    se = d.std() / np.sqrt(n)
    assert diff == pytest.approx(d.mean())
    assert lo == pytest.approx(d.mean() - 1.96 * se, abs=0.004) and hi == pytest.approx(d.mean() + 1.96 * se, abs=0.004)


def test_compare_verdicts():
    # 16 items, 3 -> 5 right with 6 flips (the report: noise, not a gain)
    a = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    b = [1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    c = compare(a, b)
    assert (c.n, c.n01, c.n10) == (16, 4, 2) and c.diff == pytest.approx(2 / 16)
    assert not c.significant and c.lo < 0 < c.hi
    big = compare([0] * 40 + [1] * 60, [1] * 40 + [1] * 60)  # 40 of 100 improved, none got worse
    assert big.significant and big.p_mcnemar < 1e-9 and big.lo > 0.25


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="same items"):
        compare([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="0/1"):
        mcnemar_exact([0, 2], [1, 1])
    with pytest.raises(ValueError, match="at least one item"):
        paired_bootstrap([], [])


def test_sign_flip_p_by_hand():
    from pipeline.core.significance import sign_flip_p

    assert sign_flip_p([1, 1, 1]) == pytest.approx(2 / 8)  # only +++ and --- reach |sum| = 3
    # d = (0.5, 0.25, -0.25), sum 0.5: |sum| >= 0.5 for +++ (1.0), ++- (0.5), +-+ (0.5) and their
    # mirrors; +-- and -++ give 0: 6 of 8 patterns
    assert sign_flip_p([0.5, 0.25, -0.25]) == pytest.approx(6 / 8)
    assert sign_flip_p([0.0, 0.0]) == 1.0
    assert sign_flip_p([0.5, -0.25, 0.0]) == 1.0  # every pattern of (0.5, -0.25) has |sum| >= 0.25
    # on 0/1 items it is McNemar's exact test (5 wrong->right, 1 right->wrong: 14/64)
    a = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    b = [1, 1, 0, 1, 1, 1, 1, 1, 0, 0]
    d = np.asarray(b, float) - np.asarray(a, float)
    assert sign_flip_p(d) == pytest.approx(mcnemar_exact(a, b))
    # the Monte Carlo path (forced) agrees with the exact value within its sampling error
    assert sign_flip_p([1, 1, 1], exact_up_to=0, n_perm=20_000) == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError, match="1-D"):
        sign_flip_p([[1.0]])


def test_compare_rates_by_hand_and_errors():
    from pipeline.core.significance import compare_rates

    # 4 items, sampled accuracy c/4: two rose (+0.5, +0.25), two unchanged
    c = compare_rates([0, 0.25, 0.5, 1.0], [0.5, 0.25, 0.75, 1.0])
    assert (c.n, c.n_up, c.n_down) == (4, 2, 0)
    assert c.rate_a == pytest.approx(0.4375) and c.rate_b == pytest.approx(0.625)
    assert c.diff == pytest.approx(0.1875)
    assert c.p_sign_flip == pytest.approx(2 / 4)  # (0.5, 0.25): only ++ and -- reach |sum| 0.75
    assert not c.significant
    # 200 items each up by 0.25: interval [0.25, 0.25], p at its Monte Carlo floor -> significant
    c = compare_rates([0.25] * 200, [0.5] * 200)
    assert (c.lo, c.hi) == (pytest.approx(0.25), pytest.approx(0.25)) and c.p_sign_flip < 1e-3 and c.significant
    with pytest.raises(ValueError, match=r"rates in \[0, 1\].*1\.5"):
        compare_rates([0.5, 1.5], [0.5, 0.5])
    with pytest.raises(ValueError, match="same items"):
        compare_rates([0.5], [0.5, 0.5])
    with pytest.raises(ValueError, match="at least one"):
        compare_rates([], [])
