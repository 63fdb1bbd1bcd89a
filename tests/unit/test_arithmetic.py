"""The exact step arithmetic checker (pipeline/core/arithmetic.py), numbers worked by hand."""

import time
from fractions import Fraction

import pytest

from pipeline.core.arithmetic import Equation, check_step, count_checkable, step_verdict, critique_steps


def verdicts(text):
    return [(e.lhs, e.rhs, e.right) for e in check_step(text)]


def one(text):
    eqs = check_step(text)
    assert len(eqs) == 1, eqs
    return eqs[0]


# --- right and wrong equalities, plain text and LaTeX ------------------------------------------


@pytest.mark.parametrize("text, right", [
    (r"\frac{3}{4} \times 120 = 90", True),         # 120 / 4 = 30, 30 * 3 = 90
    (r"\dfrac{3}{4} \cdot 120 = 90", True),
    (r"\$12 \times 3 = \$36", True),                 # 12 * 3 = 36
    ("$12 x 3 = $36", True),                          # "x" between spaced numbers is a product
    ("(3 + 4) x 2 = 14", True),
    ("1,250 + 750 = 2,000", True),                    # 1250 + 750 = 2000
    ("148 + 4 + 42 = 206", False),                    # 148 + 4 = 152, + 42 = 194
    ("206 × 0.90 = 187.40", False),                   # 206 * 9/10 = 1854/10 = 185.4
    ("206 × 0.90 = 185.40", True),
    ("20 + 10 = 50", False),                          # 30
    ("12 ÷ 4 = 3", True),
    (r"15 \div 4 = 3.75", True),                      # 15/4 = 3.75 exactly
    ("2 · 3 · 4 = 24", True),
    ("3 - 5 = -2", True),
    ("2(3+4) = 14", True),                            # implicit product: 2 * 7
    (r"\left( 3 + 4 \right) \times 2 = 14", True),
    (r"\[ \left[ 2 + 3 \right] \cdot 4 = 21 \]", False),  # 5 * 4 = 20
    (r"\frac{\frac{1}{2}}{2} + \frac12 = 0.75", True),   # 1/4 + 1/2 = 3/4
    ("$$\\frac{1}{2} \\cdot 8 = 4$$", True),
    ("2^3 = 8", True),
    ("10^{2} = 100", True),
    ("2**10 = 1024", True),
    ("2^-2 = 0.25", True),                            # 1/4
    ("1{,}000 + 1 = 1{,}001", True),                  # LaTeX thousands separator
    ("The answer is **3 + 4 = 8**.", False),          # markdown bold stripped; 3 + 4 = 7
    (r"So $6 \cdot 6 = \boxed{36}$.", True),
    ("- 3 + 4 = 7", True),                            # a list bullet, not a minus sign
])
def test_single_equalities(text, right):
    assert one(text).right is right


def test_equation_fields_point_into_the_step():
    text = "So she has 148 + 4 + 42 = 206 stickers."
    eq = one(text)
    # "So she has " is 11 characters, "148 + 4 + 42 = 206" 18; the unit word is not shown
    assert eq == Equation(lhs="148 + 4 + 42", rhs="206", stated=Fraction(206),
                          value=Fraction(194), right=False, span=(11, 29),
                          text="148 + 4 + 42 = 206")
    assert text[eq.span[0]:eq.span[1]] == eq.text


def test_latex_offsets_map_back_to_the_original_text():
    text = r"Then \(\frac{3}{4} \times 120 = 90\) cookies."
    eq = one(text)
    assert eq.lhs == r"\frac{3}{4} \times 120" and eq.rhs == "90"
    assert text[eq.span[0]:eq.span[1]] == r"\frac{3}{4} \times 120 = 90"
    assert eq.value == 90 and eq.right


def test_several_equations_in_one_step_in_text_order():
    text = "1) 5 + 5 = 10\n2) 10 * 2 = 20\n3) 20 / 4 = 6"
    assert verdicts(text) == [("5 + 5", "10", True), ("10 * 2", "20", True),
                              ("20 / 4", "6", False)]           # 20 / 4 = 5
    assert count_checkable(text) == 3


