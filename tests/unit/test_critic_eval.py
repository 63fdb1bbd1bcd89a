"""The critic scorer (critic_eval.scores) against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from critic_eval.scores import (
    EvalItem,
    earliest_flagged,
    markdown_table,
    predict,
    processbench_f1,
    render_report,
    score_grid,
    score_items,
    subsets,
)

RULES = ("intersection", "union", "majority", "average")


def _item(label, n_steps, critiques, tokens=(10, 20, 30, 40), step_labels=None):
    return EvalItem(label, n_steps, tuple(critiques), tuple(tokens[: len(critiques)]), step_labels)


# A: first wrong step 1 of 3; B: all right (2 steps); C: wrong at 0, every critique fails to parse;
# D: all right (3 steps), the first critique fails.
A = _item(1, 3, [(1,), (1, 2), None, (0, 1)], step_labels=(0, 1, 0))
B = _item(-1, 2, [(), (), (0,), ()], step_labels=(0, 0))
C = _item(0, 2, [None, None, None, None], step_labels=(1, 0))
D = _item(-1, 3, [None, (2,), (), ()], step_labels=(0, 0, 0))
ITEMS = [A, B, C, D]


def test_earliest_flagged_and_f1():
    assert earliest_flagged(np.array([0.0, 1.0, 1.0])) == 1
    assert earliest_flagged(np.array([0.0, 0.0])) == -1
    assert earliest_flagged(np.array([0.25, 0.5])) == 1  # >= 0.5 is flagged
    assert processbench_f1(0.5, 1.0) == pytest.approx(2 * 0.5 * 1.0 / (0.5 + 1.0))
    assert processbench_f1(0.0, 0.0) == 0.0
    assert math.isnan(processbench_f1(math.nan, 1.0))


def test_n1_every_rule_reads_the_single_critique():
    for rule in RULES:
        s = score_items(ITEMS, 1, rule)
        # A: (1,) -> 1 = label (hit); C: no valid critique -> nothing flagged -> miss.
        assert s.acc_erroneous == 1 / 2
        # B: () -> nothing (hit); D: parse failure -> no valid -> nothing flagged (hit).
        assert s.acc_correct == 2 / 2
        assert s.f1 == pytest.approx(2 * (1 / 2) * 1 / (1 / 2 + 1))
        assert s.parse_failure_rate == 2 / 4  # C and D's first critiques
        assert s.no_valid_rate == 2 / 4
        assert s.critic_tokens_per_item == 10
        assert (s.n_items, s.n_erroneous, s.n_correct) == (4, 2, 2)
        # AUROC of the mean step weight against "has an error": A 1/3, C 0 (wrong); B 0, D 0 (right):
        # (A,B) 1, (A,D) 1, (C,B) tie 1/2, (C,D) tie 1/2 -> 3 / 4
        assert s.auroc == pytest.approx(3 / 4)


def test_n2_ties_separate_average_from_majority_at_the_step_level():
    # A: (1,), (1,2): step 1 flagged 2/2, step 2 1/2. D: None, (2,): one valid critique flags step 2.
    for rule in RULES:
        s = score_items(ITEMS, 2, rule)
        assert s.acc_erroneous == 1 / 2  # A hit (earliest 1), C miss
        assert s.acc_correct == 1 / 2  # B hit, D flags step 2
        assert s.f1 == pytest.approx(0.5)
        assert s.label_flagged == 1 / 2
        assert s.parse_failure_rate == (0 + 0 + 2 + 1) / 8
        assert s.critic_tokens_per_item == 10 + 20
    # average at N=2: A [0, 1, 1/2] -> 1/2, C 0; B 0, D [0, 0, 1] -> 1/3: (A,B) 1, (A,D) 1, (C,B) 1/2, (C,D) 0
    assert score_items(ITEMS, 2, "average").auroc == pytest.approx(2.5 / 4)
    # steps flagged: A {1} (+{2} when a tie counts), D {2}; wrong steps: A1, C0.
    for rule, flagged_a in (("intersection", 1), ("majority", 1), ("union", 2), ("average", 2)):
        s = score_items(ITEMS, 2, rule)
        tp, fp, fn = 1, (flagged_a - 1) + 1, 1
        assert s.step_precision == pytest.approx(tp / (tp + fp)), rule
        assert s.step_recall == pytest.approx(tp / (tp + fn)), rule
        assert s.flag_rate == pytest.approx((flagged_a + 1) / (3 + 2 + 2 + 3)), rule


def test_n4_rules_differ():
    # A: 3 valid, flags s0 1/3, s1 3/3, s2 1/3. B: 4 valid, s0 1/4. D: 3 valid, s2 1/3. C: none valid.
    expected = {  # (acc_erroneous, acc_correct, F1 = their harmonic mean)
        "intersection": (1 / 2, 2 / 2, 2 / 3),  # A -> 1, B/D nothing; 2 * 0.5 * 1 / 1.5
        "union": (0 / 2, 0 / 2, 0.0),  # A -> 0, B -> 0, D -> 2
        "majority": (1 / 2, 2 / 2, 2 / 3),  # only A's s1 is above half
        "average": (1 / 2, 2 / 2, 2 / 3),  # 1/3 and 1/4 are below 0.5
    }
    for rule, (acc_err, acc_ok, f1) in expected.items():
        s = score_items(ITEMS, 4, rule)
        assert (s.acc_erroneous, s.acc_correct) == (acc_err, acc_ok), rule
        assert s.f1 == pytest.approx(f1) == pytest.approx(processbench_f1(acc_err, acc_ok))
        assert s.parse_failure_rate == (1 + 0 + 4 + 1) / 16
        assert s.no_valid_rate == 1 / 4
        assert s.critic_tokens_per_item == 100


def test_a_critic_that_flags_everything():
    items = [_item(lbl, 3, [(0, 1, 2)] * 2, step_labels=tuple(int(i == lbl) for i in range(3)))
             for lbl in (0, 1, 2, -1, -1)]
    for rule in RULES:
        s = score_items(items, 2, rule)
        assert s.acc_erroneous == 1 / 3  # only the item whose first wrong step is 0
        assert s.acc_correct == 0.0
        assert s.f1 == 0.0
        assert s.label_flagged == 1.0
        assert s.flag_rate == 1.0
        assert s.step_recall == 1.0
        assert s.step_precision == pytest.approx(3 / 15)


def test_a_critic_that_flags_nothing():
    items = [_item(lbl, 3, [()] * 2, step_labels=tuple(int(i == lbl) for i in range(3)))
             for lbl in (0, 1, 2, -1, -1)]
    for rule in RULES:
        s = score_items(items, 2, rule)
        assert (s.acc_erroneous, s.acc_correct, s.f1) == (0.0, 1.0, 0.0)
        assert s.label_flagged == 0.0 and s.flag_rate == 0.0
        assert math.isnan(s.step_precision) and s.step_recall == 0.0
        assert s.parse_failure_rate == 0.0


def test_all_correct_items_only_and_all_parse_failures():
    ok = [_item(-1, 2, [(), ()]), _item(-1, 2, [(1,), ()])]
    s = score_items(ok, 2, "intersection")
    assert math.isnan(s.acc_erroneous) and math.isnan(s.f1) and math.isnan(s.label_flagged)
    assert s.acc_correct == 1.0 and s.n_erroneous == 0
    assert score_items(ok, 2, "union").acc_correct == 1 / 2
    assert math.isnan(s.step_precision) and math.isnan(s.step_recall)  # no per-step labels
    failed = [_item(-1, 2, [None, None]), _item(1, 2, [None, None])]
    f = score_items(failed, 2, "union")
    assert f.parse_failure_rate == 1.0 and f.no_valid_rate == 1.0
    assert (f.acc_correct, f.acc_erroneous) == (1.0, 0.0)  # no valid critique: nothing flagged


def test_seconds_and_too_few_critiques():
    s = score_items([A], 2, "union", seconds_per_token=0.5)
    assert s.seconds_per_item == (10 + 20) * 0.5
    assert math.isnan(score_items([A], 2, "union").seconds_per_item)
    with pytest.raises(ValueError, match="N=5"):
        score_items([A], 5, "union")
    with pytest.raises(ValueError, match="unknown voting rule"):
        score_items([A], 1, "median")


@pytest.mark.parametrize("seed", range(5))
def test_rules_are_ordered_on_random_critics(seed):
    """intersection flags a subset of majority's steps, majority a subset of union's; at N=1 all
    hard rules agree; the grid is rules x N."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(30):
        s = int(rng.integers(1, 6))
        crit = [None if rng.random() < 0.2 else tuple(sorted(set(rng.integers(0, s, rng.integers(0, 3)).tolist())))
                for _ in range(4)]
        items.append(_item(int(rng.integers(-1, s)), s, crit))
    for item in items:
        for n in (1, 2, 4):
            w = {r: predict(item, n, r).weights >= 0.5 for r in RULES}
            assert np.all(w["intersection"] <= w["majority"]) and np.all(w["majority"] <= w["union"])
            assert np.all(w["majority"] <= w["average"])
    grid = score_grid(items, [1, 2, 4])
    assert [(g.rule, g.n) for g in grid] == [(r, n) for r in RULES for n in (1, 2, 4)]
    at1 = {g.rule: g for g in grid if g.n == 1}
    assert at1["intersection"].f1 == at1["union"].f1 == at1["majority"].f1 == at1["average"].f1
    by = {(g.rule, g.n): g for g in grid}
    for n in (1, 2, 4):
        assert by[("union", n)].flag_rate >= by[("majority", n)].flag_rate >= by[("intersection", n)].flag_rate
        assert by[("union", n)].acc_correct <= by[("intersection", n)].acc_correct


