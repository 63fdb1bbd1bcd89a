"""``capo stage train`` starts the trainer the way a round does: under ``train.launcher`` when one
is set (a training state written by one process cannot be continued by W processes, so a stage
run by hand must not quietly use another layout than the run's rounds)."""

from __future__ import annotations

import subprocess
import sys

from pipeline.config import load_config
from pipeline.stages.base import round_paths
from tests.toy_round import write_train_round


def test_capo_stage_train_runs_under_the_configured_launcher(tmp_path, tiny_model, repo):
    # The launcher is `echo LAUNCHED`: it prints the command the trainer would get and trains nothing.
    overrides = [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}", "run_id=launch",
                 f"rollout.policy={tiny_model}", "train.launcher=[echo,LAUNCHED]"]
    cfg = load_config(repo / "configs" / "default.yaml", overrides)  # what the CLI loads
    write_train_round(cfg, tiny_model)
    # the hand-written tables are not under their stages' keys: --allow-stale-inputs lets the stage start
    out = subprocess.run([sys.executable, "-m", "flows.cli", "stage", "train", "--round", "1", "--allow-stale-inputs",
                          *overrides],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    logged = out.stdout + out.stderr
    assert "LAUNCHED -m pipeline.stages.train_launch --config" in logged, logged[-2000:]
    assert "--round 1" in logged
    assert not round_paths(cfg, 1)["checkpoint"].exists()  # echo trained nothing; the stage did not run here
