"""How much signal a round's process critiques carry: valid-critique share, verdict lists, echo warning."""

from __future__ import annotations

from collections import Counter

from pipeline.core.critique.parse import STATUS_OK, VERDICT_STATUSES, critique_votes

ECHO_SHARE = 0.3
"""A verdict list holding more than this share of a round's non-empty verdicts is suspicious: a
critic repeating one answer (or the prompt's example) instead of judging."""


def signal_health(critiques: list[dict], flagged_step_rate: float | None = None, partial: str = "list",
                  top: int = 5) -> dict:
    """How much signal a round's process critiques carry (round summary and report).

    Args:
        critiques: critiques-table rows (``rollout_id``, ``parse_status``, ``wrong_steps``,
            ``steps_wrong_lines``); rows of empty responses (``skipped_empty_response``) are
            counted by status only.
        flagged_step_rate: share of steps the variant's voting rule flagged (from the vote stage).
        partial: ``vote.partial_critiques``, which decides whether a critique votes.
        top: how many of the most common non-empty verdict lists to return.

    Returns:
        ``responses`` (with a judged response), ``responses_with_valid_critique`` (share with at
        least one voting critique), ``critiques_by_status``, ``flagged_step_rate``,
        ``non_empty_verdicts``, ``top_verdicts`` ([[list, count], ...]), ``top_verdict_share``
        (the most common list's share of the non-empty lists, None without any) and ``warning``
        (a sentence when that share exceeds :data:`ECHO_SHARE`, else None).
    """
    statuses = Counter(c["parse_status"] for c in critiques)
    judged = [c for c in critiques if c["parse_status"] != "skipped_empty_response"]
    valid: dict[str, bool] = {}
    for c in judged:
        votes = critique_votes(c["parse_status"], c.get("wrong_steps"), c.get("steps_wrong_lines"), partial)
        valid[c["rollout_id"]] = valid.get(c["rollout_id"], False) or votes is not None
    lists = Counter(str(list(c["wrong_steps"])) for c in judged
                    if c["parse_status"] in VERDICT_STATUSES + (STATUS_OK,) and c.get("wrong_steps"))
    n = sum(lists.values())
    top_share = lists.most_common(1)[0][1] / n if n else None
    warning = None
    if top_share is not None and top_share > ECHO_SHARE:
        v = lists.most_common(1)[0][0]
        warning = (f"one verdict list, {v}, is {100 * top_share:.0f} % of the {n} non-empty verdicts (more than "
                   f"{100 * ECHO_SHARE:.0f} %): the critic may be repeating itself or the prompt rather than judging")
    return {"responses": len(valid),
            "responses_with_valid_critique": sum(valid.values()) / len(valid) if valid else None,
            "critiques_by_status": dict(statuses), "flagged_step_rate": flagged_step_rate,
            "non_empty_verdicts": n, "top_verdicts": [[v, k] for v, k in lists.most_common(top)],
            "top_verdict_share": top_share, "warning": warning}
