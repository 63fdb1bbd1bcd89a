"""What the critic is asked, decided once: the critique mode as a tagged union, and the pure core of the
critique stage, from (prompts, steps, replies) to critiques-table rows.

:func:`critique_mode` reads the configuration's ``critique`` section once and returns one of

* :class:`ProcessCritique` (``type = "process"``): the GenPRM judges every step and ends with its list
  of wrong steps (CAPO §3); its rows vote step by step and its table is ``critiques``;
* :class:`OutcomeCritique` (``type = "outcome"``): the GenORM baseline judges only the final answer
  (CAPO §4); its rows hold a yes/no verdict and its table is ``genorm_critiques``;
* :class:`NoCritique` (``type = "none"``): no critic (the GRPO rule-reward baseline).

Every place that used to test ``critique.enabled`` and ``critique.mode`` asks the mode instead
(``mode.type``, ``mode.votes_steps``, ``mode.table``). :func:`critique_requests` and
:func:`critique_rows` are pure (no engine, no I/O): the stage's ``run`` loads the engine, sends the
requests, and commits what :func:`critique_rows` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, Union

from pipeline.core.critique.parse import (
    OUTCOME_PARSE_STATUSES,
    VERDICT_STATUSES,
    critique_regex,
    parse_critique,
    parse_outcome_verdict,
)
from pipeline.core.critique.templates import build_critique_messages, build_outcome_messages

SKIPPED_EMPTY = "skipped_empty_response"
"""``parse_status`` of a critique row of an empty response: nothing was sent to the critic."""
MALFORMED_REPLY = "malformed_reply"
"""``parse_status`` of a critique whose reply stayed malformed after the engine's retries (a served
critic answered fewer choices than asked, or a choice without its text): nothing to parse, no
vote; ``raw_text`` keeps why and an excerpt of the reply's body (:attr:`Reply.malformed`)."""


@dataclass(frozen=True)
class CritiqueJob:
    """One response to critique.

    Attributes:
        rollout_id: the response's id in the rollouts table.
        question: the problem text.
        steps: the response's S >= 1 steps (the steps table), in order.
        response_text: the whole response (what the GenORM reads).
        gold_answer: the reference final answer, or None (not in the dataset).
        reference_solution: the dataset's worked solution, or None.
        empty: the response is empty: no request is sent and its rows say ``skipped_empty_response``.
    """

    rollout_id: str
    question: str
    steps: Sequence[str]
    response_text: str
    gold_answer: str | None = None
    reference_solution: str | None = None
    empty: bool = False


