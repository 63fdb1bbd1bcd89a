"""The parser of the critic's verdicts: per-step lines and the final wrong-step list (GenPRM), the
yes/no verdict (GenORM), what a parsed critique votes, and the regular expression a structured
critique must match. Pure: strings in, data out.

Malformed critic output is data, not an error: :func:`parse_critique` never raises on any string and
returns a status from :data:`PARSE_STATUSES` that the critiques table counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STATUS_OK = "ok"  # GenORM verdicts; process critiques written before per-step parsing (read as complete)
STATUS_COMPLETE = "complete"  # every step has a line, and the lines agree with the final list
STATUS_INCOMPLETE = "incomplete"  # the final list parsed, but some steps have no line of their own
STATUS_INCONSISTENT = "inconsistent"  # a step's own line and the final list disagree
STATUS_EMPTY = "empty"  # blank critic output
STATUS_NO_VERDICT = "no_verdict"  # no `Wrong step list:` line
STATUS_NOT_A_LIST = "not_a_list"  # the verdict is not `[i, j, ...]` of non-negative integers
STATUS_OUT_OF_RANGE = "out_of_range"  # an index >= n_steps
STATUS_DUPLICATE = "duplicate"  # an index listed twice
VERDICT_STATUSES = (STATUS_COMPLETE, STATUS_INCOMPLETE, STATUS_INCONSISTENT)
"""Statuses of a critique whose final list parsed (it can vote, per ``vote.partial_critiques``)."""
PARSE_STATUSES = (
    *VERDICT_STATUSES,
    STATUS_EMPTY,
    STATUS_NO_VERDICT,
    STATUS_NOT_A_LIST,
    STATUS_OUT_OF_RANGE,
    STATUS_DUPLICATE,
)
STATUS_NOT_YES_NO = "not_yes_no"  # GenORM: the verdict is neither yes nor no
OUTCOME_PARSE_STATUSES = (STATUS_OK, STATUS_EMPTY, STATUS_NO_VERDICT, STATUS_NOT_YES_NO)

PARSER_VERSION = "steps-and-list-v2"
"""Version of :func:`parse_critique`'s output (in the critique stage's key): v2 reads the per-step
lines as well as the final list (statuses complete / incomplete / inconsistent)."""


@dataclass(frozen=True)
class ParsedCritique:
    """One parsed critique.

    Attributes:
        wrong_steps: the final list: sorted 0-indexed steps it calls wrong (``()`` = all right),
            or None when it did not parse (a failure status).
        status: one of ``PARSE_STATUSES``.
        judged: sorted steps that have a line of their own (``Step i: correct`` / ``wrong``).
        wrong_by_lines: sorted steps whose own line calls them wrong.
    """

    wrong_steps: tuple[int, ...] | None
    status: str
    judged: tuple[int, ...] = ()
    wrong_by_lines: tuple[int, ...] = ()

    def votes(self, partial: str = "list") -> tuple[int, ...] | None:
        """The wrong steps this critique votes for, or None when it does not vote.

        ``complete`` (and legacy ``ok``) critiques vote their list. ``incomplete`` and
        ``inconsistent`` ones vote per ``partial`` (``vote.partial_critiques``): ``list`` their
        final list, ``lines`` the steps their own lines call wrong, ``drop`` not at all. Failure
        statuses never vote.

        Raises:
            ValueError: unknown ``partial`` (lists the valid ones).
        """
        return critique_votes(self.status, self.wrong_steps, self.wrong_by_lines, partial)


PARTIAL_POLICIES = ("list", "lines", "drop")
"""How ``incomplete`` / ``inconsistent`` critiques vote (``vote.partial_critiques``)."""


def critique_votes(status: str, listed, wrong_by_lines, partial: str = "list") -> tuple[int, ...] | None:
    """What a critique row votes (see :meth:`ParsedCritique.votes`): its status, final list
    (None when unparsed) and steps its lines call wrong (None in tables from before per-step
    parsing, read as the list).

    Args:
        status: the row's ``parse_status``.
        listed: the row's ``wrong_steps`` (a sequence of step indices, or None).
        wrong_by_lines: the row's ``steps_wrong_lines`` (a sequence of step indices, or None).
        partial: ``vote.partial_critiques``, one of :data:`PARTIAL_POLICIES`.

    Returns:
        The step indices the row votes wrong, or None when it casts no vote.

    Raises:
        ValueError: an unknown ``partial`` policy (the valid ones listed).
    """
    if partial not in PARTIAL_POLICIES:
        raise ValueError(f"unknown partial-critique policy {partial!r}; valid: {list(PARTIAL_POLICIES)}")
    if status in (STATUS_COMPLETE, STATUS_OK):
        return None if listed is None else tuple(listed)
    if status not in (STATUS_INCOMPLETE, STATUS_INCONSISTENT) or listed is None:
        return None
    if partial == "drop":
        return None
    if partial == "lines" and wrong_by_lines is not None:
        return tuple(wrong_by_lines)
    return tuple(listed)


_MARKUP = "*_`~ \t"  # markdown the critic may wrap around the verdict
_VERDICT = re.compile(r"wrong\s+step\s+list[\s*_`]*:", re.IGNORECASE)  # one repeat before ':': linear time
_INT_LIST = re.compile(r"\[\s*(?:[0-9]+\s*(?:,\s*[0-9]+\s*)*,?\s*)?\]")


def _last_verdict(text: str, label: re.Pattern[str]) -> str | None:
    """What follows ``label`` on the last line holding it (markdown and a final period
    stripped), or None when no line holds it."""
    for line in reversed(text.splitlines()):
        matches = list(label.finditer(line[:_MAX_LINE]))  # a verdict sits in a line's first 2,000 characters
        if matches:
            rest = line[matches[-1].end() :]
            return rest.strip(_MARKUP).rstrip(".").strip(_MARKUP)
    return None


_STEP_LINE = re.compile(r"[\s*_`#>|-]{0,8}step[\s*_`]{0,3}(\d{1,6})[\s*_`]{0,3}[:.)\-\u2013\u2014][\s*_`]{0,3}",
                        re.IGNORECASE)
_JUDGMENT = re.compile(r"(not\s{1,3})?(correct|right|ok|okay|valid|true|fine|wrong|incorrect|error|invalid|false|"
                       r"flawed|mistaken|mistake)\b", re.IGNORECASE)
_WRONG_WORDS = frozenset({"wrong", "incorrect", "error", "invalid", "false", "flawed", "mistaken", "mistake"})
_MAX_LINE = 2000  # judgments sit at a line's start; longer lines are cut before matching (linear time)


def parse_step_lines(text: str, n_steps: int) -> dict[int, bool]:
    """The per-step judgments of a critique: ``{step: wrong}`` from lines such as ``Step 2: wrong -
    ...``, ``**Step 0:** correct``, ``Step 1 - incorrect``, ``Step 3: not correct``.

    A line judges a step when it starts (after markdown) with ``Step i`` and a separator and then
    a judgment word; a line that goes on with anything else (an echoed step, a copied ``<...>``
    placeholder) judges nothing, and so does an index outside ``[0, n_steps)``. Lines from the
    last ``Wrong step list:`` line on are not read; a step judged twice keeps its last line.
    Never raises on any string.
    """
    lines = text.splitlines() if isinstance(text, str) else []
    for k in range(len(lines) - 1, -1, -1):  # stop at the final verdict line
        if _VERDICT.search(lines[k][:_MAX_LINE]):
            lines = lines[:k]
            break
    out: dict[int, bool] = {}
    for line in lines:
        m = _STEP_LINE.match(line[:_MAX_LINE])
        if m is None:
            continue
        i = int(m.group(1))
        j = _JUDGMENT.match(line, m.end(), min(len(line), m.end() + 40))
        if j is None or i >= n_steps:
            continue
        out[i] = (j.group(2).lower() in _WRONG_WORDS) != (j.group(1) is not None)
    return out


def parse_critique(text: str, n_steps: int) -> ParsedCritique:
    """Read a critique: its per-step lines and its final list (the LAST line holding
    ``Wrong step list:``).

    The list: case-insensitive; markdown around it is tolerated (``**Wrong step list:** [1, 3]``,
    backticks, a trailing period); it must be a bracketed list of non-negative integers (``[]``
    means every step is right). The lines: :func:`parse_step_lines`. Source: docs/design.md §1.5
    (every step accounted for).

    Args:
        text: raw critic output (any string; never raises).
        n_steps: S, the number of steps shown to the critic.

    Returns:
        ``ParsedCritique``. Failure statuses, checked in this order: ``empty`` (blank text),
        ``no_verdict`` (no list line), ``not_a_list`` (e.g. ``[1, two]``, ``none``, ``1,2``),
        ``out_of_range`` (an index >= n_steps), ``duplicate`` (an index repeated). Otherwise
        ``inconsistent`` when a step's own line and the list disagree about it, else
        ``incomplete`` when some step has no line, else ``complete``.

    Raises:
        ValueError: ``n_steps`` < 0 (a caller bug, not critic output).
    """
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}")
    if not isinstance(text, str) or not text.strip():
        return ParsedCritique(None, STATUS_EMPTY)
    lines = parse_step_lines(text, n_steps)
    judged = tuple(sorted(lines))
    by_lines = tuple(sorted(i for i, w in lines.items() if w))
    verdict = _last_verdict(text, _VERDICT)
    if verdict is None:
        return ParsedCritique(None, STATUS_NO_VERDICT, judged, by_lines)
    if len(verdict) > _MAX_LINE or not _INT_LIST.fullmatch(verdict):
        return ParsedCritique(None, STATUS_NOT_A_LIST, judged, by_lines)
    tokens = re.findall(r"[0-9]+", verdict)
    if any(len(t) > 6 for t in tokens):  # no solution has a million steps (and int() of 4,300+ digits raises)
        return ParsedCritique(None, STATUS_OUT_OF_RANGE, judged, by_lines)
    indices = [int(tok) for tok in tokens]
    if any(i >= n_steps for i in indices):
        return ParsedCritique(None, STATUS_OUT_OF_RANGE, judged, by_lines)
    if len(set(indices)) != len(indices):
        return ParsedCritique(None, STATUS_DUPLICATE, judged, by_lines)
    listed = set(indices)
    if any(lines[i] != (i in listed) for i in lines):
        status = STATUS_INCONSISTENT
    elif len(lines) < n_steps:
        status = STATUS_INCOMPLETE
    else:
        status = STATUS_COMPLETE
    return ParsedCritique(tuple(sorted(indices)), status, judged, by_lines)


STRUCTURED_VERSION = "lines-then-sorted-list-v2"
"""Version of :func:`critique_regex` (in the critique stage's key when ``critique.structured_output``
is on). v2: a wrong step's reason is unbounded (v1 held it to 160 characters)."""