# --- rounding -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, right", [
    ("10/3 = 3.33", True),     # 3.3333..., |3.3333 - 3.33| = 0.0033 <= 0.005
    ("10/3 = 3.3", True),      # |3.333 - 3.3| = 0.033 <= 0.05
    ("10/3 = 3.4", False),     # |3.333 - 3.4| = 0.067 > 0.05
    ("10/3 = 3.30", False),    # two decimals shown: 0.033 > 0.005
    ("2/3 = 0.67", True),      # 0.6667: |0.6667 - 0.67| = 0.0033 <= 0.005
    ("2/3 = 0.66", False),     # 0.0067 > 0.005
    ("7/2 = 3.5", True),
    ("7/2 = 3", False),        # an integer must be exact (strict, even for "people")
    ("7/2 = 4", False),
    ("100 / 3 = 33.33 people", True),
    ("2 * 3.50 = 7.00 dollars", True),
    ("1/8 = 0.125", True),
    ("1/8 = 0.13", True),      # |0.125 - 0.13| = 0.005: half a unit of the last digit is right
    ("1/8 = 0.12", True),      # likewise 0.005 (either rounding of an exact half)
    ("1/8 = 0.14", False),
    # an integer is compared within 0.5 only when the step says it rounds
    ("10/3 = 3 buses, rounded to the nearest whole", True),   # |3.33 - 3| <= 0.5
    ("7/2 = 4 (rounded up)", True),                           # |3.5 - 4| = 0.5
    ("10/3 = 4 buses, rounded up", False),                    # |3.33 - 4| = 0.67 > 0.5
])
def test_rounding_at_the_decimals_shown(text, right):
    assert one(text).right is right


# --- chains ---------------------------------------------------------------------------------


def test_chain_flagged_at_the_second_link():
    # 2 + 3 = 5: the first link is right, 6 != 5
    assert verdicts("2 + 3 = 5 = 6") == [("2 + 3", "5", True), ("2 + 3", "6", False)]
    assert step_verdict("2 + 3 = 5 = 6") == (True, "2 + 3 = 6 (is 5)")


def test_chain_all_right():
    # (3 + 4) * 2 = 7 * 2 = 14
    assert verdicts("(3+4)*2 = 14 = 14") == [("(3+4)*2", "14", True), ("(3+4)*2", "14", True)]


def test_chain_of_expressions_compares_each_with_the_latest_expression():
    # 2*3 + 4*5 = 6 + 20 = 26
    assert verdicts(r"2 \cdot 3 + 4 \cdot 5 = 6 + 20 = 26") == [
        (r"2 \cdot 3 + 4 \cdot 5", "6 + 20", True), ("6 + 20", "26", True)]
    # 6 + 20 = 26, not 27
    assert step_verdict("2 * 3 + 4 * 5 = 6 + 20 = 27") == (True, "6 + 20 = 27 (is 26)")


def test_run_on_chain_starts_a_new_reference():
    # "3 + 4 = 7 * 2 = 14": 7 * 2 is not 3 + 4, but it is a new computation (not flagged)
    assert verdicts("3 + 4 = 7 * 2 = 14") == [("7 * 2", "14", True)]
    # a rounded intermediate: 1/3 * 9 = 3, 0.33 * 9 = 2.97
    assert verdicts("1/3 * 9 = 0.33 * 9 = 2.97") == [("0.33 * 9", "2.97", True)]


def test_label_before_the_chain():
    assert verdicts("Total cost = 3 * 4 = 12") == [("3 * 4", "12", True)]
    assert verdicts("Let x = 5 + 3 = 9") == [("5 + 3", "9", False)]


def test_brackets_around_the_chain():
    assert verdicts("(so 3 + 4 = 7)") == [("3 + 4", "7", True)]
    # a parenthetical after a result ends the chain; "15 * 2 = 30" inside it is read too
    assert verdicts("(12 + 3) * 2 = 30 (since 15 * 2 = 30)") == [
        ("(12 + 3) * 2", "30", True), ("15 * 2", "30", True)]
    assert verdicts("3 + 4 = 7 (not 8)") == [("3 + 4", "7", True)]


