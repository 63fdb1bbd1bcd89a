"""The light stages (pipeline/stages/{verify,segment,vote,reward}.py): math-verify grading, and vote -> reward end to end on
hand-built tables whose rewards and advantages are worked out by hand below."""

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.grading import grade, verify_answer
from pipeline.stages.base import prompts_path, round_paths
from pipeline.stages.reward import reward_key, reward_stage
from pipeline.stages.segment import segment_stage
from pipeline.stages.verify import verify_stage
from pipeline.stages.vote import vote_stage
from tests.toy_round import (
    CORRECT,
    N_TOK,
    PID,
    SPANS,
    WEIGHTS,
)
from tests.toy_round import toy_config
from tests.toy_round import write_round as _write_round
from tests.toy_round import write_rows as _write


def _cfg(tmp_path, *overrides: str):
    """The toy round under the paper's intersection rule (the numbers worked by hand below are
    for it; the shipped default is majority); later overrides win."""
    return toy_config(tmp_path, "vote.rule=intersection", "variant=capo-intersection", *overrides)


# ------------------------------------------------------------------------------------- verify


@pytest.mark.parametrize(
    "gold, response, expected",
    [
        ("72", "She sells 9 * 8 = 72 eggs.\n\nSo the answer is \\boxed{72}.", ("72", True, "ok")),
        ("72", "So the answer is \\boxed{71}.", ("71", False, "ok")),
        ("72", "I cannot solve this.", (None, False, "no_answer")),
        ("72", "", (None, False, "no_answer")),
        ("72", "\\boxed{72", (None, False, "no_answer")),  # unclosed box: nothing extracted
        # the default rule (verify.answer=boxed) reads only a boxed answer: prose numbers are no answer
        ("72", "She has 72 eggs left.", (None, False, "no_answer")),
        ("72", "First 72 eggs, then 5 boxes.", (None, False, "no_answer")),
        # ... and a \boxed answer wins over numbers written after it
        ("72", "\\boxed{72}. That took 3 steps.", ("72", True, "ok")),
        # two boxes are read as the set {72, 71}: wrong (the instruction asks for exactly one)
        ("72", "\\boxed{72} or \\boxed{71}", ("72,71", False, "ok")),
        # GSM8K golds have thousands separators removed; a response may keep them
        ("1000", "The total is \\boxed{1,000}.", ("1,000", True, "ok")),
        ("1000", "The total is \\boxed{1000}.", ("1000", True, "ok")),
        ("-3", "\\boxed{-3}", ("-3", True, "ok")),
        ("0.5", "\\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", True, "ok")),
        ("72", "\\[ \\boxed{72 \\text{ eggs}} \\]", ("72", True, "ok")),  # units inside the box
        # LaTeX golds without $...$ (MATH-style sources) must parse as LaTeX, not as "no gold"/"2"
        ("\\sqrt{2}", "\\boxed{\\sqrt 2}", ("\\sqrt{2}", True, "ok")),
        ("2\\pi", "\\boxed{2\\pi}", ("2\\pi", True, "ok")),
        ("2\\pi", "\\boxed{2}", ("2", False, "ok")),
        ("\\frac{1}{2}", "\\boxed{1/2}", ("\\frac{1}{2}", True, "ok")),
        ("$\\frac{1}{2}$", "\\boxed{0.5}", ("\\frac{1}{2}", True, "ok")),  # math-verify prints 0.5 as 1/2
    ],
)
def test_verify_answer(gold, response, expected):
    assert verify_answer(gold, response) == expected


@pytest.mark.parametrize(
    "gold, response, expected",
    [
        # verify.answer=any is math-verify's own extraction: without \boxed it grades the LAST number
        ("72", "She has 72 eggs left.", ("72", True, "ok")),
        ("72", "First 72 eggs, then 5 boxes.", ("5", False, "ok")),
        # the learning benchmark's case: a response cut mid-sentence, last number = the gold answer
        ("1", "0.75 mile + 0.25 mile = 1 mile.\n\nSo, the", ("1", True, "ok")),
        ("72", "\\boxed{72}. That took 3 steps.", ("72", True, "ok")),
    ],
)
def test_verify_answer_any(gold, response, expected):
    assert verify_answer(gold, response, answer="any") == expected


def test_grade_truncated_responses_score_zero_by_default():
    pairs = [("72", "So \\boxed{72}"), ("72", "So \\boxed{72}"), ("72", "9 * 8 = 72 and then"), ("72", "\\boxed{71}")]
    fins = ["stop", "length", "length", "length"]
    assert grade(pairs, workers=1, finish_reasons=fins) == [
        ("72", True, "ok"), ("72", False, "truncated"), (None, False, "truncated"), ("71", False, "truncated")]
    assert grade(pairs, workers=1, finish_reasons=fins, truncated="grade") == [
        ("72", True, "ok"), ("72", True, "ok"), (None, False, "no_answer"), ("71", False, "ok")]
    assert grade(pairs, workers=1, finish_reasons=fins, answer="any", truncated="grade")[2] == ("72", True, "ok")
    assert grade(pairs, workers=1) == grade(pairs, workers=1, truncated="grade")  # no finish reasons: nothing cut


def test_grade_rejects_bad_modes():
    with pytest.raises(ValueError, match="answer='last'; valid: \\('boxed', 'any'\\)"):
        grade([("1", "1")], answer="last")
    with pytest.raises(ValueError, match="truncated='drop'; valid: \\('zero', 'grade'\\)"):
        grade([("1", "1")], truncated="drop")
    with pytest.raises(ValueError, match="1 finish_reasons for 2 pairs"):
        grade([("1", "1"), ("2", "2")], finish_reasons=["stop"])
    with pytest.raises(ValueError, match="answer='last'"):
        verify_answer("1", "\\boxed{1}", answer="last")


