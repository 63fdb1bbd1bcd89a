"""A hand-built round for the stage tests (no model): one prompt group of two responses with
their steps, critiques and outcomes, and the step weights worked out by hand under every voting
rule. Shared by tests/stages/test_stage_score.py and tests/stages/test_genorm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from pipeline import storage
from pipeline.config import load_config
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


def write_rows(cfg, name: str, rows: list[dict], stage: str) -> None:
    table = pa.Table.from_pylist([{"run_id": cfg.run_id, "round": 1, **r} for r in rows], schema=SCHEMAS[name])
    storage.write_table(table, round_paths(cfg, 1)[name], name, stage=stage, key={"hand": name})


def critique_row(rid: str, k: int, wrong: list[int] | None, n_steps: int) -> dict:
    return {"rollout_id": rid, "critique_idx": k, "critic_model": "hand", "template_version": "t", "include_gold_answer": True,
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
