r"""Exact arithmetic check of one reasoning step (pure: a string in, data out).

:func:`check_step` finds every ``=`` of a GSM8K / MATH style step (plain text or LaTeX) that reads
as arithmetic and evaluates it exactly with ``fractions.Fraction`` (own tokenizer and
recursive-descent parser; model text never reaches ``eval``/``exec``).

Read: numbers (``1,250``, ``3,\!744``, ``.5``), mixed numbers (``1 1/2``, ``5 and 2/3``,
``6 \frac{3}{4}``), ``+ - * / × ÷ · \times \cdot \div``, ``x``/``X`` spaced between numbers or
brackets or after a unit (``3 x 4``, ``(1 + 2) x 3``, ``60 minutes x 3/4``), ``\frac \dfrac
\tfrac``, brackets ``() [] {}`` and ``\left( \right)``, implicit products ``2(3+4)``, integer
powers ``2^3``, ``10**2`` (|exponent| <= 64), ``%`` after a number (/100) and ``N% of X``,
currency signs and one unit word after a number (``12 apples``), ``$ \( \[ align \text{}
\boxed{} **bold**`` wrappers, bullets, GSM8K annotations ``<<48/2=24>>``. A tight fraction after
a spaced ``/`` is one number (``60 / 3/4`` = 80). A word-only first member is a label
(``Total = 3 * 4 = 12``).

Chains: each member is compared with the latest expression before it (``a + b = c = d``: ``c``
and ``d`` with ``a + b``); an expression member of another value (run-on ``3 + 4 = 7 * 2 = 14``,
a rounded intermediate) is not flagged and becomes the reference for the members after it.

Rounding: a result with ``d`` decimals is right within half a unit of its last digit (``10/3 =
3.33`` right, ``3.4`` wrong). A stated integer must be exact (``7/2 = 3`` wrong: strict on
purpose, though GSM8K text sometimes rounds people), unless the step says it rounds ("nearest",
"rounded", "approximately": then within 0.5) or gives a remainder (``13 / 6 = 2 with 1
remaining``, ``8 R4``: then the quotient). A ``%`` (or "percent") may be read as /100 or
ignored, in the result and in the expression (``3/4 = 75%``, ``3/4 * 100 = 75%``,
``9/21 * 100% = 42.86``).

Deliberately not read (no equation, never flagged): variables (``x = 5``, ``2x + 3 = 11``,
``5 m + 3 m``), functions and unknown LaTeX commands (``\sqrt``, ``\pi``), words inside an
expression or as operators (``3 times 4``), glued units (``5km``), two unit words in one
expression (``4 pounds - 6 ounces``, ``1 cheese + 1 meat``), a change between known units
(``7 dollars = 700 cents``, ``$1 = 100 cents``, ``2 hours * 60 = 120 minutes``; a bare ``$`` is
a dollar only in a step without LaTeX), ``≈``/``\approx``/``...``/``\overline`` chains,
inequalities, ranges / dates / phone numbers (a hyphen without spaces from a smaller to a larger
number, or several: ``5-10``, ``2023-2024``, ``555-123-4567``), ``3:30``, ``3:4``, ``0900``,
factorials, numbers side by side (``100 000``, ``2 (3+4)``), ``50 + 10%`` (markup or not is
ambiguous), steps about modular arithmetic or bases (``\pmod``, "units digit", "in base"),
chains whose first member has no operation (``1 dozen = 12``). Literals over 30 digits, powers
past the bounds and any result over 10**40 (numerator or denominator) are not checkable, so
every input is answered quickly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["VERSION", "ArithmeticCritique", "Equation", "check_step", "critique_steps", "count_checkable",
           "step_verdict"]

VERSION = "arithmetic-v1"
"""Names the checker's behaviour in the critique stage's key and in every ``arithmetic`` critique row
(``template_version``): bump it when a change here can flag a different set of steps."""

MAX_DIGITS = 30          # digits of one number literal
MAX_SIZE = 10**40        # bound on |numerator| and denominator of every intermediate result
MAX_EXPONENT = 64
MAX_DEPTH = 24           # nesting of brackets and unary signs
MAX_MEMBER_TOKENS = 200
MAX_CHAIN = 64           # members of one a = b = c chain
_Span = tuple[int, int]  # (start, end) in the step


@dataclass(frozen=True)
class Equation:
    """One checked ``=`` link: ``lhs`` (the reference expression) against ``rhs`` (as written).

    ``stated`` and ``value`` are their exact values (a percent ``rhs`` as the reading that
    matched), ``right`` says whether they agree up to the rounding ``rhs`` shows, ``span`` is
    ``(start, end)`` in the step from ``lhs`` to the end of ``rhs`` and ``text`` that slice.
    """

    lhs: str
    rhs: str
    stated: Fraction
    value: Fraction
    right: bool
    span: tuple[int, int]
    text: str


class _NotCheckable(Exception):
    pass


@dataclass
class _Tok:
    kind: str            # num word cmd op lp rp eq pct break taint
    text: str
    start: int           # offsets in the normalized string
    end: int
    spaced: bool         # whitespace (or the start) before it
    value: Fraction = Fraction(0)
    decimals: int = 0


# ------------------------------------------------------------------------------ normalization
_NOT_LETTER = r"(?![A-Za-z])"
_WRAPPERS = [  # applied until nothing changes: innermost first
    (r"(?<![\d.^_])(\d+)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}",
     (1, " ", 2, "/", 3)),                                     # a mixed number: 6 \frac{3}{4}
    (r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|boxed|fbox)\s*"
     r"\{([^{}]*)\}", (" ", 1, " ")),
    (r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", ("((", 1, ")/(", 2, "))")),
    (r"\\[dt]?frac\s*(\d)\s*(\d)", ("((", 1, ")/(", 2, "))")),
]
_RULES = [
    (r"\\\\|\\(?:begin|end)\s*\{[^{}]*\}", ("\n",)),           # LaTeX rows, environments
    (r"\\[()\[\]]", (" ",)),                                   # \( \) \[ \]
    (r"(?m)^[ \t]*[-*+•][ \t]+", (" ",)),                      # list bullets
    (r"(?<![\d)])\*\*|\*\*(?![\d(-])", (" ",)),                # markdown bold
    (r"\*\*", ("^",)),
    (r"\{,\}|,\\!|(?<=\d)\\,(?=\d{3}(?!\d))", (",",)),      # 1{,}000  1,\!000  1\,000
    (r"\\(?:ldots|dots|cdots|dotsc|dotsb)" + _NOT_LETTER, ("…",)),
    (r"\\(?:approx|sim|simeq|cong|thickapprox)" + _NOT_LETTER + "|[≈≃≅∼]", ("≈",)),
    (r"<=|>=|!=|=>|:=|=:|[≤≥≠→⇒⟹]|\\(?:leq?|geq?|neq?|lt|gt|leqslant|geqslant"
     r"|implies|iff|to|Rightarrow|rightarrow)" + _NOT_LETTER, ("<",)),  # inequalities: a break
    (r"==", ("=",)),
    (r"\.{2,}", ("…",)),                                       # an ellipsis: a taint
    (r"\\(?:times|cdot|ast)" + _NOT_LETTER + "|[×·⋅∙∗]", ("*",)),
    (r"\\div" + _NOT_LETTER + "|[÷∕]", ("/",)),
    (r"[−–]", ("-",)),
    (r"\\%", ("%",)),
    (r"\\?[$€£¥]", ("",)),
    (r"\\(?:left|right|[bB]igg?[lr]?)" + _NOT_LETTER, ("",)),    # \left( is (: 5\left(2\right)
    (r"\\[,;:! ]|\\(?:quad|qquad|displaystyle|textstyle|boxed|fbox|limits)" + _NOT_LETTER
     + "|[&~]", (" ",)),
    (r"\\?[\[{]", ("(",)),
    (r"\\?[\]}]", (")",)),
    (r"(?<=[\d)])[ \t]+[xX][ \t]+(?=[\d(])", (" * ",)),        # 3 x 4, (1 + 2) x 3
    (r"(\d[ \t]+[^\W\d_]{2,}[ \t]+)[xX](?=[ \t]+[\d(])", (1, "*")),   # 60 minutes x 3/4
]
_WRAPPERS, _RULES = ([(re.compile(p), r) for p, r in rules] for rules in (_WRAPPERS, _RULES))


def _sub(s: str, pos: list[_Span], pattern: re.Pattern, pieces: tuple) -> tuple[str, list[_Span]]:
    """``re.sub`` that keeps, for every output char, the span of the step it stands for: a
    group's chars keep theirs, a literal stands for the matched text around it."""
    out: list[str] = []
    opos: list[_Span] = []
    last = 0
    for m in pattern.finditer(s):
        out.append(s[last:m.start()])
        opos += pos[last:m.start()]
        bounds = [m.start()] + [i for p in pieces if isinstance(p, int) for i in m.span(p)]
        bounds.append(m.end())
        for p in pieces:
            if isinstance(p, int):
                out.append(m.group(p))
                opos += pos[m.start(p):m.end(p)]
                bounds = bounds[2:]
            else:
                lo, hi = bounds[0], bounds[1]
                at = pos[lo][0] if lo < len(pos) else pos[-1][1]      # an empty stretch
                span = (pos[lo][0], pos[hi - 1][1]) if hi > lo else (at, at)
                out.append(p)
                opos += [span] * len(p)
        last = m.end()
    out.append(s[last:])
    opos += pos[last:]
    return "".join(out), opos