# --- percents -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, right", [
    (r"60\% \times 150 = 90", True),     # 60/100 * 150 = 90
    ("60% * 150 = 90", True),
    ("150 * 60% = 90", True),
    ("60% * 150 = 9", False),
    ("25% of 80 = 20", True),            # "of" is read right after a percent: 1/4 * 80
    ("25% of 80 = 25", False),
    ("3/4 = 75%", True),                 # 0.75 = 75/100
    ("3/4 * 100 = 75%", True),           # 75, the percent read as a number
    ("1/5 = 20 percent", True),          # "percent" as a word
    ("2/3 = 66.67%", True),              # 0.666.. vs 0.6667: 0.00003 <= 0.00005
    ("100% - 25% = 75%", True),          # 1 - 0.25 = 0.75
    ("150 - 10% * 150 = 135", True),     # 150 - 15
])
def test_percents(text, right):
    assert one(text).right is right


def test_percent_added_to_a_plain_number_is_ambiguous():
    assert check_step("50 + 10% = 55") == []       # 50.1 literally, 55 as a markup


# --- money and units ------------------------------------------------------------------------


@pytest.mark.parametrize("text, right", [
    ("5 apples + 3 apples = 8 apples", True),
    ("5 apples + 3 apples = 9 apples", False),
    ("She sells them at $2 each, so 9 * $2 = $18.", True),
    ("- Apples: 5 × $0.50 = $2.50", True),
    ("The price: €80 × (1 - 0.25) = €60", True),   # 80 * 0.75 = 60
    ("£3.20 + £1.80 = £5", True),
    ("5 feet + 3 feet = 8 feet", True),
    ("5 feet + 3 feet = 9 ft", False),                # one unit, two spellings
    ("The area is 5^2 = 25 square units.", True),
])
def test_money_and_units(text, right):
    assert one(text).right is right


def test_a_change_of_unit_is_not_compared():
    # 7 dollars = 700 cents is a conversion, not 7 = 700
    assert verdicts("3 + 4 = 7 dollars = 700 cents") == [("3 + 4", "7", True)]
    # the result's unit differs from the expression's (checked only when the units agree)
    assert check_step("2 hours * 2 = 240 minutes") == []
    assert check_step("2 hours * 60 = 120 minutes") == []
    # two units inside one expression: 4 pounds = 64 ounces, 64 - 6 = 58
    assert check_step("Lazlo = 4 pounds - 6 ounces = 58 ounces") == []


# --- must not be read as arithmetic ---------------------------------------------------------


@pytest.mark.parametrize("text", [
    "The 2023-2024 season.", "Between 2020-2023 = 3 years", "It takes 5-10 minutes.",
    "5-10 = -5", "Call 555-123-4567 now.", "Call 555-123-4567 = office", "On 2023-05-01 = today",
    "Step 2:", "1.", "2)", "Step 2: Find the total.",
    "At 3:30 + 2 hours = 5:30", "The ratio is 3:4 = 0.75", "3:4 = 6:8",
    "x = 5", "2x + 3 = 11", "x + 3 = 11", "3 + x = 11", "2 x + 3 = 11", "y = 2x + 1 = 7",
    "a = 3, b = 4, a+b = 7", "n(n+1)/2 = 15", "5 m + 3 m = 9 m", "x^2 + 3x = 10",
    "3 + 4 < 8", "3 + 4 > 8", r"3 + 4 \le 8", "3 + 4 >= 8", "3 + 4 ≠ 8", "3 + 4 != 8",
    "10/3 ≈ 3.4", r"10/3 \approx 3.4", "2/3 ≈ 0.67 = 0.6",
    "3 apples and 4 pears = 8", "half of 10 = 6", "3 times 4 = 13", "1 dozen = 13",
    "Profit = Revenue - Cost = 500 - 300 = 201", "8 - 3 = 6 = five",
    r"\sqrt{16} + 1 = 6", r"\log 100 + 1 = 4", r"2\pi = 6", "f(3) = 2(3) + 1 = 8",
    "sqrt(16) = 5", "5! = 100", "|-3| + 4 = 8", "5km + 3km = 9km",
    "1 + 2 + ... + 9 + 10 = 55", r"1 + 2 + \cdots + 10 = 55", "6 / 0 = 0", "2 (3+4) = 15",
    "1 hour = 60 minutes", "3 + 4 = 8 ✓",
])
def test_not_read_as_arithmetic(text):
    assert check_step(text) == []
    assert step_verdict(text) == (False, None)


