"""Hand-built rounds for the stage tests. :func:`write_round` (no model): one prompt group of two
responses with their steps, critiques and outcomes, and the step weights worked out by hand under
every voting rule (tests/stages/test_stage_score.py, tests/stages/test_genorm.py).
:func:`write_train_round`: rollouts and token rewards of the tiny model for the train stage
(tests/flows/test_trainer_distributed.py, tests/stages/test_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.config import load_config
from pipeline.core.rewards import group_token_advantages, token_rewards
from pipeline.schemas import SCHEMAS
from pipeline.stages.base import round_paths

# --------------------------------------------------------------------------- hand-built round
#
# One prompt group ("toy-train-00000", gold 5) of two responses, C=2, P=1:
#
#   A (correct), 11 tokens, 3 steps with token spans [0,4) [4,5) [5,11)   (token 10 = EOS)
#       critiques: [1], [2, 1], <parse failure>          -> n_valid 2, n_flagged [0, 2, 1]
#   B (wrong),    7 tokens, 3 steps with token spans [0,2) [2,2) [2,7)    (step 1 owns no token)
#       critiques: [], [0, 1]                             -> n_valid 2, n_flagged [1, 1, 0]
#
# Step weights per rule (majority: share strictly above 0.5):
WEIGHTS = {
    "intersection": {"A": [0, 1, 0], "B": [0, 0, 0]},
    "union": {"A": [0, 1, 1], "B": [1, 1, 0]},
    "majority": {"A": [0, 1, 0], "B": [0, 0, 0]},
    "average": {"A": [0, 2 / 2, 1 / 2], "B": [1 / 2, 1 / 2, 0]},
}
SPANS = {"A": [(0, 4), (4, 5), (5, 11)], "B": [(0, 2), (2, 2), (2, 7)]}
N_TOK = {"A": 11, "B": 7}
CORRECT = {"A": True, "B": False}
PID = "toy-train-00000"
TEXTS = {
    "A": "Half of 6 is 3.\n\n3 + 2 = 5 apples.\n\nSo the answer is \\boxed{5}.",
    "B": "6 - 2 = 4.\n\nHmm.\n\n\\boxed{4}",
}


def toy_config(tmp_path: Path, *overrides: str):
    prompts = tmp_path / "toy.jsonl"
    if not prompts.exists():
        rows = [{"question": "Sam has 6 apples, eats half, then buys 2. How many now?", "answer": "6 / 2 = 3\n3 + 2 = 5\n#### 5"},
                {"question": "How many grams in a kilogram?", "answer": "#### 1,000"}]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}", "run_id=toy",
                              f"data.train_prompts={prompts}", "critique.enabled=true", "reward.correct_weight=2",
                              "reward.process_weight=1", *overrides])


def _table(cfg, name: str) -> list[dict]:
    return storage.read_table(round_paths(cfg, 1)[name], name).to_pylist()


def write_rows(cfg, name: str, rows: list[dict], stage: str) -> None:
    table = pa.Table.from_pylist([{"run_id": cfg.run_id, "round": 1, **r} for r in rows], schema=SCHEMAS[name])
    storage.write_table(table, round_paths(cfg, 1)[name], name, stage=stage, key={"hand": name})


def critique_row(rid: str, k: int, wrong: list[int] | None, n_steps: int) -> dict:
    return {"rollout_id": rid, "critique_idx": k, "source": "llm", "critic_model": "hand", "template_version": "t", "include_gold_answer": True,
            "n_steps": n_steps, "raw_text": "...", "wrong_steps": wrong, "parse_status": "ok" if wrong is not None else "no_verdict",
            "critic_tokens": 9, "finish_reason": "stop"}


def write_round(cfg, extra_group: bool = False) -> None:
    """rollouts, outcomes, steps and critiques of round 1, rows deliberately out of order."""
    ro = []
    for sample, rid in enumerate("AB"):
        ids = [100 + 7 * sample + t for t in range(N_TOK[rid] - 1)] + [2]  # ends with EOS
        ro.append({"rollout_id": rid, "prompt_id": PID, "sample_idx": sample, "policy": "hand", "prompt_token_ids": [1, 5, 9],
                   "response_text": TEXTS[rid], "response_token_ids": ids, "rollout_logprobs": [-0.5] * len(ids),
                   "finish_reason": "stop", "num_tokens": len(ids)})
    steps = [{"rollout_id": rid, "step_idx": s, "n_steps": 3, "char_start": 10 * s, "char_end": 10 * s + 5,
              "token_start": a, "token_end": b, "step_text": f"step {s}", "empty_response": False}
             for rid in "BA" for s, (a, b) in reversed(list(enumerate(SPANS[rid])))]
    crit = [critique_row("B", 1, [0, 1], 3), critique_row("A", 2, None, 3), critique_row("A", 0, [1], 3),
            critique_row("B", 0, [], 3), critique_row("A", 1, [2, 1], 3)]
    outc = [{"rollout_id": rid, "prompt_id": PID, "gold_answer": "5", "extracted_answer": "5" if CORRECT[rid] else "4",
             "outcome_correct": CORRECT[rid], "verify_status": "ok"} for rid in "AB"]
    if extra_group:
        # second group "toy-train-00001": C (3 tokens, every critique failed) and D (2 tokens, no
        # critique flags), both correct: all rewards 2, std 0, advantages 0. Interleaved with A, B.
        for sample, (rid, n) in enumerate([("C", 3), ("D", 2)]):
            ro.insert(2 * sample + 1, {**ro[0], "rollout_id": rid, "prompt_id": "toy-train-00001", "sample_idx": sample,
                                       "response_text": "\\boxed{1000}", "response_token_ids": list(range(300, 300 + n)),
                                       "rollout_logprobs": [-0.1] * n, "num_tokens": n})
            steps.append({**steps[0], "rollout_id": rid, "step_idx": 0, "n_steps": 1, "token_start": 0, "token_end": n})
            outc.append({"rollout_id": rid, "prompt_id": "toy-train-00001", "gold_answer": "1000", "extracted_answer": "1000",
                         "outcome_correct": True, "verify_status": "ok"})
        crit += [critique_row("C", 0, None, 1), critique_row("C", 1, None, 1), critique_row("D", 0, [], 1), critique_row("D", 1, [], 1)]
    write_rows(cfg, "rollouts", ro, "rollout")
    write_rows(cfg, "outcomes", outc, "verify")
    write_rows(cfg, "steps", steps, "segment")
    write_rows(cfg, "critiques", crit, "critique")


# --------------------------------------------------------------------------- a round to train on
#
# (group, question, response, outcome r_v, penalized share of tokens at the end of the response)
TRAIN_ROLLOUTS = [
    (0, "Sam has 6 apples, eats half, then buys 2. How many now?",
     "Half of 6 is 3. Then 3 + 2 = 5. The answer is \\boxed{5}.", 1.0, 0.0),
    (0, "Sam has 6 apples, eats half, then buys 2. How many now?",
     "6 - 2 = 4 apples, so \\boxed{4}.", 0.0, 0.5),
    (0, "Sam has 6 apples, eats half, then buys 2. How many now?",
     "Half of six is three, and two more makes five: \\boxed{5}", 1.0, 0.4),
    (1, "How many grams are in a kilogram?", "A kilogram is 1000 grams. \\boxed{1000}", 1.0, 0.0),
    (1, "How many grams are in a kilogram?", "There are 100 grams in a kilogram, so the answer is \\boxed{100}.", 0.0, 0.3),
]


def write_train_round(cfg, tiny_model) -> None:
    """Round 1's rollouts + token_rewards of :data:`TRAIN_ROLLOUTS` for the train-stage tests: tokenized
    with the tiny model's chat template, CAPO token rewards with C=2, P=1 and advantages normalized
    over all tokens of each group (some positive, some negative)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ro, lengths, outcome, weights = [], [], [], []
    for i, (g, q, text, r_v, bad) in enumerate(TRAIN_ROLLOUTS):
        chat = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = tok(chat, add_special_tokens=False)["input_ids"]
        resp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ro.append({"run_id": cfg.run_id, "round": 1, "rollout_id": f"r{i}", "prompt_id": f"p{g}", "sample_idx": i,
                   "policy": str(tiny_model), "prompt_token_ids": prompt, "response_text": text,
                   "response_token_ids": resp, "rollout_logprobs": [-1.0] * len(resp), "finish_reason": "stop",
                   "num_tokens": len(resp)})
        n_bad = int(round(bad * len(resp)))
        lengths.append(len(resp))
        outcome.append(r_v)
        weights.append(np.r_[np.zeros(len(resp) - n_bad), np.ones(n_bad)])
    off = np.r_[0, np.cumsum(lengths)]
    rewards = token_rewards(np.array(outcome), np.concatenate(weights), off, C=2.0, P=1.0)
    adv = group_token_advantages(rewards, off, np.array([g for g, *_ in TRAIN_ROLLOUTS]))
    assert (adv > 0).any() and (adv < 0).any()
    tr = [{"run_id": cfg.run_id, "round": 1, "variant": cfg.variant, "rollout_id": f"r{i}", "prompt_id": f"p{g}",
           "outcome_correct": bool(r_v), "outcome_reward": r_v, "rule": "intersection", "n_valid_critiques": 1,
           "n_penalized_tokens": int(weights[i].sum()), "rewards": rewards[off[i]:off[i + 1]].tolist(),
           "advantages": adv[off[i]:off[i + 1]].tolist(), "reward_config_hash": "hand"}
          for i, (g, _, _, r_v, _) in enumerate(TRAIN_ROLLOUTS)]
    p = round_paths(cfg, 1)
    storage.write_table(pa.Table.from_pylist(ro, schema=SCHEMAS["rollouts"]), p["rollouts"], "rollouts",
                        stage="rollout", key={"hand": "rollouts"})
    storage.write_table(pa.Table.from_pylist(tr, schema=SCHEMAS["token_rewards"]), p["token_rewards"], "token_rewards",
                        stage="reward", key={"hand": "token_rewards"})


