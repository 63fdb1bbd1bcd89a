"""The format of a policy's answer, apart from whether it is right: cut at the token budget, boxed,
a program, or other.

A policy can gain held-out accuracy without reasoning better, by learning to finish inside the
budget or to put its answer in ``\\boxed{}`` where the verifier looks (``verify.answer: boxed``).
The learning benchmarks break every eval down by these formats and compare arms within finished,
boxed answers, where that gain does not count.
"""

from __future__ import annotations

import re

PROGRAM = re.compile(r"```|^\s*(?:def \w+\(|import \w|from \w+ import|print\()", re.M)
"""A response that contains a program: a fenced code block, or a line that defines a function,
imports or prints (a coder policy's way of answering without a boxed result)."""

FORMAT_CODE = {"cut": "c", "boxed": "b", "program": "p", "other": "o"}
"""One letter per format of :func:`answer_format`, for compact per-item records."""


def answer_format(text: str | None, finish_reason: str | None) -> str:
    """One answer's format, the first that applies: ``cut`` (``finish_reason == "length"``: stopped
    at the token budget), ``boxed`` (finished, and contains ``\\boxed``), ``program`` (finished, no
    box, contains a program: :data:`PROGRAM`), ``other`` (finished, neither).

    Args:
        text: the response text (None reads as empty).
        finish_reason: the engine's finish reason (``"length"``, ``"stop"``, ...).
    """
    text = text or ""
    if finish_reason == "length":
        return "cut"
    if "\\boxed" in text:
        return "boxed"
    return "program" if PROGRAM.search(text) else "other"
