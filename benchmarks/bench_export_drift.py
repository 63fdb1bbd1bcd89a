"""How much of a run's fp32 update reaches the engine checkpoint written in ``train.save_dtype``.

The trainer keeps fp32 master weights in the training state and exports the
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
update at full size on average; the cosine is ``null`` where either update is zero, the slope where
the fp32 update is). With ``--checkpoint`` it also checks that the exported checkpoint
is exactly the cast of the master weights.

The arithmetic is :mod:`train.drift`'s, which the train stage runs on every round (the
``export_*`` train metrics). Raises ``SystemExit`` naming the path when a directory holds no
``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from pipeline.precision import bench_context
from train.drift import DTYPES, WeightFiles, summarize, sums_against


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


def _files(path: Path) -> WeightFiles:
    try:
        return WeightFiles(path)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=Path, required=True, help="the starting policy (model directory)")
    ap.add_argument("--state", type=Path, required=True, help="a round's train_state directory (fp32 master weights)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the same round's exported checkpoint (optional)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=sorted(DTYPES))
    args = ap.parse_args()
    t0 = time.time()
    cast = DTYPES[args.save_dtype]
    s, m = _files(args.start), _files(args.state)
    ck = _files(args.checkpoint) if args.checkpoint else None
    acc: dict[str, dict[str, float]] = {}
    ckpt_mismatch = ckpt_compared = 0
    unmatched: list[str] = []
    for name in m.names():
        if name not in s:
            unmatched.append(name)
            continue
        w = m.get(name)
        if ck is not None and name in ck:
            ckpt_mismatch += int((ck.get(name).float() != w.to(cast).float()).sum())
            ckpt_compared += w.numel()
        w0 = s.get(name)
        sums_against(w, [(acc.setdefault(k, {}), w0, None) for k in ("all", _kind(name))], cast)
    if not acc:
        raise SystemExit(f"no tensor of {m.path} matched one of {s.path} by name (first state names: "
                         f"{unmatched[:3]}); a LoRA state holds adapters, not the policy's weights")
    for k, a in acc.items():
        figures = {f: (None if isinstance(v, float) and not math.isfinite(v) else v) for f, v in summarize(a).items()}
        print(json.dumps({"bench": "export_drift", "tensors": k, **figures, "save_dtype": args.save_dtype}, allow_nan=False))
    out = {"bench": "export_drift", "state": str(args.state), "start": str(args.start), "seconds": round(time.time() - t0, 1),
           **bench_context()}
    out["state_tensors_not_in_start"] = len(unmatched)
    if ck is not None:
        if ckpt_compared == 0:
            raise SystemExit(f"no tensor of {ck.path} matched the state's by name: nothing to compare")
        out["checkpoint_elements_compared"] = ckpt_compared
        out["checkpoint_elements_not_the_cast"] = ckpt_mismatch
    print(json.dumps(out))


if __name__ == "__main__":
    main()