def test_verify_answer_without_a_usable_gold():
    assert verify_answer("", "\\boxed{1}") == (None, False, "no_gold")


# --------------------------------------------------------------------------- hand-built round
# The round and its hand-worked step weights: tests/toy_round.py


def _expected_rewards(rule: str, C: float = 2.0, P: float = 1.0) -> dict[str, list[float]]:
    """R[t] = C * r_v - P * w[step(t)], token by token from the spans above."""
    out = {}
    for rid in "AB":
        r_v = 1.0 if CORRECT[rid] else 0.0
        out[rid] = [C * r_v - P * w for (a, b), w in zip(SPANS[rid], WEIGHTS[rule][rid]) for _ in range(a, b)]
        assert len(out[rid]) == N_TOK[rid]
    return out


def _token_group_advantages(rewards: dict[str, list[float]], eps: float = 1e-6) -> dict[str, list[float]]:
    """Naive loop: normalize over ALL tokens of the group, std with ddof=1."""
    flat = [r for rid in "AB" for r in rewards[rid]]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / (len(flat) - 1))
    return {rid: [(r - mean) / (std + eps) for r in rewards[rid]] for rid in "AB"}


def _read_rewards(cfg) -> dict[str, dict]:
    t = storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards")
    return {r["rollout_id"]: r for r in t.to_pylist()}


