"""The trainer under ``accelerate launch`` with two CPU processes (gloo) equals one process.

One hand-built round of the tiny model (SmolLM2-135M): 5 responses in two prompt groups, real
CAPO token rewards and group-normalized advantages (some positive, some negative). With
``micro_batch_size=2`` and ``num_mini_batches=2`` the 3 micro-batches (2, 2 and 1 sequences) make
mini-batches of 2 and 1 micro-batches, so with 2 processes the second mini-batch leaves rank 1
with nothing (it runs a zero-weighted dummy) and the micro-batches have different sizes.

The train stage runs through :func:`flows.runner.run_stage`, as a round runs it: once with no
launcher (one child process) and once with ``train.launcher = [accelerate, launch, --config_file,
configs/accelerate/cpu_2proc.yaml]``, the two at the same time (independent runs, one intra-op
thread per process in both). Both checkpoints must agree tensor by tensor (float32, no autocast)
and differ from the starting weights; the logged loss and token counts must agree.

Fast tests below: the mini-batch schedule does not depend on the number of processes, and the
FSDP / ZeRO-3 save path (a gathered state dict) writes the same checkpoint as the plain one.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flows.runner import run_stage
from pipeline import storage
from pipeline.config import load_config
from pipeline.stages.base import round_paths
from tests.toy_round import TRAIN_ROLLOUTS, write_train_round

LR = 2e-4
TOL = 2e-6  # max |w_1proc - w_2proc| allowed; AdamW moves weights by ~LR per step, 100x more


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _round(tmp_path, tiny_model, mode: str, launcher: list[str]):
    """The config of a fresh round (its own runs dir per launcher) with its rollouts and token rewards written."""
    name = "w2" if launcher else "w1"
    cfg = load_config(None, [f"runs_dir={tmp_path / name}", f"data_dir={tmp_path / 'data'}", "run_id=dist",
                             f"rollout.policy={tiny_model}", f"train.loss_agg_mode={mode}", f"train.learning_rate={LR}",
                             "train.micro_batch_size=2", "train.num_mini_batches=2", "train.ppo_epochs=1",
                             "train.dtype=float32", "train.mixed_precision='no'", "train.save_dtype=float32",
                             f"train.launcher={launcher!r}".replace("'", "")])
    assert cfg.train.launcher == launcher
    write_train_round(cfg, tiny_model)
    return cfg


def _train(cfg, mode: str):
    """Run the train stage of ``cfg``'s round through the runner; return (result, logged lines, seconds)."""
    name = "w2" if cfg.train.launcher else "w1"
    logger = logging.getLogger(f"capo.test.dist.{name}.{mode}")
    logger.setLevel(logging.INFO)
    h = _Lines()
    logger.addHandler(h)
    t0 = time.perf_counter()
    res = run_stage("train", cfg, 1, logger=logger)
    return res, h.lines, time.perf_counter() - t0


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}


def _metrics(cfg) -> dict[tuple[int, str], float]:
    t = storage.read_table(round_paths(cfg, 1)["train_metrics"], "train_metrics").to_pylist()
    return {(r["step"], r["name"]): r["value"] for r in t}