def test_subsets():
    kinds = ["original", "carried", "adv_verdict", "original", "as_was", "adv_ignore"]
    labels = [-1, 1, 1, -1, 0, 0]
    got = subsets(kinds, labels)
    assert got["all"] == list(range(6))
    assert got["plain"] == [0, 1, 3, 4]
    assert got["adversarial"] == [0, 2, 3, 5]  # adversarial items + the plain set's all-right items
    assert got["adv_verdict"] == [2] and got["carried"] == [1]
    assert subsets(["external"] * 3, [-1, 0, 1]) == {"all": [0, 1, 2]}


def test_report_renders_every_section():
    rows = []
    for setup in ("a+gold", "a+nogold"):
        for subset, items in (("plain", ITEMS), ("adversarial", [A, B]), ("adv_verdict", [A])):
            rows += [{"setup": setup, "subset": subset, **s.as_dict()} for s in score_grid(items, [1, 2])]
    meta = {"name": "t", "benchmark": "hand", "kinds": {"original": 2, "carried": 1, "adv_verdict": 1},
            "template_version": "v", "n_values": [1, 2], "plot": "f1_vs_n.png",
            "setups": [{"setup": s, "model": "m", "include_gold_answer": s.endswith("+gold"), "engine": "vllm",
                        "sampling": "T=0.7", "critic_seconds": 1.0, "tokens_per_s": None} for s in ("a+gold", "a+nogold")]}
    text = render_report(meta, rows)
    assert "## ProcessBench F1 by N (subset `plain`: 4 items, 2 erroneous, 2 all right)" in text
    assert "![F1 against N" in text
    assert "| a+nogold | average | 0.667 | 0.500 |" in text  # F1 at N=1 and N=2, as computed above
    assert "flagged: adv_verdict" in text and "Robustness" in text
    assert markdown_table(["x"], [[math.nan], [None], [1.23456]]).splitlines()[2:] == ["| – |", "| – |", "| 1.235 |"]


