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


def test_mcnemar_exact_above_1023_discordant_items():
    """2.0**n overflows a float past n = 1023 (a full 2,000-problem eval that learned a format
    flips that many): the tail is computed on integers."""
    assert mcnemar_exact([1] * 600 + [0] * 600, [0] * 600 + [1] * 600) == 1.0  # 600 each way: symmetric
    assert mcnemar_exact([0] * 1200, [1] * 1200) == 0.0  # 2 / 2**1200 underflows to 0
    # 1200 discordant, 580 one way: 2 * P(Bin(1200, 1/2) <= 580), z = (580.5 - 600) / sqrt(300) = -1.126
    assert mcnemar_exact([1] * 580 + [0] * 620, [0] * 580 + [1] * 620) == pytest.approx(0.26, abs=0.01)


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
    # 16 items, 3 -> 5 right with 6 flips (noise, not a gain)
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
    assert sign_flip_p(d) == pytest.approx(14 / 64) == pytest.approx(mcnemar_exact(a, b))  # 2 * (1 + 6) / 2^6
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


def test_pooled_over_seeds_by_hand():
    from pipeline.core.significance import pooled_over_seeds, seeds_by_items_variance

    # three runs, two items: mean 0.2, run means (0.3, 0.1, 0.2), item means (0.1, 0.3);
    # MS_seed = 2 * (0.01 + 0.01 + 0) / 2 = 0.02, MS_item = 3 * (0.01 + 0.01) / 1 = 0.06, every
    # residual d - run - item + mean is 0 -> V = (0.02 + 0.06) / 6 = 0.013333, sd 0.11547;
    # t(2) at 97.5 % = 4.3027 -> half-width 0.49683
    d = [[0.2, 0.4], [0.0, 0.2], [0.1, 0.3]]
    assert seeds_by_items_variance(np.asarray(d)) == pytest.approx(0.08 / 6)
    r = pooled_over_seeds(d)
    assert (r.seeds, r.n) == (3, 2) and r.diff == pytest.approx(0.2)
    assert r.per_seed == pytest.approx((0.3, 0.1, 0.2))
    assert r.lo == pytest.approx(0.2 - 0.49683, abs=1e-5) and r.hi == pytest.approx(0.2 + 0.49683, abs=1e-5)
    assert not r.significant
    # two runs, two identical items: MS_seed = 2 * (0.25 + 0.25) / 1 = 1, no item or residual part:
    # V = 1 / 4, half-width t(1) * 0.5 = 12.706 * 0.5 -> clipped to the whole range of a change
    r = pooled_over_seeds([[1, 1], [0, 0]])
    assert (r.seeds, r.n, r.diff, r.per_seed) == (2, 2, 0.5, (1.0, 0.0))
    assert (r.lo, r.hi, r.significant) == (-1.0, 1.0, False)
    # one run is the paired item bootstrap: 4 items, one gained; the replicate mean is X/4 with
    # X ~ Binomial(4, 1/4): P(X = 0) = 0.32 > 2.5 %, P(X >= 3) = 13/256 = 5.1 % > 2.5 %, P(X = 4) = 0.4 %
    r = pooled_over_seeds([[1, 0, 0, 0]])
    assert (r.diff, r.lo, r.hi) == (0.25, 0.0, 0.75)
    # no variation at all: a point interval, significant when away from 0
    r = pooled_over_seeds(np.full((3, 5), 0.1))
    assert r.lo == pytest.approx(0.1) and r.hi == pytest.approx(0.1) and r.significant
    # per-item rates are allowed (k samples per item)
    assert pooled_over_seeds([[0.25, -0.5], [0.75, 0.0]]).diff == pytest.approx(0.125)


