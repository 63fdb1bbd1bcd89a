"""The PPO-clip trainer: reads a round's rollouts and token advantages, writes the next policy.

    batch -> old log-probs -> [per mini-batch: log-probs -> loss -> backward] -> step -> log -> save

Here: the update (:func:`ppo_update`) and the stage around it (:func:`train_stage`). Beside it:
``examples.py`` (responses and advantages from the round's tables, padded micro-batches),
``logprobs.py`` (token log-probs at the sampling temperature, head applied in chunks),
``loss.py`` (the clipped surrogate and KL, pure), ``distributed.py`` (mini-batch plans and each
process's share), ``state.py`` (the checkpoint and the training state across rounds) and
``drift.py`` (how much of the fp32 update the checkpoint carries).

Run it as a stage (``capo stage train``), or under Accelerate's launchers for several processes
(``accelerate launch --config_file configs/accelerate/fsdp.yaml -m train.trainer --config ... --round K``,
or ``train.launcher`` in the config); DDP/FSDP/DeepSpeed come from Accelerate, not from this file.
With W processes every process reads the whole round and computes its share of each mini-batch,
weighted so that the averaged gradient equals the one-process gradient (:func:`ppo_update`);
docs/distributed-training.md has the configs and what was tested. Old log-probs are recomputed
here, before the first update, with the exact weights that sampled the round (the engine's
log-probs serve the rollout/trainer mismatch diagnostic).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import time

import pyarrow as pa
import torch

from pipeline import storage
from pipeline.config import CAPOConfig, TrainConfig, load_config
from pipeline.faults import kill_point
from pipeline.schemas import TRAIN_METRICS_SCHEMA
from pipeline.stages import stage_key
from pipeline.stages.base import StageResult, policy_for_round, provenance, round_paths
from train.distributed import (
    allow_precision_change,
    dummy_micro_batch,
    force_cpu,
    loss_normalizer,
    plan_steps,
    rank_share,
    shards_parameters,
)
from train.examples import Example, collate, load_examples
from train.logprobs import token_logprobs
from train.loss import ppo_clip_loss
from train.state import export_drift, measures_drift, optimizer_steps, prune_states, save_checkpoint

log = logging.getLogger("capo.train")


_METRICS = ("loss", "pg_loss", "clip_frac", "approx_kl", "kl_ref", "ratio_mean")


_TOKEN_MEANS = {"clip_frac", "approx_kl", "ratio_mean"}  # token means in any loss_agg_mode


def ppo_update(model, optimizer, examples: list[Example], tc: TrainConfig, pad_id: int, seed: int,
               accelerator, ref_model=None, temperature: float = 1.0, fuse_head: bool | None = None) -> list[dict]:
    """One round of PPO-clip: old log-probs first (:func:`old_logprobs`), then ``ppo_epochs`` x
    ``num_mini_batches`` optimizer steps, each over the gradients of :func:`accumulate_gradients`.

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
    if not examples:
        raise ValueError("ppo_update needs at least one example")
    world = accelerator.num_processes
    micro = [collate(examples[i : i + tc.micro_batch_size], pad_id) for i in range(0, len(examples), tc.micro_batch_size)]
    t_global = max(len(e.response_ids) for e in examples)  # the round's longest response (seq-mean-token-sum-norm)
    steps = plan_steps(len(micro), tc, seed)
    shares = [sorted({j for _, chunk in steps for j in rank_share(chunk, r, world)}) for r in range(world)]
    fuse = not shards_parameters(accelerator) if fuse_head is None else fuse_head  # a sharded head is whole only in forward
    mismatch = old_logprobs(model, micro, shares, accelerator, ref_model, temperature, fuse, pad_id)
    model.train()
    params = list(model.parameters())  # all of them: FSDP's clip_grad_norm_ path needs exactly these
    update = any(g["lr"] > 0 for g in optimizer.param_groups)  # lr 0 (the control arm): no backward, no step
    metrics = []
    for step, (epoch, chunk) in enumerate(steps):
        t0 = time.perf_counter()
        local, ntok = accumulate_gradients(model, micro, chunk, tc, accelerator, t_global, temperature, fuse, pad_id,
                                           ref_model is not None, update)
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


