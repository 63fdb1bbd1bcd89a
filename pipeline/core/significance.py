"""Is a change in held-out accuracy between two rounds more than noise? Paired tests on the same items.

Two evaluations of the same problems (round k-1 and round k, same seeded subset) give two 0/1
vectors ``a`` and ``b``. Their accuracy difference is judged *paired*, item by item, which is far
more sensitive than comparing two independent proportions: only the discordant items (right in one
round, wrong in the other) carry information.

- :func:`mcnemar_exact`: McNemar's exact test (two-sided binomial test on the discordant pairs:
  under "no change" each discordant item is equally likely to go either way).
- :func:`paired_bootstrap`: percentile interval of ``mean(b) - mean(a)`` from resampling items
  with replacement (Efron & Tibshirani 1993, ch. 13).
- :func:`compare`: both, and the verdict the report prints: a change is *significant* when the
  bootstrap interval excludes 0 and McNemar's p < alpha; otherwise "within noise".
- :func:`compare_rates`: the same for per-item *rates* (right samples / k samples at T = 1): a
  bootstrap interval and :func:`sign_flip_p`, the paired permutation test (McNemar's for 0/1).
- :func:`holm_adjust`: Holm's step-down adjustment of a family of p-values (a report's many
  round-over-round rows, each tested at alpha, would call some change significant by chance).
- :func:`pooled_over_seeds`: the mean change over several runs (seeds) evaluated on the same items,
  with an interval that counts both the seed-to-seed and the item-to-item variation (the t interval
  of the two-way crossed random-effects model, from the seeds x items table's mean squares).

Sizes: with a discordance rate d (share of items that flip between the two rounds) the standard
error of the difference is about ``sqrt(d / n)``. Greedy decoding of two checkpoints one bf16 step
apart rewrote 10-11 of 16 answers' texts but flipped only 1-2 answers (d of 0.06-0.125;
docs/data/noise-floor-round0-default-avx512bf16.json), so a change must exceed about 12-18 points
to be seen at 16 items; at n = 500 and d ~ 0.1 the 95 % interval is about +-2.8 points.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


def _as_bool(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector of per-item outcomes, got shape {arr.shape}")
    if arr.dtype != bool:
        if not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold 0/1 or booleans, got values {np.unique(arr)[:5].tolist()}")
        arr = arr.astype(bool)
    return arr


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = _as_bool(a, "a"), _as_bool(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes need the same items: a has {a.size}, b has {b.size}")
    return a, b


def mcnemar_exact(a, b) -> float:
    """Two-sided exact McNemar p-value for paired 0/1 outcomes ``a`` (before) and ``b`` (after).

    With n01 items wrong-then-right and n10 right-then-wrong, p = min(1, 2 * P(X <= min(n01, n10)))
    for X ~ Binomial(n01 + n10, 1/2). p = 1 when no item changed (McNemar 1947, the exact binomial
    form).

    Args:
        a: (n,) bool or 0/1, the outcomes before.
        b: (n,) bool or 0/1, the outcomes after, of the same items in the same order.
    Raises:
        ValueError: different lengths, not 1-D, or values other than 0/1.
    """
    a, b = _pair(a, b)
    n01 = int((~a & b).sum())
    n10 = int((a & ~b).sum())
    n = n01 + n10
    if n == 0:
        return 1.0
    k = min(n01, n10)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # ints: exact above 1023 items too
    return min(1.0, 2.0 * tail)


def paired_bootstrap(a, b, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``mean(b) - mean(a)`` and its percentile bootstrap interval, resampling items (pairs kept together;
    Efron & Tibshirani 1993, ch. 13).

    Args:
        a: (n,) bool or 0/1, the outcomes before (n >= 1).
        b: (n,) bool or 0/1, the outcomes after, of the same items in the same order.
        n_boot: bootstrap resamples.
        level: coverage of the interval.
        seed: seed of the resampling (the interval is reproducible).
    Returns:
        ``(diff, lo, hi)`` in accuracy units (0.05 = 5 points).
    Raises:
        ValueError: see :func:`mcnemar_exact`; empty vectors; level outside (0, 1).
    """
    a, b = _pair(a, b)
    if a.size == 0:
        raise ValueError("paired_bootstrap needs at least one item")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = b.astype(np.float64) - a.astype(np.float64)  # (n,) per-item change in {-1, 0, 1}
    return _bootstrap_mean(d, n_boot, level, seed)


