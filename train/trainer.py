"""The PPO-clip trainer: the update of one round, from the models to the written training state
and checkpoint.

    batch -> old log-probs -> [per mini-batch: log-probs -> loss -> backward] -> step -> log -> save

Here: the update loop (:func:`ppo_update`) and the round around it (:func:`update_policy`: the
Accelerator, the models, the state carried from round k-1, the save). The train stage
(:mod:`pipeline.stages.train`) reads the round's tables, calls it and commits what it wrote.
Beside it: ``examples.py`` (responses and advantages, padded micro-batches), ``logprobs.py``
(token log-probs at the sampling temperature, head applied in chunks), ``loss.py`` (the clipped
surrogate and KL, pure), ``distributed.py`` (mini-batch plans and each process's share),
``state.py`` (exporting the checkpoint, the drift of its update) and ``drift.py`` (how much of
the fp32 update the checkpoint carries). Nothing here imports a stage.

Several processes: ``accelerate launch --config_file configs/accelerate/fsdp.yaml -m
pipeline.stages.train_launch --config ... --round K`` (or ``train.launcher`` in the config);
DDP/FSDP/DeepSpeed come from Accelerate, not from this file. With W processes every process reads
the whole round and computes its share of each mini-batch, weighted so that the averaged gradient
equals the one-process gradient (:func:`ppo_update`); docs/distributed-training.md has the configs
and what was tested. Old log-probs are recomputed here, before the first update, with the exact
weights that sampled the round (the engine's log-probs serve the rollout/trainer mismatch diagnostic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.config import TrainConfig
from train.distributed import (
    allow_precision_change,
    dummy_micro_batch,
    force_cpu,
    loss_normalizer,
    plan_steps,
    rank_share,
    shards_parameters,
)
from train.examples import Example, collate
from train.logprobs import token_logprobs
from train.loss import ppo_clip_loss, token_credit
from train.state import export_checkpoint, export_drift, measures_drift, optimizer_steps

log = logging.getLogger("capo.train")


_METRICS = ("loss", "pg_loss", "clip_frac", "approx_kl", "kl_ref", "ratio_mean")


_TOKEN_MEANS = {"clip_frac", "approx_kl", "ratio_mean"}  # token means in any loss_agg_mode


class CreditSums:
    """Each response token's credit (:func:`train.loss.token_credit`) added up over the passes an
    update makes over its response, for the ``token_credit`` table.

    Attributes:
        sums: (sum of lengths,) float32, the responses' summed credits laid end to end (response n at
            ``offsets[n]:offsets[n + 1]``), one value per response token: no padding to the longest.
        passes: (N,) int64, how many micro-batch passes added to response n (``ppo_epochs`` once
            the update has run).
        offsets: (N + 1,) int64, where each response's tokens start in ``sums``.
    """

    def __init__(self, lengths: list[int]):
        """``lengths``: (N,) response lengths in tokens, in the order of the update's examples."""
        self.lengths = [int(n) for n in lengths]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.sums = torch.zeros(self.offsets[-1], dtype=torch.float32)
        self.passes = torch.zeros(len(self.lengths), dtype=torch.int64)

    def add(self, first: int, mask: torch.Tensor, credit: torch.Tensor) -> None:
        """Add a micro-batch's (B, T) ``credit`` (``mask``: its response tokens, a prefix of each row)
        for examples ``first .. first + B - 1``.

        Raises:
            ValueError: a row's response tokens are not the length of that example.
        """
        credit = credit.detach().float().cpu()
        for b, n in enumerate(mask.bool().sum(dim=1).tolist()):
            i = first + b
            if n != self.lengths[i]:
                raise ValueError(f"example {i} has {self.lengths[i]} response tokens; its micro-batch row masks {n}")
            self.sums[self.offsets[i] : self.offsets[i + 1]] += credit[b, :n]
            self.passes[i] += 1

    def means(self) -> list[list[float]]:
        """Per response, its tokens' credit averaged over its passes (all 0 for a response never passed)."""
        return [(self.sums[self.offsets[i] : self.offsets[i + 1]] / max(int(self.passes[i]), 1)).tolist()
                for i in range(len(self.lengths))]


