"""The built-in step-error benchmark's building blocks, by hand: exact arithmetic, number formats, one
corrupted step, adversarial kinds, ProcessBench rows. The labels of the whole benchmark built from
GSM8K are checked in tests/stages/test_critic_bench_gsm8k.py (it needs the embedded GSM8K set)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from critic_eval.items import (
    KINDS_ADVERSARIAL,
    adversarial_steps,
    build_benchmark,
    calc_is_right,
    corrupt_steps,
    format_number,
    parse_calcs,
    parse_number,
    processbench_rows,
    safe_eval,
    solution_steps,
    step_is_right,
    strip_annotations,
)


def test_safe_eval_is_exact_and_refuses_anything_but_arithmetic():
    assert safe_eval("16-3-4") == 9
    assert safe_eval("80000*1.5") == 120000
    assert safe_eval("2/3*30") == 20  # exact: no float rounding
    assert safe_eval("(1+2)*-3") == -9
    assert safe_eval(".25*4") == 1
    for bad, why in (("__import__('os').system('true')", "unsupported Call"), ("2**3", "unsupported BinOp"),
                     ("5%2", "unsupported BinOp"), ("a+1", "unsupported Name"), ("1,000", "unsupported Tuple"),
                     ("abs(-1)", "unsupported Call"), ("[1]", "unsupported List"), ("", "not an arithmetic expression")):
        with pytest.raises(ValueError, match=why):
            safe_eval(bad)
    with pytest.raises(ValueError, match="division by zero"):
        safe_eval("1/(2-2)")


def test_numbers_and_rounding():
    assert parse_number("130,000") == 130000 and parse_number(".5") == Fraction(1, 2) and parse_number("-3") == -3
    with pytest.raises(ValueError):
        parse_number("1,00")
    assert calc_is_right("10/3", "3.33") and calc_is_right("2+2", "4") and not calc_is_right("2+2", "5")
    assert not calc_is_right("10/3", "3.4")
    assert format_number(Fraction(130000), commas=True) == "130,000"
    assert format_number(Fraction(3, 2)) == "1.5" and format_number(Fraction(1, 3)) == "0.33"
    assert format_number(Fraction(-87)) == "-87"


SOLUTION = ("Tom buys 3*4 = <<3*4=12>>12 apples.\n"
            "He eats 2, so 12-2 = <<12-2=10>>10 are left.\n"
            "Twice that is 10*2 = <<10*2=20>>20.\n#### 20")
QUESTION = "Tom buys 3 bags of 4 apples and eats 2. What is twice the number left?"


def test_corrupting_one_step_by_hand():
    steps = solution_steps(SOLUTION)
    assert len(steps) == 3 and all(step_is_right(s) for s in steps)
    assert strip_annotations(steps[0]) == "Tom buys 3*4 = 12 apples."
    calc = parse_calcs(steps[1])[0]
    assert (calc.expr, calc.result, steps[1][calc.shown[0]:calc.shown[1]]) == ("12-2", "10", "10")
    for seed in range(10):
        as_was = corrupt_steps(QUESTION, steps, 1, np.random.default_rng(seed), carried=False)
        carried = corrupt_steps(QUESTION, steps, 1, np.random.default_rng(seed), carried=True)
        for bad in (as_was, carried):
            assert bad.label == 1 and bad.annotated_steps[0] == steps[0]
            assert not step_is_right(bad.annotated_steps[1])
            new = parse_calcs(bad.annotated_steps[1])[0]
            assert new.expr == "12-2" and new.result != "10"
            assert strip_annotations(bad.annotated_steps[1]) == f"He eats 2, so 12-2 = {new.result} are left."
        assert as_was.annotated_steps[2] == steps[2]
        wrong = parse_number(parse_calcs(carried.annotated_steps[1])[0].result)
        assert strip_annotations(carried.annotated_steps[2]) == f"Twice that is {format_number(wrong)}*2 = {format_number(wrong * 2)}."
        assert step_is_right(carried.annotated_steps[2])
    # step 0's 12 feeds step 1, whose 10 feeds step 2: both later steps change; the last step has
    # no consumer, so it cannot be carried; a value that the question also holds is ambiguous.
    first = corrupt_steps(QUESTION, steps, 0, np.random.default_rng(0), carried=True)
    assert first.label == 0 and all(a != b for a, b in zip(first.annotated_steps, steps))
    assert [step_is_right(s) for s in first.annotated_steps] == [False, True, True]
    assert corrupt_steps(QUESTION, steps, 2, np.random.default_rng(0), carried=True) is None
    assert corrupt_steps(QUESTION + " He had 12 before.", steps, 0, np.random.default_rng(0), carried=True) is None




def test_adversarial_kinds_and_errors():
    steps = ["a", "b"]
    for kind in KINDS_ADVERSARIAL:
        out = adversarial_steps(steps, kind)
        assert out[0] == "a" and out[1].startswith("b\n") and len(out) == 2
    with pytest.raises(ValueError, match="valid"):
        adversarial_steps(steps, "adv_other")
    with pytest.raises(ValueError, match="n_problems"):
        build_benchmark([{"prompt_id": "x", "question": QUESTION, "gold_answer": "20", "gold_solution": SOLUTION}], 2, 0)


def test_processbench_rows_checks_every_field():
    good = [{"problem": "p", "steps": ["a", "b"], "label": 1, "step_labels": [0, 1], "final_answer_correct": False},
            {"id": "z", "problem": "q", "steps": ["a"], "label": -1, "gold_answer": 3}]
    rows = processbench_rows(good, "pb")
    assert [r["id"] for r in rows] == ["pb-00000", "z"] and rows[1]["gold_answer"] == "3"
    assert rows[0]["kind"] == "external" and rows[1]["step_labels"] is None
    for bad, msg in (({"problem": "p", "steps": [], "label": -1}, "steps"),
                     ({"problem": "p", "steps": ["a"], "label": 1}, "label"),
                     ({"problem": "p", "steps": ["a"], "label": True}, "label"),
                     ({"problem": "", "steps": ["a"], "label": 0}, "problem"),
                     ({"problem": "p", "steps": ["a", "b"], "label": 0, "step_labels": [0, 1]}, "step_labels")):
        with pytest.raises(ValueError, match=msg):
            processbench_rows([bad], "pb")
    with pytest.raises(ValueError, match="unique"):
        processbench_rows([good[1], good[1]], "pb")
    for bad, msg in ((["p", ["a"], 0], r"pb row 0: an item must be a JSON object .*got a list"),
                     ({"problem": "p", "steps": ["a"], "label": 0, "step_labels": "1"}, r"`step_labels` must be a list"),
                     ({"problem": "p", "steps": ["a"], "label": 0, "step_labels": [2]}, r"`step_labels\[0\]` must be 0")):
        with pytest.raises(ValueError, match=msg):
            processbench_rows([bad], "pb")
    with pytest.raises(ValueError, match=r"repeated: 'z' at f: line 2, f: line 5"):
        processbench_rows([good[1], good[1]], "pb", where=["f: line 2", "f: line 5"])