# seq-mean-token-mean passes too (its checkpoints were bit-identical when last run): left out to keep
# this under 2 minutes on a 2-core machine. The micro-batching tests in test_trainer.py cover every
# mode's weighting in one process; what two processes add (shares, x world, dummies) is mode-independent.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_two_cpu_processes_equal_one(tmp_path, tiny_model, repo, mode, monkeypatch):
    # One intra-op thread per process in both runs: a matmul's float sums depend on the thread count,
    # and AdamW's first step (lr * g / (|g| + eps)) turns their last-bit differences into sign flips of
    # near-zero gradients. Measured on a 2-core AMX Xeon: the lone process on torch's default 2 threads
    # against `accelerate launch`'s 1 per process (cores / processes) differed by 2.8e-4, 0.0 with
    # OMP_NUM_THREADS=1 for both. Without this, the result depended on whether an earlier test had
    # started a vLLM engine in-process (which sets OMP_NUM_THREADS to the core count for both runs).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launcher = ["accelerate", "launch", "--config_file", str(repo / "configs/accelerate/cpu_2proc.yaml")]
    cfg1 = _round(tmp_path, tiny_model, mode, [])
    cfg2 = _round(tmp_path, tiny_model, mode, launcher)
    # The two runs are independent (own runs dir, own children) and each process computes at one
    # thread whatever else runs: started together they keep both cores busy (the lone 1-thread
    # process alone left one idle) and their results are those of runs started one after the other.
    with ThreadPoolExecutor(2) as pool:
        one, two = pool.submit(_train, cfg1, mode), pool.submit(_train, cfg2, mode)
        (res1, _, s1), (res2, lines2, s2) = one.result(), two.result()
    print(f"{mode}: 1 process {s1:.1f}s, 2 processes {s2:.1f}s (run at the same time)")

    # both ranks ran to the end; rank 0 alone wrote the result line the runner parsed
    out = "\n".join(lines2)
    assert "[train] running on 2 process(es) (MULTI_CPU)" in out, out[-3000:]  # gloo, not 2 lone trainers
    assert "[train] rank 0/2 finished" in out and "[train] rank 1/2 finished" in out, out[-3000:]
    if os.environ.get("CAPO_TEST_SHOW_LAUNCH"):
        print(out)
    assert not res1.skipped and not res2.skipped and res1.rows == res2.rows == 2
    man = storage.read_manifest(round_paths(cfg2, 1)["checkpoint"])
    assert man["num_processes"] == 2 and man["examples"] == len(TRAIN_ROLLOUTS)
    assert storage.read_manifest(round_paths(cfg1, 1)["checkpoint"])["num_processes"] == 1

    w0 = _weights(tiny_model)
    w1 = _weights(round_paths(cfg1, 1)["checkpoint"])
    w2 = _weights(round_paths(cfg2, 1)["checkpoint"])
    assert w1.keys() == w2.keys() == w0.keys()
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
    print(f"{mode}: max |w(1 proc) - w(2 procs)| = {diff:.3e}; max |w(1 proc) - w(start)| = {moved:.3e}")
    assert moved > 100 * TOL, "the update is too small to tell the runs apart"
    assert diff <= TOL, f"{mode}: 1 vs 2 processes differ by {diff:.3e} > {TOL:.0e}"

    m1, m2 = _metrics(cfg1), _metrics(cfg2)
    assert {k for k in m1 if k[1] == "loss"} == {(0, "loss"), (1, "loss")}
    for step in (0, 1):
        assert m1[(step, "tokens")] == m2[(step, "tokens")] > 0
        for name in ("loss", "pg_loss", "clip_frac", "approx_kl", "ratio_mean", "grad_norm"):
            assert m2[(step, name)] == pytest.approx(m1[(step, name)], rel=1e-4, abs=1e-6), (step, name)
    for m in (m1, m2):  # the export diagnostic, on the main process: a float32 checkpoint carries it all
        assert m[(1, "export_update_share")] == 1.0 and m[(1, "master_moved_frac")] > 0
    # where the update put the credit: each process computed its share, the main process wrote all of it
    c1, c2 = ({r["rollout_id"]: (r["credit"], r["passes"])
               for r in storage.read_table(round_paths(c, 1)["token_credit"], "token_credit").to_pylist()}
              for c in (cfg1, cfg2))
    assert c1.keys() == c2.keys() and len(c1) == len(TRAIN_ROLLOUTS)
    for rid, (credit, passes) in c1.items():
        assert passes == c2[rid][1] == 1 and any(x != 0 for x in credit)
        assert c2[rid][0] == pytest.approx(credit, rel=1e-4, abs=1e-6), rid


# ----------------------------------------------------------------------- fast: schedule and saving


@pytest.mark.parametrize("n_micro,mini,epochs", [(3, 2, 1), (5, 3, 2), (1, 4, 1), (8, 2, 3)])
def test_schedule_is_the_same_for_any_number_of_processes(n_micro, mini, epochs):
    from pipeline.config import TrainConfig
    from train.distributed import plan_steps, rank_share

    tc = TrainConfig(num_mini_batches=mini, ppo_epochs=epochs)
    steps = plan_steps(n_micro, tc, seed=3)
    assert steps == plan_steps(n_micro, tc, seed=3) and len(steps) == epochs * min(mini, n_micro)
    for e in range(epochs):  # every micro-batch exactly once per epoch
        assert sorted(j for ep, chunk in steps if ep == e for j in chunk) == list(range(n_micro))
    for world in (1, 2, 3, 4):
        for _, chunk in steps:  # the ranks' shares partition the mini-batch; ranks beyond it get nothing
            shares = [rank_share(chunk, r, world) for r in range(world)]
            assert sorted(j for s in shares for j in s) == sorted(chunk)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_a_fipo_round_with_one_optimizer_step_says_its_update_is_grpos(caplog):
    """The config's step count assumes every response trains; a round left with one micro-batch
    (responses dropped) has one optimizer step, where FIPO's weights are all 1: the log says so."""
    import logging

    import numpy as np

    from pipeline.config import FutureKLConfig, TrainConfig
    from train.examples import Example
    from train.trainer import _plan_micro_batches

    fipo = TrainConfig(num_mini_batches=2, micro_batch_size=2, future_kl=FutureKLConfig())
    ex = [Example([1, 2], [3, 4, 5], np.ones(3, np.float32)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="capo.train"):
        _, _, steps, _ = _plan_micro_batches(ex, fipo, 0, seed=0, world=1)
    assert len(steps) == 1 and "its update is GRPO's" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capo.train"):  # two micro-batches: two steps, no warning
        _, _, steps, _ = _plan_micro_batches(ex * 2, fipo, 0, seed=0, world=1)
    assert len(steps) == 2 and "GRPO's" not in caplog.text


def test_saving_a_gathered_state_dict_equals_saving_the_model(tmp_path, tiny_model):
    """The FSDP / ZeRO-3 save path (unwrapped model + a full state dict of separate tensors, as
    ``accelerator.get_state_dict`` returns) writes the same checkpoint as the plain one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.state import save_checkpoint

    tok = AutoTokenizer.from_pretrained(tiny_model)
    a = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gathered = {k: v.detach().clone() for k, v in b.state_dict().items()}  # no shared storage, like a gather
    save_checkpoint(a, tok, tmp_path / "plain", "bfloat16")
    save_checkpoint(b, tok, tmp_path / "gathered", "bfloat16", state_dict=gathered)
    wa, wb = _weights(tmp_path / "plain"), _weights(tmp_path / "gathered")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ca = AutoModelForCausalLM.from_pretrained(tmp_path / "gathered").config
    assert ca.dtype == torch.bfloat16 and ca.tie_word_embeddings