def test_intersection_rewards_and_advantages_by_hand(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.vote.rule == "intersection" and cfg.reward.estimator == "capo-token-group"
    _write_round(cfg)
    assert not vote_stage(cfg, 1).skipped
    res = reward_stage(cfg, 1)
    assert not res.skipped and res.rows == 2
    got = _read_rewards(cfg)

    # A: step 1 (token 4 only) flagged by both valid critiques; B: wrong, nothing flagged.
    assert got["A"]["rewards"] == [2, 2, 2, 2, 2 - 1, 2, 2, 2, 2, 2, 2]
    assert got["B"]["rewards"] == [0] * 7
    # Group of 18 tokens: sum 2*10 + 1 = 21, mean 7/6; squared deviations
    # 10*(5/6)^2 + (1/6)^2 + 7*(7/6)^2 = 594/36 = 16.5; std = sqrt(16.5 / 17).
    mean, std = 21 / 18, math.sqrt(16.5 / 17)
    np.testing.assert_allclose(got["A"]["advantages"], [(2 - mean) / std] * 4 + [(1 - mean) / std] + [(2 - mean) / std] * 6,
                               rtol=1e-5)
    np.testing.assert_allclose(got["B"]["advantages"], [(0 - mean) / std] * 7, rtol=1e-5)
    adv = np.array(got["A"]["advantages"] + got["B"]["advantages"], dtype=np.float64)
    assert abs(adv.mean()) < 1e-6 and adv.std(ddof=1) == pytest.approx(1.0, abs=1e-5)

    for rid in "AB":
        row = got[rid]
        assert (row["prompt_id"], row["outcome_correct"], row["rule"], row["variant"]) == (PID, CORRECT[rid], "intersection", cfg.variant)
        assert row["n_valid_critiques"] == 2  # A's parse failure does not count
        assert row["outcome_reward"] == (1.0 if CORRECT[rid] else 0.0)
    assert (got["A"]["n_penalized_tokens"], got["B"]["n_penalized_tokens"]) == (1, 0)
    man = storage.read_manifest(round_paths(cfg, 1)["token_rewards"])
    assert got["A"]["reward_config_hash"] == man["key_hash"] == storage.key_hash(man["key"])
    assert man["share_tokens_penalized"] == pytest.approx(1 / 18)


def test_step_verdicts_under_every_rule(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    vote_stage(cfg, 1)
    t = storage.read_table(round_paths(cfg, 1)["step_verdicts"], "step_verdicts")
    assert t.num_rows == (3 + 3) * 4
    rows = {(r["rollout_id"], r["rule"], r["step_idx"]): r for r in t.to_pylist()}
    for rule, per in WEIGHTS.items():
        for rid, ws in per.items():
            for s, w in enumerate(ws):
                r = rows[(rid, rule, s)]
                assert r["weight"] == pytest.approx(w), (rid, rule, s)
                assert r["n_valid"] == 2
    assert [rows[("A", "union", s)]["n_flagged"] for s in range(3)] == [0, 2, 1]
    assert [rows[("B", "union", s)]["n_flagged"] for s in range(3)] == [1, 1, 0]


@pytest.mark.parametrize("rule", ["union", "majority", "average"])
def test_other_rules_reuse_the_votes_and_follow_the_token_spans(tmp_path, rule):
    base = _cfg(tmp_path)
    _write_round(base)
    vote_stage(base, 1)
    reward_stage(base, 1)
    cfg = _cfg(tmp_path, f"vote.rule={rule}", f"variant=capo-{rule}")
    assert not vote_stage(cfg, 1).skipped  # verdicts live under the variant: its own copy
    assert not reward_stage(cfg, 1).skipped
    assert vote_stage(base, 1).skipped and reward_stage(base, 1).skipped  # the base variant is untouched
    for table in ("step_verdicts", "token_rewards"):
        assert round_paths(cfg, 1)[table] != round_paths(base, 1)[table]
    got, want = _read_rewards(cfg), _expected_rewards(rule)
    want_adv = _token_group_advantages(want)
    for rid in "AB":
        np.testing.assert_allclose(got[rid]["rewards"], want[rid], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[rid]["advantages"], want_adv[rid], rtol=1e-5)
        assert got[rid]["rule"] == rule
    if rule == "union":  # written out: B's flagged step 0 is tokens 0-1; its empty step 1 owns none
        assert got["A"]["rewards"] == [2] * 4 + [1] + [1] * 6
        assert got["B"]["rewards"] == [-1, -1] + [0] * 5


def test_groups_are_normalized_separately(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg, extra_group=True)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    got = _read_rewards(cfg)
    assert list(got) == ["A", "C", "B", "D"]  # one row per rollout, in rollouts order
    want = _token_group_advantages(_expected_rewards("intersection"))
    for rid in "AB":
        np.testing.assert_allclose(got[rid]["advantages"], want[rid], rtol=1e-5)
    assert got["C"]["rewards"] == [2, 2, 2] and got["D"]["rewards"] == [2, 2]
    assert got["C"]["advantages"] == [0, 0, 0] and got["D"]["advantages"] == [0, 0]
    assert (got["C"]["n_valid_critiques"], got["D"]["n_valid_critiques"]) == (0, 2)


def test_grpo_baseline_without_critiques(tmp_path):
    cfg = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo", "variant=grpo")
    _write_round(cfg)
    reward_stage(cfg, 1)  # needs neither steps nor verdicts
    assert not round_paths(cfg, 1)["step_verdicts"].exists()
    got = _read_rewards(cfg)
    assert got["A"]["rewards"] == [2] * 11 and got["B"]["rewards"] == [0] * 7
    # sequence rewards [2, 0]: mean 1, std (ddof=1) sqrt(2)
    np.testing.assert_allclose(got["A"]["advantages"], [1 / math.sqrt(2)] * 11, rtol=1e-5)
    np.testing.assert_allclose(got["B"]["advantages"], [-1 / math.sqrt(2)] * 7, rtol=1e-5)
    assert got["A"]["rule"] is None and got["A"]["n_penalized_tokens"] == 0
    with pytest.raises(ValueError, match="process_weight"):  # a process penalty needs step critiques
        _cfg(tmp_path, "critique.enabled=false", "variant=grpo")


def test_overlong_penalty_by_hand_in_both_estimators(tmp_path):
    # DAPO's soft overlong punishment, budget 12 tokens, buffer 6: no penalty up to 6 tokens, then
    # -(n - 6) / 6: A (11 tokens) -5/6, B (7 tokens) -1/6, on every token of the response
    over = ["rollout.sampling.max_tokens=12", "reward.overlong_buffer=6"]
    cfg = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo",
               "reward.scale_by_std=false", "variant=grpo", *over)
    _write_round(cfg)
    reward_stage(cfg, 1)
    got = _read_rewards(cfg)
    np.testing.assert_allclose(got["A"]["rewards"], [2 - 5 / 6] * 11, rtol=1e-6)
    np.testing.assert_allclose(got["B"]["rewards"], [-1 / 6] * 7, rtol=1e-6)
    # sequence rewards [7/6, -1/6], mean 1/2: Dr.GRPO advantages (no std) +-2/3 (+-1 without the penalty)
    np.testing.assert_allclose(got["A"]["advantages"], [2 / 3] * 11, rtol=1e-5)
    np.testing.assert_allclose(got["B"]["advantages"], [-2 / 3] * 7, rtol=1e-5)
    man = storage.read_manifest(round_paths(cfg, 1)["token_rewards"])
    assert man["overlong_penalized"] == 2 and man["mean_overlong_penalty"] == pytest.approx(-0.5)
    assert man["key"]["reward"]["overlong"] == {"overlong_buffer": 6, "overlong_penalty": 1.0, "max_tokens": 12}

    # CAPO token rewards under intersection: the step penalty and the overlong penalty add up
    capo = _cfg(tmp_path, *over, "variant=capo-overlong")
    vote_stage(capo, 1)
    reward_stage(capo, 1)
    got = _read_rewards(capo)
    np.testing.assert_allclose(got["A"]["rewards"], [7 / 6] * 4 + [1 / 6] + [7 / 6] * 6, rtol=1e-6)
    np.testing.assert_allclose(got["B"]["rewards"], [-1 / 6] * 7, rtol=1e-6)
    # off (the default), the reward key holds no overlong settings: keys of earlier rounds stay valid
    off = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo", "variant=grpo")
    key_off = reward_key(off, 1)["reward"]
    assert not {"overlong", "overlong_buffer", "overlong_penalty"} & set(key_off)
    assert key_off == {k: v for k, v in man["key"]["reward"].items() if k != "overlong"} | {"scale_by_std": True}


def test_shuffled_outcome_control_deals_each_groups_outcomes_out_again(tmp_path):
    # groups: A (right) and B (wrong); C and D both right (extra_group). Shuffled within groups, the
    # first group is either as verified (A 1, B 0) or swapped (A 0, B 1); the second stays (1, 1).
    seen = set()
    for seed in range(8):
        cfg = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo",
                   "reward.outcome=shuffled", f"variant=shuffled-{seed}", f"seed={seed}")
        if seed == 0:
            _write_round(cfg, extra_group=True)
        reward_stage(cfg, 1)
        got = _read_rewards(cfg)
        r = {k: got[k]["outcome_reward"] for k in "ABCD"}
        assert sorted([r["A"], r["B"]]) == [0.0, 1.0] and r["C"] == r["D"] == 1.0
        assert [got[k]["outcome_correct"] for k in "ABCD"] == [True, False, True, True]  # the truth is kept
        a = 1 / math.sqrt(2) if r["A"] == 1.0 else -1 / math.sqrt(2)  # the same advantages, dealt to whom the shuffle says
        np.testing.assert_allclose(got["A"]["advantages"], [a] * 11, rtol=1e-5)
        np.testing.assert_allclose(got["B"]["advantages"], [-a] * 7, rtol=1e-5)
        np.testing.assert_allclose(got["C"]["advantages"] + got["D"]["advantages"], [0] * 5)
        assert storage.read_manifest(round_paths(cfg, 1)["token_rewards"])["key"]["reward"]["shuffle_seed"] == [seed, 1]
        seen.add(r["A"])
    assert seen == {0.0, 1.0}, "over 8 seeds the first group must be swapped at least once and kept at least once"
    # the rule's key holds no shuffle seed, so keys written before the option stay valid
    assert "shuffle_seed" not in reward_key(_cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0",
                                                 "reward.estimator=grpo", "variant=grpo"), 1)["reward"]


