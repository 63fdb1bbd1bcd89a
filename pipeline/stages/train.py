"""Stage ``train``: one PPO-style update of the policy on the round's token rewards -> ``checkpoint``,
``train_state``, ``train_metrics`` and ``token_credit`` (where the update put the credit).

The stage reads the round's tables (:func:`load_examples`), resolves the models and the training
state it continues from, runs the update (:func:`train.trainer.update_policy`, the library below
this stage: Accelerate, the models, the loop) and commits what it wrote through
:mod:`pipeline.storage` as every stage does (:func:`commit_round`). Its key chains through the
previous round's training state (:func:`previous_state_fp`).

Several processes: ``accelerate launch ... -m pipeline.stages.train_launch --config FILE --round K``
(what ``train.launcher`` runs): every process runs :func:`train_stage`; the main process commits.
"""

from __future__ import annotations

import logging
import shutil
import time

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.schemas import TOKEN_CREDIT_SCHEMA, TRAIN_METRICS_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    model_fingerprint,
    policy_for_round,
    provenance,
    resolve_model,
    round_paths,
)

log = logging.getLogger("capo.train")


def previous_state_fp(cfg: CAPOConfig, round_idx: int) -> str | None:
    """Fingerprint of the training state round ``round_idx`` starts from: None for round 1 (the
    starting policy, a fresh optimizer), else round k-1's ``train_state`` of the same variant, read
    from its manifest (which outlives a state pruned by ``train.keep_states``).

    Raises:
        FileNotFoundError: round k-1 of this variant committed no training state.
    """
    if round_idx <= 1:
        return None
    prev = round_paths(cfg, round_idx - 1)["train_state"]
    man = storage.read_manifest(prev)
    if man is None:
        raise FileNotFoundError(
            f"round {round_idx} of variant {cfg.variant!r} continues from round {round_idx - 1}'s training state "
            f"{prev}, which was never committed: run round {round_idx - 1} first (capo round --round "
            f"{round_idx - 1}); a run trained by a version without carried training state must be re-trained "
            "from round 1 (or start a new run_id)")
    return f"{man['key_hash']}:{man['fingerprint']}"  # the key chains through every earlier round's state


def train_settings_key(cfg: CAPOConfig) -> dict:
    """The ``train`` settings that the checkpoint depends on: every field but ``launcher`` and
    ``keep_states`` (how and where it runs, how many states it keeps), and ``deterministic``,
    ``ratio_trace`` and ``future_kl`` only
    when true (a setting added later must not make the runs trained before it stale).
    ``report_to`` (where the metrics are logged) changes no output either: it is held as ``[]``
    whatever it is, the value rounds trained before this rule have in their key."""
    out = {k: v for k, v in cfg.model_dump(mode="json")["train"].items()
           if k not in ("launcher", "keep_states") and not (k in ("deterministic", "ratio_trace", "future_kl") and not v)}
    return {**out, "report_to": []}