@pytest.mark.parametrize("text, expected", [
    ("Step 2: 3 + 4 = 8", [("3 + 4", "8", False)]),
    ("1. 3 + 4 = 8", [("3 + 4", "8", False)]),
    ("2) 3 + 4 = 8", [("3 + 4", "8", False)]),
    ("The 2023-2024 season had 3 + 4 = 7 games", [("3 + 4", "7", True)]),
    ("At 3:30 he had 3 + 4 = 7 eggs", [("3 + 4", "7", True)]),
    ("So... 3 + 4 = 8", [("3 + 4", "8", False)]),
])
def test_markers_around_an_equation_are_not_part_of_it(text, expected):
    assert verdicts(text) == expected


# --- bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    # exponents: 10**10 > 64, 9**9 > 64, 100 > 64, 99999**64 > 10**40, not an integer, 1/0
    "10**10**10 = 5", "9^9^9^9 = 1", "2^100 = 1", "99999^64 = 1", "2^0.5 = 1.41", "0^-1 = 1",
    "1" * 10_000 + " + 1 = 2", "3 + 4 = " + "9" * 10_000,
    "123456789012345678901234567890 * 123456789012345678901234567890 = 1",   # 1.5e58 > 1e40
    "(" * 40 + "1" + ")" * 40 + " + 1 = 3", "-" * 5000 + "1 + 1 = 2", "1/" * 3000 + "1 = 2",
    r"\frac{" * 3000 + "1" + "}{2}" * 3000 + " = 1",
    "(" * 20_000 + "1 + 1 = 2", "2 + 3" + " = 6" * 5_000, "(1)2" * 5_000 + " = 3",
    "\\begin{" * 10_000, "\\[" * 10_000, "$$ " * 10_000,
])
def test_huge_numbers_and_powers_are_not_checkable_and_fast(text):
    # a guard against a hang (an exponent evaluated, a regex backtracking), not a speed target: the
    # worst of these takes under a second on a busy 2-core CPU, a pathological one minutes or forever
    start = time.perf_counter()
    assert step_verdict(text) == (False, None)
    assert time.perf_counter() - start < 5.0


def test_bounded_powers_still_check():
    # 2^64 * 2^64 = 2^128 ~ 3.4e38 < 1e40
    assert one("2^64 * 2^64 = 3").right is False
    # "<10,000 nines> + 1 = 2" is not checkable, and it does not hide the equation before it
    assert verdicts("3 + 4 = 8. " + "9" * 10_000 + " + 1 = 2") == [("3 + 4", "8", False)]


# --- GSM8K annotations ----------------------------------------------------------------------


def test_annotations():
    eq = one("<<48/2=24>>")
    assert (eq.lhs, eq.rhs, eq.value, eq.right, eq.span) == ("48/2", "24", 24, True, (2, 9))
    assert step_verdict("<<48/2=25>>") == (True, "48/2 = 25 (is 24)")


def test_annotation_and_its_visible_twin_count_once():
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May."
    assert verdicts(text) == [("48/2", "24", True)]
    assert count_checkable(text) == 1
    # a visible result that differs from its annotation is a second, wrong, claim
    text = "Natalia sold 48/2 = <<48/2=24>>25 clips in May."
    assert verdicts(text) == [("48/2", "25", False), ("48/2", "24", True)]   # in span order


# --- step_verdict and count_checkable -------------------------------------------------------