def test_densr_token_rewards_are_keyed_to_the_weights_noise_floor(tmp_path, monkeypatch):
    """Divergences below the noise floor count as 0 since the floor came in: the DenseR reward key
    names it, so token rewards written before it are recomputed; other estimators' keys hold nothing new."""
    import pipeline.stages.reward as reward
    from pipeline.stages.reward import DENSR_WEIGHTS_VERSION

    monkeypatch.setattr(reward, "input_fp", lambda path: path.name)  # the inputs' fingerprints are not under test

    densr = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=densr", "variant=densr")
    assert reward_key(densr, 1)["densr_weights"] == DENSR_WEIGHTS_VERSION == "noise-floor-1e-4"
    grpo = _cfg(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo", "variant=grpo")
    assert "densr_weights" not in reward_key(grpo, 1)


def test_an_overlong_buffer_as_long_as_the_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"reward.overlong_buffer=12 must be below rollout.sampling.max_tokens=12"):
        _cfg(tmp_path, "rollout.sampling.max_tokens=12", "reward.overlong_buffer=12")


def _add_arithmetic_rows(cfg, flags: dict[str, list[int] | None]) -> None:
    """The toy round's critiques plus one arithmetic row per response (``None``: an empty response)."""
    crit = storage.read_table(round_paths(cfg, 1)["critiques"], "critiques").to_pylist()
    crit += [{"run_id": cfg.run_id, "round": 1, "rollout_id": rid, "critique_idx": 0, "source": "arithmetic",
              "mode": "process", "critic_model": "arithmetic", "template_version": "arithmetic-v1",
              "include_gold_answer": False, "n_steps": 3, "raw_text": "...", "wrong_steps": wrong,
              "steps_judged": wrong, "steps_wrong_lines": wrong,
              "parse_status": "complete" if wrong is not None else "skipped_empty_response", "critic_tokens": 0}
             for rid, wrong in flags.items()]
    _write(cfg, "critiques", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in crit], "critique")


@pytest.mark.parametrize("sources, expected", [
    # the arithmetic check flags B's step 2 only; LLM weights are WEIGHTS (module docstring of tests/toy_round.py)
    ("[llm]", {"intersection": {"A": [0, 1, 0], "B": [0, 0, 0]}, "average": {"A": [0, 1, 0.5], "B": [0.5, 0.5, 0]}}),
    ("[arithmetic]", {"intersection": {"A": [0, 0, 0], "B": [0, 0, 1]}, "average": {"A": [0, 0, 0], "B": [0, 0, 1]}}),
    ("[arithmetic,llm]", {"intersection": {"A": [0, 1, 0], "B": [0, 0, 1]},
                          "average": {"A": [0, 1, 0.5], "B": [0.5, 0.5, 1]}}),
])
def test_the_arithmetic_source_votes_beside_the_critiques(tmp_path, sources, expected):
    cfg = _cfg(tmp_path, f"vote.sources={sources}")
    _write_round(cfg)
    _add_arithmetic_rows(cfg, {"A": [], "B": [2]})
    assert not vote_stage(cfg, 1).skipped
    rows = {(r["rollout_id"], r["rule"], r["step_idx"]): r
            for r in storage.read_table(round_paths(cfg, 1)["step_verdicts"], "step_verdicts").to_pylist()}
    assert len(rows) == (3 + 3) * 4  # the arithmetic row is no extra step or rule
    for rule, per in expected.items():
        for rid, ws in per.items():
            got = [rows[(rid, rule, s)] for s in range(3)]
            assert [r["weight"] for r in got] == pytest.approx(ws), (sources, rule, rid)
            assert [r["llm_weight"] for r in got] == pytest.approx(WEIGHTS[rule][rid])  # stored whatever votes
            assert [r["arithmetic_flag"] for r in got] == [rid == "B" and s == 2 for s in range(3)]
            assert {r["n_valid"] for r in got} == {2}  # the arithmetic row is not an LLM critique
            assert {r["sources"] for r in got} == {"+".join(cfg.vote.sources)}
    assert cfg.vote.sources == [s for s in ("llm", "arithmetic") if s in sources]  # one order, whatever was written
    # the reward stage subtracts the combined weight: B (wrong, r_v 0) loses P=1 on step 2's tokens [2, 7)
    reward_stage(cfg, 1)
    b = _read_rewards(cfg)["B"]["rewards"]
    assert b == [0.0, 0.0] + [-float(expected["intersection"]["B"][2])] * 5


def test_a_step_without_an_arithmetic_row_has_no_arithmetic_flag(tmp_path):
    cfg = _cfg(tmp_path, "vote.sources=[llm,arithmetic]")
    _write_round(cfg)
    _add_arithmetic_rows(cfg, {"A": None})  # A empty (nothing checked), B has no row at all
    vote_stage(cfg, 1)
    t = storage.read_table(round_paths(cfg, 1)["step_verdicts"], "step_verdicts").to_pylist()
    assert {r["arithmetic_flag"] for r in t} == {None}
    assert {(r["rollout_id"], r["rule"], r["step_idx"]): r["weight"] for r in t if r["rule"] == "union"} == \
        {(rid, "union", s): w for rid, ws in WEIGHTS["union"].items() for s, w in enumerate(ws)}


@pytest.mark.parametrize("bad", ["[]", "[llm,llm]", "[lllm]"])
def test_bad_vote_sources_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="vote.sources|llm"):
        _cfg(tmp_path, f"vote.sources={bad}")


