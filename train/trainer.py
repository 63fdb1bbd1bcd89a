"""The PPO-clip trainer: reads a round's rollouts and token advantages, writes the next policy.

    batch -> old log-probs -> [per mini-batch: log-probs -> loss -> backward] -> step -> log -> save

Run it as a stage (``capo stage train``), or under Accelerate's launchers for several processes
(``accelerate launch --config_file configs/accelerate/fsdp.yaml -m train.trainer --config ... --round K``,
or ``train.launcher`` in the config); DDP/FSDP/DeepSpeed come from Accelerate, not from this file.
With W processes every process reads the whole round and computes its share of each mini-batch,
weighted so that the averaged gradient equals the one-process gradient (:func:`ppo_update`);
docs/distributed-training.md has the configs and what was tested. Old log-probs are recomputed
here, before the first update, with the exact weights that sampled the round (vLLM's sampler
log-probs are kept only for inspection).
"""

from __future__ import annotations

import argparse
import contextlib
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
from pipeline.stages import (
    StageResult,
    policy_for_round,
    provenance,
    round_paths,
    stage_key,
)
from train.loss import ppo_clip_loss

log = logging.getLogger("capo.train")


@dataclass
class Example:
    """One response to train on: prompt + response token ids and its per-token advantages."""

    prompt_ids: list[int]
    response_ids: list[int]  # (T,)
    advantages: np.ndarray  # (T,) float32
    engine_logprobs: np.ndarray | None = None  # (T,) float32: the sampler's log-prob of each token, if recorded


def load_examples(cfg: CAPOConfig, round_idx: int) -> list[Example]:
    """Join rollouts with the variant's token advantages (checks every length matches).

    The engine's log-probs ride along for the mismatch diagnostic only when the rollouts were
    sampled without top-p truncation (``rollout.sampling.top_p == 1``): the engine reports log-probs
    renormalized over the nucleus, the trainer the untruncated ones."""
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
            out.append(Example(r["prompt_token_ids"], r["response_token_ids"], np.asarray(a, np.float32), elp))
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
    elp = torch.full((len(batch), T), float("nan"), dtype=torch.float32)  # (B, T) engine log-probs, NaN if unknown
    for i, e in enumerate(batch):
        P, R = len(e.prompt_ids), len(e.response_ids)
        ids[i, : P + R] = torch.tensor(e.prompt_ids + e.response_ids)
        attn[i, : P + R] = 1
        pos[i, :R] = torch.arange(P - 1, P + R - 1)
        tgt[i, :R] = torch.tensor(e.response_ids)
        mask[i, :R] = True
        adv[i, :R] = torch.from_numpy(e.advantages)
        if e.engine_logprobs is not None:
            elp[i, :R] = torch.from_numpy(e.engine_logprobs)
    return {"input_ids": ids, "attention_mask": attn, "pos": pos, "target": tgt, "mask": mask, "advantages": adv,
            "engine_logprobs": elp}


LOGPROB_CHUNK = 128
"""Response positions per chunk of the vocabulary log-softmax in :func:`token_logprobs`."""


