"""Answer checking with math-verify: one response (:func:`verify_answer`) or many in a process
pool (:func:`grade`), used by the verify stage, the held-out eval and the benchmarks.

What counts as an answer is ``verify.answer`` and ``verify.truncated`` (:class:`pipeline.config.VerifyConfig`):
by default only a ``\\boxed{}`` answer of a response that finished (the instruction asks for one),
as the field's rule-based math rewards do; ``answer="any"`` is math-verify's own default extraction
(the last LaTeX or plain number anywhere in the text), which credits a response cut off mid-sentence
whose last number happens to equal the gold answer.

math-verify enforces its timeouts with ``signal.alarm``, which works only in a process's main
thread; :func:`grade` therefore runs it in the main threads of a ``spawn`` process pool.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

ANSWER_MODES = ("boxed", "any")
"""``boxed``: the content of ``\\boxed{...}`` (math-verify's LaTeX extraction, boxed first, no
unanchored fallback); ``any``: math-verify's default extraction (LaTeX and plain expressions)."""
TRUNCATED_MODES = ("zero", "grade")
"""``zero``: a response cut at the token budget (``finish_reason == "length"``) is wrong with status
``truncated`` (its extracted answer is still recorded); ``grade``: graded like any other."""


def verify_answer(gold: str, response: str, answer: str = "boxed") -> tuple[str | None, bool, str]:
    """Grade one response with math-verify (call in a process's main thread).

    Args:
        gold: the gold answer (bare LaTeX or number, or delimited).
        response: the policy's response text.
        answer: one of :data:`ANSWER_MODES`.

    Returns:
        (extracted answer or None, correct, status) with status ``ok`` | ``no_answer`` |
        ``no_gold`` | ``error:<ExceptionType>``.

    Raises:
        ValueError: ``answer`` is not one of :data:`ANSWER_MODES`.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    if answer not in ANSWER_MODES:
        raise ValueError(f"answer={answer!r}; valid: {ANSWER_MODES}")
    try:
        # math-verify finds LaTeX only inside delimiters: a bare gold such as ``\\sqrt{2}`` or
        # ``2\\pi`` must be wrapped too, or it parses to nothing (or to ``2``).
        delimited = any(d in gold.replace("\\$", "") for d in ("$", "\\boxed", "\\(", "\\["))  # \\$ is a dollar sign
        gold_parsed = parse(gold if delimited else f"${gold}$")
        if not gold_parsed:
            return None, False, "no_gold"
        if answer == "boxed":
            if "\\boxed" not in response:
                return None, False, "no_answer"
            pred = parse(response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0,
                                                                            try_extract_without_anchor=False)])
        else:
            pred = parse(response)
        if not pred:
            return None, False, "no_answer"
        return str(pred[-1]), bool(verify(gold_parsed, pred)), "ok"
    except Exception as e:  # math-verify raises many types on odd LaTeX; record it as data
        return None, False, f"error:{type(e).__name__}"


def _grade_chunk(args: tuple[list[tuple[str, str]], str]) -> list[tuple[str | None, bool, str]]:
    pairs, answer = args
    return [verify_answer(g, r, answer) for g, r in pairs]


def grade(pairs: list[tuple[str, str]], workers: int = 2, chunk: int = 64, *, answer: str = "boxed",
          finish_reasons: list[str | None] | None = None, truncated: str = "zero") -> list[tuple[str | None, bool, str]]:
    """math-verify ``(gold, response)`` pairs in a spawn process pool (main threads, so its
    ``signal.alarm`` timeouts work); returns ``(extracted, correct, status)`` per pair, in order
    (:func:`verify_answer`).

    With ``finish_reasons`` (one per pair, the engine's) and ``truncated="zero"``, a response whose
    finish reason is ``length`` gets ``correct=False`` and status ``truncated``, its extracted answer
    kept for the record.

    Raises:
        ValueError: ``answer`` or ``truncated`` is not a valid mode, or ``finish_reasons`` has
            another length than ``pairs``.
    """
    if answer not in ANSWER_MODES:
        raise ValueError(f"answer={answer!r}; valid: {ANSWER_MODES}")
    if truncated not in TRUNCATED_MODES:
        raise ValueError(f"truncated={truncated!r}; valid: {TRUNCATED_MODES}")
    if finish_reasons is not None and len(finish_reasons) != len(pairs):
        raise ValueError(f"{len(finish_reasons)} finish_reasons for {len(pairs)} pairs")
    if not pairs:
        return []
    chunks = [(pairs[i : i + chunk], answer) for i in range(0, len(pairs), chunk)]
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(chunks))), mp_context=mp.get_context("spawn")) as pool:
        out = [x for part in pool.map(_grade_chunk, chunks) for x in part]
    if finish_reasons is not None and truncated == "zero":
        out = [(ext, False, "truncated") if fin == "length" else (ext, ok, st)
               for (ext, ok, st), fin in zip(out, finish_reasons)]
    return out