def train_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the checkpoint depends on: rollouts, token rewards, the training state it
    continues from, train settings (not the launcher or retention), resolved precision, policy, seed."""
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    prec = precision_record(cfg)
    return {"rollouts": input_fp(p["rollouts"]), "token_rewards": input_fp(p["token_rewards"]),
            "state": previous_state_fp(cfg, round_idx),
            "train": train_settings_key(cfg),
            "mixed_precision": prec["train_mixed_precision"], "save_dtype": prec["train_save_dtype"],
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)), "seed": cfg.seed}


def load_examples(cfg: CAPOConfig, round_idx: int) -> list:
    """The round's responses to train on (:class:`train.examples.Example`, empty responses left
    out): rollouts joined with the variant's token advantages (every length checked).

    The engine's log-probs ride along for the mismatch diagnostic only when the rollouts were
    sampled without top-p truncation (``rollout.sampling.top_p == 1``): the engine reports log-probs
    renormalized over the nucleus, the trainer the untruncated ones.

    Raises:
        FileNotFoundError: ``rollouts.parquet`` or the variant's ``token_rewards.parquet`` is missing.
        ValueError: a rollout without token advantages, or with another number of them than its
            response tokens (the reward stage ran on other rollouts: run it again).
    """
    from train.examples import Example

    p = round_paths(cfg, round_idx)
    ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_token_ids", "response_token_ids",
                                                               "rollout_logprobs"])
    tr = storage.read_table(p["token_rewards"], "token_rewards").select(["rollout_id", "advantages"])
    adv = {r["rollout_id"]: r["advantages"] for r in tr.to_pylist()}
    out = []
    for r in ro.to_pylist():
        a = adv.get(r["rollout_id"])
        if a is None or len(a) != len(r["response_token_ids"]):
            raise ValueError(f"rollout {r['rollout_id']}: {len(r['response_token_ids'])} tokens but "
                             f"{None if a is None else len(a)} advantages; re-run the reward stage")
        if r["response_token_ids"]:
            elp = r["rollout_logprobs"] if cfg.rollout.sampling.top_p >= 1.0 else None
            elp = np.asarray(elp, np.float32) if elp is not None and len(elp) == len(a) else None
            out.append(Example(r["prompt_token_ids"], r["response_token_ids"], np.asarray(a, np.float32), elp,
                               r["rollout_id"]))
    return out


def prune_states(cfg: CAPOConfig, round_idx: int, keep: int) -> list:
    """Delete the training states of this variant older than the newest ``keep`` (rounds
    ``<= round_idx - keep``); their manifests stay, marked ``pruned``, so later rounds' keys
    (which hold their fingerprints) still resolve. Checkpoints are never touched.

    Returns:
        The state folders deleted.
    """
    gone = []
    for r in range(1, round_idx - keep + 1):
        path = round_paths(cfg, r)["train_state"]
        if path.is_dir():
            shutil.rmtree(path)
            storage.mark_pruned(path)
            gone.append(path)
            log.info("[train] pruned round %d's training state (train.keep_states=%d)", r, keep)
    return gone


def previous_state(cfg: CAPOConfig, round_idx: int):
    """Round k-1's training state of this variant and its manifest: ``(None, None)`` for round 1.

    Raises:
        FileNotFoundError: the state is gone (pruned by ``train.keep_states`` or deleted).
    """
    if round_idx <= 1:
        return None, None
    prev = round_paths(cfg, round_idx - 1)["train_state"]
    man = storage.read_manifest(prev)
    if man is None or man.get("pruned") or not prev.is_dir():
        raise FileNotFoundError(
            f"round {round_idx} continues from round {round_idx - 1}'s training state {prev}, which is gone "
            f"(train.keep_states={cfg.train.keep_states} pruned it, or it was deleted): re-train from the newest round "
            "that still has its state, or raise train.keep_states")
    return prev, man


def train_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Train the round's policy on its token advantages -> ``variants/<v>/checkpoint``, its training
    state, ``train_metrics`` and ``token_credit`` (where the update put the credit, per token);
    skipped when the checkpoint and the metrics are current under :func:`train_key`.

    Runs unchanged in one process or in each of W processes (``train.launcher``): every process
    reads the whole round and runs :func:`train.trainer.update_policy`; the main process commits
    (:func:`commit_round`). With ``train.deterministic`` the whole update runs under
    :func:`train.trainer.deterministic_kernels`.

    Raises:
        ValueError: the round has no non-empty responses; LoRA together with FSDP or ZeRO-3; a
            training state saved under another process layout.
        FileNotFoundError: the round's rollouts or token rewards were never committed; round k-1's
            training state is missing or was pruned.
    """
    from pipeline.precision import announce, precision_record, resolve_mixed_precision
    from train.trainer import UpdateJob, deterministic_kernels, finish_update, update_policy

    p = round_paths(cfg, round_idx)
    key = train_key(cfg, round_idx)
    cur = storage.outputs_current([p["checkpoint"], p["train_metrics"]], key)
    if cur.current and not force:
        log.info("[train] skipped: %s", cur.reason)
        return StageResult("train", str(p["checkpoint"]), True, cur.reason)
    t0 = time.perf_counter()
    log.info("[train] running: %s", cur.reason)
    prev_state, prev_man = previous_state(cfg, round_idx)
    examples = load_examples(cfg, round_idx)  # the whole round on every process; ppo_update shares it out
    if not examples:
        raise ValueError(f"round {round_idx} has no non-empty responses to train on")
    tc = cfg.train
    job = UpdateJob(
        tc=tc, round_idx=round_idx, seed=cfg.seed, temperature=cfg.rollout.sampling.temperature,
        policy=policy_for_round(cfg, round_idx), start=resolve_model(cfg.rollout.policy, cfg),
        prev_state=prev_state,
        prev_layout={k: prev_man.get(k) for k in ("num_processes", "distributed_type")} if prev_man else None,
        examples=examples, state_out=p["train_state"].with_name(f".{p['train_state'].name}.tmp"),
        checkpoint_out=p["checkpoint"].with_name(f".{p['checkpoint'].name}.tmp"),
        save_dtype=precision_record(cfg)["train_save_dtype"],
        mixed_precision=announce("train.mixed_precision", resolve_mixed_precision(tc.mixed_precision), log),
        tracking_dir=cfg.run_dir() / "tracking", run_name=cfg.run_id,
        tracker_config={"variant": cfg.variant, **cfg.model_dump(mode="json")["train"]})
    with deterministic_kernels(tc.deterministic):
        out = update_policy(job)
    if out.is_main:
        commit_round(cfg, round_idx, key, job, out, time.perf_counter() - t0)
    finish_update(out)
    return StageResult("train", str(p["checkpoint"]), False, cur.reason, len(out.metrics), time.perf_counter() - t0)