def old_logprobs(model, micro: list[dict], shares: list[list[int]], accelerator, ref_model, temperature: float,
                 fuse_head: bool, pad_id: int) -> dict:
    """Old (and reference) log-probs of this process's micro-batches, before any update; stored in
    place as ``micro[j]["old_logprobs"]`` / ``["ref_logprobs"]``, (B, T) float32 on the CPU.

    Runs in ``model.eval()`` mode (no dropout) under the update's autocast. A process with fewer
    micro-batches than the busiest runs dummy forwards (forwards are collective under DDP buffers
    and FSDP/ZeRO-3).

    Returns:
        The round's rollout/trainer mismatch and entropy, reduced over processes:
        ``engine_logprob_diff_mean`` / ``engine_logprob_diff_max`` (|old - engine log-prob| over
        response tokens with an engine log-prob, nats; NaN without any) and ``entropy`` (token
        mean of the tempered distribution, nats).
    """
    rank, world = accelerator.process_index, accelerator.num_processes
    model.eval()
    diff = torch.zeros(5, dtype=torch.float64)  # sum |old - engine|, tokens compared, sum entropy, tokens, max
    with torch.no_grad():
        for j in shares[rank]:
            mb = micro[j]
            lp_old, ent = token_logprobs(model, mb, temperature, with_entropy=True, fuse_head=fuse_head)
            mb["old_logprobs"] = lp_old.cpu()
            diff[2] += float(ent.sum())
            diff[3] += float(mb["mask"].sum())
            if ref_model is not None:
                with accelerator.autocast():  # the policy's forward runs under this autocast too
                    mb["ref_logprobs"] = token_logprobs(ref_model, mb, temperature).cpu()
            ok = mb["mask"] & torch.isfinite(mb["engine_logprobs"])
            if ok.any():
                d = (mb["old_logprobs"] - mb["engine_logprobs"])[ok].abs().double()
                diff[0] += float(d.sum())
                diff[1] += float(ok.sum())
                diff[4] = max(float(diff[4]), float(d.max()))
        dummy = dummy_micro_batch(pad_id)
        for _ in range(max(map(len, shares)) - len(shares[rank])):
            token_logprobs(model, dummy, temperature, fuse_head=fuse_head)
    if world > 1:
        mx = accelerator.reduce(diff[4:].to(accelerator.device), reduction="max")
        diff = torch.cat([accelerator.reduce(diff[:4].to(accelerator.device), reduction="sum").cpu(), mx.cpu()])
    return {"engine_logprob_diff_mean": float(diff[0] / diff[1]) if diff[1] > 0 else float("nan"),
            "engine_logprob_diff_max": float(diff[4]) if diff[1] > 0 else float("nan"),
            "entropy": float(diff[2] / diff[3]) if diff[3] > 0 else float("nan")}


