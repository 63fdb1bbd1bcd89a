"""Log-prob readout of the critic: P(step wrong) from one teacher-forced pass, calibrated.

Instead of sampling N critiques, the critic reads the critique prompt (the same one the sampled
critiques get, :func:`pipeline.core.critique.build_critique_messages`) followed by a forced answer
``Step 0: correct`` ... ``Step S-1: correct``; at the position after each ``Step i:`` its
next-token distribution gives ``P(" wrong")`` and ``P(" correct")``. One prefill per response
scores every step, with no sampling and nothing to parse. Each step's verdict is read given that
the steps before it were judged correct (the forced answer), which is what locating the first
error needs.

Calibration ("Calibrate Before Use", Zhao et al. 2021, arXiv 2102.09690, §4): a small model's
readout is biased toward one label whatever the input. The same prompt with a content-free
input (problem, gold answer and every step ``N/A``) measures that bias per step position, and the
readout is divided by it:

    p_i   = P(wrong) / (P(wrong) + P(correct))            at step i        (binary readout)
    c_i   = the same on the content-free input, S steps
    q_i   = (p_i / c_i) / (p_i / c_i + (1 - p_i) / (1 - c_i))              (calibrated P(wrong))

so an input the model judges exactly like the content-free one scores 0.5. ``vote.sources:
[logprob]`` uses ``q_i`` as the step weight under the ``average`` rule and ``q_i >
vote.logprob_threshold`` under the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

VERSION = "logprob-v1"
"""Names the readout (forced answer, candidate tokens, calibration) in the critique stage's key and in
every ``logprob`` critique row (``template_version`` holds the critic template, ``critic_model`` the critic)."""

CONTENT_FREE = "N/A"
"""The content-free input of the calibration (Zhao et al. 2021 use "N/A")."""

VERDICTS = (" correct", " wrong")
"""The two verdict words as they follow ``Step i:`` in every critique template."""


def verdict_token_ids(tokenizer) -> tuple[int, int]:
    """The first token of ``" correct"`` and of ``" wrong"`` under ``tokenizer``.

    Raises:
        ValueError: the two words start with the same token (the readout could not tell them apart).
    """
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in VERDICTS]
    if not ids[0] or not ids[1] or ids[0][0] == ids[1][0]:
        raise ValueError(f"the tokenizer does not tell {VERDICTS[0]!r} from {VERDICTS[1]!r} by their first token "
                         f"({ids}); the log-prob readout needs a critic whose tokenizer does")
    return ids[0][0], ids[1][0]


def forced_answer(prompt_ids: Sequence[int], n_steps: int, tokenizer) -> tuple[list[int], list[int]]:
    """The prompt followed by the forced ``Step i: correct`` lines, and where each verdict is read.

    Args:
        prompt_ids: the critique prompt's token ids with the assistant turn opened
            (:func:`pipeline.engines.base.apply_chat_template`).
        n_steps: S >= 1, the number of steps judged.
        tokenizer: the critic's tokenizer.

    Returns:
        ``(ids, positions)``: the token ids, and for each step i the index whose next-token
        distribution is step i's verdict (the last token of ``Step i:``), shape (S,).

    Raises:
        ValueError: ``n_steps < 1``.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    ids = [int(t) for t in prompt_ids]
    positions = []
    correct = tokenizer.encode(VERDICTS[0], add_special_tokens=False)
    for i in range(n_steps):
        ids += tokenizer.encode(("\n" if i else "") + f"Step {i}:", add_special_tokens=False)
        positions.append(len(ids) - 1)
        ids += correct
    return ids, positions


def binary_wrong(p_correct: float, p_wrong: float) -> float:
    """``P(wrong) / (P(wrong) + P(correct))``; 0.5 when both are 0.

    Raises:
        ValueError: a negative or non-finite probability.
    """
    for name, p in (("p_correct", p_correct), ("p_wrong", p_wrong)):
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"{name} must be a finite probability >= 0, got {p}")
    total = p_correct + p_wrong
    return 0.5 if total == 0 else p_wrong / total


def calibrate(p_wrong: float, content_free: float, eps: float = 1e-6) -> float:
    """Calibrated P(wrong) (module docstring; Zhao et al. 2021, §4, W = diag(p_cf)^-1, b = 0).

    Args:
        p_wrong: the binary readout of the step, in [0, 1].
        content_free: the binary readout at the same step position of the content-free input.
        eps: both are clipped to [eps, 1 - eps], so a certain readout stays finite.

    Returns:
        A probability in (0, 1); 0.5 when ``p_wrong == content_free``.

    Raises:
        ValueError: an argument outside [0, 1].
    """
    for name, p in (("p_wrong", p_wrong), ("content_free", content_free)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    p = min(max(p_wrong, eps), 1 - eps)
    c = min(max(content_free, eps), 1 - eps)
    w, r = p / c, (1 - p) / (1 - c)
    return w / (w + r)


READOUT_NONFINITE = "readout_nonfinite"
"""``parse_status`` of a ``logprob`` critique row whose readout was not finite (a NaN or inf
probability, e.g. an overflow in the critic's forward pass): ``step_scores`` is null and the row
gives no score (the vote reads it as no readout)."""


def binary_readout(probs: Sequence[tuple[float, float]]) -> list[float]:
    """:func:`binary_wrong` of each step's ``(P(correct), P(wrong))``; NaN at a step whose two
    probabilities are not finite and >= 0 (never raises: :func:`calibrated_scores` then gives None)."""
    out = []
    for p_correct, p_wrong in probs:
        pc, pw = float(p_correct), float(p_wrong)
        ok = math.isfinite(pc) and math.isfinite(pw) and pc >= 0 and pw >= 0
        out.append(binary_wrong(pc, pw) if ok else math.nan)
    return out


def calibrated_scores(raw: Sequence[float], content_free: Sequence[float]) -> list[float] | None:
    """:func:`calibrate` at every step, or None when a raw or content-free readout is not a finite
    probability in [0, 1] (the row is then :data:`READOUT_NONFINITE`)."""
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in (*raw, *content_free)):
        return None
    return [calibrate(p, c) for p, c in zip(raw, content_free)]


def readout_text(scores: Sequence[float], raw: Sequence[float], content_free: Sequence[float],
                 threshold: float = 0.5) -> str:
    """The readout as the critique browser and SQL show it: one line per step (numbered from 0 like a
    critique's lines) with the calibrated and raw P(wrong) and the content-free one, then the steps
    above ``threshold`` as ``Wrong step list: [...]``."""
    lines = [f"Step {i}: P(wrong) {q:.3f} (raw {p:.3f}, content-free {c:.3f})"
             for i, (q, p, c) in enumerate(zip(scores, raw, content_free))]
    lines.append(f"Wrong step list: [{', '.join(str(i) for i, q in enumerate(scores) if q > threshold)}]")
    return "\n".join(lines)


def nonfinite_text(raw: Sequence[float], content_free: Sequence[float]) -> str:
    """The raw text of a :data:`READOUT_NONFINITE` row: each step's raw and content-free P(wrong)
    (``nan`` where the critic's probabilities were not finite), and no list."""
    lines = [f"Step {i}: raw P(wrong) {p:.3f}, content-free {c:.3f}"
             + ("" if math.isfinite(p) and math.isfinite(c) else " (not finite)")
             for i, (p, c) in enumerate(zip(raw, content_free))]
    return "\n".join([*lines, "Readout not finite: no step scores"])