def ppo_update(model, optimizer, examples: list[Example], tc: TrainConfig, pad_id: int, seed: int,
               accelerator, ref_model=None, temperature: float = 1.0, fuse_head: bool | None = None,
               credit: CreditSums | None = None) -> list[dict]:
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
        credit: where to add up each token's credit (:class:`CreditSums` of ``examples``), or None.

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
    micro, t_global, steps, shares = _plan_micro_batches(examples, tc, pad_id, seed, world)
    fuse = not shards_parameters(accelerator) if fuse_head is None else fuse_head  # a sharded head is whole only in forward
    mismatch = old_logprobs(model, micro, shares, accelerator, ref_model, temperature, fuse, pad_id)
    model.train()
    params = list(model.parameters())  # all of them: FSDP's clip_grad_norm_ path needs exactly these
    update = any(g["lr"] > 0 for g in optimizer.param_groups)  # lr 0 (the control arm): no backward, no step
    metrics = _run_steps(model, optimizer, params, micro, steps, tc, accelerator, world, t_global, temperature, fuse,
                         pad_id, ref_model is not None, update, mismatch, credit)
    if credit is not None and world > 1:  # each process added its share of the micro-batches
        credit.sums = accelerator.reduce(credit.sums.to(accelerator.device), reduction="sum").cpu()
        credit.passes = accelerator.reduce(credit.passes.to(accelerator.device), reduction="sum").cpu()
    return metrics


def _plan_micro_batches(examples: list[Example], tc: TrainConfig, pad_id: int, seed: int,
                        world: int) -> tuple[list[dict], int, list, list[list[int]]]:
    """The padded micro-batches, longest response (tokens), step plan and each process's micro-batch indices."""
    micro = [collate(examples[i : i + tc.micro_batch_size], pad_id) for i in range(0, len(examples), tc.micro_batch_size)]
    for j, mb in enumerate(micro):
        mb["first"] = j * tc.micro_batch_size  # index of its first example
    t_global = max(len(e.response_ids) for e in examples)  # the round's longest response (seq-mean-token-sum-norm)
    steps = plan_steps(len(micro), tc, seed)
    if tc.future_kl is not None and len(steps) < 2:  # the config's check assumes every response trains
        log.warning("[train] FIPO's future-KL weights act from the second optimizer step, and this round has %d "
                    "example(s) in %d micro-batch(es), one step: its update is GRPO's", len(examples), len(micro))
    shares = [sorted({j for _, chunk in steps for j in rank_share(chunk, r, world)}) for r in range(world)]
    return micro, t_global, steps, shares