class Reply(Protocol):
    """One sampled critique as the engines return it (:class:`pipeline.engines.base.Sample`).
    ``malformed`` (optional: read with ``getattr``) is set, with why and an excerpt of the reply,
    when the engine's reply stayed malformed after its retries; ``text`` is then empty."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[float] | None
    finish_reason: str | None


def reply_tokens(reply: Reply) -> int:
    """The tokens a critic generated for ``reply``: its token ids, or where the engine has none (an
    OpenAI endpoint returns no ids) its per-token log-probs; 0 when it has neither."""
    return len(reply.token_ids) or len(reply.logprobs or [])


@dataclass(frozen=True)
class ProcessCritique:
    """GenPRM: judge every step of the response in one generation (CAPO §3).

    Attributes:
        template: ``critique.template`` (:data:`pipeline.core.critique.TEMPLATES`).
        include_gold_answer: show the reference final answer.
        include_reference: show the dataset's worked solution (a reference-guided critique).
        structured_output: constrain the reply to :func:`critique_regex`.
        logprob_readout: add the critic's calibrated log-prob readout rows (the finalize step).
    """

    template: str
    include_gold_answer: bool = True
    include_reference: bool = False
    structured_output: bool = False
    logprob_readout: bool = False
    type: Literal["process"] = "process"

    table = "critiques"
    votes_steps = True
    parsed_statuses = frozenset(VERDICT_STATUSES)
    """Statuses of a critique whose verdict parsed (the rest are parse failures)."""

    @property
    def template_version(self) -> str | None:
        """The template stored with every row."""
        return self.template

    def request(self, job: CritiqueJob) -> tuple[list[dict[str, str]], str | None]:
        """The chat messages for ``job`` and the regex its reply must match (None: free text).

        Raises:
            ValueError: ``job.steps`` is empty, or an unknown template.
        """
        messages = build_critique_messages(job.question, list(job.steps),
                                           job.gold_answer if self.include_gold_answer else None, self.template,
                                           reference_solution=job.reference_solution if self.include_reference else None)
        return messages, critique_regex(len(job.steps)) if self.structured_output else None

    def read(self, text: str, n_steps: int) -> dict[str, Any]:
        """The parsed fields of a row (``parse_status``, ``wrong_steps``, ``steps_judged``,
        ``steps_wrong_lines``, ``outcome_verdict``) of one reply; never raises on any string."""
        parsed = parse_critique(text, n_steps)
        return {"outcome_verdict": None, "parse_status": parsed.status,
                "wrong_steps": list(parsed.wrong_steps) if parsed.wrong_steps is not None else None,
                "steps_judged": list(parsed.judged), "steps_wrong_lines": list(parsed.wrong_by_lines)}


@dataclass(frozen=True)
class OutcomeCritique:
    """GenORM baseline: judge only the final answer, ``Final answer correct: yes|no`` (CAPO §4).

    Attributes:
        include_gold_answer: show the reference final answer.
    """

    include_gold_answer: bool = True
    type: Literal["outcome"] = "outcome"

    table = "genorm_critiques"
    votes_steps = False
    parsed_statuses = frozenset(OUTCOME_PARSE_STATUSES[:1])
    template_version = None

    def request(self, job: CritiqueJob) -> tuple[list[dict[str, str]], str | None]:
        """The chat messages for ``job`` (the whole response) and no reply constraint."""
        return build_outcome_messages(job.question, job.response_text,
                                      job.gold_answer if self.include_gold_answer else None), None

    def read(self, text: str, n_steps: int) -> dict[str, Any]:
        """The parsed fields of a row of one reply (``outcome_verdict`` and ``parse_status``); never raises."""
        verdict, status = parse_outcome_verdict(text)
        return {"outcome_verdict": verdict, "parse_status": status, "wrong_steps": None, "steps_judged": None,
                "steps_wrong_lines": None}


@dataclass(frozen=True)
class NoCritique:
    """No critic: the GRPO rule-reward baseline (``critique.enabled: false``)."""

    type: Literal["none"] = "none"

    table = "critiques"
    votes_steps = False


CritiqueMode = Union[ProcessCritique, OutcomeCritique, NoCritique]
"""What the critic is asked; tell the cases apart by ``type``."""


def critique_mode(critique: Any) -> CritiqueMode:
    """The mode of a ``critique`` configuration section (:class:`pipeline.config.CritiqueConfig`):
    :class:`NoCritique` when ``enabled`` is false, else by ``mode``.

    Raises:
        ValueError: an unknown ``mode`` (the configuration validates it first).
    """
    if not critique.enabled:
        return NoCritique()
    if critique.mode == "process":
        return ProcessCritique(critique.template, critique.include_gold_answer, critique.include_reference,
                               critique.structured_output, critique.logprob_readout)
    if critique.mode == "outcome":
        return OutcomeCritique(critique.include_gold_answer)
    raise ValueError(f"unknown critique.mode {critique.mode!r}; valid: ['process', 'outcome']")


def critique_requests(mode: ProcessCritique | OutcomeCritique,
                      jobs: Sequence[CritiqueJob]) -> tuple[list[list[dict[str, str]]], list[str] | None]:
    """The requests of the jobs that are not empty, in order: their chat messages and, when the mode
    constrains replies, one regex each (else None)."""
    built = [mode.request(j) for j in jobs if not j.empty]
    regexes = [r for _, r in built]
    return [m for m, _ in built], (regexes if any(r is not None for r in regexes) else None)


def critique_rows(mode: ProcessCritique | OutcomeCritique, jobs: Sequence[CritiqueJob],
                  replies: dict[str, Sequence[Reply]], n: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Critiques-table rows (:data:`pipeline.schemas.CRITIQUES_SCHEMA`, ``source = 'llm'``): ``n`` per job,
    in job order then ``critique_idx``.

    A job with replies gets one parsed row per reply (``mode.read``); a reply the engine marked
    malformed (``malformed`` set) gets a row ``malformed_reply`` (:data:`MALFORMED_REPLY`) that
    votes nothing, its ``raw_text`` the marker's text; a job without replies (an empty response)
    gets ``n`` rows ``skipped_empty_response`` with empty text. Pure: no engine, no I/O.

    Args:
        mode: the critique mode.
        jobs: the responses, with their steps.
        replies: per ``rollout_id`` of a judged job, its ``n`` sampled critiques.
        n: critiques per response (``critique.num_critiques``).
        base: the columns every row shares (``run_id``, ``round``, ``critic_model``).

    Raises:
        ValueError: a judged job with fewer than ``n`` replies, or a job that is not empty with no
            replies at all (named: only an empty response goes unjudged).
    """
    rows = []
    shared = {**base, "source": "llm", "mode": mode.type, "template_version": mode.template_version,
              "include_gold_answer": mode.include_gold_answer}
    for job in jobs:
        got = replies.get(job.rollout_id)
        if got is None and not job.empty and n > 0:
            raise ValueError(f"rollout {job.rollout_id} is not empty and has no critiques; every non-empty "
                             "response is judged (a job without replies must be an empty response)")
        if got is not None and len(got) < n:
            raise ValueError(f"rollout {job.rollout_id} has {len(got)} critiques, {n} were asked for")
        for k in range(n):
            row = {**shared, "rollout_id": job.rollout_id, "critique_idx": k, "n_steps": len(job.steps)}
            if got is None:
                row.update(raw_text="", critic_tokens=0, finish_reason=None, outcome_verdict=None,
                           wrong_steps=None, steps_judged=None, steps_wrong_lines=None, parse_status=SKIPPED_EMPTY)
            elif bad := getattr(got[k], "malformed", None):
                row.update(raw_text=bad, critic_tokens=0, finish_reason=None,
                           **{**mode.read("", len(job.steps)), "parse_status": MALFORMED_REPLY})
            else:
                s = got[k]
                row.update(raw_text=s.text, critic_tokens=reply_tokens(s),
                           finish_reason=s.finish_reason, **mode.read(s.text, len(job.steps)))
            rows.append(row)
    return rows
