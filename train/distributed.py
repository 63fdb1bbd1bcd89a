"""Bookkeeping that makes W processes compute the one-process update: mini-batch plans, each
process's share, loss normalizers, dummy micro-batches, and what Accelerate set up
(docs/distributed-training.md)."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from pipeline.config import TrainConfig
from train.examples import Example, collate

log = logging.getLogger("capo.train")


def loss_normalizer(mode: str, mb: dict, t_global: int) -> float:
    """Size of what the aggregation divides by, to weight micro-batches inside a mini-batch:
    ``token-mean`` its response tokens, ``seq-mean-token-mean`` its responses with a token,
    ``seq-mean-token-sum-norm`` responses x ``t_global`` (the round's longest response, as
    :func:`train.trainer.ppo_update` takes it).

    Args:
        mode: one of :data:`train.loss.LOSS_AGG_MODES`.
        mb: the micro-batch; ``mb["mask"]`` is (B, T), 1 on response tokens.
        t_global: the normalizing length of ``seq-mean-token-sum-norm``, in tokens.

    Raises:
        ValueError: an unknown ``mode`` (the valid ones listed).
    """
    m = mb["mask"]
    if mode == "token-mean":
        return float(m.sum())
    if mode == "seq-mean-token-mean":
        return float((m.sum(1) > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        return float(m.size(0) * t_global)
    from train.loss import LOSS_AGG_MODES

    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {list(LOSS_AGG_MODES)}")


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


def dummy_micro_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """A one-token micro-batch whose loss is multiplied by 0: keeps a rank that has no data for a
    mini-batch in step with the others (same number of forward/backward calls, so collectives match)."""
    mb = collate([Example([pad_id], [pad_id], np.zeros(1, np.float32))], pad_id)
    mb["old_logprobs"] = torch.zeros(1, 1)
    mb["ref_logprobs"] = torch.zeros(1, 1)
    return mb


def force_cpu() -> bool:
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


def allow_precision_change(mixed_precision: str) -> None:
    """Let a train stage in a single, unlaunched process use another ``mixed_precision`` than an
    earlier Accelerator of the same process did.

    Accelerate keeps one ``AcceleratorState`` per process and refuses a second ``Accelerator`` with
    another mixed precision ("AcceleratorState has already been initialized and cannot be
    changed"): a script or notebook that calls :func:`pipeline.stages.train.train_stage` for a bf16 run and
    then for an fp32 one failed at the second. When the state holds another precision and this
    process is alone (``WORLD_SIZE`` unset or 1: not started by ``accelerate launch`` or ``torchrun``
    with several processes), the accelerator part of the state is cleared (Accelerate's own
    ``AcceleratorState._reset_state``; the process part, which holds the device and any process
    group, is kept) so the next Accelerator is built afresh. Under DeepSpeed the state records
    ``"no"`` whatever the precision (DeepSpeed's own config holds it), so there it is always
    rebuilt. Launched processes are left alone: every round there runs in its own process anyway.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    shared = AcceleratorState._shared_state
    if not shared or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    held = shared.get("_mixed_precision")
    if shared.get("distributed_type") == DistributedType.DEEPSPEED or (held is not None and str(held) != str(mixed_precision)):
        log.info("[train] mixed precision %s in this process after %s: Accelerate's state is rebuilt", mixed_precision, held)
        AcceleratorState._reset_state()


def shards_parameters(accelerator) -> bool:
    """Whether the prepared model holds only a shard of each weight (FSDP, DeepSpeed ZeRO-3)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False
