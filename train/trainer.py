"""The PPO-clip trainer: reads a round's rollouts and token advantages, writes the next policy.

    batch -> old log-probs -> [per mini-batch: log-probs -> loss -> backward] -> step -> log -> save

Run it as a stage (``capo stage train``), or under Accelerate's launchers for several GPUs
(``accelerate launch -m train.trainer --config ... --round K``); DDP/FSDP/DeepSpeed come from
Accelerate, not from this file. Old log-probs are recomputed here, before the first update, with
the exact weights that sampled the round (vLLM's sampler log-probs are kept only for inspection).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline import storage
from pipeline.config import CAPOConfig, TrainConfig, load_config
from pipeline.schemas import TRAIN_METRICS_SCHEMA
from pipeline.stages import StageResult, _with_prov, policy_for_round, round_paths, stage_key
from train.loss import ppo_clip_loss

log = logging.getLogger("capo.train")


@dataclass
class Example:
    """One response to train on: prompt + response token ids and its per-token advantages."""

    prompt_ids: list[int]
    response_ids: list[int]  # (T,)
    advantages: np.ndarray  # (T,) float32


def load_examples(cfg: CAPOConfig, round_idx: int) -> list[Example]:
    """Join rollouts with the variant's token advantages (checks every length matches)."""
    p = round_paths(cfg, round_idx)
    ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_token_ids", "response_token_ids"])
    tr = storage.read_table(p["token_rewards"], "token_rewards").select(["rollout_id", "advantages"])
    adv = {r["rollout_id"]: r["advantages"] for r in tr.to_pylist()}
    out = []
    for r in ro.to_pylist():
        a = adv.get(r["rollout_id"])
        if a is None or len(a) != len(r["response_token_ids"]):
            raise ValueError(f"rollout {r['rollout_id']}: {len(r['response_token_ids'])} tokens but "
                             f"{None if a is None else len(a)} advantages; re-run the reward stage")
        if r["response_token_ids"]:
            out.append(Example(r["prompt_token_ids"], r["response_token_ids"], np.asarray(a, np.float32)))
    return out


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response into (B, L); response positions as (B, T) index/mask tensors."""
    L = max(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    T = max(len(e.response_ids) for e in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    pos = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T) logit position predicting each response token
    tgt = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T) response token ids
    mask = torch.zeros((len(batch), T), dtype=torch.bool)
    adv = torch.zeros((len(batch), T), dtype=torch.float32)
    for i, e in enumerate(batch):
        P, R = len(e.prompt_ids), len(e.response_ids)
        ids[i, : P + R] = torch.tensor(e.prompt_ids + e.response_ids)
        attn[i, : P + R] = 1
        pos[i, :R] = torch.arange(P - 1, P + R - 1)
        tgt[i, :R] = torch.tensor(e.response_ids)
        mask[i, :R] = True
        adv[i, :R] = torch.from_numpy(e.advantages)
    return {"input_ids": ids, "attention_mask": attn, "pos": pos, "target": tgt, "mask": mask, "advantages": adv}


def token_logprobs(model, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T) log-prob (nats) of each response token under ``model`` (0 at padding)."""
    dev = next(model.parameters()).device
    logits = model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev)).logits  # (B, L, V)
    pos = mb["pos"].to(dev)
    sel = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.size(-1))).float()  # (B, T, V)
    lp = sel.gather(-1, mb["target"].to(dev).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(sel, dim=-1)
    return lp * mb["mask"].to(dev)


def _normalizer(mode: str, mb: dict, t_global: int) -> float:
    """Size of what the aggregation divides by, to weight micro-batches inside a mini-batch."""
    m = mb["mask"]
    if mode == "token-mean":
        return float(m.sum())
    if mode == "seq-mean-token-mean":
        return float((m.sum(1) > 0).sum())
    return float(m.size(0) * t_global)  # seq-mean-token-sum-norm


def ppo_update(model, optimizer, examples: list[Example], tc: TrainConfig, pad_id: int, seed: int,
               accelerator, ref_model=None) -> list[dict]:
    """One round of PPO-clip: old log-probs first, then ``ppo_epochs`` x ``num_mini_batches`` steps.

    Micro-batches are weighted so that a mini-batch's loss equals the chosen aggregation over the
    whole mini-batch (not a mean of micro-batch means). Returns one metrics dict per optimizer step.
    """
    micro = [collate(examples[i : i + tc.micro_batch_size], pad_id) for i in range(0, len(examples), tc.micro_batch_size)]
    t_global = max(len(e.response_ids) for e in examples)
    model.eval()
    with torch.no_grad():
        for mb in micro:
            mb["old_logprobs"] = token_logprobs(model, mb).cpu()
            if ref_model is not None:
                mb["ref_logprobs"] = token_logprobs(ref_model, mb).cpu()
    model.train()
    rng = np.random.default_rng(seed)
    metrics, step = [], 0
    for epoch in range(tc.ppo_epochs):
        order = rng.permutation(len(micro))
        for chunk in np.array_split(order, min(tc.num_mini_batches, len(micro))):
            t0 = time.perf_counter()
            mbs = [micro[j] for j in chunk]
            total = sum(_normalizer(tc.loss_agg_mode, mb, t_global) for mb in mbs)
            agg = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "ratio_mean": 0.0}
            for mb in mbs:
                lp = token_logprobs(model, mb)
                dev = lp.device
                out = ppo_clip_loss(lp, mb["old_logprobs"].to(dev), mb["advantages"].to(dev), mb["mask"].to(dev),
                                    tc.clip_low, tc.clip_high, tc.loss_agg_mode,
                                    ref_logprobs=mb["ref_logprobs"].to(dev) if "ref_logprobs" in mb else None,
                                    kl_coef=tc.kl_coef)
                w = _normalizer(tc.loss_agg_mode, mb, t_global) / total
                if tc.loss_agg_mode == "seq-mean-token-sum-norm":
                    w *= mb["mask"].size(1) / t_global  # agg used the micro-batch's own T
                accelerator.backward(out.loss * w)
                for k in agg:
                    agg[k] += float(getattr(out, k).detach()) * w
            grad_norm = float(accelerator.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], tc.max_grad_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ntok = int(sum(mb["mask"].sum() for mb in mbs))
            secs = time.perf_counter() - t0
            metrics.append({**agg, "grad_norm": grad_norm, "epoch": epoch, "tokens": ntok,
                            "seconds": secs, "tokens_per_s": ntok / secs})
            log.info("[train] step %d: %s", step, json.dumps({k: round(v, 5) for k, v in metrics[-1].items()}))
            step += 1
    return metrics