# --------------------------------------------------------------------------- the rivals' credit
def rival_credit_by_hand(cfg, estimator: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each rollout's token rewards and advantages under the rival ``estimator`` (``reward.estimator``:
    grpo-lambda, fipo, vineppo or densr), recomputed from round 1's tables as written, not through the
    reward stage's readers (tests/slow/test_round_integration.py checks a real round's ``token_rewards``
    against it, tests/stages/test_rival_credit.py a hand-built one).

    Rewards: ``C * r_v`` on every token (process weight 0, no overlong penalty). GRPO's sequence
    advantage ``A_i = (C r_i - mean_g) / (std_g + eps)`` (ddof 1, over the group's responses) by hand;
    grpo-lambda: ``max(A_i, -0.1)`` on every token (its credit over tokens is the traced ratio in the
    loss, docs/method.md); fipo: ``A_i`` unchanged (its future-KL weights act in the loss); vineppo:
    :func:`pipeline.core.mc.mc_step_advantages` of ``V(S_0)`` (the group's other outcomes), the
    ``mc_values`` table's ``V(S_1 .. S_{M-1})`` and ``r_v``, each step's over its tokens, whitened over
    the round's tokens (:func:`pipeline.core.mc.whiten_runs`); densr: ``A_i`` times
    :func:`pipeline.core.densr.densr_weights` of the ``token_divergence`` table's divergences.
    """
    from pipeline.core.densr import densr_weights
    from pipeline.core.mc import leave_one_out_means, mc_step_advantages, whiten_runs

    rc = cfg.reward
    assert rc.process_weight == 0 and rc.overlong_buffer == 0 and rc.outcome == "rule" and rc.scale_by_std
    ro = _table(cfg, "rollouts")
    rids = [r["rollout_id"] for r in ro]
    n_tok = np.array([r["num_tokens"] for r in ro], np.int64)
    correct = {o["rollout_id"]: o["outcome_correct"] for o in _table(cfg, "outcomes")}
    r_v = np.array([float(correct[rid]) for rid in rids])
    pids = [r["prompt_id"] for r in ro]
    grpo = np.zeros(len(ro))
    for pid in set(pids):
        idx = [i for i, q in enumerate(pids) if q == pid]
        x = rc.correct_weight * r_v[idx]
        std = x.std(ddof=1) if len(x) > 1 else 0.0
        grpo[idx] = (x - x.mean()) / (std + rc.eps)
    rewards = {rid: np.full(n, rc.correct_weight * r_v[i]) for i, (rid, n) in enumerate(zip(rids, n_tok))}
    if estimator in ("grpo-lambda", "fipo"):
        seq = np.maximum(grpo, -0.1) if estimator == "grpo-lambda" else grpo
        return rewards, {rid: np.full(n, seq[i]) for i, (rid, n) in enumerate(zip(rids, n_tok))}
    if estimator == "densr":
        div = {r["rollout_id"]: r for r in _table(cfg, "token_divergence")}
        assert {r["layer"] for r in div.values()} == {cfg.densr.layer}
        d = np.concatenate([np.full(n, np.nan) if div[rid]["divergence"] is None else np.asarray(div[rid]["divergence"])
                            for rid, n in zip(rids, n_tok)])
        off = np.r_[0, np.cumsum(n_tok)]
        w = densr_weights(d, off, cfg.densr.mix)
        return rewards, {rid: grpo[i] * w[off[i]:off[i + 1]] for i, rid in enumerate(rids)}
    assert estimator == "vineppo"
    steps: dict[str, list] = {}
    for s in sorted(_table(cfg, "steps"), key=lambda s: (s["rollout_id"], s["step_idx"])):
        steps.setdefault(s["rollout_id"], []).append(s)
    mc: dict[str, dict[int, float]] = {}
    for row in _table(cfg, "mc_values"):
        mc.setdefault(row["rollout_id"], {})[row["state_idx"]] = row["value"]
    groups = np.unique(pids, return_inverse=True)[1]
    v0 = leave_one_out_means(r_v, groups)
    values, n_states, n_steps, lengths = [], [], [], []
    for i, rid in enumerate(rids):
        st = steps[rid]
        m = min(len(st), cfg.mc.max_states) if len(st) >= 2 else 1  # valued states, S_0 included
        have = mc.pop(rid, {})
        assert sorted(have) == list(range(1, m)), (rid, sorted(have), m)
        values += [v0[i]] + [have[k] for k in range(1, m)]
        n_states.append(m)
        n_steps.append(len(st))
        lengths += [s["token_end"] - s["token_start"] for s in st]
    assert not mc  # no values of other rollouts
    step_adv = whiten_runs(mc_step_advantages(np.array(values), np.array(n_states), np.array(n_steps), r_v),
                           np.array(lengths), rc.eps)
    tok = np.repeat(step_adv, lengths)
    off = np.r_[0, np.cumsum(n_tok)]
    return rewards, {rid: tok[off[i]:off[i + 1]] for i, rid in enumerate(rids)}
