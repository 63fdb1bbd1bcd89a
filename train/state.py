"""The checkpoint for the engines and the training state carried across rounds (docs/design.md
§1.10): exporting the checkpoint in ``train.save_dtype``, AdamW's step count, and how much of the
update the checkpoint carries (:func:`export_drift`)."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from pipeline import storage

log = logging.getLogger("capo.train")


def optimizer_steps(optimizer) -> int | None:
    """AdamW's step count (the same for every parameter), None when it keeps none."""
    opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
    for st in opt.state.values():
        if "step" in st:
            return int(st["step"])
    return None


def measures_drift(accelerator, tc) -> bool:
    """Whether the train stage measures :func:`export_drift`: not for LoRA (the exported weights are
    merged at save time), FSDP or DeepSpeed (their modules may hold bf16 copies while the fp32
    master sits in the optimizer, and their states have no ``model.safetensors``)."""
    from accelerate.utils import DistributedType

    return tc.lora is None and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def export_drift(round_idx: int, weights: dict, save_dtype: str, start: str, prev_state: Path | None,
                 prev_checkpoint: str) -> dict[str, float]:
    """:func:`train.drift.checkpoint_drift` for the train stage: round ``round_idx``'s master
    weights ``weights`` against the start (round 1) or round k-1's training state and checkpoint
    (``prev_state`` / ``prev_checkpoint``, the checkpoint that sampled the round). Logs a warning
    when the exported checkpoint carries less than half of the round's update (the bf16 dead zone).

    Returns:
        The four ``export_*`` / ``master_moved_frac`` figures (train metrics of the round's last
        step), or ``{}`` with a warning where they cannot be measured (a start that is a hub name,
        an unreadable file): a diagnostic never fails the round.
    """
    from train.drift import checkpoint_drift

    t0 = time.perf_counter()
    try:
        out = checkpoint_drift(weights.items(), save_dtype, start, prev_state,
                               prev_checkpoint if prev_state is not None else None)
    except Exception as e:  # noqa: BLE001 - a diagnostic: the round's training must still be saved
        log.warning("[train] the checkpoint's share of the update is not measured: %s: %s", type(e).__name__, e)
        return {}
    log.info("[train] the %s checkpoint carries %.0f%% of round %d's fp32 update (%.1f%% of elements moved, %.1f%% of "
             "the master's) and %.0f%% of the run's (%.1fs)", save_dtype, 100 * out["export_update_share"], round_idx,
             100 * out["export_moved_frac"], 100 * out["master_moved_frac"],
             100 * out["export_update_share_from_start"], time.perf_counter() - t0)
    if out["export_update_share"] < 0.5:
        log.warning("[train] round %d's %s checkpoint carries only %.0f%% of its fp32 update: most weights moved by "
                    "less than half a %s step (the dead zone, docs/benchmarks.md); a larger learning rate or more "
                    "steps per round, or train.save_dtype=float32 with rollout.engine.dtype=float32 and "
                    "train.mixed_precision=no, carry it", round_idx, save_dtype, 100 * out["export_update_share"],
                    save_dtype)
    return out


def export_checkpoint(model, tok, out: Path, dtype: str, state_dict: dict | None = None) -> None:
    """Write the engines' checkpoint into the folder ``out`` (``save_pretrained``, safetensors, plus
    the tokenizer): the master weights cast to ``dtype``. Not committed: the stage places it
    (:func:`pipeline.storage.place_dir`) and writes its manifest.

    ``model`` is the unwrapped model. ``state_dict`` (from ``accelerator.get_state_dict`` under
    FSDP / ZeRO-3, where ``model`` holds only shards) replaces the model's own weights, cast to
    ``dtype``: the pattern of Accelerate's docs, ``unwrap_model(model).save_pretrained(...,
    state_dict=accelerator.get_state_dict(model))``. Without it a LoRA model is merged first, with
    PEFT's ``merge_and_unload``, which adds the adapters into the base weights in place: afterwards
    ``model``'s base layers hold the merged weights. The model is also cast to ``dtype`` in place.
    So export last, after the training state is saved.
    """
    if state_dict is not None:
        torch_dtype = getattr(torch, dtype)
        # a gathered state dict holds tied weights (lm_head <- embed_tokens) as separate tensors, which
        # save_pretrained would write twice; keep only the source, as the plain save does
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        sd = {k: v.to(torch_dtype) for k, v in state_dict.items() if not (k in tied and tied[k] in state_dict)}
        model.save_pretrained(out, state_dict=sd, safe_serialization=True)
        model.config.dtype = dtype  # save_pretrained recorded the (sharded) model's own dtype
        model.config.save_pretrained(out)
    else:
        if hasattr(model, "merge_and_unload"):  # LoRA: the next round's engine loads plain weights
            model = model.merge_and_unload()
        model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def save_checkpoint(model, tok, ckpt: Path, dtype: str, state_dict: dict | None = None) -> None:
    """:func:`export_checkpoint` into a temporary folder beside ``ckpt``, then placed at ``ckpt``
    (:func:`pipeline.storage.place_dir`: an earlier one is superseded). For scripts and tests; the
    train stage exports and places in two steps.

    Raises:
        OSError: the leftover temporary folder of an earlier, killed save cannot be removed.
    """
    tmp = ckpt.with_name(f".{ckpt.name}.tmp")  # one name: a killed save's leftovers are cleared here
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        raise OSError(f"cannot clear the leftover {tmp} of an earlier save; remove it and save again")
    export_checkpoint(model, tok, tmp, dtype, state_dict)
    storage.place_dir(tmp, ckpt, "checkpoint")
