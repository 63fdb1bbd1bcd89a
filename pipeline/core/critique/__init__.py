"""The GenPRM critic: its prompts, how judged text is escaped, the parser of its verdicts, the signal
health of a round, and the critique mode (pure: strings in, data out).

CAPO (arXiv 2508.02298) §3 asks an off-the-shelf instruction model ("LLM-as-GenPRM") to judge
every step of a rollout in one generation and to end with the list of wrong steps. The authors
released no prompt; this template is ours (docs/design.md §1.4-1.5). Any change to the wording
must bump ``TEMPLATE_VERSION``, which is stored with every critique.

Malformed critic output is data, not an error: ``parse_critique`` never raises on any string
and returns a status from ``PARSE_STATUSES`` that the critiques table counts. It reads the
per-step lines as well as the final list, so a critique that judged only some steps, or whose
lines contradict its list, is recorded as such (``incomplete``, ``inconsistent``) instead of
passing as a verdict on every step; ``vote.partial_critiques`` decides how those vote.

Templates (``critique.template``; the version is in the critique stage's key and in every row):

* ``capo-genprm-v1``: the first template. Its worked example ends in ``Wrong step list: [1]``
  with a reason about ``12 * 3``; small critics copied both (most non-empty verdicts of
  a default round were exactly ``[1]``).
* ``capo-genprm-v2``: the same instructions with no verdict to copy: the output format is shown
  with one placeholder line per step of *this* solution (``Step i: <correct, or wrong - the
  reason>``) and a placeholder list; a copied placeholder is not a judgment (the parser skips it
  and the list fails as ``not_a_list``).
* ``capo-genprm-v3``: v1's instructions with a worked example that changes with the solution being
  judged: a 3-step arithmetic example whose numbers and whose wrong step (step 0, 1, 2, or none)
  are drawn from a hash of the problem and the steps (:func:`worked_example`), so a critic that
  copies the example copies a different verdict each time instead of one list for every response.

Modules: :mod:`~pipeline.core.critique.templates` (the prompts), :mod:`~pipeline.core.critique.escape`
(judged text as data), :mod:`~pipeline.core.critique.parse` (verdicts, votes, the structured-output
regex), :mod:`~pipeline.core.critique.health` (signal health), :mod:`~pipeline.core.critique.mode`
(the critique mode and the stage's pure core). Their public names are importable from here.
"""

from pipeline.core.critique.escape import (
    DATA_ESCAPE_VERSION,
    OUTCOME_DATA_ESCAPE_VERSION,
    as_data,
    defuse_tags,
    reference_text,
)
from pipeline.core.critique.health import ECHO_SHARE, signal_health
from pipeline.core.critique.mode import (
    MALFORMED_REPLY,
    SKIPPED_EMPTY,
    CritiqueJob,
    CritiqueMode,
    NoCritique,
    OutcomeCritique,
    ProcessCritique,
    critique_mode,
    critique_requests,
    critique_rows,
    reply_tokens,
)
from pipeline.core.critique.parse import (
    OUTCOME_PARSE_STATUSES,
    PARSE_STATUSES,
    PARSER_VERSION,
    PARTIAL_POLICIES,
    REASON_CHARS,
    STATUS_COMPLETE,
    STATUS_DUPLICATE,
    STATUS_EMPTY,
    STATUS_INCOMPLETE,
    STATUS_INCONSISTENT,
    STATUS_NO_VERDICT,
    STATUS_NOT_A_LIST,
    STATUS_NOT_YES_NO,
    STATUS_OK,
    STATUS_OUT_OF_RANGE,
    STRUCTURED_VERSION,
    VERDICT_STATUSES,
    ParsedCritique,
    critique_regex,
    critique_votes,
    parse_critique,
    parse_outcome_verdict,
    parse_step_lines,
)
from pipeline.core.critique.templates import (
    TEMPLATE_V1,
    TEMPLATE_V2,
    TEMPLATE_V3,
    TEMPLATE_VERSION,
    TEMPLATES,
    build_critique_messages,
    build_outcome_messages,
    worked_example,
)

__all__ = [
    "DATA_ESCAPE_VERSION",
    "OUTCOME_DATA_ESCAPE_VERSION",
    "ECHO_SHARE",
    "OUTCOME_PARSE_STATUSES",
    "PARSER_VERSION",
    "PARSE_STATUSES",
    "PARTIAL_POLICIES",
    "REASON_CHARS",
    "MALFORMED_REPLY",
    "SKIPPED_EMPTY",
    "STATUS_COMPLETE",
    "STATUS_DUPLICATE",
    "STATUS_EMPTY",
    "STATUS_INCOMPLETE",
    "STATUS_INCONSISTENT",
    "STATUS_NOT_A_LIST",
    "STATUS_NOT_YES_NO",
    "STATUS_NO_VERDICT",
    "STATUS_OK",
    "STATUS_OUT_OF_RANGE",
    "STRUCTURED_VERSION",
    "TEMPLATES",
    "TEMPLATE_V1",
    "TEMPLATE_V2",
    "TEMPLATE_V3",
    "TEMPLATE_VERSION",
    "VERDICT_STATUSES",
    "CritiqueJob",
    "CritiqueMode",
    "NoCritique",
    "OutcomeCritique",
    "ParsedCritique",
    "ProcessCritique",
    "as_data",
    "build_critique_messages",
    "build_outcome_messages",
    "critique_mode",
    "critique_regex",
    "critique_requests",
    "critique_rows",
    "reply_tokens",
    "critique_votes",
    "defuse_tags",
    "parse_critique",
    "parse_outcome_verdict",
    "parse_step_lines",
    "reference_text",
    "signal_health",
    "worked_example",
]
