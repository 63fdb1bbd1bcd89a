"""``round_summary.json``: the round's own figures are never lost to a later invocation."""

from __future__ import annotations

import json

from flows.runner import write_round_summary
from pipeline.config import load_config
from pipeline.stages.base import round_paths


def test_a_partial_rerun_supersedes_the_round_summary_and_an_all_skipped_one_writes_beside_it(tmp_path):
    cfg = load_config(None, [f"runs_dir={tmp_path}", "run_id=r"])
    ran = [{"stage": s, "skipped": False, "seconds": 100.0} for s in ("rollout", "train", "eval")]
    first = write_round_summary(cfg, 1, ran, wall_s=300.0)
    assert json.loads(first.read_text())["wall_seconds"] == 300.0

    skipped = [{"stage": s, "skipped": True, "seconds": 0.1} for s in ("rollout", "train", "eval")]
    resume = write_round_summary(cfg, 1, skipped, wall_s=1.0)
    assert resume.name == "round_summary.resume.json"
    assert json.loads(first.read_text())["wall_seconds"] == 300.0  # the real run's figures stay

    forced = skipped[:2] + [{"stage": "eval", "skipped": False, "seconds": 50.0}]
    again = write_round_summary(cfg, 1, forced, wall_s=55.0)
    assert again == first and json.loads(again.read_text())["wall_seconds"] == 55.0
    (old,) = (round_paths(cfg, 1)["run_summary"].parent / "superseded").glob("round_summary-*.json")
    assert json.loads(old.read_text())["wall_seconds"] == 300.0  # moved, not overwritten