def train_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Train the round's policy on its token advantages -> ``variants/<v>/checkpoint`` + metrics."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = round_paths(cfg, round_idx)
    ckpt, key = p["checkpoint"], stage_key("train", cfg, round_idx)
    cur = storage.is_current(ckpt, key)
    metrics_cur = storage.is_current(p["train_metrics"], key)
    if cur.current and metrics_cur.current and not force:
        log.info("[train] skipped: %s", cur.reason)
        return StageResult("train", str(ckpt), True, cur.reason)
    log.info("[train] running: %s", cur.reason)
    t0 = time.perf_counter()
    tc = cfg.train
    accelerator = Accelerator(mixed_precision=tc.mixed_precision, log_with=tc.report_to or None,
                              project_dir=str(cfg.run_dir() / "tracking"))
    if tc.report_to:
        accelerator.init_trackers(cfg.run_id, config={"variant": cfg.variant, **cfg.model_dump(mode="json")["train"]})
    set_seed(cfg.seed + round_idx)
    policy = policy_for_round(cfg, round_idx)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, tc.dtype))
    if tc.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if tc.lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(r=tc.lora.r, lora_alpha=tc.lora.alpha, lora_dropout=tc.lora.dropout,
                                                     target_modules=tc.lora.target_modules, task_type="CAUSAL_LM"))
    ref_model = None
    if tc.kl_coef > 0:
        from pipeline.stages import resolve_model

        ref_model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.rollout.policy, cfg), dtype=getattr(torch, tc.dtype)).eval()
        ref_model.requires_grad_(False)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=tc.learning_rate,
                                  weight_decay=tc.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    if ref_model is not None:
        ref_model.to(accelerator.device)
    examples = load_examples(cfg, round_idx)[accelerator.process_index :: accelerator.num_processes]
    if not examples:
        raise ValueError(f"round {round_idx} has no non-empty responses to train on")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    metrics = ppo_update(model, optimizer, examples, tc, pad_id, cfg.seed + round_idx, accelerator, ref_model)
    if tc.report_to:  # global step: rounds are consecutive blocks of optimizer steps
        for i, m in enumerate(metrics):
            accelerator.log({f"train/{k}": v for k, v in m.items()}, step=(round_idx - 1) * len(metrics) + i)
        accelerator.end_training()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _save(accelerator.unwrap_model(model), tok, ckpt, tc.save_dtype)
        secs = time.perf_counter() - t0
        rows = [{"run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "step": i, "name": k, "value": float(v)}
                for i, m in enumerate(metrics) for k, v in m.items()]
        extra = _with_prov(cfg, {"elapsed_s": round(secs, 3), "policy_parent": policy, "round": round_idx,
                                 "optimizer_steps": len(metrics), "examples": len(examples)})
        storage.write_table(pa.Table.from_pylist(rows, schema=TRAIN_METRICS_SCHEMA), p["train_metrics"], "train_metrics",
                            stage="train", key=key, extra=extra)
        storage.commit_manifest(ckpt, stage="train", key=key, rows=None, extra=extra)
        log.info("[train] wrote %s in %.1fs", ckpt, secs)
    return StageResult("train", str(ckpt), False, cur.reason, len(metrics), time.perf_counter() - t0)


def _save(model, tok, ckpt: Path, dtype: str) -> None:
    """save_pretrained into a temporary dir, then rename into place (earlier one superseded)."""
    tmp = ckpt.with_name(f".{ckpt.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(model, "merge_and_unload"):  # LoRA: the next round's engine loads plain weights
        model = model.merge_and_unload()
    model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if ckpt.exists():
        storage.supersede(ckpt)
    os.replace(tmp, ckpt)


def main(argv: list[str] | None = None) -> None:
    """``python -m train.trainer --config FILE --round K`` (also under ``accelerate launch``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(train_stage(load_config(a.config, a.overrides), a.round, a.force).line())


if __name__ == "__main__":
    main()
