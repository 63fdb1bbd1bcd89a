"""Vote N parsed critiques of one response into one process weight per step.

CAPO (arXiv 2508.02298) §3 samples several critiques per response and combines their wrong-step
lists by intersection, union or majority voting (the paper's Figure 2 votes ``[1,3]``,
``[1,2,3]``, ``[1,3]``, ``[2,3]``); it names an "average" rule without defining it, and
docs/design.md §1.6 reads it as the share of critiques that flag a step.

A weight ``w_s`` in [0, 1] says how strongly step ``s`` is judged wrong; ``rewards.token_rewards``
turns it into the process penalty ``-P * w``. Failed critiques (parse failures) do not vote; a
step seen by no valid critique gets weight 0 (no process penalty) under every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# rule(n_flagged, n_valid, majority_threshold) -> bool/float weights; n_valid > 0 everywhere
# it is called (vote() handles n_valid == 0).
VoteRule = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def _intersection(n_flagged: np.ndarray, n_valid: np.ndarray, _: float) -> np.ndarray:
    return n_flagged == n_valid  # every valid critique flags the step


def _union(n_flagged: np.ndarray, n_valid: np.ndarray, _: float) -> np.ndarray:
    return n_flagged > 0  # any valid critique flags the step


def _majority(n_flagged: np.ndarray, n_valid: np.ndarray, threshold: float) -> np.ndarray:
    return n_flagged / n_valid > threshold  # strictly more than the threshold share


def _average(n_flagged: np.ndarray, n_valid: np.ndarray, _: float) -> np.ndarray:
    return n_flagged / n_valid  # share of critiques flagging the step (our reading)


VOTING_RULES: dict[str, VoteRule] = {
    "intersection": _intersection,
    "union": _union,
    "majority": _majority,
    "average": _average,
}


GRADED_RULES = frozenset({"average"})
"""The rules whose weight is a share in [0, 1], not a yes/no: under them a step score (the
log-prob readout's probability that a step is wrong) is the weight itself (:func:`score_weights`)."""


def score_weights(scores: np.ndarray, rule: str, threshold: float) -> np.ndarray:
    """Step weights from step scores in [0, 1] (the critic's log-prob readout), the way ``rule``
    turns votes into weights: a graded rule (:data:`GRADED_RULES`) keeps the score, the others flag a
    step whose score is above ``threshold`` (``vote.logprob_threshold``; docs/design.md on the readout).

    Args:
        scores: (S,) float scores in [0, 1].
        rule: a key of ``VOTING_RULES``.
        threshold: a score above it flags the step (yes/no rules).

    Returns:
        (S,) float32 weights in [0, 1].

    Raises:
        ValueError: unknown ``rule`` (lists the valid ones).
    """
    if rule not in VOTING_RULES:
        raise ValueError(f"unknown voting rule {rule!r}; valid rules: {sorted(VOTING_RULES)}")
    q = np.asarray(scores, dtype=np.float32)
    return q if rule in GRADED_RULES else (q > threshold).astype(np.float32)


def flag_counts(
    wrong_steps_per_critique: Sequence[tuple[int, ...] | None], n_steps: int
) -> tuple[int, np.ndarray]:
    """Count, per step, the valid critiques that flag it.

    Args:
        wrong_steps_per_critique: one entry per critique of a response: the 0-indexed wrong
            steps (``ParsedCritique.wrong_steps``), or None for a failed critique (it does not
            vote).
        n_steps: S, the number of steps of the response.

    Returns:
        ``(n_valid, n_flagged)``: the number of non-None critiques, and (S,) int32 counts
        ``n_flagged[s]`` = number of valid critiques listing step ``s`` (a step listed twice by
        one critique counts once).

    Raises:
        ValueError: a step index outside ``[0, n_steps)``.
    """
    n_flagged_S = np.zeros(n_steps, dtype=np.int32)
    n_valid = 0
    for wrong_steps in wrong_steps_per_critique:
        if wrong_steps is None:
            continue
        n_valid += 1
        idx = np.unique(np.asarray(wrong_steps, dtype=np.int64))
        if idx.size and (idx[0] < 0 or idx[-1] >= n_steps):
            raise ValueError(
                f"wrong step indices {tuple(wrong_steps)} must lie in [0, {n_steps}); "
                "parse critiques with parse_critique(text, n_steps) first"
            )
        n_flagged_S[idx] += 1
    return n_valid, n_flagged_S


def vote(
    n_flagged: np.ndarray,
    n_valid: np.ndarray | int,
    rule: str,
    majority_threshold: float = 0.5,
) -> np.ndarray:
    """Per-step process weights from flag counts (CAPO §3 voting; docs/design.md §1.6).

    * ``intersection``: 1 iff ``n_valid > 0`` and every valid critique flags the step;
    * ``union``: 1 iff at least one valid critique flags the step;
    * ``majority``: 1 iff ``n_flagged / n_valid > majority_threshold`` (strictly: with the
      default 0.5, 2 of 4 is not a majority);
    * ``average``: ``n_flagged / n_valid``.

    ``n_valid == 0`` gives weight 0 under every rule (no valid critique, no process penalty).

    Args:
        n_flagged: (...,) int, valid critiques flagging each step.
        n_valid: int array broadcastable to ``n_flagged`` (e.g. a scalar per response, or (...,)
            per step for a flat batch of many responses' steps).
        rule: a key of ``VOTING_RULES``.
        majority_threshold: share in [0, 1) that a majority must exceed (used by ``majority``).

    Returns:
        float32 weights in [0, 1], shape ``broadcast(n_flagged, n_valid)``.

    Raises:
        ValueError: unknown ``rule`` (lists the valid ones); ``majority_threshold`` outside
            [0, 1); negative counts or ``n_flagged > n_valid``.
    """
    try:
        rule_fn = VOTING_RULES[rule]
    except KeyError:
        raise ValueError(
            f"unknown voting rule {rule!r}; valid rules: {sorted(VOTING_RULES)}"
        ) from None
    if not 0.0 <= majority_threshold < 1.0:
        raise ValueError(f"majority_threshold must be in [0, 1), got {majority_threshold}")
    flagged, valid = np.broadcast_arrays(
        np.asarray(n_flagged, dtype=np.float64), np.asarray(n_valid, dtype=np.float64)
    )
    if np.any(flagged < 0) or np.any(flagged > valid):
        i = int(np.flatnonzero((flagged < 0) | (flagged > valid))[0])
        raise ValueError(f"flag counts must satisfy 0 <= n_flagged <= n_valid; step {i} has n_flagged "
                         f"{flagged.flat[i]:g} and n_valid {valid.flat[i]:g}")
    has_votes = valid > 0
    safe_valid = np.where(has_votes, valid, 1.0)
    weights = rule_fn(flagged, safe_valid, majority_threshold).astype(np.float64)
    return np.where(has_votes, weights, 0.0).astype(np.float32)