def _tempered_logprobs(logits: torch.Tensor, target: torch.Tensor, inv_temp: float, entropy: bool = False):
    """(B, C, V) logits, (B, C) targets -> (B, C) fp32 log-softmax of ``logits * inv_temp`` at the
    targets (and, with ``entropy``, the (B, C) entropy in nats of that distribution:
    ``logsumexp(z) - sum(softmax(z) * z)``)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * inv_temp  # fp32 (fp64 stays fp64)
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return lp
    return lp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)


def _chunk_logprobs(logits: torch.Tensor, idx: torch.Tensor, target: torch.Tensor, inv_temp: float,
                    entropy: bool = False):
    """(B, L', V) logits, (B, C) positions into them, (B, C) targets -> :func:`_tempered_logprobs`
    of those positions."""
    sel = torch.gather(logits, 1, idx.unsqueeze(-1).expand(-1, -1, logits.size(-1)))  # (B, C, V)
    return _tempered_logprobs(sel, target, inv_temp, entropy)


def _chunk_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                         target: torch.Tensor, inv_temp: float, autocast: tuple | None, entropy: bool = False):
    """(B, L', H) final hidden states, the output head's (V, H) weight and (V,) bias, (B, C)
    positions, (B, C) targets -> :func:`_tempered_logprobs` of ``hidden @ weight.T + bias`` at those
    positions: the logits of C positions only, under the autocast the model's forward ran in
    (``autocast``: (device type, dtype), or None)."""
    h = torch.gather(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))  # (B, C, H)
    ctx = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    with ctx:
        logits = torch.nn.functional.linear(h, weight, bias)  # (B, C, V)
    return _tempered_logprobs(logits, target, inv_temp, entropy)


class _HeadLogProbs(torch.autograd.Function):
    """Tempered log-probs of the targets under the output head, chunk by chunk, with a hand-written
    backward that never holds more than one (B, chunk, V) block and accumulates the head's weight
    gradient in place in one (V, H) buffer (autograd would allocate a (V, H) gradient per chunk
    and sum them: +0.55 GB per chunk in flight for Qwen2.5-0.5B's tied 151,936 x 896 head).

    Forward: (B, L', H) ``hidden``, (V, H) ``weight``, (V,) ``bias`` or None, (B, T) ``idx`` into
    L', (B, T) ``target`` -> (B, T) log-probs (:func:`_chunk_head_logprobs` per chunk, under the
    forward's ``autocast``). Backward, with z = (hidden @ weight.T + bias) * inv_temp and
    lp = z[target] - logsumexp(z): d lp / d logits = inv_temp * (onehot(target) - softmax(z)),
    so per chunk G = grad_lp * that (B, C, V); d hidden = G @ weight, d weight += G^T @ h,
    d bias += sum G (the gradients in fp32, or the weight's dtype when wider).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, idx, target, inv_temp, chunk, autocast):
        out = [_chunk_head_logprobs(hidden, weight, bias, idx[:, c0:c0 + chunk], target[:, c0:c0 + chunk],
                                    inv_temp, autocast) for c0 in range(0, idx.size(1), chunk)]
        ctx.save_for_backward(hidden, weight, bias, idx, target)
        ctx.inv_temp, ctx.chunk, ctx.autocast = inv_temp, chunk, autocast
        return torch.cat(out, dim=1) if out else hidden.new_zeros(idx.shape, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_lp):
        hidden, weight, bias, idx, target = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)
        gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias is not None else None
        B, H, V = hidden.size(0), hidden.size(-1), weight.size(0)
        w = weight.to(acc)
        for c0 in range(0, idx.size(1), ctx.chunk):
            ix, tg = idx[:, c0:c0 + ctx.chunk], target[:, c0:c0 + ctx.chunk]
            g = grad_lp[:, c0:c0 + ctx.chunk].to(acc)  # (B, C)
            h = torch.gather(hidden, 1, ix.unsqueeze(-1).expand(-1, -1, H))  # (B, C, H)
            ac = torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]) if ctx.autocast else contextlib.nullcontext()
            with torch.no_grad():
                with ac:
                    logits = torch.nn.functional.linear(h, weight, bias)  # (B, C, V), as in forward
                G = torch.softmax(logits.to(acc) * ctx.inv_temp, dim=-1)
                del logits
                G.mul_(-g.unsqueeze(-1)).scatter_add_(-1, tg.unsqueeze(-1), g.unsqueeze(-1)).mul_(ctx.inv_temp)
                G2 = G.view(-1, V)
                if gw is not None:
                    gw.addmm_(G2.t(), h.reshape(-1, H).to(acc))
                if gb is not None:
                    gb.add_(G2.sum(0))
                if gh is not None:
                    gh.scatter_add_(1, ix.unsqueeze(-1).expand(-1, -1, H), (G2 @ w).view(B, -1, H))
                del G, G2
        return (gh.to(hidden.dtype) if gh is not None else None, gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None else None, None, None, None, None, None)


def _output_head(model) -> torch.nn.Linear | None:
    """The model's output head (a plain ``nn.Linear``, possibly tied to the input embedding) through
    DDP/DeepSpeed (``.module``) and peft wrappers, or None when it has another form."""
    m = model
    while isinstance(getattr(m, "module", None), torch.nn.Module):
        m = m.module
    if getattr(getattr(m, "config", None), "final_logit_softcapping", None):
        return None  # Gemma 2 squashes the logits after the head (tanh): the head is not the last step
    get = getattr(m, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is torch.nn.Linear else None


@contextlib.contextmanager
def _head_bypassed(head: torch.nn.Linear, seen: dict):
    """Make ``head`` return its input (the final hidden states) for the duration, recording in
    ``seen["autocast"]`` the autocast (device type, dtype) active inside the model's forward (None
    when off), so the caller applies the head itself, chunk by chunk, in the same precision."""
    def passthrough(x):
        dt = x.device.type
        seen["autocast"] = (dt, torch.get_autocast_dtype(dt)) if torch.is_autocast_enabled(dt) else None
        return x

    before = head.__dict__.get("forward")  # e.g. an Accelerate hook (device_map / offload) to restore
    head.forward = passthrough  # an instance attribute shadows nn.Linear.forward
    try:
        yield
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def token_logprobs(model, mb: dict[str, torch.Tensor], temperature: float = 1.0,
                   chunk: int = LOGPROB_CHUNK, with_entropy: bool = False, fuse_head: bool = True):
    """(B, T) log-prob (nats) of each response token under ``model`` at sampling ``temperature``
    (0 at padding).

    The log-probs are those of the distribution the rollout engine sampled from:
    ``log_softmax(logits / temperature)`` (temperature 0, greedy, counts as 1). Top-p/top-k
    truncation is not applied, as in verl and TRL: the truncated distribution is undefined outside
    the nucleus and the PPO ratio uses the untruncated one.

    Memory: the model runs only from the first response position on (``logits_to_keep``) and,
    with ``fuse_head`` (the default, where the output head is a plain ``nn.Linear`` with whole
    weights), returns its final hidden states instead of logits: the output head and the fp32
    log-softmax are applied ``chunk`` positions at a time, so the (B, T', V) logits never exist
    (V = 151,936 for Qwen2.5: 0.39 GB of fp32 logits and as much again for their gradient in a
    micro-batch of 2 x 320 tokens); at most one (B, chunk, V) block is alive, in the backward too
    (:class:`_HeadLogProbs` recomputes each block and accumulates the head's weight gradient in
    place). The chunked scheme of Liger-Kernel's and Apple's cut-cross-entropy fused linear losses,
    in plain PyTorch (it runs on any device). Without ``fuse_head`` (FSDP / ZeRO-3, whose head
    weight is a shard outside the forward) the model's own (B, T', V) logits are chunked instead,
    each block's log-softmax recomputed in backward (activation checkpointing).

    Args:
        model: a causal LM (plain, prepared by Accelerate, or peft-wrapped) taking ``logits_to_keep``.
        mb: a :func:`collate` micro-batch (``input_ids``/``attention_mask`` (B, L), ``pos``/``target``/
            ``mask`` (B, T)).
        temperature: the rollout's sampling temperature (``rollout.sampling.temperature``).
        chunk: response positions per log-softmax block.
        with_entropy: also return the (B, T) entropy (nats) of each position's tempered
            distribution (no-grad passes only).
        fuse_head: apply the output head chunk by chunk (ignored when the model has no plain
            ``nn.Linear`` head); pass False when parameters are sharded (FSDP, ZeRO-3).

    Returns:
        (B, T) log-probs, or ``(log-probs, entropies)`` with ``with_entropy``.

    Raises:
        ValueError: ``with_entropy`` on a pass that records gradients.
    """
    dev = next(model.parameters()).device
    pos = mb["pos"].to(dev)
    L = mb["input_ids"].size(1)
    first = int(pos[mb["mask"].to(dev)].min()) if bool(mb["mask"].any()) else L - 1
    keep = L - first  # logits for positions first .. L-1
    head = _output_head(model) if fuse_head else None
    seen: dict = {}
    with _head_bypassed(head, seen) if head is not None else contextlib.nullcontext():
        out_t = model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev),
                      logits_to_keep=keep).logits  # (B, keep, H) hidden states with the head bypassed, else (B, keep, V)
    if out_t.size(1) != keep:  # a model that ignores logits_to_keep returns every position
        out_t = out_t[:, -keep:]
    rel = (pos - first).clamp(min=0)  # (B, T) index into the kept positions
    target = mb["target"].to(dev)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    grad = torch.is_grad_enabled() and out_t.requires_grad
    if with_entropy and grad:
        raise ValueError("token_logprobs(with_entropy=True) is for no-grad passes")
    mask = mb["mask"].to(dev)
    if grad and head is not None:  # one Function over all chunks, with a hand-written chunked backward
        return _HeadLogProbs.apply(out_t, head.weight, head.bias, rel, target, inv_temp, chunk,
                                   seen.get("autocast")) * mask
    if head is not None:
        fn, args = _chunk_head_logprobs, (out_t, head.weight, head.bias)
        extra: tuple = (seen.get("autocast"),)
    else:
        fn, args, extra = _chunk_logprobs, (out_t,), ()
    out, ent = [], []
    for c0 in range(0, rel.size(1), chunk):
        idx, tgt = rel[:, c0:c0 + chunk], target[:, c0:c0 + chunk]
        if grad:  # the model's own logits: recompute each block's log-softmax in backward
            from torch.utils.checkpoint import checkpoint

            out.append(checkpoint(fn, *args, idx, tgt, inv_temp, *extra, use_reentrant=False))
        elif with_entropy:
            lp_c, ent_c = fn(*args, idx, tgt, inv_temp, *extra, entropy=True)
            out.append(lp_c)
            ent.append(ent_c)
        else:
            out.append(fn(*args, idx, tgt, inv_temp, *extra))
    lp = torch.cat(out, dim=1) if out else torch.zeros(rel.shape, device=dev)
    if with_entropy:
        return lp * mask, (torch.cat(ent, dim=1) if ent else torch.zeros(rel.shape, device=dev)) * mask
    return lp * mask


def _normalizer(mode: str, mb: dict, t_global: int) -> float:
    """Size of what the aggregation divides by, to weight micro-batches inside a mini-batch."""
    m = mb["mask"]
    if mode == "token-mean":
        return float(m.sum())
    if mode == "seq-mean-token-mean":
        return float((m.sum(1) > 0).sum())
    return float(m.size(0) * t_global)  # seq-mean-token-sum-norm


def plan_steps(n_micro: int, tc: TrainConfig, seed: int) -> list[tuple[int, list[int]]]:
    """The optimizer steps of a round: ``(epoch, micro-batch indices)`` per step, the same on every rank.

    Each epoch permutes the ``n_micro`` micro-batches with ``numpy.random.default_rng(seed)`` and
    splits the permutation into ``min(num_mini_batches, n_micro)`` near-equal mini-batches
    (``numpy.array_split``), so the schedule depends on the data and the seed only, never on the
    number of processes.
    """
    rng = np.random.default_rng(seed)
    steps = []
    for epoch in range(tc.ppo_epochs):
        order = rng.permutation(n_micro)
        steps += [(epoch, [int(j) for j in chunk]) for chunk in np.array_split(order, min(tc.num_mini_batches, n_micro))]
    return steps


def rank_share(chunk: list[int], rank: int, world: int) -> list[int]:
    """Micro-batches of one mini-batch that process ``rank`` of ``world`` computes: round-robin
    ``chunk[rank::world]``. A rank may get none when the mini-batch has fewer than ``world``."""
    return chunk[rank::world]


def _dummy_micro_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """A one-token micro-batch whose loss is multiplied by 0: keeps a rank that has no data for a
    mini-batch in step with the others (same number of forward/backward calls, so collectives match)."""
    mb = collate([Example([pad_id], [pad_id], np.zeros(1, np.float32))], pad_id)
    mb["old_logprobs"] = torch.zeros(1, 1)
    mb["ref_logprobs"] = torch.zeros(1, 1)
    return mb


_METRICS = ("loss", "pg_loss", "clip_frac", "approx_kl", "kl_ref", "ratio_mean")
_TOKEN_MEANS = {"clip_frac", "approx_kl", "ratio_mean"}  # token means in any loss_agg_mode


def ppo_update(model, optimizer, examples: list[Example], tc: TrainConfig, pad_id: int, seed: int,
               accelerator, ref_model=None, temperature: float = 1.0, fuse_head: bool | None = None) -> list[dict]:
    """One round of PPO-clip: old log-probs first, then ``ppo_epochs`` x ``num_mini_batches`` steps.

    ``examples`` is the whole round, identical on every process. Micro-batches are fixed groups of
    ``micro_batch_size`` consecutive examples; :func:`plan_steps` groups them into mini-batches
    (one optimizer step each) the same way for any number of processes W, and :func:`rank_share`
    gives each process its micro-batches of every mini-batch. Each micro-batch's loss is weighted
    by its share of the mini-batch's normalizer (global token count for token-mean, sequence
    count for seq-mean-token-mean, rows x longest response of the round for
    seq-mean-token-sum-norm; every process knows every micro-batch's mask, so no communication
    is needed) and by W, because DDP/FSDP/DeepSpeed average gradients over processes: after the
    all-reduce the gradient is the chosen aggregation over the whole mini-batch, the same as one
    process computes (up to float rounding). Gradients are synchronized once per step (the other
    micro-backwards run under ``accelerator.no_sync``); a process with fewer micro-batches runs
    zero-weighted dummy ones, so every process makes the same number of forward and backward
    calls (collectives never hang).

    Args:
        model: prepared by ``accelerator.prepare`` (or a plain module in one process).
        optimizer: prepared optimizer over the trainable parameters.
        examples: the round's responses (non-empty list, the same list and order on every process).
        tc: the train config (``loss_agg_mode``, clip, kl, epochs, mini/micro-batch sizes, ...).
        pad_id: padding token id.
        seed: seed of the mini-batch permutation (:func:`plan_steps`).
        accelerator: the ``accelerate.Accelerator``.
        ref_model: frozen reference for the k3 KL (plain module on this process's device), or None.
            Its log-probs are computed under the same autocast as the policy's, so KL is exactly 0
            while the policy equals the reference.
        temperature: the rollouts' sampling temperature; every log-prob is of ``logits / temperature``
            (:func:`token_logprobs`).
        fuse_head: :func:`token_logprobs`'s ``fuse_head``; None (default): on unless parameters
            are sharded (FSDP, ZeRO-3).

    Old log-probs are computed in the update's own mode (``model.eval()``: no dropout; the same
    autocast) before the first step. The rollout/trainer mismatch diagnostic compares them with the
    engine's recorded log-prob of each sampled token (``rollouts.rollout_logprobs``).

    With every learning rate 0 (the no-update control of ``benchmarks/bench_learning.py``) the
    forward passes and metrics are the same, but no backward runs and no optimizer step is taken
    (``grad_norm`` is NaN, the optimizer keeps no moments).

    Returns:
        One metrics dict per optimizer step, the same on every process: ``loss``, ``pg_loss``,
        ``kl_ref`` (aggregated over the whole mini-batch by ``loss_agg_mode``), ``clip_frac``,
        ``approx_kl``, ``ratio_mean`` (token means over the whole mini-batch), ``grad_norm``,
        ``epoch``, ``tokens`` (response tokens of the mini-batch, all processes), ``seconds``,
        ``tokens_per_s``, and the round's ``engine_logprob_diff_mean`` / ``engine_logprob_diff_max``
        (mean and max over response tokens with an engine log-prob of |old log-prob - engine
        log-prob|, nats; NaN when the engine recorded none) and ``entropy`` (token mean, nats, of
        the rollout policy's tempered distribution over the round's responses), repeated in every
        step's dict.

    Raises:
        ValueError: ``examples`` is empty.
    """
    from accelerate.utils import DistributedType

    if not examples:
        raise ValueError("ppo_update needs at least one example")
    rank, world = accelerator.process_index, accelerator.num_processes
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    micro = [collate(examples[i : i + tc.micro_batch_size], pad_id) for i in range(0, len(examples), tc.micro_batch_size)]
    t_global = max(len(e.response_ids) for e in examples)
    steps = plan_steps(len(micro), tc, seed)
    shares = [sorted({j for _, chunk in steps for j in rank_share(chunk, r, world)}) for r in range(world)]
    dummy = _dummy_micro_batch(pad_id)
    T = temperature
    fuse = not _shards_parameters(accelerator) if fuse_head is None else fuse_head  # a sharded head is whole only in forward
    model.eval()
    diff = torch.zeros(5, dtype=torch.float64)  # sum |old - engine|, tokens compared, sum entropy, tokens, max
    with torch.no_grad():  # old (and reference) log-probs of this process's micro-batches, before any update
        for j in shares[rank]:
            lp_old, ent = token_logprobs(model, micro[j], T, with_entropy=True, fuse_head=fuse)
            micro[j]["old_logprobs"] = lp_old.cpu()
            diff[2] += float(ent.sum())
            diff[3] += float(micro[j]["mask"].sum())
            if ref_model is not None:
                with accelerator.autocast():  # the policy's forward runs under this autocast too
                    micro[j]["ref_logprobs"] = token_logprobs(ref_model, micro[j], T).cpu()
            elp = micro[j]["engine_logprobs"]
            ok = micro[j]["mask"] & torch.isfinite(elp)
            if ok.any():
                d = (micro[j]["old_logprobs"] - elp)[ok].abs().double()
                diff[0] += float(d.sum())
                diff[1] += float(ok.sum())
                diff[4] = max(float(diff[4]), float(d.max()))
        for _ in range(max(map(len, shares)) - len(shares[rank])):
            token_logprobs(model, dummy, T, fuse_head=fuse)  # forwards are collective under DDP (buffers) and FSDP/ZeRO-3
    if world > 1:
        mx = accelerator.reduce(diff[4:].to(accelerator.device), reduction="max")
        diff = torch.cat([accelerator.reduce(diff[:4].to(accelerator.device), reduction="sum").cpu(), mx.cpu()])
    mismatch = {"engine_logprob_diff_mean": float(diff[0] / diff[1]) if diff[1] > 0 else float("nan"),
                "engine_logprob_diff_max": float(diff[4]) if diff[1] > 0 else float("nan"),
                "entropy": float(diff[2] / diff[3]) if diff[3] > 0 else float("nan")}
    model.train()
    params = list(model.parameters())  # all of them: FSDP's clip_grad_norm_ path needs exactly these
    # learning rate 0 (the no-update control arm): the same forward passes and metrics, no backward
    # and no optimizer step (on every process alike, so no collective is left waiting)
    update = any(g["lr"] > 0 for g in optimizer.param_groups)
    metrics = []
    for step, (epoch, chunk) in enumerate(steps):
        t0 = time.perf_counter()
        share = rank_share(chunk, rank, world)
        calls = -(-len(chunk) // world)  # ceil: the busiest process's micro-batches this step
        total = sum(_normalizer(tc.loss_agg_mode, micro[j], t_global) for j in chunk)
        ntok = int(sum(micro[j]["mask"].sum() for j in chunk))
        local = torch.zeros(len(_METRICS), dtype=torch.float64)
        for i in range(calls):
            real = i < len(share)
            mb = micro[share[i]] if real else dummy
            sync = i == calls - 1
            if deepspeed:
                accelerator.sync_gradients = sync  # DeepSpeed reduces and steps inside backward at the boundary
            with contextlib.nullcontext() if sync else accelerator.no_sync(model), torch.set_grad_enabled(update):
                lp = token_logprobs(model, mb, T, fuse_head=fuse)
                dev = lp.device
                out = ppo_clip_loss(lp, mb["old_logprobs"].to(dev), mb["advantages"].to(dev), mb["mask"].to(dev),
                                    tc.clip_low, tc.clip_high, tc.loss_agg_mode,
                                    ref_logprobs=mb["ref_logprobs"].to(dev) if ref_model is not None else None,
                                    kl_coef=tc.kl_coef)
                w = 0.0
                if real:
                    w = _normalizer(tc.loss_agg_mode, mb, t_global) / total
                    if tc.loss_agg_mode == "seq-mean-token-sum-norm":
                        w *= mb["mask"].size(1) / t_global  # agg used the micro-batch's own T
                if update:
                    accelerator.backward(out.loss * (w * world))  # x world: the gradient all-reduce averages
            if real:
                wt = float(mb["mask"].sum()) / max(ntok, 1)
                local += torch.tensor([float(getattr(out, k).detach()) * (wt if k in _TOKEN_MEANS else w) for k in _METRICS],
                                      dtype=torch.float64)
        grad_norm = None
        if update:
            grad_norm = accelerator.clip_grad_norm_(params, tc.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if world > 1:
            local = accelerator.reduce(local.to(accelerator.device), reduction="sum").cpu()
        secs = time.perf_counter() - t0
        metrics.append({**dict(zip(_METRICS, local.tolist())),
                        "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                        "epoch": epoch, "tokens": ntok, "seconds": secs, "tokens_per_s": ntok / secs, **mismatch})
        if accelerator.is_main_process:
            log.info("[train] step %d: %s", step, json.dumps({k: round(v, 5) for k, v in metrics[-1].items()}))
    return metrics


def _force_cpu() -> bool:
    """True when launched as several processes (``WORLD_SIZE`` > 1) on a machine with no accelerator.

    Accelerate picks its multi-CPU (gloo) backend only when told to use the CPU; without this,
    ``accelerate launch --multi_gpu`` or ``torchrun`` on a CPU-only machine would start W
    independent single-process trainers that all write the same checkpoint. ``ACCELERATE_USE_CPU``
    still forces the CPU anywhere.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    has_accel = getattr(torch, "accelerator", None)
    return not (has_accel.is_available() if has_accel is not None else torch.cuda.is_available())


def make_optimizer(model, tc: TrainConfig, accelerator) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the trainable parameters, with PyTorch's fused kernel where it applies.

    The fused implementation (one kernel per parameter on CPU and CUDA) computes the same update as
    the default multi-tensor (``foreach``) one without its temporaries: ``foreach`` allocates
    copies the size of all parameters (``sqrt(v)`` and the update), about 1.5 GB at the step of a
    0.5B fp32 policy. It is used without Accelerate's DeepSpeed and FSDP (which bring their own
    optimizer handling and sharded parameters) and on CPU / CUDA devices; elsewhere the default.
    """
    from accelerate.utils import DistributedType

    params = [q for q in model.parameters() if q.requires_grad]
    plain = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    fused = plain and accelerator.device.type in ("cpu", "cuda") and all(q.is_floating_point() for q in params)
    return torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=tc.weight_decay, **({"fused": True} if fused else {}))


def _shards_parameters(accelerator) -> bool:
    """Whether the prepared model holds only a shard of each weight (FSDP, DeepSpeed ZeRO-3)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False


def train_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Train the round's policy on its token advantages -> ``variants/<v>/checkpoint`` + metrics.

    Runs unchanged in one process or in W processes started by ``accelerate launch`` / ``torchrun``
    (DDP, FSDP or DeepSpeed, from the Accelerate config; gloo on CPU-only machines): every process
    reads the whole round and computes its share of every mini-batch (:func:`ppo_update`), and only
    the main process writes the checkpoint, the ``train_metrics`` table and their manifests. Under
    FSDP / ZeRO-3 the full state dict is gathered with ``accelerator.get_state_dict`` (a collective,
    called by every process) and saved by the main process.

    Training state (docs/design.md §1.10): round 1 starts from ``rollout.policy`` (cast to ``train.dtype``)
    with a fresh AdamW; round k > 1 loads round k-1's ``train_state`` of the same variant
    (``accelerator.load_state``: fp32 master weights, AdamW moments and step, RNG states; the
    learning rate and weight decay come from the config). After the update every process saves the
    new state (``accelerator.save_state`` into a temporary folder, renamed into place by the main
    process), then the checkpoint for the engines is exported from the master weights in
    ``train.save_dtype`` (``auto``: the rollout engine's resolved dtype), and states older than
    ``train.keep_states`` rounds are pruned.

    Raises:
        ValueError: the round has no non-empty responses; LoRA together with FSDP or ZeRO-3
            (merging the adapters needs the full weights in one process).
        FileNotFoundError: the round's rollouts or token rewards were never committed; round k-1's
            training state is missing or was pruned.
    """
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
    t0 = time.perf_counter()
    tc = cfg.train
    from pipeline.precision import announce, precision_record, resolve_mixed_precision

    prec = precision_record(cfg)
    mixed = announce("train.mixed_precision", resolve_mixed_precision(tc.mixed_precision), log)
    save_dtype = prec["train_save_dtype"]
    accelerator = Accelerator(mixed_precision=mixed, log_with=tc.report_to or None,
                              project_dir=str(cfg.run_dir() / "tracking"), cpu=_force_cpu())
    if accelerator.is_main_process:
        log.info("[train] running on %d process(es) (%s): %s", accelerator.num_processes,
                 accelerator.distributed_type.value, cur.reason)
    sharded = _shards_parameters(accelerator)
    if sharded and tc.lora is not None:
        raise ValueError("train.lora with FSDP or DeepSpeed ZeRO-3 is not supported (merging the adapters needs the "
                         "full weights in one process); use DDP or ZeRO-2, or train without LoRA")
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader is prepared: DeepSpeed needs this set
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.micro_batch_size
    if tc.report_to:
        accelerator.init_trackers(cfg.run_id, config={"variant": cfg.variant, **cfg.model_dump(mode="json")["train"]})
    set_seed(cfg.seed + round_idx)
    from pipeline.stages import resolve_model

    policy = policy_for_round(cfg, round_idx)  # the checkpoint that sampled the round (tokenizer)
    start = resolve_model(cfg.rollout.policy, cfg)
    prev_state = round_paths(cfg, round_idx - 1)["train_state"] if round_idx > 1 else None
    if prev_state is not None:
        prev_man = storage.read_manifest(prev_state)
        if prev_man is None or prev_man.get("pruned") or not prev_state.is_dir():
            raise FileNotFoundError(
                f"round {round_idx} continues from round {round_idx - 1}'s training state {prev_state}, which is gone "
                f"(train.keep_states={tc.keep_states} pruned it, or it was deleted): re-train from the newest round "
                "that still has its state, or raise train.keep_states")
    tok = AutoTokenizer.from_pretrained(policy)
    # the architecture and, for round 1, the weights of the starting policy; round k > 1 replaces
    # them with round k-1's fp32 master weights (load_state below), never with its engine checkpoint
    model = AutoModelForCausalLM.from_pretrained(start, dtype=getattr(torch, tc.dtype))
    if tc.gradient_checkpointing:  # non-reentrant: works under DDP's no_sync and with frozen inputs
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tc.lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(r=tc.lora.r, lora_alpha=tc.lora.alpha, lora_dropout=tc.lora.dropout,
                                                     target_modules=tc.lora.target_modules, task_type="CAUSAL_LM"))
    ref_model = None
    if tc.kl_coef > 0 or tc.measure_kl_to_start:
        ref_model = AutoModelForCausalLM.from_pretrained(start, dtype=getattr(torch, tc.dtype)).eval()
        ref_model.requires_grad_(False)
    optimizer = make_optimizer(model, tc, accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    layout = {"num_processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value}
    if prev_state is not None:  # fp32 master weights, AdamW moments and step, RNG states of round k-1
        saved = {k: prev_man.get(k) for k in layout}
        if saved != layout:  # Accelerate's state layout depends on them (DDP's module. prefix, FSDP shards)
            raise ValueError(
                f"round {round_idx - 1}'s training state was saved by {saved}, this round runs as {layout}: "
                "Accelerate states cannot be moved between process layouts; keep train.launcher as it was for "
                "this run, or start a new run_id")
        accelerator.load_state(str(prev_state))
        for group in optimizer.param_groups:  # the state restores its own hyper-parameters; the config wins
            group["lr"], group["weight_decay"] = tc.learning_rate, tc.weight_decay
        if accelerator.is_main_process:
            log.info("[train] continuing from round %d's training state %s", round_idx - 1, prev_state)
    if ref_model is not None:
        ref_model.to(accelerator.device)
    examples = load_examples(cfg, round_idx)  # the whole round on every process; ppo_update shares it out
    if not examples:
        raise ValueError(f"round {round_idx} has no non-empty responses to train on")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    metrics = ppo_update(model, optimizer, examples, tc, pad_id, cfg.seed + round_idx, accelerator, ref_model,
                         temperature=cfg.rollout.sampling.temperature)
    if tc.report_to:  # global step: rounds are consecutive blocks of optimizer steps (main process only)
        for i, m in enumerate(metrics):
            accelerator.log({f"train/{k}": v for k, v in m.items()}, step=(round_idx - 1) * len(metrics) + i)
    accelerator.wait_for_everyone()
    state_dir = p["train_state"]
    state_tmp = state_dir.with_name(f".{state_dir.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(state_tmp, ignore_errors=True)
        state_tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(state_tmp), safe_serialization=True)  # collective under FSDP / DeepSpeed
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model) if sharded else None  # collective: every process gathers
    if accelerator.is_main_process:
        # replace in an order a crash cannot confuse: the old checkpoint (with its manifest) goes to
        # superseded/ and the old state is uncommitted before anything new is in place; the manifests
        # of the new state and checkpoint are written last
        if ckpt.exists() or storage.manifest_path(ckpt).exists():
            storage.supersede(ckpt)
        storage.uncommit(state_dir)
        if state_dir.exists():  # a re-trained round: its old state belonged to the superseded checkpoint
            log.warning("[train] replacing round %d's earlier training state %s", round_idx, state_dir)
            shutil.rmtree(state_dir)
        os.replace(state_tmp, state_dir)
        # the engines' checkpoint: the master weights cast to save_dtype (after the state is saved:
        # _save casts the model in place)
        _save(accelerator.unwrap_model(model), tok, ckpt, save_dtype, state_dict)
        secs = time.perf_counter() - t0
        rows = [{"run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "step": i, "name": k, "value": float(v)}
                for i, m in enumerate(metrics) for k, v in m.items()]
        extra = provenance(cfg, {"elapsed_s": round(secs, 3), "policy_parent": policy, "round": round_idx,
                                 "optimizer_steps": len(metrics), "examples": len(examples),
                                 "num_processes": accelerator.num_processes,
                                 "distributed_type": accelerator.distributed_type.value})
        storage.write_table(pa.Table.from_pylist(rows, schema=TRAIN_METRICS_SCHEMA), p["train_metrics"], "train_metrics",
                            stage="train", key=key, extra=extra)
        storage.commit_manifest(state_dir, stage="train", key=key, rows=None,
                                extra={**extra, **layout, "optimizer_steps_total": _optimizer_steps(optimizer)})
        storage.commit_manifest(ckpt, stage="train", key=key, rows=None, extra=extra)
        log.info("[train] wrote %s and its training state in %.1fs", ckpt, secs)
        prune_states(cfg, round_idx, tc.keep_states)
    accelerator.wait_for_everyone()  # no process returns before the checkpoint is in place
    if tc.report_to:
        accelerator.end_training()
    log.info("[train] rank %d/%d finished", accelerator.process_index, accelerator.num_processes)
    return StageResult("train", str(ckpt), False, cur.reason, len(metrics), time.perf_counter() - t0)


def _optimizer_steps(optimizer) -> int | None:
    """AdamW's step count (the same for every parameter), None when it keeps none."""
    opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
    for st in opt.state.values():
        if "step" in st:
            return int(st["step"])
    return None


def prune_states(cfg: CAPOConfig, round_idx: int, keep: int) -> list[Path]:
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


def _save(model, tok, ckpt: Path, dtype: str, state_dict: dict | None = None) -> None:
    """save_pretrained into a temporary dir, then rename into place (earlier one superseded).

    ``model`` is the unwrapped model. ``state_dict`` (from ``accelerator.get_state_dict`` under
    FSDP / ZeRO-3, where ``model`` holds only shards) replaces the model's own weights, cast to
    ``dtype``: the pattern of Accelerate's docs, ``unwrap_model(model).save_pretrained(...,
    state_dict=accelerator.get_state_dict(model))``. Without it a LoRA model is merged first.
    """
    tmp = ckpt.with_name(f".{ckpt.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is not None:
        torch_dtype = getattr(torch, dtype)
        # a gathered state dict holds tied weights (lm_head <- embed_tokens) as separate tensors, which
        # save_pretrained would write twice; keep only the source, as the plain save does
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        sd = {k: v.to(torch_dtype) for k, v in state_dict.items() if not (k in tied and tied[k] in state_dict)}
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        model.config.dtype = dtype  # save_pretrained recorded the (sharded) model's own dtype
        model.config.save_pretrained(tmp)
    else:
        if hasattr(model, "merge_and_unload"):  # LoRA: the next round's engine loads plain weights
            model = model.merge_and_unload()
        model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if ckpt.exists():
        storage.supersede(ckpt)
    os.replace(tmp, ckpt)


def main(argv: list[str] | None = None) -> None:
    """``python -m train.trainer --config FILE --round K`` (also under ``accelerate launch`` / ``torchrun``).

    The main process prints the stage result as the ``CAPO_STAGE_RESULT`` line that
    :func:`flows.runner.run_stage` reads; every process logs ``[train] rank r/W finished``.
    """
    import dataclasses
    import resource

    from pipeline.stages import RESULT_TAG

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


if __name__ == "__main__":
    main()
