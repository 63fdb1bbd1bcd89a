"""Two on-policy rounds with the tiny model and the deterministic transformers engine (CPU).

An uninterrupted ``capo run --rounds 2`` is compared with one killed in the middle of round 1's
critique stage and again between rounds, then started again: the tables must be the same.
Round 2 must sample from round 1's checkpoint, eval must have a row per benchmark per round, and
the report must be written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

TABLES = ("rollouts", "outcomes", "steps", "critiques", "variants/capo-intersection/step_verdicts",
          "variants/capo-intersection/token_rewards", "variants/capo-intersection/eval")


def _cmd(repo: Path, runs: Path, data_dir: Path) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "run", "--rounds", "2", "--config", str(repo / "configs" / "tiny.yaml"),
            f"runs_dir={runs}", f"data_dir={data_dir}", "rollout.engine.type=transformers",
            "critique.engine.type=transformers", "critique.batch_rollouts=1", "eval.benchmarks=[gsm8k]"]


def _wait_for(cond, proc, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def two_runs(repo, data_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("multi")
    a, b = base / "a", base / "b"
    out = subprocess.run(_cmd(repo, a, data_dir), cwd=repo, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    rd1 = b / "tiny" / "round_001"
    parts = rd1 / "critiques.parts"
    ckpt_man = rd1 / "variants" / "capo-intersection" / "checkpoint.manifest.json"
    kills = []
    for cond, what in ((lambda: any(parts.glob("part-*.json")), "a committed critique shard of round 1"),
                       (lambda: ckpt_man.exists(), "round 1's checkpoint")):
        proc = subprocess.Popen(_cmd(repo, b, data_dir), cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        _wait_for(cond, proc, what)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills.append(what)
    out = subprocess.run(_cmd(repo, b, data_dir), cwd=repo, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return a / "tiny", b / "tiny", kills, out.stderr


def _table(run: Path, k: int, name: str):
    t = pq.read_table(run / f"round_{k:03d}" / f"{name}.parquet")
    # absolute checkpoint paths differ between the two run dirs (and so do hashes over them)
    return t.drop_columns([c for c in ("policy", "reward_config_hash") if c in t.column_names])


@pytest.mark.parametrize("name", TABLES)
def test_killed_and_resumed_run_equals_uninterrupted_run(two_runs, name):
    a, b, kills, _ = two_runs
    assert len(kills) == 2
    for k in (1, 2):
        ta, tb = _table(a, k, name), _table(b, k, name)
        assert ta.num_rows > 0 and ta.equals(tb), f"round {k} {name} differs after kill + resume"


def test_resumed_run_continued_where_it_stopped(two_runs):
    _, _, _, log = two_runs
    assert "rollouts.parquet is current" in log  # round 1 was not sampled again


def test_round_2_samples_from_round_1_checkpoint(two_runs, data_dir):
    from safetensors.torch import load_file

    a = two_runs[0]
    ckpt = a / "round_001" / "variants" / "capo-intersection" / "checkpoint"
    pol = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("policy").to_pylist())
    assert pol == {str(ckpt)}
    man = json.loads((a / "round_002" / "rollouts.parquet.manifest.json").read_text())
    assert man["policy"] == str(ckpt)
    base = load_file(str(data_dir / "models" / "smollm2-135m-instruct" / "model.safetensors"))

    def moved(k: int) -> bool:
        w = load_file(str(a / f"round_{k:03d}" / "variants" / "capo-intersection" / "checkpoint" / "model.safetensors"))
        return any(not np.array_equal(w[n].float().numpy(), base[n].float().numpy()) for n in w if n in base)

    def has_signal(k: int) -> bool:
        t = pq.read_table(a / f"round_{k:03d}" / "variants" / "capo-intersection" / "token_rewards.parquet")
        return any(abs(x) > 0 for row in t.column("advantages").to_pylist() for x in row)

    # a round with a non-zero advantage moves the weights; one without leaves them exactly as they were
    assert moved(1) == has_signal(1)
    assert has_signal(2) and moved(2), "round 2 must train on a non-zero signal and write new weights"
    # prompts do not repeat across rounds
    p1 = set(pq.read_table(a / "round_001" / "rollouts.parquet").column("prompt_id").to_pylist())
    p2 = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("prompt_id").to_pylist())
    assert p1.isdisjoint(p2)


def test_eval_has_every_round_and_the_report_exists(two_runs):
    a = two_runs[0]
    rounds = {0: a / "round_000" / "eval.parquet"}
    rounds.update({k: a / f"round_{k:03d}" / "variants" / "capo-intersection" / "eval.parquet" for k in (1, 2)})
    for k, path in rounds.items():
        t = pq.read_table(path)
        assert set(t.column("benchmark").to_pylist()) == {"gsm8k"} and set(t.column("round").to_pylist()) == {k}
    rep = a / "report"
    for png in rep.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    html = (rep / "report.html").read_text()
    assert "<table" in html and "GSM8K" in html and html.count("<tr") >= 4  # header + rounds 0, 1, 2
