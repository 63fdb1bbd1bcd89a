"""Held-out hygiene: training problems that are template twins of held-out ones.

Word-problem sets such as MAWPS merge collections (AddSub, MultiArith, SingleEq, SingleOp) that
share problems and templates: the same text with other numbers. Rows disjoint by index can still be
the same problem, and a policy trained on one is not being tested on new problems by the other.
:func:`masked_text` is the key two problems share when they differ only in their numbers, case,
spacing, punctuation or the names in them; :func:`template_twins` finds the training rows whose key
a held-out row has.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand "
    "million half twice".split())
"""Number words masked like numerals (``"five apples"`` and ``"7 apples"`` share a key)."""

PERSONAL = frozenset("he she him her his hers himself herself".split())
"""Gendered pronouns, masked like names (``"Tom ... his"`` and ``"Sara ... her"`` share a key)."""

_NUMERAL = re.compile(r"\d[\d,]*(?:\.\d+)?|\.\d+")
_CAPITALIZED = re.compile(r"\b[A-Z][a-z]*\b")
_NOT_WORD = re.compile(r"[^a-z#@]+")


def masked_text(text: str) -> str:
    """The text with its numbers and names masked: every numeral (``1,250``, ``3.5``, ``.5``) and
    number word (:data:`NUMBER_WORDS`) replaced by ``#``, a run of them (``twenty-one``, ``1/2``)
    by one ``#``; every capitalized word (names, and so also a sentence's first word) and gendered
    pronoun (:data:`PERSONAL`) by ``@``; then lowercase, everything but letters, ``#`` and ``@``
    dropped, words joined by single spaces. ``"Tom has 5 apples. He eats 2 of his."`` and ``"Sara
    has twenty-one apples; she eats three of her"`` both give ``"@ has # apples @ eats # of @"``.

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"masked_text expects a string, got {type(text).__name__}: {text!r}")
    text = _CAPITALIZED.sub(lambda m: m.group(0) if m.group(0).lower() in NUMBER_WORDS else " @ ", text)
    words = _NOT_WORD.sub(" ", _NUMERAL.sub(" # ", text.lower())).split()
    out: list[str] = []
    for w in ("#" if w in NUMBER_WORDS else "@" if w in PERSONAL else w for w in words):
        if not (w == "#" and out and out[-1] == "#"):
            out.append(w)
    return " ".join(out)


def template_twins(train: Sequence[str], held_out: Sequence[str]) -> list[int]:
    """Indices (ascending) of the ``train`` texts whose :func:`masked_text` equals that of some
    ``held_out`` text: exact duplicates and problems that differ from a held-out one only in their
    numbers. Empty texts are never twins.

    Raises:
        TypeError: a text is not a string.
    """
    keys = {k for k in map(masked_text, held_out) if k}
    return [i for i, t in enumerate(train) if (k := masked_text(t)) and k in keys]
