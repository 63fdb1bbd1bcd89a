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