def test_the_critique_stage_adds_the_arithmetic_check_and_keeps_older_llm_critiques(tmp_path, monkeypatch):
    """A critiques table written before the arithmetic check (no ``source`` column, its key without
    the checker's entry) is brought up to date without the critic: its LLM rows are kept as they
    are, one arithmetic row per response is computed from the real step texts, the old table is
    superseded (not overwritten), and the vote then flags B's wrong sum."""
    import json

    import pyarrow as pa

    from pipeline.stages import critique as crit_mod
    from pipeline.schemas import CRITIQUES_SCHEMA

    cfg = _cfg(tmp_path, "critique.engine.type=openai", "critique.critic=served-critic", "vote.sources=[llm,arithmetic]")
    _write_round(cfg)
    p = round_paths(cfg, 1)
    steps = storage.read_table(p["steps"], "steps").to_pylist()
    texts = {("A", 1): "3 + 2 = 5 apples.", ("B", 0): "6 - 2 = 4.", ("B", 2): "So 4 + 4 = 9."}
    for r in steps:
        r["step_text"] = texts.get((r["rollout_id"], r["step_idx"]), r["step_text"])
    _write(cfg, "steps", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in steps], "segment")
    # an interrupted run under another key left a committed shard: finished critic output, kept aside
    parts = crit_mod.critique_parts_dir(cfg, 1)
    storage.write_part(storage.read_table(p["critiques"], "critiques").slice(0, 2), parts, 0, "critiques",
                       {"key": "another-key"})
    old = storage.read_table(p["critiques"], "critiques").drop_columns(["source"])  # as written before the column
    old_key = {k: v for k, v in crit_mod.critique_key(cfg, 1).items() if k != "arithmetic"}
    storage.write_parquet(old, p["critiques"], stage="critique", key=old_key)

    def no_critic(*a, **k):
        raise AssertionError("the critic must not run: its critiques are kept")

    monkeypatch.setattr(crit_mod, "make_engine", no_critic)
    n_superseded = len(list((p["round_dir"] / "superseded").glob("critiques-*.parquet")))
    res = crit_mod.critique_stage(cfg, 1)
    assert not res.skipped and res.critic_calls == 0
    t = storage.read_table(p["critiques"], "critiques")
    llm = [r for r in t.to_pylist() if r["source"] == "llm"]
    assert [(r["rollout_id"], r["critique_idx"], r["wrong_steps"]) for r in llm] == \
        sorted((r["rollout_id"], r["critique_idx"], r["wrong_steps"]) for r in old.to_pylist())
    arith = {r["rollout_id"]: r for r in t.to_pylist() if r["source"] == "arithmetic"}
    assert sorted(arith) == ["A", "B"]
    assert (arith["A"]["wrong_steps"], arith["A"]["steps_judged"]) == ([], [1])
    assert (arith["B"]["wrong_steps"], arith["B"]["steps_judged"]) == ([2], [0, 2])
    assert "Step 2: wrong - 4 + 4 = 9 (is 8)" in arith["B"]["raw_text"]
    assert len(list((p["round_dir"] / "superseded").glob("critiques-*.parquet"))) == n_superseded + 1
    (aside,) = (p["round_dir"] / "superseded").glob("critiques.parts-*")
    assert sorted(f.name for f in aside.iterdir()) == ["part-00000.json", "part-00000.parquet"]
    assert not parts.exists()
    assert crit_mod.critique_stage(cfg, 1).skipped  # current now
    vote_stage(cfg, 1)
    sv = {(r["rollout_id"], r["step_idx"]): r for r in storage.read_table(p["step_verdicts"], "step_verdicts").to_pylist()
          if r["rule"] == "intersection"}
    assert [sv[("B", s)]["weight"] for s in range(3)] == [0, 0, 1]
    assert json.loads(storage.manifest_path(p["step_verdicts"]).read_text())["key"]["sources"] == ["llm", "arithmetic"]
    # a table altered after its manifest is not trusted: the critic is asked again
    storage.write_parquet(old, p["critiques"], stage="critique", key=old_key)
    pq.write_table(pa.concat_tables([old, old]), p["critiques"])
    with pytest.raises(AssertionError, match="must not run"):
        crit_mod.critique_stage(cfg, 1)
    assert CRITIQUES_SCHEMA.field("source").nullable is False


def test_reruns_skip_and_changed_inputs_recompute(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    assert vote_stage(cfg, 1).skipped and reward_stage(cfg, 1).skipped
    # new critiques (A's step 2 now flagged by both) -> votes and rewards recompute
    p = round_paths(cfg, 1)
    crit = storage.read_table(p["critiques"], "critiques").to_pylist()
    for r in crit:
        if r["rollout_id"] == "A" and r["critique_idx"] == 0:
            r["wrong_steps"] = [1, 2]
    _write(cfg, "critiques", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in crit], "critique")
    assert not vote_stage(cfg, 1).skipped
    assert not reward_stage(cfg, 1).skipped
    assert _read_rewards(cfg)["A"]["rewards"] == [2] * 4 + [1] + [1] * 6
    assert len(list((p["variant_dir"] / "superseded").glob("token_rewards-*.parquet"))) == 1