def test_pooled_over_seeds_with_a_residual_and_an_item_component():
    from pipeline.core.significance import pooled_over_seeds, seeds_by_items_variance

    # runs gaining 30 and 10 points on 200 items (items 0-19 gained in both, 20-59 in the first):
    # item means 1 (20 items), 0.5 (40), 0 (140); SS_item = 20 * 0.64 + 40 * 0.09 + 140 * 0.04 = 22,
    # MS_item = 2 * 22 / 199; MS_seed = 200 * (0.01 + 0.01) / 1 = 4; residuals +-0.1 (160 items) and
    # +-0.4 (40 items): SS_res = 320 * 0.01 + 80 * 0.16 = 16, MS_res = 16 / 199
    d = np.zeros((2, 200))
    d[0, :60] = 1
    d[1, :20] = 1
    v = (4 + 2 * 22 / 199 - 16 / 199) / 400
    assert seeds_by_items_variance(d) == pytest.approx(v)
    r = pooled_over_seeds(d)
    assert r.diff == pytest.approx(0.2) and r.per_seed == pytest.approx((0.3, 0.1))
    # two runs that disagree by 20 points tell nothing at 95 %: t(1) * sqrt(v) = 12.706 * 0.1017 > 1
    assert (r.lo, r.hi, r.significant) == (-1.0, 1.0, False)
    # three such runs (30, 10, 20 points) narrow it: MS_seed = 200 * 0.02 / 2 = 2, still wide
    d3 = np.vstack([d, np.r_[np.ones(40), np.zeros(160)]])
    r3 = pooled_over_seeds(d3)
    assert r3.lo < 0 < r3.hi and r3.hi - r3.lo < 1.2


def test_pooled_over_seeds_never_below_the_residual_noise():
    """Two runs each gaining 10 different problems of 200: equal run means (MS_seed = 0). Item means
    0.5 (20 problems) and 0 (180): MS_item = 2 * (20 * 0.45^2 + 180 * 0.05^2) / 199 = 9 / 199;
    residuals +-0.5 on those 20 problems: MS_res = 20 * 2 * 0.25 / 199 = 10 / 199 > MS_item. The
    seed component is floored at 0, so V = max(MS_seed, MS_res) / 400 = 10 / 199 / 400 (without the
    floor V = 0: a zero-width interval at +5 points); t(1) * sqrt(V) = 12.706 * 0.011208 = 0.14241."""
    from pipeline.core.significance import pooled_over_seeds, seeds_by_items_variance

    d = np.zeros((2, 200))
    d[0, :10] = 1
    d[1, 10:20] = 1
    assert seeds_by_items_variance(d) == pytest.approx(10 / 199 / 400)
    r = pooled_over_seeds(d)
    assert r.lo == pytest.approx(0.05 - 0.14241, abs=1e-4) and r.hi == pytest.approx(0.05 + 0.14241, abs=1e-4)
    assert not r.significant


def test_pooled_over_seeds_keeps_its_level_when_runs_differ():
    """Under no true change, runs that differ by a seed effect of sd 7 points on 200 items: the
    interval excludes 0 in about 5 % of tables (the crossed bootstrap used before: about 15 %)."""
    from pipeline.core.significance import pooled_over_seeds

    rng = np.random.default_rng(0)
    hits = 0
    sims = 400
    for _ in range(sims):
        a = rng.normal(0, 0.07, 3)  # (S,) each run's shift
        up = np.clip(0.1 + a[:, None] / 2, 0, 1)
        down = np.clip(0.1 - a[:, None] / 2, 0, 1)
        u = rng.random((3, 200))
        d = np.where(u < up, 1.0, np.where(u < up + down, -1.0, 0.0))
        hits += pooled_over_seeds(d).significant
    assert hits / sims < 0.09, hits / sims


def test_pooled_over_seeds_bad_input_names_the_problem():
    from pipeline.core.significance import pooled_over_seeds

    with pytest.raises(ValueError, match=r"2-D \(runs, items\).*shape \(3,\)"):
        pooled_over_seeds([1, 0, 1])
    with pytest.raises(ValueError, match=r"at least one run and one item.*\(0, 0\)"):
        pooled_over_seeds(np.zeros((0, 0)))
    with pytest.raises(ValueError, match=r"\[-1, 1\].*2\.0"):
        pooled_over_seeds([[0, 2]])
    with pytest.raises(ValueError, match=r"\[-1, 1\].*nan"):
        pooled_over_seeds([[0, float("nan")]])
    with pytest.raises(ValueError, match="level must be in"):
        pooled_over_seeds([[0, 1]], level=1.5)


def test_holm_adjust_by_hand():
    from pipeline.core.significance import holm_adjust

    # sorted 0.01, 0.03, 0.04 (m = 3): 3 * 0.01 = 0.03, 2 * 0.03 = 0.06, 1 * 0.04 = 0.04 -> running
    # max 0.03, 0.06, 0.06, back in the input's order
    assert holm_adjust([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjust([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm_adjust([0.02]) == pytest.approx([0.02]) and holm_adjust([]).size == 0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm_adjust([0.1, 1.5])