def test_verdict_distribution_counts_statuses_and_the_most_common_lists():
    from critic_eval.stages import verdict_distribution

    crit = [{"parse_status": "complete", "wrong_steps": [1]}, {"parse_status": "incomplete", "wrong_steps": [1]},
            {"parse_status": "complete", "wrong_steps": [1]}, {"parse_status": "complete", "wrong_steps": [0, 2]},
            {"parse_status": "complete", "wrong_steps": []}, {"parse_status": "no_verdict", "wrong_steps": None}]
    d = verdict_distribution(crit)
    assert d["statuses"] == {"complete": 4, "incomplete": 1, "no_verdict": 1}
    assert d["non_empty_lists"] == 4  # [] is an all-correct verdict, not a list of wrong steps
    assert d["top_lists"] == [["[1]", 3, 0.75], ["[0, 2]", 1, 0.25]]
    meta = {"name": "t", "benchmark": "hand", "kinds": {"original": 2}, "n_values": [1], "plot": "p.png",
            "setups": [{"setup": "a+gold", "model": "m", "include_gold_answer": True, "engine": "vllm",
                        "sampling": "T=0.7", "critic_seconds": 1.0, "tokens_per_s": None}],
            "verdicts": {"a+gold": d}}
    rows = [{"setup": "a+gold", "subset": "plain", **x.as_dict()} for x in score_grid(ITEMS, [1])]
    text = render_report(meta, rows)
    assert "| a+gold | complete 4, incomplete 1, no_verdict 1 | 4 | [1] (3, 75 %); [0, 2] (1, 25 %) |" in text


# ------------------------------------------------------------------------ checks and unions of sources
def _check(label, n_steps, wrong, scores=None, n=4, step_labels=None):
    """A check's single verdict (``wrong``), repeated for every N as critic_eval.stages gives it."""
    return EvalItem(label, n_steps, (tuple(wrong),) * n, (0,) * n, step_labels, scores)


def test_a_readout_weighs_steps_by_p_wrong_under_average_and_by_the_threshold_otherwise():
    # q = (0.2, 0.7, 0.55): average keeps q; the hard rules flag q > 0.6 -> step 1 only.
    it = _check(1, 3, [1], scores=(0.2, 0.7, 0.55))
    avg = predict(it, 4, "average", logprob_threshold=0.6)
    assert np.allclose(avg.weights, [0.2, 0.7, 0.55]) and avg.earliest == 1
    for rule in ("intersection", "union", "majority"):
        p = predict(it, 2, rule, logprob_threshold=0.6)
        assert p.weights.tolist() == [0.0, 1.0, 0.0] and p.earliest == 1
    # at the default 0.5 the hard rules flag steps 1 and 2; the same N=1 as N=4 (one verdict)
    assert predict(it, 1, "majority").weights.tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown voting rule"):
        predict(it, 1, "mode")