@pytest.mark.parametrize("text, reason", [
    ("148 + 4 + 42 = 206", "148 + 4 + 42 = 206 (is 194)"),
    ("206 × 0.90 = 187.40", "206 × 0.90 = 187.40 (is 185.4)"),
    ("10/3 = 3.4", "10/3 = 3.4 (is 3.3333…)"),
    ("5 - 8 = 3", "5 - 8 = 3 (is -3)"),
    ("So 3 + 4 = 7 and 7 + 1 = 9 and 9 + 1 = 11.", "7 + 1 = 9 (is 8)"),   # the first wrong one
])
def test_step_verdict_reason(text, reason):
    assert step_verdict(text) == (True, reason)


def test_step_verdict_right_and_empty():
    assert step_verdict("3 + 4 = 7") == (False, None)
    assert step_verdict("There is nothing to compute here.") == (False, None)
    assert step_verdict("") == (False, None)
    assert count_checkable("") == 0
    assert count_checkable("3 + 4 = 7, 7 * 2 = 14, x = 5") == 2


def test_non_strings_are_refused():
    with pytest.raises(TypeError, match="wants a str, not NoneType"):
        check_step(None)
    with pytest.raises(TypeError, match="wants a str, not bytes"):
        step_verdict(b"3 + 4 = 7")


def test_units_are_shown_inside_an_expression_but_not_after_a_stated_result():
    # 5 + 3 = 8 apples, not 9
    assert step_verdict("5 apples + 3 apples = 9 apples") == (
        True, "5 apples + 3 apples = 9 (is 8)")


# --- GSM8K-style writing (from reference solutions that are right) --------------------------


@pytest.mark.parametrize("text, expected", [
    # mixed numbers: 14 * 3/2 = 21; 2 + 1.5 + 3.5 = 7; 17/3 = 5 2/3; 1/4 + 5/4 = 1.5
    ("14 * 1 1/2 = 21 birds weekly.", [("14 * 1 1/2", "21", True)]),
    ("2 + 1 1/2 + 3 1/2 = 7 square feet", [("2 + 1 1/2 + 3 1/2", "7", True)]),
    ("it takes 17/3 = 5 and 2/3 loads.", [("17/3", "5 and 2/3", True)]),
    ("1/4 cup + 1 and 1/4 cup = 1.5 cups", [("1/4 cup + 1 and 1/4 cup", "1.5", True)]),
    # a tight fraction after a spaced "/" is one number: 60 / (3/4) = 80, 50 / (1/2) = 100
    ("their father's age was 60 / 3/4 = 80 years.", [("60 / 3/4", "80", True)]),
    ("she sold 50/ 1/2 = 100 halves", [("50/ 1/2", "100", True)]),
    ("6/3/2 = 1", [("6/3/2", "1", True)]),                   # all tight: (6/3)/2
    ("60 / 3 / 4 = 5", [("60 / 3 / 4", "5", True)]),         # all spaced: (60/3)/4
    # "x" after a unit word is a product: 60 * 3/4 = 45
    ("Mr. Willson worked for 60 minutes x 3/4 = 45 minutes", [("60 minutes x 3/4", "45", True)]),
    ("100 basketballs x (10 / 100) = 10 basketballs", [
        ("100 basketballs x (10 / 100)", "10", True)]),
    # "* 100%" turns a fraction into a percent number: 9/21 * 100 = 42.857142..
    ("9 teaspoons / 21 teaspoons * 100% = 42.857%", [
        ("9 teaspoons / 21 teaspoons * 100%", "42.857%", True)]),
    ("every 1% is equal to $7500/75% = $100.", [("7500/75%", "100", True)]),
    # an integer quotient with the remainder said: 13 = 6 * 2 + 1
    ("13 / 6 = 2 full cycles with a remainder of 1 hour", [("13 / 6", "2", True)]),
    ("50 / 3 = 16 stickers for each friend, with 2 left over", [("50 / 3", "16", True)]),
])
def test_gsm8k_style_writing(text, expected):
    assert verdicts(text) == expected