REASON_CHARS: int | None = None
"""Longest reason a structured critique may give for a wrong step (characters); None: unbounded, the
critique's length held by ``critique.sampling.max_tokens`` alone. A bound costs compile time in the
structured-output backend (xgrammar) that grows with it, whatever the step count: 160 characters
took 2.8 to 3.2 s per step count on a 2-core Zen 4 EPYC, and 7.4 to 8.4 s with one compile
thread beside other work (docs/changelog.md, "Earlier measurements"), near or past vLLM's 5 s
regex compile timeout (``VLLM_REGEX_COMPILATION_TIMEOUT_S``); unbounded, 0.01 s (1 step) to
0.24 s (20 steps). ``benchmarks/bench_structured.py`` measures it."""


def critique_regex(n_steps: int, reason_chars: int | None = REASON_CHARS) -> str:
    """The regular expression a structured critique of an ``n_steps``-step solution must match
    in full (``critique.structured_output``; vLLM structured outputs).

    Exactly one line per step, in order, ``Step i: correct`` or ``Step i: wrong - <reason>``
    (reason: at least one character, no line break, at most ``reason_chars`` when given), then
    ``Wrong step list: [...]`` whose indices are strictly increasing and in ``[0, n_steps)`` (so
    never ``duplicate`` or ``out_of_range``). The list is not tied to the lines (that would take
    2^S grammar states): a critique whose list contradicts its own lines is still possible and is
    parsed as ``inconsistent``. Any text matching it parses (:func:`parse_critique`) as
    ``complete`` or ``inconsistent``; a critique cut by ``max_tokens`` before its list parses as
    ``incomplete`` or ``no_verdict``, as free text does.

    Size: O(S^2) characters (the increasing list: ``[`` then a first index i and, for each later
    index j > i, an optional ``, j``).

    Raises:
        ValueError: ``n_steps`` < 1 or ``reason_chars`` < 1.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1 (a response has at least one step), got {n_steps}")
    if reason_chars is not None and reason_chars < 1:
        raise ValueError(f"reason_chars must be >= 1 or None (unbounded), got {reason_chars}")
    reason = r"[^\n]+" if reason_chars is None else rf"[^\n]{{1,{reason_chars}}}"
    lines = "".join(rf"Step {i}: (?:correct|wrong - {reason})\n" for i in range(n_steps))
    firsts = "|".join(f"{i}" + "".join(f"(?:, {j})?" for j in range(i + 1, n_steps)) for i in range(n_steps))
    return rf"{lines}Wrong step list: \[(?:{firsts})?\]"


_OUTCOME_VERDICT = re.compile(r"final\s+answer\s+correct[\s*_`]*:", re.IGNORECASE)


def parse_outcome_verdict(text: str) -> tuple[bool | None, str]:
    """Read a GenORM verdict: the LAST line holding ``Final answer correct:``.

    Case-insensitive, markdown and a trailing period tolerated; the verdict must be ``yes``
    or ``no``. Never raises on any string.

    Returns:
        ``(True | False, "ok")``, or ``(None, status)`` with status in
        ``OUTCOME_PARSE_STATUSES`` (``empty``, ``no_verdict``, ``not_yes_no``).
    """
    if not isinstance(text, str) or not text.strip():
        return None, STATUS_EMPTY
    verdict = _last_verdict(text, _OUTCOME_VERDICT)
    if verdict is None:
        return None, STATUS_NO_VERDICT
    word = verdict.lower()
    if word in ("yes", "no"):
        return word == "yes", STATUS_OK
    return None, STATUS_NOT_YES_NO
