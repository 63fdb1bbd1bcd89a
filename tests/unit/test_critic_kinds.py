"""The reasoning-error kinds of the built-in benchmark, worked by hand on small problems.

Each kind's candidate edits are all listed here (worked out by hand: steps before and after, the
label); over many seeds :func:`critic_eval.items.reasoning_error` must give exactly these, every
calculation arithmetically right (``check_step`` finds nothing) and the final answer changed.
The property test over the embedded GSM8K problems is in ``test_critic_bench.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from critic_eval.items import (
    KINDS_REASONING,
    final_value,
    parse_calcs,
    reasoning_error,
    solution_steps,
    step_is_right,
    strip_annotations,
)
from pipeline.core.arithmetic import check_step

CLIPS_Q = "Ann has 48 clips and keeps half of them. Then she buys 7 more. How many clips does she have?"
CLIPS = ["Ann keeps 48/2 = <<48/2=24>>24 clips.",
         "Then she has 24+7 = <<24+7=31>>31 clips."]
APPLES_Q = "Tom buys 3 bags of 4 apples and eats 2. What is twice the number left?"
APPLES = solution_steps("Tom buys 3*4 = <<3*4=12>>12 apples.\n"
                        "He eats 2, so 12-2 = <<12-2=10>>10 are left.\n"
                        "Twice that is 10*2 = <<10*2=20>>20.\n#### 20")


def _outcomes(question: str, steps: list[str], kind: str, seeds: int = 40) -> dict:
    """{(visible steps, label): description} over ``seeds`` seeds, each item checked: every written
    calculation right (own evaluator and check_step, annotated and visible), final answer changed,
    step labels one-hot at the label."""
    out = {}
    for seed in range(seeds):
        got = reasoning_error(question, steps, kind, np.random.default_rng(seed))
        assert got is not None
        for s in got.annotated_steps:
            assert step_is_right(s)
            assert all(e.right for text in (s, strip_annotations(s)) for e in check_step(text))
        assert final_value(got.annotated_steps) != final_value(steps)
        assert got.description.startswith(f"{kind}: ")
        out[(tuple(strip_annotations(s) for s in got.annotated_steps), got.label)] = got.description
    return out


def test_wrong_operation_by_hand():
    # 48/2=24, 24+7=31. Each operator may become each other one of + - * /; the new result must be
    # positive and an integer (the old one is), and the later step is recomputed from it:
    #   step 0: 48*2=96 -> 96+7=103;  48-2=46 -> 46+7=53;  48+2=50 -> 50+7=57   (label 0)
    #   step 1: 24-7=17;  24*7=168;  24/7 is not an integer: refused              (label 1)
    got = _outcomes(CLIPS_Q, CLIPS, "wrong_operation")
    assert set(got) == {
        (("Ann keeps 48*2 = 96 clips.", "Then she has 96+7 = 103 clips."), 0),
        (("Ann keeps 48-2 = 46 clips.", "Then she has 46+7 = 53 clips."), 0),
        (("Ann keeps 48+2 = 50 clips.", "Then she has 50+7 = 57 clips."), 0),
        (("Ann keeps 48/2 = 24 clips.", "Then she has 24-7 = 17 clips."), 1),
        (("Ann keeps 48/2 = 24 clips.", "Then she has 24*7 = 168 clips."), 1),
    }
    assert got[(("Ann keeps 48*2 = 96 clips.", "Then she has 96+7 = 103 clips."), 0)] == \
        "wrong_operation: step 0: 48/2 -> 48*2 (/ -> *)"


def test_wrong_quantity_by_hand():
    # The question's numbers are 48 and 7 ("half" is a word). One operand becomes another of them:
    #   step 0: 48/2 -> 7/2 = 3.5 (not an integer: refused); 2 -> 48: 48/48 = 1, then 1+7 = 8 (label 0)
    #           2 -> 7: 48/7 refused
    #   step 1: 24 -> 48: 48+7 = 55;  24 -> 7: 7+7 = 14;  7 -> 48: 24+48 = 72            (label 1)
    got = _outcomes(CLIPS_Q, CLIPS, "wrong_quantity")
    assert set(got) == {
        (("Ann keeps 48/48 = 1 clips.", "Then she has 1+7 = 8 clips."), 0),
        (("Ann keeps 48/2 = 24 clips.", "Then she has 48+7 = 55 clips."), 1),
        (("Ann keeps 48/2 = 24 clips.", "Then she has 7+7 = 14 clips."), 1),
        (("Ann keeps 48/2 = 24 clips.", "Then she has 24+48 = 72 clips."), 1),
    }


def test_missing_step_by_hand():
    # 3*4=12, 12-2=10, 10*2=20. A one-calculation step that is not the last is removed and the
    # later steps use the quantity it started from instead of its result:
    #   drop step 1 (12-2): step 2 uses 12 for 10: 12*2 = 24; it is now step 1 and the first wrong
    #     one (label 1: the un-subtracted value is used);
    #   drop step 0 (3*4, a product: either factor): "He eats 2, so 3-2 = 1", then 1*2 = 2, or
    #     "so 4-2 = 2", then 2*2 = 4 (label 0).
    got = _outcomes(APPLES_Q, APPLES, "missing_step")
    assert set(got) == {
        (("Tom buys 3*4 = 12 apples.", "Twice that is 12*2 = 24."), 1),
        (("He eats 2, so 3-2 = 1 are left.", "Twice that is 1*2 = 2."), 0),
        (("He eats 2, so 4-2 = 2 are left.", "Twice that is 2*2 = 4."), 0),
    }
    assert got[(("Tom buys 3*4 = 12 apples.", "Twice that is 12*2 = 24."), 1)] == \
        "missing_step: step 1 (12-2=10) dropped, later steps use 12 for it (the step's first operand)"


def test_misread_relation_by_hand():
    # Percent more read as percent of: "goes up by 25%" is x*1.25; read as x*0.25:
    #   40*1.25 = 50 -> 40*0.25 = 10, then 3*50 = 150 -> 3*10 = 30 (label 0). Nothing else applies.
    q = "A shirt costs $40. Its price goes up by 25%. How much do 3 shirts cost now?"
    steps = ["The new price is 40*1.25 = $<<40*1.25=50>>50.", "Three shirts cost 3*50 = $<<3*50=150>>150."]
    assert set(_outcomes(q, steps, "misread_relation")) == {
        (("The new price is 40*0.25 = $10.", "Three shirts cost 3*10 = $30."), 0)}
    # Percent of read as percent more or less: "10% of it" is 200*10/100 = 20; read as 110% or 90%:
    #   200*110/100 = 220, 220*4 = 880;  200*90/100 = 180, 180*4 = 720 (label 0).
    q = "Sam earns $200 a week and saves 10% of it. How much does he save in 4 weeks?"
    steps = ["He saves 200*10/100 = $<<200*10/100=20>>20 a week.", "In 4 weeks he saves 20*4 = $<<20*4=80>>80."]
    assert set(_outcomes(q, steps, "misread_relation")) == {
        (("He saves 200*110/100 = $220 a week.", "In 4 weeks he saves 220*4 = $880."), 0),
        (("He saves 200*90/100 = $180 a week.", "In 4 weeks he saves 180*4 = $720."), 0)}
    # "3 times as many" read as "3 more": 5*3 = 15 -> 5+3 = 8, then 15+5 = 20 -> 8+5 = 13 (label 0).
    q = "Ben has 5 cards. Ann has 3 times as many cards as Ben. How many cards do they have together?"
    steps = ["Ann has 5*3 = <<5*3=15>>15 cards.", "Together they have 15+5 = <<15+5=20>>20 cards."]
    assert set(_outcomes(q, steps, "misread_relation")) == {
        (("Ann has 5+3 = 8 cards.", "Together they have 8+5 = 13 cards."), 0)}
    # A per-unit value used as the total: "$3 each", 4*3 = 12 kept; the next step uses 3 for the
    # pens' total: 12+5 = 17 -> 3+5 = 8 (label 1, the step that uses it).
    q = "Pens cost $3 each. Ann buys 4 pens and a $5 notebook. How much does she spend?"
    steps = ["The pens cost 4*3 = $<<4*3=12>>12.", "She spends 12+5 = $<<12+5=17>>17."]
    assert _outcomes(q, steps, "misread_relation") == {
        (("The pens cost 4*3 = $12.", "She spends 3+5 = $8."), 1):
            "misread_relation: step 1 uses 3 for the result 12 of step 0 (4*3) (per-unit 3 used as the total)"}
    # No percent, no "times as", no "more than", no per-unit value: no rule, no item.
    assert reasoning_error(CLIPS_Q, CLIPS, "misread_relation", np.random.default_rng(0)) is None


def test_refusals():
    rng = np.random.default_rng(0)
    # the answer of the last step has no later use, and a value that the question also holds would
    # make the carried replacement ambiguous: 12 is in the question, so only the last step can change
    steps = ["He has 3*4 = <<3*4=12>>12.", "Twice that is 12*2 = <<12*2=24>>24."]
    got = reasoning_error("He has 3 bags of 4 and had 12 before. What is twice that?", steps, "wrong_operation", rng)
    assert got.label == 1
    # a visible calculation that differs from its annotation is never edited (the critic would see
    # the old one): only step 1 can change here
    steps = ["Ann keeps half of 48, that is <<48/2=24>>24 clips.", "Then she has 24+7 = <<24+7=31>>31 clips."]
    for seed in range(10):
        assert reasoning_error(CLIPS_Q, steps, "wrong_operation", np.random.default_rng(seed)).label == 1
    # a result stated before its calculation would stay stale ("$8 ... because 216/27 = 8")
    steps = ["She saw 9*3 = <<9*3=27>>27 movies.", "They cost $8 each because 216/27 = <<216/27=8>>8"]
    assert reasoning_error("9 movies, each seen 3 times, cost $216. Price per ticket?", steps,
                           "missing_step", rng) is None
    with pytest.raises(ValueError, match="valid"):
        reasoning_error(CLIPS_Q, CLIPS, "carried", rng)
    assert len(KINDS_REASONING) == 4 and all(len(parse_calcs(s)) == 1 for s in CLIPS)