@pytest.mark.parametrize("text", [
    "Mr. Grey had a $100 000 x 10/100 = $10,000 profit.",     # a space as thousands separator
    "So in a month, he uses 600 x 30 = 18 000 watts.",
    "Therefore X = 9 because - 18/-2 = 9",
    "The proportions total .8 + . 84 + .82 = 2.46",           # a stray space after a point
    "1 3/2 = 2.5",                                            # not a mixed number
    "50 stickers / 3 friends = 16 stickers each, with 2 remaining",   # two unit words
    "Howie needs 25 classmates + his 1 teacher + 1 himself = 27 cupcakes",
    "1 cheese +1 meat *+1 vegetable = 3 bad choices",
])
def test_gsm8k_style_writing_not_read(text):
    assert step_verdict(text) == (False, None)


def test_integer_quotient_without_a_remainder_is_wrong():
    # 50 / 3 = 16.666..; strict unless the step says what remains
    assert step_verdict("50 / 3 = 16 stickers for each friend") == (
        True, "50 / 3 = 16 (is 16.6667…)")


# --- MATH-style LaTeX (from reference solutions that are right) -----------------------------


@pytest.mark.parametrize("text, expected", [
    # LaTeX thousands: 13 * 4 * 12 * 6 = 52 * 72 = 3744
    (r"So there are $13 \times 4 \times 12 \times 6 = 3,\!744$ full houses.", [
        (r"13 \times 4 \times 12 \times 6", r"3,\!744", True)]),
    (r"there are  \[15^4=\boxed{50,\!625}\]total choices", [("15^4", r"50,\!625", True)]),
    # mixed numbers: 27/4 = 6 3/4, 700/60 = 35/3 = 11 2/3
    (r"$h = \frac{27}{4} = \boxed{6 \frac{3}{4}}$ inches.", [
        (r"\frac{27}{4}", r"6 \frac{3}{4}", True)]),
    (r"$\frac{700}{60} = \boxed{11 \frac{2}{3}}$.", [(r"\frac{700}{60}", r"11 \frac{2}{3}", True)]),
    # \left( \right) keep an implicit product: 5 * (6 * 7 / 2) = 105 = 5 * 21
    (r"$5\left(\frac{6\cdot7}{2}\right) = 105$", [
        (r"5\left(\frac{6\cdot7}{2}\right)", "105", True)]),
    # align rows are separate equations; a line end inside display math is a space
    ("\\[\n\\begin{align*}\n3 \\times 4 &= 12 \\\\\n12 + 5 &= 18\n\\end{align*}\n\\]", [
        (r"3 \times 4", "12", True), ("12 + 5", "18", False)]),
    ("$$\n15 \\times 4\n= 60\n$$", [(r"15 \times 4", "60", True)]),
    # "to the nearest dollar": 10000 * 1.06^5 = 13382.255776, stated 13382
    (r"grown to $10000 \cdot 1.06^5 = \boxed{13382}$, to the nearest dollar.", [
        (r"10000 \cdot 1.06^5", "13382", True)]),
    # a remainder written "R": 100 = 12 * 8 + 4
    (r"Since $100 \div 12 = 8 \text{ R}4$, we know", [(r"100 \div 12", "8", True)]),
])
def test_math_style_latex(text, expected):
    assert verdicts(text) == expected


@pytest.mark.parametrize("text", [
    r"$n < \frac{988}{6} = 164.\overline{6}.$",              # a repeating decimal
    r"$\frac{23}{63}=0.\overline{365079}$",
    r"If $\frac{3}{11}=0.ababab\ldots$, then",
    r"$\cos A = \dfrac{7}{9} = 0.777 \ldots$",                # truncated with an ellipsis
    r"$$6.9999852\cdot5.9999985401\cdot10.00001988=419.999844...$$",
    r"we find that $7 \cdot 3 = 1 \pmod{10}$",                 # modular arithmetic
    r"we find that $7 \cdot 3 = 1$, so $\boxed{3}$ is the units digit",
    r"in base $7$, we have $44 \times 55 = 3506$.",
    r"\[33 \cdot 11 + 55 \cdot 33 = 33 (11 + 55) = 33 \cdot 66.\]",  # "33 (11 + 55)": not read
    "$\\log_{2002}\n\\frac{1}{2002} = \\boxed{-1}$",           # a line end inside math
    "$$\\log_{2002}\n\\frac{1}{2002} = \\boxed{-1}$$",
    "Nikita = (1/2) 278 + 11 = 150 points",                   # (1/2) * 278 + 11 = 150
    "He has to leave 0900-0130 = 0730 hours",                 # times, not numbers
    "That means he can park 16,0000/10=16000 cars",           # a broken thousands separator
])
def test_math_style_latex_not_read(text):
    assert step_verdict(text) == (False, None)


