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
def two_runs(repo, data_dir, module_tmp):
    base = module_tmp("multi")
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


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _variant(run: Path, k: int) -> Path:
    return run / f"round_{k:03d}" / "variants" / "capo-intersection"


def _share_changed(a: dict, b: dict) -> float:
    changed = total = 0
    for n in a:
        if n in b:
            changed += int((a[n].float() != b[n].float()).sum())
            total += a[n].numel()
    return changed / total


def test_round_2_samples_from_round_1_checkpoint(two_runs, data_dir):
    a = two_runs[0]
    ckpt = _variant(a, 1) / "checkpoint"
    pol = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("policy").to_pylist())
    assert pol == {str(ckpt)}
    man = json.loads((a / "round_002" / "rollouts.parquet.manifest.json").read_text())
    assert man["policy"] == str(ckpt)
    base = _weights(data_dir / "models" / "smollm2-135m-instruct")

    def has_signal(k: int) -> bool:
        t = pq.read_table(_variant(a, k) / "token_rewards.parquet")
        return any(abs(x) > 0 for row in t.column("advantages").to_pylist() for x in row)

    # each round's fp32 master weights move by that round's full update: round k against round k-1,
    # in most elements (Adam moves every weight with a gradient), and the engine checkpoint is their cast
    prev = {n: w.float() for n, w in base.items()}
    for k in (1, 2):
        state = _weights(_variant(a, k) / "train_state")
        share = _share_changed(state, prev)
        if has_signal(k):
            assert share > 0.5, f"round {k}'s master weights differ from round {k - 1}'s in only {share:.1%}"
        else:
            assert share == 0.0, f"round {k} had no signal but moved {share:.1%} of the weights"
        ckpt_w = _weights(_variant(a, k) / "checkpoint")
        for n, w in ckpt_w.items():
            assert torch_equal_cast(state[n], w), f"round {k} checkpoint {n} is not the cast of the master weights"
        prev = state
    assert has_signal(2), "round 2 must train on a non-zero signal"
    # prompts do not repeat across rounds
    p1 = set(pq.read_table(a / "round_001" / "rollouts.parquet").column("prompt_id").to_pylist())
    p2 = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("prompt_id").to_pylist())
    assert p1.isdisjoint(p2)


def torch_equal_cast(master, exported) -> bool:
    return bool((master.to(exported.dtype) == exported).all())


def test_two_rounds_equal_one_process_training_both(two_runs):
    """Round 2 continued round 1's optimization: replaying both rounds' updates in one process, with
    one model and one AdamW, ends at round 2's saved master weights and optimizer step count."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import load_config
    from pipeline.precision import resolve_mixed_precision
    from train.examples import load_examples
    from train.trainer import ppo_update

    a = two_runs[0]
    cfg = load_config(None, json.loads((_variant(a, 1) / "train_metrics.parquet.manifest.json").read_text())["resolved_config"])
    tc = cfg.train
    start = json.loads((a / "round_001" / "rollouts.parquet.manifest.json").read_text())["policy"]
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(start)
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(tc.mixed_precision).value, cpu=True)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=tc.learning_rate,
                            weight_decay=tc.weight_decay)
    model, opt = accelerator.prepare(model, opt)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    steps = 0
    for k in (1, 2):
        steps += len(ppo_update(model, opt, load_examples(cfg, k), tc, pad, cfg.seed + k, accelerator,
                                temperature=cfg.rollout.sampling.temperature))
    saved = _weights(_variant(a, 2) / "train_state")
    mine = accelerator.unwrap_model(model).state_dict()
    worst = max(float((mine[n].float() - saved[n].float()).abs().max()) for n in saved)
    assert worst < 1e-6, f"two rounds differ from one process by {worst:.2e}"
    man = json.loads((_variant(a, 2) / "train_state.manifest.json").read_text())
    assert man["optimizer_steps_total"] == steps


def test_killed_run_resumed_to_the_same_training_state(two_runs):
    a, b = two_runs[0], two_runs[1]
    for k in (1, 2):
        wa, wb = _weights(_variant(a, k) / "train_state"), _weights(_variant(b, k) / "train_state")
        assert all(bool((wa[n] == wb[n]).all()) for n in wa), f"round {k}'s master weights differ after kill + resume"


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