def commit_round(cfg: CAPOConfig, round_idx: int, key: dict, job, out, seconds: float) -> None:
    """Commit what :func:`train.trainer.update_policy` wrote (main process), in an order a crash
    cannot confuse: the old checkpoint, token credit and training state (with their manifests) go to
    ``superseded/`` before anything new is in place, so a re-trained round loses nothing (the old
    checkpoint and the state it continued from can be put back together); the state and the checkpoint are placed
    (:func:`pipeline.storage.place_dir`); the token-credit and metrics tables and the two manifests
    come last; then states older than ``train.keep_states`` rounds are pruned. ``token_credit`` is not
    one of the stage's outputs for :func:`train_key`: a round trained before the table existed stays
    current without it."""
    p = round_paths(cfg, round_idx)
    ckpt, state_dir = p["checkpoint"], p["train_state"]
    if ckpt.exists() or storage.manifest_path(ckpt).exists():
        storage.supersede(ckpt)
    storage.supersede(p["token_credit"])  # the old update's credit goes with its checkpoint
    storage.supersede(state_dir)  # a re-trained round: its old state goes with the old checkpoint, manifest and all
    storage.place_dir(job.state_out, state_dir, "state")
    storage.place_dir(job.checkpoint_out, ckpt, "checkpoint")
    rows = [{"run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "step": i, "name": k, "value": float(v)}
            for i, m in enumerate(out.metrics) for k, v in m.items()]
    extra = provenance(cfg, {"elapsed_s": round(seconds, 3), "policy_parent": job.policy, "round": round_idx,
                             "optimizer_steps": len(out.metrics), "examples": len(job.examples), **out.layout})
    if out.credit is not None:
        credit = [{"run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "rollout_id": e.rollout_id,
                   "credit": c, "passes": int(n)}
                  for e, c, n in zip(job.examples, out.credit.means(), out.credit.passes.tolist())]
        storage.write_table(pa.Table.from_pylist(credit, schema=TOKEN_CREDIT_SCHEMA), p["token_credit"], "token_credit",
                            stage="train", key=key, extra=extra)
    storage.write_table(pa.Table.from_pylist(rows, schema=TRAIN_METRICS_SCHEMA), p["train_metrics"], "train_metrics",
                        stage="train", key=key, extra=extra)
    storage.commit_manifest(state_dir, stage="train", key=key, rows=None,
                            extra={**extra, "optimizer_steps_total": out.optimizer_steps})
    storage.commit_manifest(ckpt, stage="train", key=key, rows=None, extra=extra)
    log.info("[train] wrote %s and its training state in %.1fs", ckpt, seconds)
    prune_states(cfg, round_idx, cfg.train.keep_states)


def main(argv: list[str] | None = None) -> None:
    """``python -m pipeline.stages.train_launch --config FILE --round K`` (also under ``accelerate launch`` /
    ``torchrun``: what ``train.launcher`` runs).

    The main process prints the stage result as the ``CAPO_STAGE_RESULT`` line that
    :func:`flows.runner.run_stage` reads; every process logs ``[train] rank r/W finished``.
    """
    import argparse
    import dataclasses
    import json
    import os
    import resource

    import torch

    from pipeline.config import load_config
    from pipeline.stages.base import RESULT_TAG

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = train_stage(load_config(a.config, a.overrides), a.round, a.force)
    if int(os.environ.get("RANK", "0")) == 0:  # the launchers set RANK; a skipped stage built no Accelerator
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (main process only)
        print(RESULT_TAG + json.dumps(dataclasses.asdict(dataclasses.replace(res, peak_rss_mb=round(peak, 1)))), flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


STAGE = Stage("train", ("rollouts", "token_rewards"), ("checkpoint", "train_metrics"), True, train_key,
              "pipeline.stages.train:train_stage", engine_env=True, launcher=lambda cfg: cfg.train.launcher,
              launch_module="pipeline.stages.train_launch")