def _run_steps(model, optimizer, params: list, micro: list[dict], steps: list, tc: TrainConfig, accelerator,
               world: int, t_global: int, temperature: float, fuse: bool, pad_id: int, has_ref: bool, update: bool,
               mismatch: dict, credit: CreditSums | None = None) -> list[dict]:
    """Every optimizer step of the plan ``steps`` over ``micro``: one metrics dict per step (:func:`ppo_update`)."""
    metrics = []
    for step, (epoch, chunk) in enumerate(steps):
        t0 = time.perf_counter()
        local, ntok = accumulate_gradients(model, micro, chunk, tc, accelerator, t_global, temperature, fuse, pad_id,
                                           has_ref, update, credit)
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
                         update: bool, credit: CreditSums | None = None) -> tuple[torch.Tensor, int]:
    """Forward and backward of this process's micro-batches of one mini-batch (``chunk``, indices
    into ``micro``), gradients synchronized once, at the last call.

    Each micro-batch's loss (:func:`train.loss.ppo_clip_loss`) is weighted by its share of the
    mini-batch's normalizer (:func:`loss_normalizer`) and by the number of processes W (the
    gradient all-reduce averages). Every process makes the same number of calls (dummy
    micro-batches with weight 0 where it has fewer). ``update`` False runs the forwards only.
    With ``credit``, each real micro-batch's :func:`train.loss.token_credit` is added to it.

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
    trace = (tc.ratio_trace.kappa, tc.ratio_trace.style) if tc.ratio_trace else None
    future_kl = tc.future_kl.model_dump() if tc.future_kl else None
    for i in range(calls):
        real = i < len(share)
        mb = micro[share[i]] if real else dummy
        sync = i == calls - 1
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            accelerator.sync_gradients = sync  # DeepSpeed reduces and steps inside backward at the boundary
        with contextlib.nullcontext() if sync else accelerator.no_sync(model), torch.set_grad_enabled(update):
            lp = token_logprobs(model, mb, temperature, fuse_head=fuse_head)
            dev = lp.device
            old, adv, mask = (mb[k].to(dev) for k in ("old_logprobs", "advantages", "mask"))
            out = ppo_clip_loss(lp, old, adv, mask, tc.clip_low, tc.clip_high, tc.loss_agg_mode,
                                ref_logprobs=mb["ref_logprobs"].to(dev) if with_ref else None, kl_coef=tc.kl_coef,
                                ratio_trace=trace, future_kl=future_kl)
            w = 0.0
            if real:
                w = loss_normalizer(tc.loss_agg_mode, mb, t_global) / total
                if tc.loss_agg_mode == "seq-mean-token-sum-norm":
                    w *= mb["mask"].size(1) / t_global  # agg used the micro-batch's own T
            if update:
                accelerator.backward(out.loss * (w * world))  # x world: the gradient all-reduce averages
        if real and credit is not None:
            credit.add(mb["first"], mb["mask"],
                       token_credit(lp, old, adv, mask, tc.clip_low, tc.clip_high, trace, future_kl))
        if real:
            wt = float(mb["mask"].sum()) / max(ntok, 1)
            local += torch.tensor([float(getattr(out, k).detach()) * (wt if k in _TOKEN_MEANS else w) for k in _METRICS],
                                  dtype=torch.float64)
    return local, ntok


def make_optimizer(model, tc: TrainConfig, accelerator) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the trainable parameters, with PyTorch's fused kernel where it applies.

    The fused implementation (one kernel per parameter on CPU and CUDA) computes the same update as
    the default multi-tensor (``foreach``) one without its temporaries: ``foreach`` allocates
    copies the size of all parameters (``sqrt(v)`` and the update), 2.5 GB each for the 630 M
    fp32 parameters of the 0.5B policy. It is used without Accelerate's DeepSpeed and FSDP (which bring their own
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


@dataclass
class UpdateJob:
    """One round's update as the train stage resolved it (:mod:`pipeline.stages.train`): settings,
    models, the state it continues from, its examples and where to write.

    Attributes:
        tc: the ``train`` settings.
        round_idx: the round trained (k >= 1).
        seed: the run's seed (the update seeds with ``seed + round_idx``).
        temperature: the sampling temperature (log-probs are taken at it).
        policy: the checkpoint that sampled the round (its tokenizer).
        start: the starting policy (the architecture; round 1's weights).
        prev_state: round k-1's training state folder (None for round 1).
        prev_layout: the process layout that state was saved under (``num_processes``, ``distributed_type``).
        examples: the whole round (:class:`train.examples.Example`), the same on every process.
        state_out: a temporary folder for the new training state (cleared first; every process writes).
        checkpoint_out: a temporary folder for the engines' checkpoint (cleared first; the main process writes).
        save_dtype: the checkpoint's dtype (resolved).
        mixed_precision: Accelerate's mixed precision (resolved: ``no``, ``bf16``, ``fp16``).
        tracking_dir: the trackers' project folder (``train.report_to``).
        run_name: the trackers' run name.
    """

    tc: TrainConfig
    round_idx: int
    seed: int
    temperature: float
    policy: str
    start: str
    prev_state: Path | None
    prev_layout: dict | None
    examples: list[Example]
    state_out: Path
    checkpoint_out: Path
    save_dtype: str
    mixed_precision: str
    tracking_dir: Path
    run_name: str
    tracker_config: dict = field(default_factory=dict)


@dataclass
class UpdateResult:
    """What :func:`update_policy` gives back: per-step ``metrics`` (the last with the drift figures
    where measured), the process ``layout`` the state was saved under, AdamW's total
    ``optimizer_steps``, whether this is the main process, the Accelerator (for :func:`finish_update`)
    and the update's :class:`CreditSums` over the job's examples (the same on every process)."""

    metrics: list[dict]
    layout: dict
    optimizer_steps: int | None
    is_main: bool
    accelerator: object
    credit: CreditSums | None = None


def update_policy(job: UpdateJob) -> UpdateResult:
    """One round's PPO update, from the models to the written state and checkpoint (not committed).

    Runs unchanged in one process or in W processes started by ``accelerate launch`` / ``torchrun``
    (DDP, FSDP or DeepSpeed, from the Accelerate config; gloo on CPU-only machines): every process
    reads the whole round and computes its share of every mini-batch (:func:`ppo_update`). Under
    FSDP / ZeRO-3 the full state dict is gathered with ``accelerator.get_state_dict`` (a collective,
    called by every process) and exported by the main process.

    Training state (docs/design.md §1.10): round 1 starts from ``job.start`` (cast to ``train.dtype``)
    with a fresh AdamW; round k > 1 loads ``job.prev_state`` (``accelerator.load_state``: fp32 master
    weights, AdamW moments and step, RNG states; the learning rate and weight decay come from the
    config). After the update every process saves the new state into ``job.state_out``
    (``accelerator.save_state``), then the main process exports the engines' checkpoint from the
    master weights in ``job.save_dtype`` into ``job.checkpoint_out`` and measures how much of the
    update it carries (:func:`train.state.export_drift`). Placing both and their manifests is the
    stage's (:mod:`pipeline.stages.train`); call :func:`finish_update` on every process after it.

    Raises:
        ValueError: LoRA together with FSDP or ZeRO-3 (merging the adapters needs the full weights
            in one process); a training state saved under another process layout.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tc = job.tc
    allow_precision_change(job.mixed_precision)
    accelerator = Accelerator(mixed_precision=job.mixed_precision, log_with=tc.report_to or None,
                              project_dir=str(job.tracking_dir), cpu=force_cpu())
    if accelerator.is_main_process:
        log.info("[train] running on %d process(es) (%s)", accelerator.num_processes, accelerator.distributed_type.value)
    sharded = shards_parameters(accelerator)
    if sharded and tc.lora is not None:
        raise ValueError("train.lora with FSDP or DeepSpeed ZeRO-3 is not supported (merging the adapters needs the "
                         "full weights in one process); use DDP or ZeRO-2, or train without LoRA")
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader is prepared: DeepSpeed needs this set
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.micro_batch_size
    if tc.report_to:
        accelerator.init_trackers(job.run_name, config=job.tracker_config)
    set_seed(job.seed + job.round_idx)
    tok, model, ref_model, optimizer, layout = _prepare(job, accelerator)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    credit = CreditSums([len(e.response_ids) for e in job.examples])
    metrics = ppo_update(model, optimizer, job.examples, tc, pad_id, job.seed + job.round_idx, accelerator, ref_model,
                         temperature=job.temperature, credit=credit)
    if tc.report_to:  # global step: rounds are consecutive blocks of optimizer steps (main process only)
        for i, m in enumerate(metrics):
            accelerator.log({f"train/{k}": v for k, v in m.items()}, step=(job.round_idx - 1) * len(metrics) + i)
    _save(job, accelerator, model, tok, sharded, metrics)
    return UpdateResult(metrics, layout, optimizer_steps(optimizer), accelerator.is_main_process, accelerator, credit)


def _prepare(job: UpdateJob, accelerator):
    """The tokenizer, the policy (round 1: the starting weights; round k > 1: round k-1's training
    state loaded into it), the frozen reference model where a KL needs one, and AdamW, prepared by
    ``accelerator``. Returns ``(tok, model, ref_model or None, optimizer, layout)``.

    Raises:
        ValueError: the previous state was saved under another process layout.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc = job.tc
    tok = AutoTokenizer.from_pretrained(job.policy)
    # the architecture and, for round 1, the weights of the starting policy; round k > 1 replaces
    # them with round k-1's fp32 master weights (load_state below), never with its engine checkpoint
    model = AutoModelForCausalLM.from_pretrained(job.start, dtype=getattr(torch, tc.dtype))
    if tc.gradient_checkpointing:  # non-reentrant: works under DDP's no_sync and with frozen inputs
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tc.lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(r=tc.lora.r, lora_alpha=tc.lora.alpha, lora_dropout=tc.lora.dropout,
                                                     target_modules=tc.lora.target_modules, task_type="CAUSAL_LM"))
    ref_model = None
    if tc.kl_coef > 0 or tc.measure_kl_to_start:
        ref_model = AutoModelForCausalLM.from_pretrained(job.start, dtype=getattr(torch, tc.dtype)).eval()
        ref_model.requires_grad_(False)
    optimizer = make_optimizer(model, tc, accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    layout = {"num_processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value}
    if job.prev_state is not None:  # fp32 master weights, AdamW moments and step, RNG states of round k-1
        if job.prev_layout != layout:  # Accelerate's state layout depends on them (DDP's module. prefix, FSDP shards)
            raise ValueError(
                f"round {job.round_idx - 1}'s training state was saved by {job.prev_layout}, this round runs as {layout}: "
                "Accelerate states cannot be moved between process layouts; keep train.launcher as it was for "
                "this run, or start a new run_id")
        accelerator.load_state(str(job.prev_state))
        for group in optimizer.param_groups:  # the state restores its own hyper-parameters; the config wins
            group["lr"], group["weight_decay"] = tc.learning_rate, tc.weight_decay
        if accelerator.is_main_process:
            log.info("[train] continuing from round %d's training state %s", job.round_idx - 1, job.prev_state)
    if ref_model is not None:
        ref_model.to(accelerator.device)
    return tok, model, ref_model, optimizer, layout


def _save(job: UpdateJob, accelerator, model, tok, sharded: bool, metrics: list[dict]) -> None:
    """Every process saves the training state into ``job.state_out`` (a collective under FSDP /
    DeepSpeed); the main process then measures the export's drift (added to the last step's
    ``metrics``) and exports the engines' checkpoint into ``job.checkpoint_out`` (the model is cast
    in place: after the state)."""
    tc = job.tc
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for tmp in (job.state_out, job.checkpoint_out):  # a killed round's leftovers
            shutil.rmtree(tmp, ignore_errors=True)
            if tmp.exists():  # never save into a folder that still holds another save's files
                raise OSError(f"cannot clear the leftover {tmp} of an earlier save; remove it and run the round again")
        job.state_out.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(job.state_out), safe_serialization=True)  # collective under FSDP / DeepSpeed
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model) if sharded else None  # collective: every process gathers
    if not accelerator.is_main_process:
        return
    if metrics and measures_drift(accelerator, tc):
        # how much of the update the checkpoint will carry: read before export_checkpoint casts the model
        drift = export_drift(job.round_idx, accelerator.unwrap_model(model).state_dict(), job.save_dtype, job.start,
                             job.prev_state, job.policy)
        metrics[-1].update(drift)
        if tc.report_to and drift:
            accelerator.log({f"train/{k}": v for k, v in drift.items()}, step=job.round_idx * len(metrics) - 1)
    export_checkpoint(accelerator.unwrap_model(model), tok, job.checkpoint_out, job.save_dtype, state_dict)


def finish_update(result: UpdateResult) -> None:
    """After the stage committed the round (main process): every process waits for it (none returns
    before the checkpoint is in place) and the trackers end."""
    accelerator = result.accelerator
    accelerator.wait_for_everyone()
    if accelerator.trackers:
        accelerator.end_training()
    log.info("[train] rank %d/%d finished", accelerator.process_index, accelerator.num_processes)
