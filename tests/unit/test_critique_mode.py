"""The critique mode decided once, and the critique stage's pure core: (prompts, steps, replies) -> rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.config import load_config
from pipeline.core.critique import (
    SKIPPED_EMPTY,
    CritiqueJob,
    NoCritique,
    OutcomeCritique,
    ProcessCritique,
    critique_mode,
    critique_regex,
    critique_requests,
    critique_rows,
)
from pipeline.schemas import CRITIQUES_SCHEMA

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


@dataclass
class _Reply:  # the fields of pipeline.engines.base.Sample the rows read
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"


def test_the_mode_is_read_once_from_the_configuration():
    cfg = load_config(DEFAULT)
    mode = critique_mode(cfg.critique)
    assert mode == ProcessCritique(cfg.critique.template, cfg.critique.include_gold_answer,
                                   cfg.critique.include_reference, cfg.critique.structured_output,
                                   cfg.critique.logprob_readout)
    assert (mode.type, mode.table, mode.votes_steps) == ("process", "critiques", True)
    genorm = critique_mode(load_config(DEFAULT, preset="grpo-genorm").critique)
    assert isinstance(genorm, OutcomeCritique) and (genorm.table, genorm.votes_steps) == ("genorm_critiques", False)
    off = critique_mode(load_config(DEFAULT, ["critique.enabled=false", "reward.process_weight=0"]).critique)
    assert off == NoCritique() and off.type == "none"


def _jobs():
    return [CritiqueJob("r0", "What is 2 + 3?", ["2 + 3 = 5", "The answer is \\boxed{5}."], "2 + 3 = 5 ...", "5", "2+3=5"),
            CritiqueJob("r1", "What is 2 + 3?", [""], "", "5", "2+3=5", empty=True),
            CritiqueJob("r2", "What is 2 * 4?", ["2 * 4 = 9"], "2 * 4 = 9", "8", None)]


def test_requests_skip_empty_responses_and_constrain_only_structured_process_critiques():
    jobs = _jobs()
    convs, regexes = critique_requests(ProcessCritique("capo-genprm-v1"), jobs)
    assert len(convs) == 2 and regexes is None  # r1 is empty: nothing is sent
    assert "Step 1: The answer is \\boxed{5}." in convs[0][1]["content"]
    assert "Reference final answer: 5" in convs[0][1]["content"]
    assert "Reference solution" not in convs[0][1]["content"]  # include_reference off
    _, regexes = critique_requests(ProcessCritique("capo-genprm-v1", structured_output=True), jobs)
    assert regexes == [critique_regex(2), critique_regex(1)]
    convs, regexes = critique_requests(ProcessCritique("capo-genprm-v1", include_gold_answer=False,
                                                       include_reference=True), jobs)
    assert "Reference final answer" not in convs[0][1]["content"] and "Reference solution" in convs[0][1]["content"]
    convs, regexes = critique_requests(OutcomeCritique(), jobs)
    assert regexes is None and "2 * 4 = 9" in convs[1][1]["content"] and "Final answer correct" in convs[1][1]["content"]


def test_rows_of_process_critiques_worked_by_hand():
    replies = {"r0": [_Reply("Step 0: correct\nStep 1: correct\nWrong step list: []", [1, 2, 3]),
                      _Reply("Step 0: wrong - no\nWrong step list: [0]", [], [-0.5, -0.1], "length")],
               "r2": [_Reply("Step 0: wrong - 2 * 4 is 8\nWrong step list: [0]", [7] * 5),
                      _Reply("no verdict here", [1])]}
    rows = critique_rows(ProcessCritique("capo-genprm-v3"), _jobs(), replies, 2,
                         {"run_id": "run", "round": 1, "critic_model": "critic"})
    assert [(r["rollout_id"], r["critique_idx"]) for r in rows] == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1),
                                                                    ("r2", 0), ("r2", 1)]
    got = [(r["parse_status"], r["wrong_steps"], r["steps_judged"], r["steps_wrong_lines"], r["critic_tokens"],
            r["finish_reason"], r["n_steps"]) for r in rows]
    assert got == [("complete", [], [0, 1], [], 3, "stop", 2),
                   ("incomplete", [0], [0], [0], 2, "length", 2),  # no token ids: counted from the log-probs
                   (SKIPPED_EMPTY, None, None, None, 0, None, 1),
                   (SKIPPED_EMPTY, None, None, None, 0, None, 1),
                   ("complete", [0], [0], [0], 5, "stop", 1),
                   ("no_verdict", None, [], [], 1, "stop", 1)]
    assert {(r["source"], r["mode"], r["template_version"], r["include_gold_answer"], r["run_id"], r["round"],
             r["critic_model"]) for r in rows} == {("llm", "process", "capo-genprm-v3", True, "run", 1, "critic")}
    assert rows[2]["raw_text"] == "" and rows[0]["outcome_verdict"] is None
    assert pa.Table.from_pylist(rows, schema=CRITIQUES_SCHEMA).num_rows == 6  # the table's columns, no others


def test_rows_of_outcome_critiques_hold_the_verdict_and_no_steps():
    replies = {"r0": [_Reply("Looks right.\nFinal answer correct: yes", [1])],
               "r2": [_Reply("Final answer correct: maybe", [1, 2])]}
    rows = critique_rows(OutcomeCritique(include_gold_answer=False), _jobs(), replies, 1,
                         {"run_id": "run", "round": 0, "critic_model": "critic"})
    assert [(r["outcome_verdict"], r["parse_status"], r["wrong_steps"], r["steps_judged"]) for r in rows] == [
        (True, "ok", None, None), (None, SKIPPED_EMPTY, None, None), (None, "not_yes_no", None, None)]
    assert {(r["mode"], r["template_version"], r["include_gold_answer"]) for r in rows} == {("outcome", None, False)}


def test_a_reply_marked_malformed_is_a_row_that_votes_nothing():
    """A reply the engine marked malformed (after its retries) is recorded, not parsed: status
    malformed_reply, the marker's text (why, and the body's excerpt) as raw text, no verdict."""
    from pipeline.core.critique import MALFORMED_REPLY, critique_votes
    from pipeline.engines.base import Sample

    note = "[malformed reply after 2 attempts] request 0: asked for n=2 samples, the reply has 1\n{\"choices\": []}"
    bad = Sample("", [], None, None, malformed=note)
    replies = {"r0": [bad, _Reply("Step 0: correct\nStep 1: correct\nWrong step list: []", [1])], "r2": [bad, bad]}
    rows = critique_rows(ProcessCritique("capo-genprm-v1"), _jobs(), replies, 2, {"run_id": "r", "round": 1, "critic_model": "c"})
    got = [(r["rollout_id"], r["parse_status"], r["wrong_steps"], r["raw_text"] == note, r["critic_tokens"]) for r in rows]
    assert got == [("r0", MALFORMED_REPLY, None, True, 0), ("r0", "complete", [], False, 1),
                   ("r1", SKIPPED_EMPTY, None, False, 0), ("r1", SKIPPED_EMPTY, None, False, 0),
                   ("r2", MALFORMED_REPLY, None, True, 0), ("r2", MALFORMED_REPLY, None, True, 0)]
    assert all(critique_votes(r["parse_status"], r["wrong_steps"], r["steps_wrong_lines"], p) is None
               for r in rows if r["parse_status"] == MALFORMED_REPLY for p in ("list", "lines", "drop"))
    outcome = critique_rows(OutcomeCritique(), _jobs(), {"r0": [bad], "r2": [bad]}, 1, {"run_id": "r", "round": 0, "critic_model": "c"})
    assert [(r["parse_status"], r["outcome_verdict"]) for r in outcome] == [
        (MALFORMED_REPLY, None), (SKIPPED_EMPTY, None), (MALFORMED_REPLY, None)]
    assert pa.Table.from_pylist(rows + outcome, schema=CRITIQUES_SCHEMA).num_rows == 9


def test_a_judged_response_with_too_few_replies_is_a_clear_error():
    with pytest.raises(ValueError, match="rollout r0 has 1 critiques, 2 were asked for"):
        critique_rows(ProcessCritique("capo-genprm-v1"), _jobs()[:1], {"r0": [_Reply("x", [1])]}, 2,
                      {"run_id": "run", "round": 0, "critic_model": "critic"})


def test_a_judged_response_without_replies_is_a_clear_error_not_an_empty_one():
    with pytest.raises(ValueError, match="rollout r2 is not empty and has no critiques"):
        critique_rows(ProcessCritique("capo-genprm-v1"), _jobs(), {"r0": [_Reply("x", [1])]}, 1,
                      {"run_id": "run", "round": 0, "critic_model": "critic"})


def test_no_critiques_asked_gives_no_rows():
    assert critique_rows(ProcessCritique("capo-genprm-v1"), _jobs(), {}, 0, {"run_id": "r", "round": 0,
                                                                            "critic_model": "c"}) == []