def accumulate_gradients(model, micro: list[dict], chunk: list[int], tc: TrainConfig, accelerator, t_global: int,
                         temperature: float, fuse_head: bool, pad_id: int, with_ref: bool,
                         update: bool) -> tuple[torch.Tensor, int]:
    """Forward and backward of this process's micro-batches of one mini-batch (``chunk``, indices
    into ``micro``), gradients synchronized once, at the last call.

    Each micro-batch's loss (:func:`train.loss.ppo_clip_loss`) is weighted by its share of the
    mini-batch's normalizer (:func:`loss_normalizer`) and by the number of processes W (the
    gradient all-reduce averages). Every process makes the same number of calls (dummy
    micro-batches with weight 0 where it has fewer). ``update`` False runs the forwards only.

    Returns:
        ``(local, ntok)``: this process's weighted sums of :data:`_METRICS` (float64, (len(_METRICS),);
        summed over processes they are the mini-batch's metrics) and the mini-batch's response tokens.
    """
    from accelerate.utils import DistributedType

    rank, world = accelerator.process_index, accelerator.num_processes
    share = rank_share(chunk, rank, world)
    calls = -(-len(chunk) // world)  # ceil: the busiest process's micro-batches this step
    total = sum(loss_normalizer(tc.loss_agg_mode, micro[j], t_global) for j in chunk)
    ntok = int(sum(micro[j]["mask"].sum() for j in chunk))
    local = torch.zeros(len(_METRICS), dtype=torch.float64)
    dummy = dummy_micro_batch(pad_id)
    for i in range(calls):
        real = i < len(share)
        mb = micro[share[i]] if real else dummy
        sync = i == calls - 1
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            accelerator.sync_gradients = sync  # DeepSpeed reduces and steps inside backward at the boundary
        with contextlib.nullcontext() if sync else accelerator.no_sync(model), torch.set_grad_enabled(update):
            lp = token_logprobs(model, mb, temperature, fuse_head=fuse_head)
            dev = lp.device
            out = ppo_clip_loss(lp, mb["old_logprobs"].to(dev), mb["advantages"].to(dev), mb["mask"].to(dev),
                                tc.clip_low, tc.clip_high, tc.loss_agg_mode,
                                ref_logprobs=mb["ref_logprobs"].to(dev) if with_ref else None, kl_coef=tc.kl_coef)
            w = 0.0
            if real:
                w = loss_normalizer(tc.loss_agg_mode, mb, t_global) / total
                if tc.loss_agg_mode == "seq-mean-token-sum-norm":
                    w *= mb["mask"].size(1) / t_global  # agg used the micro-batch's own T
            if update:
                accelerator.backward(out.loss * (w * world))  # x world: the gradient all-reduce averages
        if real:
            wt = float(mb["mask"].sum()) / max(ntok, 1)
            local += torch.tensor([float(getattr(out, k).detach()) * (wt if k in _TOKEN_MEANS else w) for k in _METRICS],
                                  dtype=torch.float64)
    return local, ntok


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


@contextlib.contextmanager
def deterministic_kernels(on: bool):
    """Deterministic kernels inside the block when ``on`` (``train.deterministic``); a no-op otherwise.

    Turns on ``torch.use_deterministic_algorithms`` (``warn_only``: an op without a deterministic
    implementation warns instead of failing), sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless it is
    set (read when cuBLAS starts: the trainer's own process sets it before its first CUDA op) and,
    on CUDA, leaves PyTorch's math attention as the only scaled-dot-product backend (the flash,
    memory-efficient and cuDNN backwards are not deterministic). Everything is restored on exit, so
    an in-process caller's other work keeps its kernels. Measured on an H100 (docs/benchmarks.md,
    "The train stage on a GPU"): two trained rounds against one process replaying both, max |diff|
    of the fp32 master weights 0.0 with these settings, 3.0e-5 with the default attention.
    """
    if not on:
        yield
        return
    cuda = torch.backends.cuda
    sdp = {"flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
           "cudnn": cuda.cudnn_sdp_enabled()}
    algos = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    cuda.enable_flash_sdp(False)
    cuda.enable_mem_efficient_sdp(False)
    cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(algos[0], warn_only=algos[1])
        cuda.enable_flash_sdp(sdp["flash"])
        cuda.enable_mem_efficient_sdp(sdp["mem_efficient"])
        cuda.enable_cudnn_sdp(sdp["cudnn"])
        if env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


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
    ``train.keep_states`` rounds are pruned. With ``train.deterministic`` the whole stage runs under
    :func:`deterministic_kernels`.

    Raises:
        ValueError: the round has no non-empty responses; LoRA together with FSDP or ZeRO-3
            (merging the adapters needs the full weights in one process).
        FileNotFoundError: the round's rollouts or token rewards were never committed; round k-1's
            training state is missing or was pruned.
    """
    with deterministic_kernels(cfg.train.deterministic):
        return _train_stage(cfg, round_idx, force)


def _train_stage(cfg: CAPOConfig, round_idx: int, force: bool) -> StageResult:
    """:func:`train_stage`'s body (its kernels chosen by the caller)."""
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
    allow_precision_change(mixed)
    accelerator = Accelerator(mixed_precision=mixed, log_with=tc.report_to or None,
                              project_dir=str(cfg.run_dir() / "tracking"), cpu=force_cpu())
    if accelerator.is_main_process:
        log.info("[train] running on %d process(es) (%s): %s", accelerator.num_processes,
                 accelerator.distributed_type.value, cur.reason)
    sharded = shards_parameters(accelerator)
    if sharded and tc.lora is not None:
        raise ValueError("train.lora with FSDP or DeepSpeed ZeRO-3 is not supported (merging the adapters needs the "
                         "full weights in one process); use DDP or ZeRO-2, or train without LoRA")
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader is prepared: DeepSpeed needs this set
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.micro_batch_size
    if tc.report_to:
        accelerator.init_trackers(cfg.run_id, config={"variant": cfg.variant, **cfg.model_dump(mode="json")["train"]})
    set_seed(cfg.seed + round_idx)
    from pipeline.stages.base import resolve_model

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
    if accelerator.is_main_process:
        storage.fsync_tree(state_tmp)  # on disk before it is renamed into place
        kill_point("state.saved", state_dir)
    state_dict = accelerator.get_state_dict(model) if sharded else None  # collective: every process gathers
    if accelerator.is_main_process and metrics and measures_drift(accelerator, tc):
        # how much of the update the checkpoint will carry: read before anything is replaced, and
        # before save_checkpoint casts the model in place
        drift = export_drift(round_idx, accelerator.unwrap_model(model).state_dict(), save_dtype, start, prev_state,
                             policy)
        metrics[-1].update(drift)
        if tc.report_to and drift:
            accelerator.log({f"train/{k}": v for k, v in drift.items()}, step=round_idx * len(metrics) - 1)
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
        storage.fsync_dir(state_dir.parent)
        # the engines' checkpoint: the master weights cast to save_dtype (after the state is saved:
        # save_checkpoint casts the model in place)
        save_checkpoint(accelerator.unwrap_model(model), tok, ckpt, save_dtype, state_dict)
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
                                extra={**extra, **layout, "optimizer_steps_total": optimizer_steps(optimizer)})
        storage.commit_manifest(ckpt, stage="train", key=key, rows=None, extra=extra)
        log.info("[train] wrote %s and its training state in %.1fs", ckpt, secs)
        prune_states(cfg, round_idx, tc.keep_states)
    accelerator.wait_for_everyone()  # no process returns before the checkpoint is in place
    if tc.report_to:
        accelerator.end_training()
    log.info("[train] rank %d/%d finished", accelerator.process_index, accelerator.num_processes)
    return StageResult("train", str(ckpt), False, cur.reason, len(metrics), time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    """``python -m train.trainer --config FILE --round K`` (also under ``accelerate launch`` / ``torchrun``).

    The main process prints the stage result as the ``CAPO_STAGE_RESULT`` line that
    :func:`flows.runner.run_stage` reads; every process logs ``[train] rank r/W finished``.
    """
    import dataclasses
    import resource

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


if __name__ == "__main__":
    main()