def test_currency_is_a_unit_against_a_unit_word():
    # $2.50 - $2.24 = $0.26, written as 26 cents; 25 * 4 = 100 cents = $1
    assert check_step("So, Bea earned $2.50 - $2.24 = 26 cents more than Dawn.") == []
    assert verdicts("Each dryer costs 25 x 4 = 100 cents = $1") == [("25 x 4", "100", True)]
    # in LaTeX "$" opens math, it is no dollar: 3 * 20 = 60
    assert verdicts(r"It takes $3 \times 20 = 60$ minutes.") == [(r"3 \times 20", "60", True)]
    # words that are no known unit do not make a conversion: 5 * 3 = 15
    assert verdicts("She pays $5 * 3 = 15 more") == [("5 * 3", "15", True)]


# --- property: a right result is never flagged, a result off by one always is ----------------


def _expressions():
    from hypothesis import strategies as st

    leaf = st.integers(1, 999).map(lambda n: (str(n), Fraction(n)))

    def combine(children):
        def build(a, op, b):
            if op == "/" and b[1] == 0:
                op = "+"
            value = {"+": a[1] + b[1], "-": a[1] - b[1], "*": a[1] * b[1],
                     "/": a[1] / b[1] if b[1] else 0}[op]
            return f"({a[0]} {op} {b[0]})", value
        return st.builds(build, children, st.sampled_from("+-*/"), children)

    return st.recursive(leaf, combine, max_leaves=6)


def _decimal(v):
    """Exact decimal text of v if it terminates within 4 places, else None."""
    for d in range(5):
        if (v * 10**d).denominator == 1:
            digits = str(abs(v.numerator) * 10**d // v.denominator).rjust(d + 1, "0")
            return ("-" if v < 0 else "") + (f"{digits[:-d]}.{digits[-d:]}" if d else digits)
    return None


def test_right_results_are_never_flagged_and_off_by_one_always_is():
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(_expressions(), st.sampled_from([
        "{e} = {r}", "So {e} = {r} apples.", r"\( {e} = {r} \)", "$${e} = \\boxed{{{r}}}$$"]))
    def check(expr, style):
        text, value = expr
        shown = _decimal(value)
        assume(text.startswith("(") and shown is not None and value >= 1)
        lhs = text[1:-1]
        right = check_step(style.format(e=lhs, r=shown))
        assert [(e.value, e.right) for e in right] == [(value, True)]
        wrong = check_step(style.format(e=lhs, r=_decimal(value + 1)))
        assert [e.right for e in wrong] == [False]

    check()


def test_critique_steps_reads_like_a_critique():
    c = critique_steps(["She pays 148 + 4 + 42 = 206 dollars.", "Then 206 \\times 0.90 = 185.4",
                        "From 2023-2024 she saved.", "So 10/3 = 3.33 each, \\boxed{185.4}"])
    assert c.wrong_steps == (0,) and c.steps_judged == (0, 1, 3)
    assert c.text.splitlines() == ["Step 0: wrong - 148 + 4 + 42 = 206 (is 194)", "Step 1: correct (1 equation)",
                                   "Step 2: nothing to check", "Step 3: correct (1 equation)", "Wrong step list: [0]"]
    assert critique_steps([]) == type(c)((), (), "Wrong step list: []")
    with pytest.raises(TypeError, match="str"):
        critique_steps([None])