def test_catalog_over_two_variants(tmp_path):
    import duckdb

    for rule in ("intersection", "union"):
        cfg = _cfg(tmp_path, f"vote.rule={rule}", f"variant=capo-{rule}")
        if rule == "intersection":
            _write_round(cfg)
        vote_stage(cfg, 1)
        reward_stage(cfg, 1)
    cat = storage.refresh_catalog(Path(cfg.runs_dir), Path(cfg.data_dir))
    with duckdb.connect(str(cat), read_only=True) as con:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        assert q("SELECT variant, count(*) FROM step_verdicts GROUP BY ALL ORDER BY 1") == [
            ("capo-intersection", (3 + 3) * 4), ("capo-union", (3 + 3) * 4)]
        assert q("SELECT count(*) FROM token_rewards") == [(2 * 2,)]
        rows = q("SELECT variant, rule, tokens, accuracy, share_tokens_penalized, mean_token_reward_correct, "
                 "mean_token_reward_wrong, adv_mean, adv_std FROM variant_summary ORDER BY variant")
    (v1, r1, t1, acc1, pen1, good1, bad1, m1, s1), (v2, r2, t2, acc2, pen2, good2, bad2, m2, s2) = rows
    assert (v1, r1, t1, acc1, v2, r2, t2, acc2) == ("capo-intersection", "intersection", 18, 0.5, "capo-union", "union", 18, 0.5)
    assert pen1 == pytest.approx(1 / 18) and pen2 == pytest.approx((7 + 2) / 18)  # union: A's steps 1-2, B's step 0
    assert good1 == pytest.approx((2 * 10 + 1) / 11) and bad1 == 0
    assert good2 == pytest.approx((2 * 4 + 1 * 7) / 11) and bad2 == pytest.approx(-2 / 7)
    for mean, std in ((m1, s1), (m2, s2)):
        assert mean == pytest.approx(0, abs=1e-6) and std == pytest.approx(1, abs=1e-5)


def test_steps_that_do_not_cover_the_tokens_are_an_error(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    p = round_paths(cfg, 1)
    steps = storage.read_table(p["steps"], "steps").to_pylist()
    for r in steps:
        if r["rollout_id"] == "A" and r["step_idx"] == 2:
            r["token_end"] = 9  # A's last step loses its last two tokens
    _write(cfg, "steps", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in steps], "segment")
    vote_stage(cfg, 1)
    with pytest.raises(ValueError, match="rollout A cover 9 tokens or are not contiguous, expected 11"):
        reward_stage(cfg, 1)


# -------------------------------------------------------------------- real verify and segment
def test_verify_stage_grades_against_the_prompt_table(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    prompts = pq.read_table(prompts_path(cfg)).to_pylist()
    assert [(r["prompt_id"], r["gold_answer"]) for r in prompts] == [(PID, "5"), ("toy-train-00001", "1000")]
    round_paths(cfg, 1)["outcomes"].unlink()  # the hand-written outcomes must be recomputed
    res = verify_stage(cfg, 1, workers=1)
    assert not res.skipped and res.rows == 2
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["outcomes"], "outcomes").to_pylist()}
    assert (got["A"]["outcome_correct"], got["A"]["extracted_answer"], got["A"]["gold_answer"]) == (True, "5", "5")
    assert (got["B"]["outcome_correct"], got["B"]["extracted_answer"]) == (False, "4")
    assert storage.read_manifest(round_paths(cfg, 1)["outcomes"])["accuracy"] == 0.5


def test_verify_stage_names_a_prompt_the_prompt_table_lost(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    ro = storage.read_table(round_paths(cfg, 1)["rollouts"], "rollouts").to_pylist()
    for r in ro:
        r["prompt_id"] = "gone-00007" if r["rollout_id"] == "B" else r["prompt_id"]
    _write(cfg, "rollouts", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in ro], "rollout")
    round_paths(cfg, 1)["outcomes"].unlink()
    with pytest.raises(ValueError, match=r"answer prompts that .* does not hold: \['gone-00007'\]"):
        verify_stage(cfg, 1, workers=1)
    assert not round_paths(cfg, 1)["outcomes"].exists()  # nothing written


def test_verify_stage_scores_a_truncated_rollout_zero_and_records_why(tmp_path):
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    p = round_paths(cfg, 1)
    ro = storage.read_table(p["rollouts"], "rollouts").to_pylist()
    for r in ro:
        r["finish_reason"] = "length" if r["rollout_id"] == "A" else r["finish_reason"]
    _write(cfg, "rollouts", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in ro], "rollout")
    p["outcomes"].unlink()
    verify_stage(cfg, 1, workers=1)
    got = {r["rollout_id"]: r for r in storage.read_table(p["outcomes"], "outcomes").to_pylist()}
    # A's boxed 5 is right, but A hit the token budget: wrong, its answer kept for the record
    assert (got["A"]["outcome_correct"], got["A"]["extracted_answer"], got["A"]["verify_status"]) == (False, "5", "truncated")
    assert (got["B"]["outcome_correct"], got["B"]["verify_status"]) == (False, "ok")
    cfg2 = _cfg(tmp_path, "verify.truncated=grade")  # another rule: another key, recomputed, A right again
    assert not verify_stage(cfg2, 1, workers=1).skipped
    got = {r["rollout_id"]: r for r in storage.read_table(p["outcomes"], "outcomes").to_pylist()}
    assert (got["A"]["outcome_correct"], got["A"]["verify_status"]) == (True, "ok")


def test_segment_stage_with_a_real_tokenizer(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    smollm = Path(tiny_model)
    tok = AutoTokenizer.from_pretrained(str(smollm))
    cfg = _cfg(tmp_path)
    full = "Café: 3 €.\n\n日本語 🎉 ok\n\n\\boxed{5}"
    ids_full = tok.encode(full, add_special_tokens=False) + [tok.eos_token_id]
    ids_cut = tok.encode("日本語 🎉\n\nab", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids_cut)) if tok.decode(ids_cut[:k]).endswith("\ufffd"))
    ids_cut = ids_cut[:cut]  # stopped by max_tokens inside a character
    rows = [{"rollout_id": rid, "prompt_id": PID, "sample_idx": i, "policy": str(smollm), "prompt_token_ids": [1],
             "response_text": "", "response_token_ids": ids, "rollout_logprobs": [0.0] * len(ids),
             "finish_reason": "stop", "num_tokens": len(ids)} for i, (rid, ids) in enumerate([("F", ids_full), ("X", ids_cut)])]
    _write(cfg, "rollouts", rows, "rollout")
    assert not segment_stage(cfg, 1).skipped
    steps = storage.read_table(round_paths(cfg, 1)["steps"], "steps").to_pylist()
    f = [r for r in steps if r["rollout_id"] == "F"]
    assert [r["step_text"] for r in f] == ["Café: 3 €.", "日本語 🎉 ok", "\\boxed{5}"]
    assert [(r["char_start"], r["char_end"]) for r in f] == [(0, 10), (12, 20), (22, 31)]
    assert f[0]["token_start"] == 0 and f[-1]["token_end"] == len(ids_full)
    assert all(a["token_end"] == b["token_start"] for a, b in zip(f, f[1:]))
    x = [r for r in steps if r["rollout_id"] == "X"]
    assert len(x) == 1 and (x[0]["token_start"], x[0]["token_end"]) == (0, cut) and x[0]["step_text"].endswith("\ufffd")


