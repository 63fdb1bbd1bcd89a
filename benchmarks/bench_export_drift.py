"""How much of a run's fp32 update reaches the engine checkpoint written in ``train.save_dtype``.

The trainer keeps fp32 master weights in the training state (issue 11, item 1) and exports the
checkpoint that vLLM and the eval load as their ``train.save_dtype`` cast (bf16 by default; the
trainer's own forward under bf16 autocast casts them the same way). Rounding would carry an update
at full size on average if the weights sat anywhere inside their bf16 bins; but the shipped policy
is bf16-valued, so every weight starts exactly on the grid and its cast moves only once its update
passes half a bf16 step (a dead zone): a small learning rate over few steps reaches the engine only
through the weights of small magnitude. This script measures how much of the update survives, in
direction and size, on a finished round:

    .venv/bin/python benchmarks/bench_export_drift.py \
        --start data/models/qwen2.5-coder-0.5b-instruct \
        --state runs/bench_learning/learn-grpo-s0-c3d97891/round_010/variants/grpo/train_state

For the whole model and per kind of tensor it prints one JSON line with: the share of elements the
fp32 master moved, the share whose ``save_dtype`` cast moved, the L2 norm of both updates, their
cosine and the regression slope <d_cast, d_fp32> / <d_fp32, d_fp32> (1 = the cast carries the
update at full size on average). With ``--checkpoint`` it also checks that the exported checkpoint
is exactly the cast of the master weights.

Raises ``SystemExit`` naming the path when a directory holds no ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from safetensors import safe_open

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _weights_file(path: Path) -> Path:
    f = path / "model.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise SystemExit(f"no model.safetensors under {path}: pass a model directory, a train_state directory or the file")
    return f


def _canon(name: str) -> str:
    for prefix in ("module.", "_orig_mod.", "base_model.model."):
        name = name.removeprefix(prefix)
    return name


def _kind(name: str) -> str:
    if "embed_tokens" in name:
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    if "norm" in name:
        return "norm"
    if name.endswith("bias"):
        return "bias"
    return "linear"


def accumulate(acc: dict[str, float], w0: torch.Tensor, w: torch.Tensor, cast: torch.dtype) -> torch.Tensor:
    """Add one tensor's update to the running sums ``acc`` and return the cast's update.

    Args:
        acc: running sums ``n, moved, moved_cast, dd, cc, dc`` (created as zeros when empty).
        w0: the starting weights, any shape (float; bf16-valued for the shipped policy).
        w: the fp32 master weights after training, the same shape as ``w0``.
        cast: the export dtype (``train.save_dtype``).

    Returns:
        ``cast(w) - w0`` in float32, the update the engine sees.

    Raises:
        ValueError: when the shapes differ (naming both).
    """
    if w0.shape != w.shape:
        raise ValueError(f"start shape {tuple(w0.shape)} != trained shape {tuple(w.shape)}")
    d = w.float() - w0.float()
    dc = w.to(cast).float() - w0.float()
    for k in ("n", "moved", "moved_cast", "dd", "cc", "dc"):
        acc.setdefault(k, 0.0)
    acc["n"] += d.numel()
    acc["moved"] += float((d != 0).sum())
    acc["moved_cast"] += float((dc != 0).sum())
    acc["dd"] += float((d.double() ** 2).sum())
    acc["cc"] += float((dc.double() ** 2).sum())
    acc["dc"] += float((d.double() * dc.double()).sum())
    return dc


def summarize(acc: dict[str, float]) -> dict[str, float]:
    """Shares moved, L2 norms, cosine and slope <d_cast, d_fp32> / <d_fp32, d_fp32> of the sums."""
    return {
        "elements": int(acc["n"]),
        "share_moved_fp32": acc["moved"] / acc["n"],
        "share_moved_cast": acc["moved_cast"] / acc["n"],
        "l2_update_fp32": acc["dd"] ** 0.5,
        "l2_update_cast": acc["cc"] ** 0.5,
        "cosine": acc["dc"] / max((acc["dd"] * acc["cc"]) ** 0.5, 1e-300),
        "slope_cast_on_fp32": acc["dc"] / max(acc["dd"], 1e-300),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=Path, required=True, help="the starting policy (model directory)")
    ap.add_argument("--state", type=Path, required=True, help="a round's train_state directory (fp32 master weights)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the same round's exported checkpoint (optional)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=sorted(DTYPES))
    args = ap.parse_args()
    t0 = time.time()
    cast = DTYPES[args.save_dtype]
    start_f, state_f = _weights_file(args.start), _weights_file(args.state)
    ckpt_f = _weights_file(args.checkpoint) if args.checkpoint else None
    acc: dict[str, dict[str, float]] = {}
    ckpt_mismatch = ckpt_compared = 0
    unmatched: list[str] = []
    with safe_open(start_f, "pt") as s, safe_open(state_f, "pt") as m:
        start_names = {_canon(k): k for k in s.keys()}
        ck = safe_open(ckpt_f, "pt") if ckpt_f else None
        ck_names = {_canon(k): k for k in ck.keys()} if ck else {}
        for key in m.keys():
            name = _canon(key)
            if name not in start_names:
                unmatched.append(key)
                continue
            w0 = s.get_tensor(start_names[name])
            w = m.get_tensor(key)
            if ck is not None and name in ck_names:
                ckpt_mismatch += int((ck.get_tensor(ck_names[name]).float() != w.to(cast).float()).sum())
                ckpt_compared += w.numel()
            one: dict[str, float] = {}
            accumulate(one, w0, w, cast)
            for k in ("all", _kind(name)):
                tot = acc.setdefault(k, {})
                for f, v in one.items():
                    tot[f] = tot.get(f, 0.0) + v
        del ck
    if not acc:
        raise SystemExit(f"no tensor of {state_f} matched one of {start_f} by name (first state names: "
                         f"{unmatched[:3]}); a LoRA state holds adapters, not the policy's weights")
    for k, a in acc.items():
        print(json.dumps({"bench": "export_drift", "tensors": k, **summarize(a), "save_dtype": args.save_dtype}))
    out = {"bench": "export_drift", "state": str(args.state), "start": str(args.start), "seconds": round(time.time() - t0, 1),
           "machine": platform.processor() or platform.machine()}
    out["state_tensors_not_in_start"] = len(unmatched)
    if ckpt_f:
        if ckpt_compared == 0:
            raise SystemExit(f"no tensor of {ckpt_f} matched the state's by name: nothing to compare")
        out["checkpoint_elements_compared"] = ckpt_compared
        out["checkpoint_elements_not_the_cast"] = ckpt_mismatch
    print(json.dumps(out))


if __name__ == "__main__":
    main()
