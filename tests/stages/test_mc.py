"""VinePPO end to end on a hand-built round: Monte Carlo values from the real tiny model (the mc stage),
the values' grading from a scripted policy (every continuation completes its state's text, graded
against the gold answer), and the reward stage's step advantages from a values table worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline.engines
import pipeline.engines.base
from pipeline import storage
from pipeline.engines.base import EngineStats, Generation, Sample
from pipeline.grading import verify_answer
from pipeline.stages.base import round_paths, round_seed
from pipeline.stages.mc import mc_stage
from pipeline.stages.reward import reward_stage
from tests.toy_round import toy_config, write_round, write_rows

VINE = ("critique.enabled=false", "reward.estimator=vineppo", "reward.process_weight=0", "variant=vineppo")


def regrade(cfg, row: dict, head_text: str, gold: str) -> list[bool]:
    """The verify stage's rules applied anew to each continuation of an ``mc_values`` row: the state's
    text (the response's first ``token_end`` tokens, decoded) followed by the continuation, graded by
    math-verify against ``gold``; a continuation cut at the budget is wrong under ``verify.truncated: zero``."""
    return [verify_answer(gold, head_text + text, cfg.verify.answer)[1]
            and not (fin == "length" and cfg.verify.truncated == "zero")
            for text, fin in zip(row["continuations"], row["finish_reasons"], strict=True)]


def test_vineppo_advantages_from_a_values_table_worked_by_hand(tmp_path):
    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)  # A right (steps of 4, 1, 6 tokens), B wrong (2, 0, 5 tokens): one group
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 2,
         "n_correct": int(2 * v), "continuations": ["", ""], "correct": [False, False], "finish_reasons": ["stop"] * 2}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.5), ("B", 2, 0.0)]], "mc")
    reward_stage(cfg, 1)
    got = {r["rollout_id"]: r for r in storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").to_pylist()}
    # V(S_0) is the group's other outcome: A 0 (B was wrong), B 1. V(S_3) = R.
    # A: V = 0, 0.5, 1.0, 1 -> step advantages 0.5, 0.5, 0.0; B: V = 1, 0.5, 0.0, 0 -> -0.5, -0.5, 0.0
    raw = [0.5] * 4 + [0.5] + [0.0] * 6 + [-0.5] * 2 + [0.0] * 5  # per token; B's step 1 owns no token
    mean = sum(raw) / 18  # (2.5 - 1.0) / 18
    std = (sum((x - mean) ** 2 for x in raw) / 17) ** 0.5
    want = [(x - mean) / (std + cfg.reward.eps) for x in raw]
    np.testing.assert_allclose(got["A"]["advantages"] + got["B"]["advantages"], want, rtol=1e-5)
    assert got["A"]["rewards"] == [2.0] * 11 and got["B"]["rewards"] == [0.0] * 7  # C * r_v, no process penalty
    assert got["A"]["rule"] is None and got["A"]["n_penalized_tokens"] == 0

    # a table that misses a state the steps call for is refused, not read as a shorter response
    write_rows(cfg, "mc_values", [
        {"rollout_id": "A", "state_idx": 1, "token_end": 0, "value": 0.5, "n_continuations": 2, "n_correct": 1,
         "continuations": ["", ""], "correct": [True, False], "finish_reasons": ["stop"] * 2}], "mc")
    with pytest.raises(ValueError, match=r"holds states \[1\] of rollout A, which has 3 steps"):
        reward_stage(cfg, 1)


def test_the_mc_stage_continues_each_state_with_the_policy(tmp_path, tiny_model):
    cfg = toy_config(tmp_path, *VINE, f"rollout.policy={tiny_model}", "rollout.engine={type: transformers, dtype: float32}",
                     "rollout.sampling.max_tokens=24", "mc.continuations=2", "mc.max_states=3")
    write_round(cfg)
    res = mc_stage(cfg, 1)
    assert not res.skipped and res.rows == 4
    rows = storage.read_table(round_paths(cfg, 1)["mc_values"], "mc_values").to_pylist()
    # states S_1, S_2 of A and B (max_states 3: S_0 comes from the group); S_k ends where step k-1 ends
    assert [(r["rollout_id"], r["state_idx"], r["token_end"]) for r in rows] == [("A", 1, 4), ("A", 2, 5),
                                                                                  ("B", 1, 2), ("B", 2, 2)]
    from pipeline.core.tokenization import decode_with_bytes
    from pipeline.engines.base import load_tokenizer

    tok = load_tokenizer(tiny_model)
    ids = {r["rollout_id"]: r["response_token_ids"] for r in storage.read_table(round_paths(cfg, 1)["rollouts"],
                                                                                "rollouts").to_pylist()}
    for r in rows:
        assert r["n_continuations"] == 2 and len(r["continuations"]) == len(r["correct"]) == 2
        assert r["value"] == r["n_correct"] / 2 == sum(r["correct"]) / 2
        assert set(r["finish_reasons"]) <= {"stop", "length"} and all(isinstance(t, str) for t in r["continuations"])
        # each stored grade is the state's text plus that continuation, graded against the gold answer
        # (the tiny model's continuations are nearly always wrong: the scripted test below has right ones)
        head = decode_with_bytes(tok, ids[r["rollout_id"]][:r["token_end"]])[0]
        assert r["correct"] == regrade(cfg, r, head, "5"), r
    man = storage.read_manifest(round_paths(cfg, 1)["mc_values"])
    assert man["continuations"] == 8 and man["engine"]["generated_tokens"] > 0
    assert mc_stage(cfg, 1).skipped  # cached: training again samples nothing
    reward_stage(cfg, 1)  # the values feed the estimator
    adv = storage.read_table(round_paths(cfg, 1)["token_rewards"], "token_rewards").column("advantages").to_pylist()
    flat = np.concatenate([np.asarray(a) for a in adv])
    assert len(flat) == 18 and abs(flat.mean()) < 1e-5  # whitened over the round's tokens


class _PieceTokenizer:
    """A tokenizer that is not byte-level: each token id stands for a fixed piece of text (decoded by
    growing prefixes, :func:`pipeline.core.tokenization.token_bytes`); id 2 (EOS) is special."""

    all_special_ids = [2]
    added_tokens_decoder: dict = {}

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces.get(int(i), "?") for i in ids if not (skip_special_tokens and i in self.all_special_ids))


# The first tokens of write_round's responses (A: ids 100.., B: ids 107..): the states' texts are
# A S_1 (4 tokens) "Half of 6 is 3.\n\n3 + 2 = ", A S_2 (5 tokens) "... 3 + 2 = 5, so \boxed{" (the answer
# opened), B S_1 = B S_2 (2 tokens; B's step 1 owns no token) "6 - 2 = 4.\n\n". Gold answer 5.
_PIECES = {100: "Half of 6 ", 101: "is 3", 102: ".\n\n", 103: "3 + 2 = ", 104: "5, so \\boxed{",
           107: "6 - 2 = 4", 108: ".\n\n"}
# three continuations per state, in state order (A S_1, A S_2, B S_1, B S_2): (text, finish reason)
_SCRIPT = [
    [("5. The answer is \\boxed{5}.", "stop"),   # right
     ("6, so \\boxed{6}.", "stop"),              # wrong answer
     ("5, so \\boxed{5}", "length")],            # right answer, cut at the budget: wrong (truncated: zero)
    [("5}.", "stop"),                            # right only with the state's text, which opened \boxed{
     ("4}.", "stop"),                            # \boxed{4}: wrong
     ("5}", "stop")],                            # right
    [("So the answer is \\boxed{4}.", "stop"),   # wrong
     ("Wait: half of 6 is 3, and 3 + 2 = \\boxed{5}.", "stop"),  # right: a state that is rescued
     ("", "stop")],                              # no \boxed{} in state + continuation: wrong
    [("\\boxed{5}", "stop"),                     # right
     ("\\boxed{\\frac{10}{2}}", "stop"),         # right: math-verify's equivalence
     ("\\boxed{5}", "length")],                  # cut at the budget: wrong
]


class _ScriptedPolicy:
    """Stands in for the policy engine at ``continue_prefixes``: the continuations of :data:`_SCRIPT`,
    one list per prefix in order; records each call."""

    def __init__(self):
        self.stats, self.calls, self.closed = EngineStats(), [], False

    def continue_prefixes(self, prefixes, n, sampling, max_tokens):
        self.calls.append(([list(p) for p in prefixes], n, sampling, list(max_tokens)))
        assert len(prefixes) == len(_SCRIPT) and n == 3
        return [Generation(list(p), [Sample(t, [7], [-1.0], fin) for t, fin in script])
                for p, script in zip(prefixes, _SCRIPT)]

    def close(self):
        self.closed = True


def test_the_mc_stage_grades_each_continuation_from_its_state(tmp_path, monkeypatch):
    """The grading and the values, with a scripted policy (no model): each continuation is graded as the
    state's decoded text followed by the continuation, against the problem's gold answer, under the verify
    stage's rules; a state's value is the share of right ones. Worked by hand from :data:`_SCRIPT`."""
    box = {}

    def make_engine(model, cfg, seed=0):
        box["model"], box["seed"], box["engine"] = model, seed, _ScriptedPolicy()
        return box["engine"]

    monkeypatch.setattr(pipeline.engines, "make_engine", make_engine)
    monkeypatch.setattr(pipeline.engines.base, "load_tokenizer", lambda model: _PieceTokenizer(_PIECES))
    cfg = toy_config(tmp_path, *VINE, "rollout.policy=hand/scripted-policy",
                     "rollout.engine={type: transformers, dtype: float32}", "rollout.sampling.max_tokens=24",
                     "mc.continuations=3", "mc.max_states=3")
    write_round(cfg)
    res = mc_stage(cfg, 1)
    assert not res.skipped and res.rows == 4
    # the engine: the round's policy and seed, one prefix per state (prompt + the response's first tokens),
    # K continuations each, the budget the response had left
    (prefixes, n, sampling, budget), = box["engine"].calls
    assert box["model"] == "hand/scripted-policy" and box["seed"] == round_seed(cfg, 1, 6) and box["engine"].closed
    assert prefixes == [[1, 5, 9, 100, 101, 102, 103], [1, 5, 9, 100, 101, 102, 103, 104], [1, 5, 9, 107, 108],
                        [1, 5, 9, 107, 108]]
    assert n == 3 and sampling == cfg.rollout.sampling and budget == [20, 19, 22, 22]
    rows = storage.read_table(round_paths(cfg, 1)["mc_values"], "mc_values").to_pylist()
    assert [(r["rollout_id"], r["state_idx"], r["token_end"]) for r in rows] == [("A", 1, 4), ("A", 2, 5),
                                                                                  ("B", 1, 2), ("B", 2, 2)]
    assert [r["correct"] for r in rows] == [[True, False, False], [True, False, True], [False, True, False],
                                            [True, True, False]]
    assert [r["n_correct"] for r in rows] == [1, 2, 1, 2]
    assert [r["value"] for r in rows] == pytest.approx([1 / 3, 2 / 3, 1 / 3, 2 / 3], abs=1e-7)  # float32 column
    assert [r["continuations"] for r in rows] == [[t for t, _ in script] for script in _SCRIPT]
    assert [r["finish_reasons"] for r in rows] == [[f for _, f in script] for script in _SCRIPT]
    heads = ["Half of 6 is 3.\n\n3 + 2 = ", "Half of 6 is 3.\n\n3 + 2 = 5, so \\boxed{", "6 - 2 = 4.\n\n", "6 - 2 = 4.\n\n"]
    assert [r["correct"] for r in rows] == [regrade(cfg, r, h, "5") for r, h in zip(rows, heads)]  # the helper agrees
    assert storage.read_manifest(round_paths(cfg, 1)["mc_values"])["mean_value"] == pytest.approx(0.5)
    # graded under verify.truncated: grade, a right answer cut at the budget counts
    cfg_grade = toy_config(tmp_path, *VINE, "rollout.policy=hand/scripted-policy",
                           "rollout.engine={type: transformers, dtype: float32}", "rollout.sampling.max_tokens=24",
                           "mc.continuations=3", "mc.max_states=3", "verify.truncated=grade")
    mc_stage(cfg_grade, 1)
    rows = storage.read_table(round_paths(cfg_grade, 1)["mc_values"], "mc_values").to_pylist()
    assert [r["correct"] for r in rows] == [[True, False, True], [True, False, True], [False, True, False],
                                            [True, True, True]]


def test_mc_values_become_a_critic_eval_benchmark(tmp_path):
    from critic_eval.items import processbench_rows
    from pipeline.mc_labels import mc_label_records

    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)
    with pytest.raises(FileNotFoundError, match="run round 1 with reward.estimator=vineppo"):
        mc_label_records(cfg, 1)
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 2,
         "n_correct": int(2 * v), "continuations": ["", ""], "correct": [False, False], "finish_reasons": ["stop"] * 2}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.5), ("B", 2, 0.0)]], "mc")
    recs = {r["id"]: r for r in mc_label_records(cfg, 1, drop=0.5)}
    # A: V = 0 (B wrong), 0.5, 1.0, R 1: never falls -> -1. B: V = 1, 0.5, 0.0, R 0: falls 0.5 at step 0
    assert (recs["A"]["label"], recs["B"]["label"]) == (-1, 0)
    assert recs["B"]["step_values"] == [1.0, 0.5, 0.0, 0.0] and recs["B"]["steps"] == ["step 0", "step 1", "step 2"]
    assert recs["A"]["problem"].startswith("Sam has 6 apples") and recs["A"]["gold_answer"] == "5"
    rows = processbench_rows(list(recs.values()), "mc")  # critic-eval takes them as they are
    assert [(r["id"], r["label"], r["kind"]) for r in rows] == [("A", -1, "mc"), ("B", 0, "mc")]


def test_a_wrong_answer_whose_values_never_fall_is_left_out_of_the_labels(tmp_path):
    from pipeline.mc_labels import mc_label_records

    cfg = toy_config(tmp_path, *VINE)
    write_round(cfg)
    # B (wrong): V = 1 (A right), 0.75, 0.5, R 0: falls 0.25, 0.25, 0.5 -> step 2 at drop 0.5, none at 0.75
    write_rows(cfg, "mc_values", [
        {"rollout_id": rid, "state_idx": k, "token_end": 0, "value": v, "n_continuations": 4,
         "n_correct": int(4 * v), "continuations": [""] * 4, "correct": [False] * 4, "finish_reasons": ["stop"] * 4}
        for rid, k, v in [("A", 1, 0.5), ("A", 2, 1.0), ("B", 1, 0.75), ("B", 2, 0.5)]], "mc")
    assert {r["id"]: r["label"] for r in mc_label_records(cfg, 1, drop=0.5)} == {"A": -1, "B": 2}
    assert {r["id"]: r["label"] for r in mc_label_records(cfg, 1, drop=0.75)} == {"A": -1}  # B: no place to blame
