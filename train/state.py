"""The checkpoint for the engines and the training state carried across rounds (docs/design.md
§1.10): saving the checkpoint in ``train.save_dtype``, pruning old states."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.faults import kill_point
from pipeline.stages.base import round_paths

log = logging.getLogger("capo.train")


def optimizer_steps(optimizer) -> int | None:
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


def save_checkpoint(model, tok, ckpt: Path, dtype: str, state_dict: dict | None = None) -> None:
    """save_pretrained into a temporary dir, then rename into place (earlier one superseded).

    ``model`` is the unwrapped model. ``state_dict`` (from ``accelerator.get_state_dict`` under
    FSDP / ZeRO-3, where ``model`` holds only shards) replaces the model's own weights, cast to
    ``dtype``: the pattern of Accelerate's docs, ``unwrap_model(model).save_pretrained(...,
    state_dict=accelerator.get_state_dict(model))``. Without it a LoRA model is merged first.
    """
    tmp = ckpt.with_name(f".{ckpt.name}.tmp")  # one name: a killed save's leftovers are cleared here
    for stale in ckpt.parent.glob(f".{ckpt.name}.tmp*"):  # (and those of older versions' per-pid names)
        shutil.rmtree(stale, ignore_errors=True)
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
    storage.fsync_tree(tmp)
    kill_point("checkpoint.saved", ckpt)
    if ckpt.exists():
        storage.supersede(ckpt)
    os.replace(tmp, ckpt)
    storage.fsync_dir(ckpt.parent)
    kill_point("checkpoint.renamed", ckpt)