def _bootstrap_mean(d: np.ndarray, n_boot: int, level: float, seed: int) -> tuple[float, float, float]:
    """``(mean(d), lo, hi)``: percentile interval of the mean of the (n,) per-item changes ``d``."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_boot, d.size))
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(d.mean()), float(lo), float(hi)


@dataclass(frozen=True)
class PairedChange:
    """The accuracy change between two evaluations of the same ``n`` items.

    Attributes:
        n: items compared. acc_a, acc_b: accuracies (0..1). diff: acc_b - acc_a.
        lo, hi: bootstrap interval of diff. p_mcnemar: exact McNemar p-value.
        n01, n10: items wrong->right and right->wrong. significant: interval excludes 0 and p < alpha.
    """

    n: int
    acc_a: float
    acc_b: float
    diff: float
    lo: float
    hi: float
    p_mcnemar: float
    n01: int
    n10: int
    significant: bool

    def as_dict(self) -> dict:
        return asdict(self)


def compare(a, b, alpha: float = 0.05, n_boot: int = 10_000, seed: int = 0) -> PairedChange:
    """:func:`paired_bootstrap` at level 1 - alpha and :func:`mcnemar_exact`, with the verdict.

    Raises:
        ValueError: see :func:`paired_bootstrap`.
    """
    a, b = _pair(a, b)
    diff, lo, hi = paired_bootstrap(a, b, n_boot=n_boot, level=1 - alpha, seed=seed)
    p = mcnemar_exact(a, b)
    return PairedChange(n=int(a.size), acc_a=float(a.mean()), acc_b=float(b.mean()), diff=diff, lo=lo, hi=hi,
                        p_mcnemar=p, n01=int((~a & b).sum()), n10=int((a & ~b).sum()),
                        significant=bool((lo > 0 or hi < 0) and p < alpha))


# ------------------------------------------------------------------ per-item rates (k samples each)
def _rates(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector of per-item rates, got shape {arr.shape}")
    bad = ~np.isfinite(arr) | (arr < 0) | (arr > 1)
    if bad.any():
        raise ValueError(f"{name} must hold rates in [0, 1] (right samples / samples per item), "
                         f"got {arr[bad][:5].tolist()}")
    return arr


def sign_flip_p(d, n_perm: int = 10_000, seed: int = 0, exact_up_to: int = 16) -> float:
    """Two-sided paired permutation p-value of ``mean(d) == 0`` by flipping the sign of each item's change.

    Under "no change" the two evaluations of an item are exchangeable, so each nonzero change is
    equally likely to have either sign (Fisher's paired randomization test; for 0/1 items it is
    McNemar's test). Items with a zero change do not affect the p-value. Exact enumeration over the
    ``2**m`` sign patterns when the m nonzero changes number at most ``exact_up_to``, else ``n_perm``
    seeded random patterns with the observed one counted: ``p = (1 + #{|mean*| >= |mean|}) / (n_perm + 1)``.

    Args:
        d: (n,) per-item changes (any real numbers).
    Returns:
        p in (0, 1]; 1.0 when every change is 0.
    Raises:
        ValueError: ``d`` not 1-D.
    """
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 1:
        raise ValueError(f"d must be a 1-D vector of per-item changes, got shape {d.shape}")
    nz = d[d != 0]
    if nz.size == 0:
        return 1.0
    obs = abs(nz.sum()) - 1e-12 * max(1.0, abs(nz).sum())  # ties count as extreme
    if nz.size <= exact_up_to:
        signs = 1 - 2 * ((np.arange(2**nz.size)[:, None] >> np.arange(nz.size)) & 1)  # (2^m, m) of +-1
        return float(np.mean(np.abs(signs @ nz) >= obs))
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(n_perm, nz.size))
    return float((1 + np.sum(np.abs(signs @ nz) >= obs)) / (n_perm + 1))


@dataclass(frozen=True)
class PairedRateChange:
    """The change in a per-item rate (e.g. sampled accuracy: right samples / k) between two
    evaluations of the same ``n`` items.

    Attributes:
        n: items compared. rate_a, rate_b: mean rates (0..1). diff: rate_b - rate_a.
        lo, hi: bootstrap interval of diff. p_sign_flip: paired permutation p (:func:`sign_flip_p`).
        n_up, n_down: items whose rate rose / fell. significant: interval excludes 0 and p < alpha.
    """

    n: int
    rate_a: float
    rate_b: float
    diff: float
    lo: float
    hi: float
    p_sign_flip: float
    n_up: int
    n_down: int
    significant: bool

    def as_dict(self) -> dict:
        return asdict(self)


def compare_rates(a, b, alpha: float = 0.05, n_boot: int = 10_000, seed: int = 0) -> PairedRateChange:
    """Paired change of per-item rates ``a`` -> ``b`` (each in [0, 1], e.g. c/k of k samples at
    T = 1): the percentile bootstrap interval of the mean change (items resampled, pairs kept) and
    the sign-flip permutation p-value, with the same verdict rule as :func:`compare`.

    Averaging k samples per item lowers the per-item variance, so a change of the policy's sampling
    distribution shows at fewer items than a change of its greedy answers.

    Raises:
        ValueError: not 1-D, different lengths, empty, or a value outside [0, 1] (named).
    """
    a, b = _rates(a, "a"), _rates(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired rates need the same items: a has {a.size}, b has {b.size}")
    if a.size == 0:
        raise ValueError("compare_rates needs at least one item")
    d = b - a
    diff, lo, hi = _bootstrap_mean(d, n_boot, 1 - alpha, seed)
    p = sign_flip_p(d, seed=seed)
    return PairedRateChange(n=int(a.size), rate_a=float(a.mean()), rate_b=float(b.mean()), diff=diff, lo=lo, hi=hi,
                            p_sign_flip=p, n_up=int((d > 0).sum()), n_down=int((d < 0).sum()),
                            significant=bool((lo > 0 or hi < 0) and p < alpha))


def holm_adjust(p_values) -> np.ndarray:
    """Holm's step-down adjusted p-values of a family of m tests (Holm 1979, "A simple sequentially
    rejective multiple test procedure", Scand. J. Statist. 6(2)).

    With the p-values sorted ascending, ``p_(1) <= ... <= p_(m)``, the adjusted value of the j-th is
    ``max_{i <= j} min(1, (m - i + 1) p_(i))``; rejecting where it is below alpha keeps the chance of
    any false rejection in the family at most alpha, whatever the tests' dependence.

    Args:
        p_values: (m,) p-values in [0, 1], in any order.
    Returns:
        (m,) adjusted p-values in the input's order.
    Raises:
        ValueError: not 1-D, or a value outside [0, 1] or not finite.
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"p_values must be a 1-D vector, got shape {p.shape}")
    if p.size and (not np.isfinite(p).all() or (p < 0).any() or (p > 1).any()):
        raise ValueError(f"p_values must lie in [0, 1], got {p[~(np.isfinite(p) & (p >= 0) & (p <= 1))][:5].tolist()}")
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.maximum.accumulate(stepped)
    return out


# ------------------------------------------------------------------ several seeds on the same items
@dataclass(frozen=True)
class PooledChange:
    """The mean per-item change over ``seeds`` runs evaluated on the same ``n`` items.

    Attributes:
        seeds: runs pooled.
        n: items per run.
        diff: mean change over runs and items (accuracy units).
        per_seed: each run's mean change.
        lo: lower end of the interval of diff (:func:`pooled_over_seeds`: seeds and items both
            random for two or more runs, the items alone for one run).
        hi: its upper end.
        significant: the interval excludes 0.
    """

    seeds: int
    n: int
    diff: float
    per_seed: tuple[float, ...]
    lo: float
    hi: float
    significant: bool

    def as_dict(self) -> dict:
        return asdict(self)


def seeds_by_items_variance(d: np.ndarray) -> float:
    """Estimated variance of the grand mean of an (S, n) table with seeds and items as crossed
    random factors, one value per cell: ``d[s, i] = mu + a_s + b_i + e_si``.

    The expected mean squares are ``E[MS_seed] = s2_e + n s2_a``, ``E[MS_item] = s2_e + S s2_b``,
    ``E[MS_res] = s2_e`` and ``Var(mean) = s2_a / S + s2_b / n + s2_e / (S n)``, so
    ``(MS_seed + MS_item - MS_res) / (S n)`` estimates it without bias (Searle, Casella &
    McCulloch 1992, *Variance Components*, the two-way crossed classification without
    interaction). Each variance component is taken at 0 when its estimate is negative, the seed's
    ``(MS_seed - MS_res) / n`` as the item's ``(MS_item - MS_res) / S``:
    ``V = (max(MS_seed, MS_res) + max(MS_item - MS_res, 0)) / (S n)``, never below the residual
    noise's ``MS_res / (S n)`` (runs whose means agree by chance would otherwise give an interval
    narrower than the items' noise, or of zero width). With one item the table is the seed means:
    ``MS_seed / S``.

    Args:
        d: (S, n) values, S >= 2 runs, n >= 1 items.
    Returns:
        the variance (accuracy units squared), >= 0.
    Raises:
        ValueError: fewer than 2 runs (the seed component cannot be estimated).
    """
    S, n = d.shape
    if S < 2:
        raise ValueError(f"the seed component needs at least 2 runs, got {S}")
    m = d.mean()
    rows, cols = d.mean(axis=1), d.mean(axis=0)
    ms_seed = n * float(((rows - m) ** 2).sum()) / (S - 1)
    if n == 1:
        return ms_seed / S
    ms_item = S * float(((cols - m) ** 2).sum()) / (n - 1)
    ms_res = float(((d - rows[:, None] - cols[None, :] + m) ** 2).sum()) / ((S - 1) * (n - 1))
    return (max(ms_seed, ms_res) + max(ms_item - ms_res, 0.0)) / (S * n)


def pooled_over_seeds(changes, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> PooledChange:
    """Mean change over several runs on the same items, with an interval for seeds and items.

    ``changes[s, i]`` is run s's change on item i (e.g. its accuracy on item i at round K minus the
    starting policy's; 0/1 outcomes give values in {-1, 0, 1}, per-item rates any value in [-1, 1]).
    Seeds and items are two crossed random factors: a different seed would have trained another
    policy, a different draw of items would have measured it on other problems.

    With S >= 2 runs the interval is ``diff +- t(S - 1) * sqrt(V)``, V the variance of the grand
    mean estimated from the table's mean squares (:func:`seeds_by_items_variance`) and t Student's
    quantile on S - 1 degrees of freedom, those of the seed mean square; clipped to [-1, 1]. Two or
    three seeds make it wide (t is 12.7 at S = 2, 4.3 at S = 3) even where the runs agree: with one
    or two degrees of freedom, runs that agree by chance say little about the next seed. That is
    the price of a level that holds: in simulated tables of 200 items with no true change it
    excluded 0 in at most about 5 % of cases (near 0 where the runs agree, so it is conservative
    there); Satterthwaite's degrees of freedom (larger where the runs agree) in 7-12 % at S = 2
    where runs differ by 3-10 points, and the crossed bootstrap of seeds and items (Owen 2007) in
    9-23 % where they differ by 5-10 (``tests/unit/test_significance.py`` checks the level).

    With one run the interval is the percentile interval of the paired item bootstrap (``n_boot``
    replicates, ``seed``): it holds the items' noise only, not the seed's.

    Args:
        changes: (S, n) per-run, per-item changes, S >= 1 runs on the same n >= 1 items in the same order.
        n_boot: bootstrap replicates (one run). level: coverage of the interval. seed: seed of the resampling.
    Returns:
        :class:`PooledChange` (``diff``, ``lo``, ``hi`` in accuracy units: 0.05 = 5 points).
    Raises:
        ValueError: ``changes`` not 2-D, empty, not finite, or a value outside [-1, 1]; level outside (0, 1).
    """
    d = np.asarray(changes, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"changes must be a 2-D (runs, items) array of per-item changes, got shape {d.shape}")
    if d.size == 0:
        raise ValueError(f"changes needs at least one run and one item, got shape {d.shape}")
    bad = ~np.isfinite(d) | (np.abs(d) > 1)
    if bad.any():
        raise ValueError(f"changes must hold per-item changes in [-1, 1], got {d[bad][:5].tolist()}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    S, n = d.shape
    mean = float(d.mean())
    if S == 1:
        rng = np.random.default_rng(seed)  # the crossed bootstrap's arithmetic, which one run reduces to
        w_runs = rng.multinomial(S, np.full(S, 1.0 / S), size=n_boot).astype(np.float64)  # (B, 1): all 1
        w_items = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)  # (B, n)
        means = np.einsum("bs,si,bi->b", w_runs, d, w_items) / (S * n)  # (B,) the resampled items' mean
        lo, hi = (float(x) for x in np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2]))
    else:
        from scipy.stats import t as student_t

        half = float(student_t.ppf(1 - (1 - level) / 2, S - 1)) * math.sqrt(seeds_by_items_variance(d))
        lo, hi = max(-1.0, mean - half), min(1.0, mean + half)
    return PooledChange(seeds=S, n=n, diff=mean, per_seed=tuple(float(x) for x in d.mean(axis=1)),
                        lo=lo, hi=hi, significant=bool(lo > 0 or hi < 0))
