"""The rollout stage under ``rollout.dynamic_sampling`` (DAPO §3.2) with a real model: SmolLM2-135M
through the transformers engine samples batches of groups, the stage grades them with math-verify
and keeps the round's groups by :func:`pipeline.stages.rollout.filter_groups` (whose choice is
worked by hand in tests/unit/test_prompt_selection.py); here the wiring: what the table holds, what
the manifest records, and that the verify stage agrees with the stage's own grading."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import load_config
from pipeline.stages.base import round_paths
from pipeline.stages.rollout import has_signal, rollout_stage
from pipeline.stages.verify import verify_stage

QUESTIONS = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 + 3?", "6"),
             ("What is 10 - 5?", "5"), ("What is 2 * 3?", "6"), ("What is 9 - 1?", "8")]


def test_dynamic_sampling_keeps_per_round_groups_and_records_the_dropped(tmp_path, tiny_model, data_dir):
    prompts = tmp_path / "arith.jsonl"
    prompts.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in QUESTIONS))
    cfg = load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"data_dir={data_dir}", "run_id=ds",
                             f"data.train_prompts={prompts}", "data.prompts_per_round=2",
                             f"rollout.policy={tiny_model}", "rollout.group_size=2",
                             "rollout.sampling.max_tokens=24", "rollout.engine.type=transformers",
                             "rollout.engine.dtype=float32", "rollout.dynamic_sampling=true",
                             "rollout.max_gen_batches=2", "verify.answer=any"])
    rollout_stage(cfg, 1)
    p = round_paths(cfg, 1)
    rows = pq.read_table(p["rollouts"]).to_pylist()
    ds = storage.read_manifest(p["rollouts"])["dynamic_sampling"]

    kept = list(dict.fromkeys(r["prompt_id"] for r in rows))
    assert len(kept) == 2 and len(rows) == 4  # data.prompts_per_round groups of G, whatever was sampled
    assert 1 <= ds["gen_batches"] <= 2 and ds["groups_sampled"] == 2 * ds["gen_batches"] and ds["groups_kept"] == 2
    assert len(ds["dropped_prompt_ids"]) == ds["groups_sampled"] - 2
    assert not set(ds["dropped_prompt_ids"]) & set(kept)  # no prompt sampled twice in a round
    if ds["groups_with_signal"] < 2:  # not enough signal in the first batch: it sampled every batch allowed
        assert ds["gen_batches"] == 2
    assert ds["groups_kept_without_signal"] == 2 - min(2, ds["groups_with_signal"])

    # the verify stage, run on the table as written, sees the signal the stage counted when choosing
    verify_stage(cfg, 1, workers=1)
    oc = pq.read_table(p["outcomes"]).to_pylist()
    by_group: dict[str, list[bool]] = {}
    for r in oc:
        by_group.setdefault(r["prompt_id"], []).append(r["outcome_correct"])
    assert sum(map(has_signal, by_group.values())) == min(2, ds["groups_with_signal"])

    # re-running the finished stage is a cache hit: the kept groups stay as written
    assert rollout_stage(cfg, 1).skipped