def test_no_sampled_critiques_the_checkers_alone_penalize(tmp_path, monkeypatch):
    """``critique.num_critiques=0`` with ``vote.sources=[arithmetic]``: the critique stage writes the
    checkers' rows only (no critic engine is made, no critic call), and the vote and reward stages
    penalize B's wrong sum from the arithmetic check alone, with no LLM critique to count."""
    from pipeline.stages import critique as crit_mod

    cfg = _cfg(tmp_path, "critique.engine.type=openai", "critique.critic=served-critic",
               "critique.num_critiques=0", "vote.sources=[arithmetic]")
    _write_round(cfg)
    p = round_paths(cfg, 1)
    steps = storage.read_table(p["steps"], "steps").to_pylist()
    texts = {("A", 1): "3 + 2 = 5 apples.", ("B", 2): "So 4 + 4 = 9."}
    for r in steps:
        r["step_text"] = texts.get((r["rollout_id"], r["step_idx"]), r["step_text"])
    _write(cfg, "steps", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in steps], "segment")
    p["critiques"].unlink()
    storage.manifest_path(p["critiques"]).unlink()

    def no_critic(*a, **k):
        raise AssertionError("num_critiques=0 must not start a critic engine")

    monkeypatch.setattr(crit_mod, "make_engine", no_critic)
    res = crit_mod.critique_stage(cfg, 1)
    assert not res.skipped and res.critic_calls == 0
    t = storage.read_table(p["critiques"], "critiques").to_pylist()
    assert sorted((r["source"], r["rollout_id"]) for r in t) == [("arithmetic", "A"), ("arithmetic", "B")]
    vote_stage(cfg, 1)
    sv = {(r["rollout_id"], r["rule"], r["step_idx"]): r
          for r in storage.read_table(p["step_verdicts"], "step_verdicts").to_pylist()}
    for rule in ("intersection", "majority", "union", "average"):
        assert [sv[("B", rule, s)]["weight"] for s in range(3)] == [0, 0, 1], rule
        assert [sv[("A", rule, s)]["weight"] for s in range(3)] == [0, 0, 0], rule
        assert {sv[(rid, rule, s)]["n_valid"] for rid in "AB" for s in range(3)} == {0}
    reward_stage(cfg, 1)
    assert _read_rewards(cfg)["B"]["rewards"] == [0.0, 0.0] + [-1.0] * 5
    from flows.runner import critic_signal

    assert critic_signal(cfg, 1) is None  # no sampled critique: no critic-health line in the round summary


def test_no_sampled_critiques_with_an_llm_source_or_genorm_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vote.sources=\['llm'\] names llm.*num_critiques=0"):
        _cfg(tmp_path, "critique.num_critiques=0")
    with pytest.raises(ValueError, match=r"num_critiques=0 samples no critique.*outcome"):
        _cfg(tmp_path, "critique.num_critiques=0", "critique.mode=outcome", "vote.sources=[arithmetic]")


def test_random_credit_moves_each_responses_penalty_to_random_steps_of_it(tmp_path):
    """The random-credit control: per response and rule, the same weights (so the same number of
    penalized steps) on a seeded random permutation of its steps, the same permutation under every
    rule; the true verdicts stay in llm_weight / arithmetic_flag. Over seeds B's flag leaves step 2."""
    from pipeline.stages.vote import random_step_order, vote_key

    where = set()
    for seed in range(6):
        (tmp_path / str(seed)).mkdir()
        cfg = _cfg(tmp_path / str(seed), "vote.sources=[llm,arithmetic]", "vote.random_credit=true", f"seed={seed}")
        _write_round(cfg)
        _add_arithmetic_rows(cfg, {"A": [], "B": [2]})
        vote_stage(cfg, 1)
        rows = storage.read_table(round_paths(cfg, 1)["step_verdicts"], "step_verdicts").to_pylist()
        got = {(r["rollout_id"], r["rule"]): [] for r in rows}
        for r in sorted(rows, key=lambda r: r["step_idx"]):
            got[(r["rollout_id"], r["rule"])].append(r)
        for (rid, rule), rs in got.items():
            true = [max(WEIGHTS[rule][rid][s], float(rid == "B" and s == 2)) for s in range(3)]
            perm = random_step_order(seed, 1, rid, 3)
            assert [r["weight"] for r in rs] == pytest.approx([true[i] for i in perm]), (seed, rid, rule)
            assert sorted(r["weight"] for r in rs) == pytest.approx(sorted(true))  # same penalty, other steps
            assert [r["llm_weight"] for r in rs] == pytest.approx(WEIGHTS[rule][rid])
            assert [r["arithmetic_flag"] for r in rs] == [rid == "B" and s == 2 for s in range(3)]
        where.add(tuple(int(i) for i in random_step_order(seed, 1, "B", 3)).index(2))
        assert vote_key(cfg, 1)["random_credit"] == [seed, 1]
    assert len(where) > 1, "over 6 seeds B's arithmetic flag must land on more than one step"
    off = _cfg(tmp_path / "5", "vote.sources=[llm,arithmetic]", "seed=5")
    assert "random_credit" not in vote_key(off, 1)  # keys written before the option stay valid
    assert "random_credit" not in reward_key(off, 1)["vote"] and reward_key(cfg, 1)["vote"]["random_credit"]  # keys written before the option stay valid