def test_a_union_takes_the_largest_weight_of_its_members():
    # the same solution (wrong at step 2 of 3) under a critic and a check:
    llm = _item(2, 3, [(0,), (0, 2), (), None])  # majority of 3 valid at N=4: step 0 (2 of 3), step 2 (1 of 3)
    arith = _check(2, 3, [2])
    u = predict((llm, arith), 4, "majority")
    assert u.weights.tolist() == [1.0, 0.0, 1.0] and u.earliest == 0  # the critic's step 0 comes first
    assert u.n_valid == 3 + 4
    avg = predict((llm, arith), 4, "average")
    assert np.allclose(avg.weights, [2 / 3, 0.0, 1.0])
    # scored: the union finds step 0 (wrong: label 2), the check alone finds step 2
    s_u = score_items([(llm, arith)], 4, "majority")
    s_a = score_items([arith], 4, "majority")
    assert (s_u.acc_erroneous, s_a.acc_erroneous) == (0.0, 1.0)
    assert s_u.parse_failure_rate == 1 / 8  # one failed critique among 4 + 4 verdicts
    assert s_u.critic_tokens_per_item == 10 + 20 + 30 + 40


def test_seconds_per_item_of_a_check_is_given_directly():
    s = score_items([_check(-1, 2, [])], 1, "union", seconds_per_token=0.5, seconds_per_item=1.25)
    assert s.seconds_per_item == 1.25 and s.critic_tokens_per_item == 0


def test_each_kind_is_scored_with_the_right_twins_of_its_problems():
    kinds = ["original", "carried", "wrong_operation", "original", "as_was", "wrong_operation", "adv_verdict"]
    labels = [-1, 1, 0, -1, 2, 1, 1]
    sources = ["p0", "p0", "p0", "p1", "p1", "p1", "p0"]
    got = subsets(kinds, labels, sources)
    assert got["carried"] == [0, 1]  # p0's error and p0's original
    assert got["as_was"] == [3, 4]
    assert got["wrong_operation"] == [0, 2, 3, 5]  # both problems' errors and both originals
    assert got["adv_verdict"] == [0, 6]
    assert got["original"] == [0, 3]  # all right: the kind alone
    assert got["plain"] == [0, 1, 2, 3, 4, 5] and got["adversarial"] == [0, 3, 6]


def test_robustness_compares_the_copies_with_their_plain_twins():
    """The adversarial copies are made from the calculation errors (`carried`, `as_was`), so the
    fair baseline is those items, not every plain error: flagged 1 of 2 `carried` and 0 of 2
    `as_was` gives 1/4 = 0.25 for the twins, beside the plain set's 0.1 (1 of 10, reasoning errors
    included) and the copies' 0.0. F1 likewise: the twins' earliest-step accuracy (1 of 2 and 1 of
    2 -> 0.5) with the adversarial subset's all-right accuracy 0.75 gives 2 x 0.5 x 0.75 / 1.25 = 0.6,
    beside the copies' F1 (0.0 found: 0.0) on the same all-right items; the plain F1 (0.4) is over
    every kind of error."""
    from critic_eval.scores import _robustness_section

    def row(subset, flagged, n_err, acc_err, acc_ok, f1, n_ok=2):
        return {"setup": "a", "subset": subset, "rule": "majority", "n": 4, "n_items": n_err + n_ok,
                "n_erroneous": n_err, "n_correct": n_ok, "label_flagged": flagged, "acc_erroneous": acc_err,
                "acc_correct": acc_ok, "f1": f1}

    scores = [row("plain", 0.1, 10, 0.3, 0.75, 0.4), row("carried", 0.5, 2, 0.5, 1.0, 0.667),
              row("as_was", 0.0, 2, 0.5, 0.5, 0.5), row("adversarial", 0.0, 4, 0.0, 0.75, 0.0),
              row("adv_verdict", 0.0, 4, 0.0, 0.75, 0.0)]
    by = {(r["setup"], r["subset"], r["rule"], r["n"]): r for r in scores}
    meta = {"kinds": {"original": 4, "carried": 2, "as_was": 2, "adv_verdict": 4}}
    text = "\n".join(_robustness_section(meta, scores, by, ["a"], ["majority"], 4))
    assert ("| flagged: plain | flagged: their plain twins | flagged: adversarial | flagged: adv_verdict | "
            "F1: plain | F1: their plain twins | F1: adversarial |") in text
    assert "| a | majority | 0.100 | 0.250 | 0.000 | 0.000 | 0.400 | 0.600 | 0.000 |" in text
    assert "(`carried`, `as_was`: the copies' twins" in text
