"""Answer checking with math-verify: one response (:func:`verify_answer`) or many in a process
pool (:func:`grade`), used by the verify stage, the held-out eval and the benchmarks.

math-verify enforces its timeouts with ``signal.alarm``, which works only in a process's main
thread; :func:`grade` therefore runs it in the main threads of a ``spawn`` process pool.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor


def verify_answer(gold: str, response: str) -> tuple[str | None, bool, str]:
    """Grade one response with math-verify (call in a process's main thread).

    Returns:
        (extracted answer or None, correct, status) with status ``ok`` | ``no_answer`` |
        ``no_gold`` | ``error:<ExceptionType>``.
    """
    from math_verify import parse, verify

    try:
        # math-verify finds LaTeX only inside delimiters: a bare gold such as ``\\sqrt{2}`` or
        # ``2\\pi`` must be wrapped too, or it parses to nothing (or to ``2``).
        delimited = any(d in gold.replace("\\$", "") for d in ("$", "\\boxed", "\\(", "\\["))  # \\$ is a dollar sign
        gold_parsed = parse(gold if delimited else f"${gold}$")
        if not gold_parsed:
            return None, False, "no_gold"
        pred = parse(response)
        if not pred:
            return None, False, "no_answer"
        return str(pred[-1]), bool(verify(gold_parsed, pred)), "ok"
    except Exception as e:  # math-verify raises many types on odd LaTeX; record it as data
        return None, False, f"error:{type(e).__name__}"


def _grade_chunk(pairs: list[tuple[str, str]]) -> list[tuple[str | None, bool, str]]:
    return [verify_answer(g, r) for g, r in pairs]


def grade(pairs: list[tuple[str, str]], workers: int = 2, chunk: int = 64) -> list[tuple[str | None, bool, str]]:
    """math-verify ``(gold, response)`` pairs in a spawn process pool (main threads, so its
    ``signal.alarm`` timeouts work); returns ``(extracted, correct, status)`` per pair, in order
    (:func:`verify_answer`)."""
    if not pairs:
        return []
    chunks = [pairs[i : i + chunk] for i in range(0, len(pairs), chunk)]
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(chunks))), mp_context=mp.get_context("spawn")) as pool:
        return [x for part in pool.map(_grade_chunk, chunks) for x in part]