def test_steps_of_other_rollouts_name_them_and_the_command_that_fixes_it(tmp_path):
    """Steps written for rollouts the rollouts table no longer has (stale steps): the reward stage
    names the strays and says to run the round again, instead of crediting unknown responses."""
    import pyarrow as pa

    from pipeline.schemas import SCHEMAS

    cfg = toy_config(tmp_path, "vote.rule=majority", "variant=capo-majority")
    _write_round(cfg)
    vote_stage(cfg, 1)
    p = round_paths(cfg, 1)
    steps = storage.read_table(p["steps"], "steps").to_pylist()
    stray = {**steps[0], "rollout_id": "Z"}
    storage.write_table(pa.Table.from_pylist(steps + [stray], schema=SCHEMAS["steps"]), p["steps"], "steps",
                        stage="segment", key={"hand": "steps+stray"})
    vote_stage(cfg, 1)
    with pytest.raises(ValueError, match=r"1 steps of rollouts not in rollouts\.parquet \(e\.g\. \['Z'\]\).*`capo round`"):
        reward_stage(cfg, 1)


def test_a_prompt_table_with_repeated_ids_names_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.assets.prompts import PROMPTS_SCHEMA, read_prompts

    row = {f.name: (0 if pa.types.is_integer(f.type) else "x") for f in PROMPTS_SCHEMA}
    rows = [{**row, "prompt_id": pid} for pid in ("p1", "p2", "p1", "p3", "p3", "p3")]
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"prompt_id values are not unique: 2 repeat, e\.g\. \['p1', 'p3'\]"):
        read_prompts(tmp_path / "t.parquet")


def test_the_shipped_default_votes_the_check_and_the_readout_into_token_rewards_by_hand(tmp_path):
    """configs/default.yaml (variant ``capo-readout``): no sampled critique votes; a step is
    penalized when the arithmetic check flags it or the readout's calibrated P(wrong) is above 0.8
    (``majority``), the larger of the two weights. Toy round: the check flags B's step 2; the
    readout gives A [0.1, 0.85, 0.75] and B [0.9, 0.2, 0.3]. Weights: A [0, 1, 0], B [1, 0, 1]
    (under ``average``: A [0.1, 0.85, 0.75], B [0.9, 0.2, 1]). Rewards C*r_v - P*w with C = 2,
    P = 1: A (right, 11 tokens, step 1 = token 4) [2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2]; B (wrong,
    7 tokens, steps 0 and 2 cover every token) [-1] * 7. Over the group's 18 tokens: mean 14/18 =
    7/9, sum of squares about it 10 (11/9)^2 + (2/9)^2 + 7 (16/9)^2 = 3006/81, variance (ddof 1)
    3006/1377 = 334/153, std 1.47750; advantages (2 - 7/9)/std = 0.82722, (1 - 7/9)/std = 0.15040,
    (-1 - 7/9)/std = -1.20323."""
    from pipeline.config import load_config
    from tests.conftest import REPO
    from tests.toy_round import critique_row

    toy = toy_config(tmp_path)  # writes the toy prompt file
    cfg = load_config(REPO / "configs" / "default.yaml", [f"runs_dir={toy.runs_dir}", f"data_dir={toy.data_dir}",
                                                          "run_id=toy", f"data.train_prompts={toy.data.train_prompts}"])
    assert (cfg.variant, cfg.vote.sources, cfg.vote.rule, cfg.vote.logprob_threshold) == (
        "capo-readout", ["arithmetic", "logprob"], "majority", 0.8)
    assert (cfg.critique.num_critiques, cfg.reward.correct_weight, cfg.reward.process_weight) == (0, 2.0, 1.0)
    _write_round(cfg)
    checks = [{**critique_row(rid, 0, wrong, 3), "source": "arithmetic", "parse_status": "complete"}
              for rid, wrong in (("A", []), ("B", [2]))]
    readout = [{**critique_row(rid, 0, [i for i, q in enumerate(qs) if q > 0.5], 3), "source": "logprob",
                "parse_status": "complete", "step_scores": qs}
               for rid, qs in (("A", [0.1, 0.85, 0.75]), ("B", [0.9, 0.2, 0.3]))]
    _write(cfg, "critiques", checks + readout, "critique")
    vote_stage(cfg, 1)
    sv = storage.read_table(round_paths(cfg, 1)["step_verdicts"], "step_verdicts").to_pylist()
    weights = {(v["rule"], v["rollout_id"]): [] for v in sv}
    for v in sorted(sv, key=lambda v: v["step_idx"]):
        weights[(v["rule"], v["rollout_id"])].append(v["weight"])
    assert weights[("majority", "A")] == [0, 1, 0] and weights[("majority", "B")] == [1, 0, 1]
    assert weights[("average", "A")] == pytest.approx([0.1, 0.85, 0.75])
    assert weights[("average", "B")] == pytest.approx([0.9, 0.2, 1.0])
    assert {v["n_valid"] for v in sv} == {0}  # no sampled critique voted
    reward_stage(cfg, 1)
    got = _read_rewards(cfg)
    assert got["A"]["rewards"] == [2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2] and got["B"]["rewards"] == [-1] * 7
    std = math.sqrt(334 / 153)
    assert std == pytest.approx(1.47750, abs=1e-5)
    a_right, a_flag, b = (2 - 7 / 9) / std, (1 - 7 / 9) / std, (-1 - 7 / 9) / std
    assert (round(a_right, 5), round(a_flag, 5), round(b, 5)) == (0.82722, 0.15040, -1.20323)
    assert got["A"]["advantages"] == pytest.approx([a_right] * 4 + [a_flag] + [a_right] * 6, abs=1e-5)
    assert got["B"]["advantages"] == pytest.approx([b] * 7, abs=1e-5)