def _normalize(s: str, pos: list[_Span]) -> tuple[str, list[_Span]]:
    for _ in range(12):
        before = s
        for pattern, pieces in _WRAPPERS:
            s, pos = _sub(s, pos, pattern, pieces)
        if s == before:
            break
    for pattern, pieces in _RULES:
        s, pos = _sub(s, pos, pattern, pieces)
    return s, pos


# ---------------------------------------------------------------------------------- tokens
_TOKEN = re.compile(
    r"(?P<num>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"|(?P<word>\\[A-Za-z]+|[^\W\d_]+(?:['’][^\W\d_]+)*)"
    r"|(?P<op>[-+*/^])|(?P<lp>\()|(?P<rp>\))|(?P<eq>=)|(?P<pct>%)|(?P<nl>\n)|(?P<sp>\s)"
    r"|(?P<other>.)", re.S)
_BREAK_CHARS = set(".,;:?!\"“”'‘’#<>—")
_UNITS = {variant: variants.split("|")[0] for variants in (
    "cent|cents|penny|pennies|pence dollar|dollars euro|euros second|seconds|sec|secs "
    "minute|minutes|min|mins hour|hours|hr|hrs day|days week|weeks month|months year|years "
    "dozen|dozens ounce|ounces|oz pound|pounds|lb|lbs gram|grams kilogram|kilograms|kg ton|tons "
    "inch|inches foot|feet|ft yard|yards mile|miles meter|meters|metre|metres centimeter|"
    "centimeters|cm millimeter|millimeters|mm kilometer|kilometers|km liter|liters|litre|litres "
    "milliliter|milliliters|ml gallon|gallons quart|quarts pint|pints cup|cups").split()
    for variant in variants.split("|")}   # the units whose change is a conversion
_FUNCS = {"sqrt", "log", "ln", "sin", "cos", "tan", "exp", "abs", "mod", "max", "min", "gcd", "lcm"}
_STOP = {"and", "or", "so", "then", "thus", "hence", "is", "are", "was", "were", "be", "which",
         "that", "the", "to", "in", "for", "on", "at", "by", "with", "from", "as", "but", "if",
         "we", "he", "she", "it", "they", "this", "there", "plus", "minus", "times", "of", "not",
         "because", "since", "when", "while", "after", "before", "than", "means", "gives"}


def _tokenize(s: str) -> list[_Tok]:
    toks: list[_Tok] = []
    spaced = True
    for m in _TOKEN.finditer(s):
        kind, text = m.lastgroup, m.group()
        if kind == "sp":
            spaced = True
            continue
        t = _Tok(kind, text, m.start(), m.end(), spaced)
        spaced = False
        if kind == "nl":
            t.kind = "break"
        elif kind == "num":
            digits = text.replace(",", "").replace(".", "")
            if len(digits) > MAX_DIGITS or re.match(r"0\d", text):    # a time: "0900 - 0130"
                t.kind = "taint"
            else:
                t.value = Fraction(text.replace(",", ""))
                t.decimals = len(text.split(".", 1)[1]) if "." in text else 0
        elif kind == "word" and (text.startswith("\\") or text.lower() in _FUNCS):
            t.kind = "cmd"
        elif kind == "other":
            prev, nxt = s[m.start() - 1:m.start()], s[m.end():m.end() + 1]
            glued = (text in ":," and prev.isdigit() and nxt.isdigit()) or (   # 3:30, 16,0000
                text == "!" and (prev.isdigit() or prev == ")")) or (            # 5!, 0.\overline3
                text == "." and prev.isdigit() and (nxt.isalnum() or nxt == "\\"))
            if text == "…":          # "1 + 2 + ... + 10" is no sum to check; "So... 3 + 4" is
                after = s[m.end():].lstrip()[:1]
                glued = bool(toks and toks[-1].kind in ("op", "num")) or (   # 0.1666..., 1 + ...
                    after != "" and after in "+-*/^")
            t.kind = "break" if (text in _BREAK_CHARS or text == "…") and not glued else "taint"
        toks.append(t)
    # "5-10", "2023-2024", "555-123-4567", "2023-05-01": ranges, dates, phone numbers
    compact = {i for i in range(1, len(toks) - 1)
               if toks[i].kind == "op" and toks[i].text == "-" and not toks[i].spaced
               and not toks[i + 1].spaced and toks[i - 1].kind == toks[i + 1].kind == "num"}
    for i in compact:
        if toks[i - 1].value < toks[i + 1].value or i - 2 in compact or i + 2 in compact:
            toks[i].kind = "taint"
    return _mixed(toks)


def _mixed(toks: list[_Tok]) -> list[_Tok]:
    """``1 1/2`` and ``5 and 2/3`` (an integer, then a proper fraction written tight) are one
    number, exact when stated."""
    out: list[_Tok] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        j = i + 2 if i + 1 < len(toks) and toks[i + 1].text == "and" else i + 1
        a, slash, b, after = (toks[j:j + 4] + [_Tok("end", "", 0, 0, True)] * 4)[:4]
        if (t.kind == a.kind == b.kind == "num" and t.decimals == a.decimals == b.decimals == 0
                and a.spaced and slash.text == "/" and not (slash.spaced or b.spaced)
                and 0 < a.value < b.value and (after.spaced or after.kind not in ("op", "num"))):
            out.append(_Tok("num", "", t.start, b.end, t.spaced, t.value + a.value / b.value))
            i = j + 3
        else:
            out.append(t)
            i += 1
    return out


# ------------------------------------------------------------------------------------ runs
def _is_unit(t: _Tok, prev: _Tok) -> bool:
    return (prev.kind in ("num", "pct") and t.kind == "word" and t.spaced and t.text.isalpha()
            and len(t.text) >= 2 and t.text.lower() not in _STOP)


def _bad_start(t: _Tok, prev: _Tok | None) -> bool:
    """Does a run starting at ``t`` (after ``prev``) leave the prose mid-expression?"""
    if t.kind in ("rp", "pct", "taint"):
        return True
    if prev is None or prev.kind == "break":
        return t.kind == "op" and t.text in "*/^"
    if prev.kind == "cmd" or t.kind == "op":        # "\log 100 + 1", "x + 3", "5 m + 3 m"
        return True
    if prev.kind == "word" and t.kind in ("num", "lp") and (
            not t.spaced or len(prev.text) == 1 and prev.text not in "aAI"):  # x2, f(3), x 3/4
        return True
    return prev.kind in ("num", "rp", "pct") and t.kind == "lp"  # "= 7 (not 8)": a parenthetical


def _runs(toks: list[_Tok]) -> list[list[_Tok]]:
    """Maximal stretches of tokens that read as one arithmetic chain; tainted ones dropped.

    ``state`` is what the run has just seen: an operand (``operand``: an operator may follow),
    an operator or ``(`` or ``=`` (``operator``: an operand must follow), a taint (``free``).
    """
    runs: list[list[_Tok]] = []
    run: list[_Tok] = []
    tainted = dangling = opened = False   # dangling: the last run broke off mid-expression
    state = "operator"

    def close() -> None:
        nonlocal run
        if not tainted and any(t.kind == "eq" for t in run):
            runs.append(run)
        run = []

    for i, t in enumerate(toks):
        prev = toks[i - 1] if i else None
        after_operand = bool(run) and state == "operand"
        if t.kind == "break":
            dangling = bool(run) and run[-1].kind == "op"          # "3 + . 84"
            close()
            continue
        if t.kind in ("word", "cmd"):
            if not run:
                continue
            if after_operand and _is_unit(t, prev):
                run.append(t)
            elif prev.kind == "pct" and t.text.lower() == "of":
                run.append(_Tok("op", "*", t.start, t.end, t.spaced))
                state = "operator"
            elif not after_operand or not t.spaced:                 # "3 + x", "2x", "(y"
                tainted = True
                run.append(t)
                state = "operand"
            else:
                close()
            continue
        if after_operand and t.kind == "num" and (
                prev.kind == "num" or prev.kind == "rp" and opened):
            tainted = True                                          # "100 000", "(1/2) 278"
        elif after_operand and (t.kind == "num" or t.kind == "lp" and (
                prev.kind == "word" or prev.kind == "num" and t.spaced and i + 1 < len(toks)
                and toks[i + 1].kind in ("word", "cmd"))):
            # "2) 3 + 4", "= 7 (not 8)"; but after "25 kids + his" the "1 teacher + 1" goes too
            dangling = len(run) > 1 and run[-1].kind == "word" and run[-2].kind == "op"
            close()
        if not run:
            tainted, dangling, opened = dangling or _bad_start(t, prev), False, False
        elif state == "operand":       # "2 (3 + 4)", "50%(2)", "5 miles^2"
            tainted |= t.kind == "lp" and (prev.kind == "pct" or prev.kind == "num" and t.spaced)
            tainted |= t.text == "^" and prev.kind == "word"
        elif state == "operator":      # "3 + = 7", "= * 2", "(%"
            tainted |= t.kind in ("rp", "pct", "eq") or (t.kind == "op" and t.text in "*/^")
        tainted |= t.kind == "taint"
        opened |= t.kind == "lp"
        run.append(t)
        state = ("free" if t.kind == "taint" else
                 "operand" if t.kind in ("num", "rp", "pct") else "operator")
    close()
    return runs


# ---------------------------------------------------------------------------------- parser
def _bound(v: Fraction) -> Fraction:
    if abs(v.numerator) > MAX_SIZE or v.denominator > MAX_SIZE:
        raise _NotCheckable("number too large")
    return v


class _Parser:
    """Exact value of one chain member (unit words skipped), by recursive descent:

    expr := term (+|- term)*;  term := unary ((*|/)? unary)*;  unary := (+|-) unary | power;
    power := (number | "(" expr ")") %* (^ unary)?.  ``ops`` counts the operations (+ - * /,
    implicit products, powers); ``N%`` alone is a "percent" term, and adding one to a plain
    number is refused (``50 + 10%``: markup or not is ambiguous).
    """

    def __init__(self, toks: list[_Tok], percent: Fraction = Fraction(1, 100)) -> None:
        self.toks = [t for t in toks if t.kind not in ("word", "cmd")]
        self.percent = percent
        self.toks.append(_Tok("end", "", 0, 0, True))
        self.i = self.ops = self.depth = self.pcts = 0
        self.nums: list[_Tok] = []

    def at(self, kind: str, texts: str = "") -> bool:
        t = self.toks[self.i]
        return t.kind == kind and (not texts or t.text in texts)

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += t.kind != "end"
        return t

    def parse(self) -> Fraction:
        if len(self.toks) > MAX_MEMBER_TOKENS:
            raise _NotCheckable("too long")
        v, _ = self.expr()
        if not self.at("end"):
            raise _NotCheckable("trailing tokens")
        return v

    def expr(self) -> tuple[Fraction, bool]:
        v, pct = self.term()
        while self.at("op", "+-"):
            op = self.take().text
            w, w_pct = self.term()
            if w_pct != pct:
                raise _NotCheckable("percent added to a plain number")
            v, self.ops = _bound(v + w if op == "+" else v - w), self.ops + 1
        return v, pct

    def term(self) -> tuple[Fraction, bool]:
        v, pct = self.unary()
        while self.at("op", "*/") or self.at("lp"):
            op_tok = self.take() if self.at("op") else None
            op = op_tok.text if op_tok else "*"
            a, slash, b, after = (self.toks[self.i:self.i + 4] + self.toks[-1:] * 4)[:4]
            if (op == "/" and (op_tok.spaced or a.spaced) and a.kind == b.kind == "num"
                    and slash.text == "/" and not (slash.spaced or b.spaced)
                    and after.kind != "pct" and after.text != "^"):
                self.i += 3            # "60 / 3/4" is 60 / (3/4): a tight fraction is one number
                self.nums += [a, b]
                w = a.value / b.value if b.value else Fraction(0)
            else:
                w, _ = self.unary()
            if op == "/" and w == 0:
                raise _NotCheckable("division by zero")
            v, pct, self.ops = _bound(v / w if op == "/" else v * w), False, self.ops + 1
        return v, pct

    def unary(self) -> tuple[Fraction, bool]:
        self.depth += 1                # every nesting (brackets, signs, exponents) passes here
        if self.depth > MAX_DEPTH:
            raise _NotCheckable("too deep")
        if self.at("op", "+-"):
            sign = self.take().text
            v, pct = self.unary()
            v = -v if sign == "-" else v
        else:
            v, pct = self.power()
        self.depth -= 1
        return v, pct

    def power(self) -> tuple[Fraction, bool]:
        t, pct = self.take(), False
        if t.kind == "num":
            v = t.value
            self.nums.append(t)
        elif t.kind == "lp":
            v, _ = self.expr()
            if self.take().kind != "rp":
                raise _NotCheckable("unbalanced bracket")
        else:
            raise _NotCheckable(f"unexpected {t.text!r}")
        while self.at("pct"):
            self.take()
            v, pct, self.pcts = v * self.percent, True, self.pcts + 1
        if not self.at("op", "^"):
            return v, pct
        self.take()
        e, _ = self.unary()
        self.ops += 1
        if e.denominator != 1 or abs(e) > MAX_EXPONENT or (v == 0 and e < 0):
            raise _NotCheckable("exponent")
        if max(abs(v.numerator), v.denominator).bit_length() * abs(int(e)) > 140:
            raise _NotCheckable("power too large")
        return _bound(v ** int(e)), False


# ---------------------------------------------------------------------------------- chains
def _close(value: Fraction, stated: Fraction, decimals: int, rounds: bool = False) -> bool:
    if decimals == 0 and not rounds:
        return value == stated
    return abs(value - stated) <= Fraction(1, 2 * 10**decimals)


def _shown(step: str, start: int, end: int) -> int:
    """``end`` moved past the ``}`` closing what ``step[start:end]`` opened: ``6 \frac{3}{4}``."""
    depth = step[start:end].count("{") - step[start:end].count("}")
    while end < len(step) and step[end] == "}" and depth > 0:
        end, depth = end + 1, depth - 1
    return end


def _trim(member: list[_Tok], first: bool) -> list[_Tok]:
    """Drops the unmatched ``(`` opening a chain or ``)`` closing it: ``(so 3 + 4 = 7)``."""
    open_, shut = ("lp", "rp") if first else ("rp", "lp")
    extra = sum(t.kind == open_ for t in member) - sum(t.kind == shut for t in member)
    ends = member if first else member[::-1]
    k = 0
    while k < min(extra, len(ends)) and ends[k].kind == open_:
        k += 1
    return member[k:] if first else member[:len(member) - k]


@dataclass(frozen=True)
class _Step:
    """The step and what it says about itself (found once: a step may hold many chains)."""

    text: str
    latex: bool                        # "$" is math, not money
    rounds: bool                       # "to the nearest dollar": an integer within 0.5
    remainder: bool                    # "13 / 6 = 2 with 1 remaining": the quotient

    @classmethod
    def of(cls, text: str) -> _Step:
        return cls(text, "\\" in text, bool(_ROUNDED.search(text)), bool(_REMAINDER.search(text)))


def _chain(run: list[_Tok], pos: list[_Span], info: _Step) -> list[Equation]:
    step = info.text
    members: list[list[_Tok]] = [[]]
    for t in run:
        if t.kind == "eq":
            members.append([])
        else:
            members[-1].append(t)
    if not members[0]:
        members = members[1:]          # a label: "Total = 3 * 4 = 12"
    if members and not members[-1]:
        members.pop()                  # a trailing "="
    if not 2 <= len(members) <= MAX_CHAIN:
        return []
    members[0], members[-1] = _trim(members[0], True), _trim(members[-1], False)
    out: list[Equation] = []
    ref: tuple[list[Fraction], int, str] | None = None   # values, start offset, text as written
    units_seen: set[str] = set()                         # of the reference and results since
    for member in filter(None, members):
        words = {t.text.lower().rstrip("s") for t in member if t.kind == "word"}
        units = {_UNITS.get(t.text.lower()) for t in member if t.kind == "word"} - {None}
        start = pos[member[0].start][0]
        end = _shown(step, start, pos[member[-1].end - 1][1])
        money = r"(?:\\\$|[€£¥])\s*$" if info.latex else r"[$€£¥]\s*$"  # LaTeX: $ is math
        if re.search(money, step[max(0, start - 3):start]):
            units.add("dollar")        # "$2.50 - $2.24 = 26 cents", "100 cents = $1"
        try:
            values, parser = _values(member)
        except _NotCheckable:
            ref = None                 # the chain is broken here
            continue
        if parser.ops:                 # an expression: the reference for what follows
            text = step[start:end].strip()
            if len(words) > 1 or len(units) > 1:   # "4 pounds - 6 ounces", "1 cheese + 1 meat"
                ref = None
                continue
            if ref is not None and set(values) & set(ref[0]):
                out.append(Equation(ref[2], text, values[0], values[0], True, (ref[1], end),
                                    step[ref[1]:end]))
            ref, units_seen = (values, start, text), units
            continue
        conversion = bool(units and units_seen and not units & units_seen)  # 7 dollars = 700 cents
        units_seen |= units
        if ref is None or len(parser.nums) != 1 or conversion:
            continue
        end = _shown(step, start, pos[[t for t in member if t.kind != "word"][-1].end - 1][1])
        d = parser.nums[0].decimals
        if "percent" in words and not parser.pcts:                     # "= 20 percent"
            values, parser.pcts = [values[0] / 100, values[0]], 1
        readings = list(zip(values, (d + 2 * parser.pcts, d)))          # "75%": 0.75 or 75
        match = next((s for s, dd in readings for v in ref[0]
                      if _close(v, s, dd, info.rounds)), None)
        if match is None and d == 0 and not parser.pcts and info.remainder and (
                values[0] == math.floor(ref[0][0])):        # "13 / 6 = 2, with 1 remaining"
            match = values[0]
        stated = values[0] if match is None else match
        out.append(Equation(ref[2], step[start:end].strip(), stated, ref[0][0], match is not None,
                            (ref[1], end), step[ref[1]:end]))
    return out


def _values(member: list[_Tok]) -> tuple[list[Fraction], _Parser]:
    """The member's exact value, then (if it has a ``%``) its value with the ``%`` ignored:
    ``9 / 21 * 100% = 42.86`` and ``7500 / 75% = 100`` are written either way."""
    parser = _Parser(member)
    values = [parser.parse()]
    if parser.pcts:
        try:
            values.append(_Parser(member, percent=Fraction(1)).parse())
        except _NotCheckable:
            pass
    return values, parser


def _join_math_lines(s: str) -> str:
    """In LaTeX math (``$..$``, ``$$..$$``, ``\\[..\\]``, environments) a line end is a space;
    rows end at ``\\\\``. Same length, so offsets stay."""
    out: list[str] = []
    last, dollar, depth = 0, False, 0
    for m in _MATH.finditer(s):
        gap = s[last:m.start()]
        out += [gap.replace("\n", " ") if dollar or depth > 0 else gap, m.group()]
        last = m.end()
        if m.group().startswith("$"):
            dollar = not dollar
        else:
            depth = max(0, depth + (1 if m.group() in ("\\[", "\\begin{") else -1))
    gap = s[last:]
    out.append(gap.replace("\n", " ") if dollar or depth > 0 else gap)
    return "".join(out)


def _check(s: str, pos: list[_Span], info: _Step) -> list[Equation]:
    if "\\" in s:
        s = _join_math_lines(s)
    s, pos = _normalize(s, pos)
    return [eq for run in _runs(_tokenize(s)) for eq in _chain(run, pos, info)]


# ---------------------------------------------------------------------------------- public
_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_MATH = re.compile(r"\$\$?|\\[\[\]]|\\(?:begin|end)\{")   # math delimiters
_REMAINDER = re.compile(r"remain|left ?over|\b[Rr]\s*\}?\s*\d")
_ROUNDED = re.compile(r"nearest|rounded|rounding|round (?:up|down|to)|approximately", re.I)
_MODULAR = re.compile(r"\\(?:pmod|bmod|mod|equiv)(?![A-Za-z])|≡|\bmod(?:ulo)?\b|\bin base\b"
                      r"|\bunits? digit", re.I)


def check_step(text: str) -> list[Equation]:
    """Every equality of a step that reads as arithmetic, checked exactly, in text order.

    GSM8K annotations ``<<48/2=24>>`` are checked on their own; the visible equation that repeats
    one (same expression and numbers) is not counted twice.

    Args:
        text: one reasoning step, plain text or LaTeX.

    Returns:
        One :class:`Equation` per checkable ``=`` link, sorted by ``span``.

    Raises:
        TypeError: ``text`` is not a ``str``. Any string, however malformed or huge, is answered.
    """
    if not isinstance(text, str):
        raise TypeError(f"check_step wants a str, not {type(text).__name__}")
    if _MODULAR.search(text):          # "7 \cdot 3 = 1" (mod 10), "44 \times 55 = 3506" in base 7
        return []
    found: list[Equation] = []
    info, visible = _Step.of(text), list(text)
    for m in _ANNOTATION.finditer(text):
        found += _check(m.group(1), [(i, i + 1) for i in range(m.start(1), m.end(1))], info)
        visible[m.start():m.end()] = " " * (m.end() - m.start())
    seen = {(re.sub(r"\s", "", e.lhs), e.stated, e.value) for e in found}
    found += [e for e in _check("".join(visible), [(i, i + 1) for i in range(len(text))], info)
              if (re.sub(r"\s", "", e.lhs), e.stated, e.value) not in seen]
    return sorted(found, key=lambda e: e.span)


def _fmt(v: Fraction) -> str:
    """``194``, ``185.4``, ``-0.25``; a value that does not terminate within 10 decimals is shown
    rounded to 4 and marked: ``3.3333…``."""
    exact = next((d for d in range(11) if (v * 10**d).denominator == 1), None)
    d = 4 if exact is None else exact
    digits = str(round(abs(v) * 10**d)).rjust(d + 1, "0")
    body = f"{digits[:-d]}.{digits[-d:]}" if d else digits
    return ("-" if v < 0 else "") + body + ("…" if exact is None else "")


def step_verdict(text: str) -> tuple[bool, str | None]:
    """Is some checkable equation of the step wrong, and which one first?

    Args:
        text: one reasoning step.

    Returns:
        ``(flagged, reason)``: ``flagged`` when some stated result disagrees with its exact value;
        ``reason`` is the first wrong equation, e.g. ``"148 + 4 + 42 = 206 (is 194)"``, else None.

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    for eq in check_step(text):
        if not eq.right:
            return True, f"{eq.lhs} = {eq.rhs} (is {_fmt(eq.value)})"
    return False, None


def count_checkable(text: str) -> int:
    """How many ``=`` links of the step :func:`check_step` could check.

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    return len(check_step(text))


@dataclass(frozen=True)
class ArithmeticCritique:
    """The arithmetic check of a whole response, shaped like a parsed step critique.

    Attributes:
        wrong_steps: 0-indexed steps with a wrong stated result, ascending (the verdict that votes).
        steps_judged: 0-indexed steps with at least one checkable equation.
        text: one line per step, ``Step i: correct (k equations)``, ``Step i: wrong - <lhs> = <rhs>
            (is <value>)`` or ``Step i: nothing to check`` (numbered from 0, like the critic's lines),
            then ``Wrong step list: [...]``: what the critique browser and SQL show.
    """

    wrong_steps: tuple[int, ...]
    steps_judged: tuple[int, ...]
    text: str


def critique_steps(step_texts: list[str]) -> ArithmeticCritique:
    """Check every step of one response (:func:`check_step`) and write the result as a critique.

    Args:
        step_texts: the response's S steps in order (``steps.step_text``).

    Returns:
        An :class:`ArithmeticCritique`; for S = 0 an empty one whose text is ``Wrong step list: []``.

    Raises:
        TypeError: a step is not a ``str``.
    """
    lines, wrong, judged = [], [], []
    for i, text in enumerate(step_texts):
        eqs = check_step(text)
        bad = next((e for e in eqs if not e.right), None)
        if eqs:
            judged.append(i)
        if bad is not None:
            wrong.append(i)
            lines.append(f"Step {i}: wrong - {bad.lhs} = {bad.rhs} (is {_fmt(bad.value)})")
        elif eqs:
            lines.append(f"Step {i}: correct ({len(eqs)} equation{'s' if len(eqs) > 1 else ''})")
        else:
            lines.append(f"Step {i}: nothing to check")
    lines.append(f"Wrong step list: [{', '.join(str(i) for i in wrong)}]")
    return ArithmeticCritique(tuple(wrong), tuple(judged), "\n".join(lines))
