"""Benchmark 7: the train stage on a CUDA GPU, the path CI never runs (no GPU there).

The policy has the default round's architecture (``--model``: the config and tokenizer of
Qwen2.5-Coder-0.5B-Instruct as shipped: 630M parameters, an untied 151,936 x 896 output head) with **random weights** from a
fixed seed: a GPU machine here cannot reach a model hub and its working tree travels with at most
64 MiB, so only the config and tokenizer go along. Every check below is about mechanics and cost,
which random weights exercise exactly as trained ones do (same shapes, same kernels); nothing here
measures learning (that is ``bench_learning.py``).

The rounds are real tables: ``rollouts`` and ``token_rewards`` of ``--responses`` responses in
groups of ``--group`` (random prompt/response token ids, ``--prompt-len`` + up to
``--response-len`` tokens; outcomes and flagged tails at random; token rewards and group advantages
by :func:`pipeline.core.rewards.token_rewards` / :func:`group_token_advantages`, the CAPO
formulas), written through :mod:`pipeline.storage` as the reward stage writes them. On them:

1. ``train_stage`` (the product's code, in process, on the **defaults** except
   ``train.measure_kl_to_start=true`` so the reference path runs, and the policy's precision of
   ``--precision``: ``auto`` by default, bf16 on a bf16 GPU) trains round 1, then round 2
   from round 1's training state. Per round: seconds, peak GPU memory, tokens/s, and the first
   step's ``ratio_mean`` / ``approx_kl`` / ``clip_frac``, which must be 1 / 0 / 0 (exactly, up to
   the float64 sum that aggregates micro-batches; old
   log-probs in the update's mode), and ``kl_ref``, exactly 0 in round 1 (the reference is the
   starting policy, through the policy's precision path) and above 0 in round 2.
2. **Two rounds equal one process**: both rounds' ``ppo_update`` replayed in one process with one
   model and one AdamW must end at round 2's saved fp32 master weights, with the same optimizer
   step count. Sections 1-2 run with ``torch.use_deterministic_algorithms`` and PyTorch's math
   attention (cuDNN's and the flash/memory-efficient attention backwards are not deterministic:
   with them two identical replays differ by about as much as the update), and the replay runs
   twice, so the line shows the replay's own noise floor beside the difference.
3. **The export**: round k's engine checkpoint must be exactly the ``train.save_dtype`` cast of
   round k's master weights; the share of master elements that round 2 moved relative to round 1.
   Sections 3-5 run with the default attention kernels again.
4. **The fused output head** (:class:`train.logprobs.HeadLogProbs`, whose backward is written by
   hand) against the model's own logits under the same autocast: max |log-prob difference| (ok
   below 1e-3) and the relative L2 difference of the gradient of ``sum(advantage * log-prob)`` over
   every parameter (ok below 5 %: the model's bf16 logits' gradient against the fused head's fp32
   accumulation).
5. **Alternatives**, one optimizer round each on the round-1 batch, peak GPU memory and seconds:
   today's defaults (fused head, gradient checkpointing, micro-batch 2) vs the model's full logits,
   vs no gradient checkpointing, vs micro-batches of 8 and 16 (what a GPU user would raise), and
   micro-batches of 16 without checkpointing. "The model's logits" are those of the response
   positions only (``logits_to_keep``), chunked, as the FSDP path computes them.
6. With ``--fsdp`` and/or ``--deepspeed`` (first; ``--only-distributed`` alone): the train stage under
   ``accelerate launch`` with ``configs/accelerate/fsdp.yaml`` / ``deepspeed_zero2.yaml`` on one process
   against the plain stage (:func:`distributed_check`).

Section 1 also reports what the stage's export diagnostic (:mod:`train.drift`) recorded on each
round's last step: ``export_update_share`` (round / since the start) and the moved fractions, and
``--no-alternatives`` skips section 5.

Every line is JSON with ``bench_context``. Run it where there is a GPU (``--out`` collects the
lines in a file as well)::

    python benchmarks/bench_trainer_gpu.py --out $OUT/trainer_gpu.jsonl
    python benchmarks/bench_trainer_gpu.py --fsdp --only-distributed     # the FSDP path on one GPU
    python benchmarks/bench_trainer_gpu.py --deepspeed --only-distributed   # DeepSpeed ZeRO-2 (pip install deepspeed)

and, as a dry run of the script on a CPU, with a 2-layer model::

    .venv/bin/python benchmarks/bench_trainer_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import numpy as np
import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT_LINES: list[dict] = []


def emit(rec: dict, ctx: dict) -> None:
    """Print one JSON line (with the run's context) and keep it for ``--out``."""
    line = {"bench": "trainer_gpu", **rec, **ctx}
    OUT_LINES.append(line)
    print(json.dumps(line), flush=True)


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release(accelerator) -> None:
    """Drop Accelerate's references to prepared models and optimizers (it keeps them in lists), so
    the next measurement's peak counts only its own tensors."""
    import gc

    accelerator.free_memory()
    gc.collect()
    reset_peak()


def deterministic_attention(on: bool) -> None:
    """PyTorch's math attention only (deterministic backward) when ``on``; every backend otherwise."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(not on)
        torch.backends.cuda.enable_mem_efficient_sdp(not on)
        torch.backends.cuda.enable_cudnn_sdp(not on)
    torch.use_deterministic_algorithms(on, warn_only=True)


def make_policy(model_dir: Path, dest: Path, tiny: bool) -> int:
    """A random-weight checkpoint with ``model_dir``'s architecture and tokenizer at ``dest``
    (bfloat16, as the shipped checkpoints are). Returns the parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    conf = AutoConfig.from_pretrained(model_dir)
    if tiny:
        conf.num_hidden_layers, conf.hidden_size, conf.intermediate_size = 2, 64, 128
        conf.num_attention_heads, conf.num_key_value_heads, conf.head_dim = 4, 2, 16
        conf.max_window_layers = 2
        if getattr(conf, "layer_types", None):
            conf.layer_types = conf.layer_types[:2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(dest)
    return sum(p.numel() for p in model.parameters())


def write_round(cfg, k: int, n: int, group: int, prompt_len: int, response_len: int, vocab: int, eos: int) -> int:
    """Round k's rollouts and token_rewards tables (CAPO token rewards, group advantages). Returns
    the number of response tokens."""
    from pipeline import storage
    from pipeline.core.rewards import group_token_advantages, token_rewards
    from pipeline.schemas import SCHEMAS
    from pipeline.stages.base import round_paths

    rng = np.random.default_rng(1000 + k)
    ro, lengths, outcome, weights, gid = [], [], [], [], []
    for i in range(n):
        g = i // group
        prompt = rng.integers(100, vocab - 100, prompt_len).tolist()
        t = int(rng.integers(response_len // 3, response_len + 1))
        resp = rng.integers(100, vocab - 100, t - 1).tolist() + [eos]
        r_v = float(rng.random() < 0.5)
        n_bad = int(rng.integers(0, t // 2)) if rng.random() < 0.5 else 0
        ro.append({"run_id": cfg.run_id, "round": k, "rollout_id": f"r{k}-{i}", "prompt_id": f"p{k}-{g}", "sample_idx": i % group,
                   "policy": cfg.rollout.policy, "prompt_token_ids": prompt, "response_text": "",
                   "response_token_ids": resp, "rollout_logprobs": [], "finish_reason": "stop", "num_tokens": t})
        lengths.append(t)
        outcome.append(r_v)
        weights.append(np.r_[np.zeros(t - n_bad), np.ones(n_bad)])
        gid.append(g)
    off = np.r_[0, np.cumsum(lengths)]
    rewards = token_rewards(np.array(outcome), np.concatenate(weights), off, C=2.0, P=1.0)
    adv = group_token_advantages(rewards, off, np.array(gid))
    tr = [{"run_id": cfg.run_id, "round": k, "variant": cfg.variant, "rollout_id": f"r{k}-{i}", "prompt_id": f"p{k}-{gid[i]}",
           "outcome_correct": bool(outcome[i]), "outcome_reward": outcome[i], "rule": "intersection",
           "n_valid_critiques": 1, "n_penalized_tokens": int(weights[i].sum()),
           "rewards": rewards[off[i]:off[i + 1]].tolist(), "advantages": adv[off[i]:off[i + 1]].tolist(),
           "reward_config_hash": "bench_trainer_gpu"} for i in range(n)]
    p = round_paths(cfg, k)
    storage.write_table(pa.Table.from_pylist(ro, schema=SCHEMAS["rollouts"]), p["rollouts"], "rollouts",
                        stage="rollout", key={"bench_trainer_gpu": "rollouts", "round": k})
    storage.write_table(pa.Table.from_pylist(tr, schema=SCHEMAS["token_rewards"]), p["token_rewards"], "token_rewards",
                        stage="reward", key={"bench_trainer_gpu": "token_rewards", "round": k})
    return int(off[-1])


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def fresh(policy: Path, tc, accelerator, gc: bool | None = None):
    """The policy in fp32 (``train.dtype``) prepared by Accelerate with the stage's optimizer."""
    from transformers import AutoModelForCausalLM

    from train.trainer import make_optimizer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, tc.dtype))
    if tc.gradient_checkpointing if gc is None else gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = make_optimizer(model, tc, accelerator)
    return accelerator.prepare(model, opt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "data" / "models" / "qwen2.5-coder-0.5b-instruct"),
                    help="folder with the architecture's config.json and tokenizer (weights are not read)")
    ap.add_argument("--responses", type=int, default=32, help="responses per round (default: 8 groups of 4)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--response-len", type=int, default=320, help="longest response (rollout.sampling.max_tokens)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model: a dry run of the script on a CPU")
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--fsdp", action="store_true",
                    help="also section 6: the train stage under accelerate launch with configs/accelerate/fsdp.yaml on "
                         "one process against the plain stage (--fsdp-config for another Accelerate config)")
    ap.add_argument("--fsdp-config", default=str(ROOT / "configs" / "accelerate" / "fsdp.yaml"))
    ap.add_argument("--deepspeed", action="store_true",
                    help="also section 6 with configs/accelerate/deepspeed_zero2.yaml (ZeRO-2; needs `pip install "
                         "deepspeed`) on one process against the plain stage")
    ap.add_argument("--deepspeed-config", default=str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    ap.add_argument("--only-distributed", "--only-fsdp", dest="only_distributed", action="store_true",
                    help="section 6 alone (with --fsdp and/or --deepspeed)")
    ap.add_argument("--no-alternatives", action="store_true", help="skip section 5 (one update per variant)")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32"),
                    help="the policy's precision in sections 1-5: auto (default: bf16 autocast and bf16 export on a "
                         "bf16 GPU, the GPU choice and the setting of the H100 lines in docs/benchmarks.md) or fp32 "
                         "(the shipped defaults: no autocast, fp32 export)")
    args = ap.parse_args(argv)
    if args.out and os.path.exists(args.out):  # evidence already written is never overwritten
        ap.error(f"--out {args.out} exists: give a new path (or delete it first)")
    if args.only_distributed and not (args.fsdp or args.deepspeed):
        ap.error("--only-distributed needs --fsdp and/or --deepspeed")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_trainer_gpu-"))
    try:
        run(args, work)
    finally:
        if args.work is None:  # states of 7.6 GB each: never leave them behind
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    import accelerate
    import transformers
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.precision import bench_context, resolve_mixed_precision
    from pipeline.stages.base import round_paths
    from pipeline.stages.train import load_examples
    from train.examples import collate
    from train.logprobs import token_logprobs
    from pipeline.stages.train import train_stage
    from train.trainer import ppo_update

    ctx = {**bench_context(), "torch": torch.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "tiny": args.tiny, "policy_precision": args.precision}
    policy = work / "policy"
    t0 = time.perf_counter()
    n_params = make_policy(Path(args.model), policy, args.tiny)
    emit({"what": "policy", "params": n_params, "random_weights": True, "seconds": round(time.perf_counter() - t0, 1)}, ctx)

    precision = (["rollout.engine.dtype=auto", "train.mixed_precision=auto"] if args.precision == "auto"
                 else ["rollout.engine.dtype=float32", "train.mixed_precision=no"])
    cfg = load_config(None, [f"runs_dir={work / 'runs'}", f"data_dir={work / 'data'}", "run_id=gpu",
                             f"rollout.policy={policy}", "train.measure_kl_to_start=true", *precision])
    tc = cfg.train
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    vocab = len(tok)
    tokens = {k: write_round(cfg, k, args.responses, args.group, args.prompt_len, args.response_len, vocab,
                             tok.eos_token_id) for k in (1, 2)}

    checks = [("fsdp", args.fsdp_config, "FSDP")] if args.fsdp else []
    checks += [("deepspeed", args.deepspeed_config, "DEEPSPEED")] if args.deepspeed else []
    for name, config_file, layout in checks:
        distributed_check(args, work, policy, ctx, name, config_file, layout)
    if checks and args.only_distributed:
        write_out(args)
        return
    deterministic_attention(True)
    # 1. the product's train stage, rounds 1 and 2
    for k in (1, 2):
        reset_peak()
        t0 = time.perf_counter()
        train_stage(cfg, k)
        sync()
        secs = time.perf_counter() - t0
        m = storage.read_table(round_paths(cfg, k)["train_metrics"], "train_metrics").to_pylist()
        first = {r["name"]: r["value"] for r in m if r["step"] == 0}
        steps = 1 + max(r["step"] for r in m)
        last = {r["name"]: r["value"] for r in m if r["step"] == steps - 1}
        emit({"what": "train_stage", "round": k, "seconds": round(secs, 2), "peak_gpu_gb": peak_gb(),
              "optimizer_steps": steps, "response_tokens": tokens[k],
              "tokens_per_s_update": float(np.mean([r["value"] for r in m if r["name"] == "tokens_per_s"])),
              "mixed_precision": resolve_mixed_precision(tc.mixed_precision).value,
              "first_step": {x: first.get(x) for x in ("ratio_mean", "approx_kl", "clip_frac", "kl_ref", "entropy")},
              # train.drift's export diagnostic, recorded on the round's last step (absent: it did not run)
              "export": {x: last.get(x) for x in ("export_update_share", "export_update_share_from_start",
                                                  "master_moved_frac", "export_moved_frac")},
              # old log-probs in the update's own mode: ratio exactly 1 before the first step; the
              # reference is the starting policy, so KL to it is exactly 0 in round 1 only
              "ok": abs(first.get("ratio_mean") - 1.0) < 1e-12 and first.get("approx_kl") == 0.0
              and first.get("clip_frac") == 0.0 and (first.get("kl_ref") == 0.0 if k == 1 else first.get("kl_ref") > 0.0)},
             ctx)

    # 2. two rounds == one process running both rounds' updates (twice: the replay's own noise floor)
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(tc.mixed_precision).value)
    replays, n_steps = [], 0
    for _ in range(2):
        model, opt = fresh(policy, tc, accelerator)
        ref = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, tc.dtype)).eval().to(accelerator.device)
        ref.requires_grad_(False)
        n_steps = 0
        for k in (1, 2):
            n_steps += len(ppo_update(model, opt, load_examples(cfg, k), tc, pad, cfg.seed + k, accelerator, ref,
                                      temperature=cfg.rollout.sampling.temperature))
        replays.append({n: v.detach().float().cpu() for n, v in accelerator.unwrap_model(model).state_dict().items()})
        del model, opt, ref
        release(accelerator)
    s1, s2 = (load_weights(round_paths(cfg, k)["train_state"]) for k in (1, 2))
    worst = max(float((replays[0][n] - s2[n].float()).abs().max()) for n in s2)
    floor = max(float((replays[0][n] - replays[1][n]).abs().max()) for n in s2)
    man2 = storage.read_manifest(round_paths(cfg, 2)["train_state"])
    emit({"what": "two_rounds_equal_one_process", "max_abs_diff": worst, "replay_vs_replay_max_abs_diff": floor,
          "steps_replayed": n_steps, "steps_in_state": man2.get("optimizer_steps_total"),
          # a replay floor above 1e-6 (kernels not deterministic after all) leaves the check inconclusive: not ok
          "ok": worst <= 1e-6 and floor <= 1e-6 and n_steps == man2.get("optimizer_steps_total")}, ctx)
    del replays
    deterministic_attention(False)

    # 3. the export is the save_dtype cast of the master weights; round 2 moved most elements
    for k, s in ((1, s1), (2, s2)):
        ck = load_weights(round_paths(cfg, k)["checkpoint"])
        exact = set(ck) == set(s) and all(bool((s[n].to(ck[n].dtype) == ck[n]).all()) for n in ck)
        emit({"what": "export_is_cast_of_master", "round": k, "checkpoint_dtype": str(next(iter(ck.values())).dtype),
              "ok": exact}, ctx)
    moved = sum(int((s1[n] != s2[n]).sum()) for n in s2) / sum(s2[n].numel() for n in s2)
    emit({"what": "round2_vs_round1_master", "share_of_elements_moved": moved}, ctx)

    # 4. fused output head vs the model's own logits: log-probs and gradients under the same autocast
    ex = load_examples(cfg, 1)
    mb = collate(ex[: tc.micro_batch_size], pad)
    res = {}
    for fuse in (True, False):
        m = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).to(accelerator.device)
        with accelerator.autocast():
            lp = token_logprobs(m, mb, cfg.rollout.sampling.temperature, fuse_head=fuse)
            (lp * mb["advantages"].to(lp.device)).sum().backward()
        res[fuse] = (lp.detach().float().cpu(), {n: q.grad.detach().float().cpu() for n, q in m.named_parameters()
                                                 if q.grad is not None})
        del m
    release(accelerator)
    d_lp = float((res[True][0] - res[False][0]).abs().max())
    g1, g0 = res[True][1], res[False][1]
    num = sum(float((g1[n] - g0[n]).norm() ** 2) for n in g0) ** 0.5
    den = sum(float(g0[n].norm() ** 2) for n in g0) ** 0.5
    # the same bf16 head matmul in both: log-probs equal to float rounding; the gradients differ by the
    # model's bf16 logits' gradient against the fused head's fp32 accumulation (~1 %)
    emit({"what": "fused_head_vs_model_logits", "max_abs_logprob_diff": d_lp, "grad_rel_l2_diff": num / den,
          "mixed_precision": accelerator.mixed_precision, "ok": d_lp < 1e-3 and num / den < 0.05}, ctx)
    del res, g1, g0
    release(accelerator)

    if args.no_alternatives:
        write_out(args)
        return
    # 5. alternatives: one optimizer round on the round-1 batch each, time and peak memory
    variants = [("defaults", {}, True, None), ("model_logits", {}, False, None), ("no_grad_ckpt", {}, True, False),
                ("micro_batch_8", {"micro_batch_size": 8}, True, None), ("micro_batch_16", {"micro_batch_size": 16}, True, None),
                ("micro_batch_16_no_grad_ckpt", {"micro_batch_size": 16}, True, False)]
    for name, over, fuse, gc in variants:
        tcv = tc.model_copy(update=over)
        model, opt = fresh(policy, tcv, accelerator, gc)
        try:
            ppo_update(model, opt, ex, tcv, pad, cfg.seed + 1, accelerator, None, cfg.rollout.sampling.temperature, fuse)  # warm-up
            reset_peak()
            t0 = time.perf_counter()
            ppo_update(model, opt, ex, tcv, pad, cfg.seed + 1, accelerator, None, cfg.rollout.sampling.temperature, fuse)
            sync()
            secs = time.perf_counter() - t0
            emit({"what": "update", "variant": name, "micro_batch_size": tcv.micro_batch_size, "fuse_head": fuse,
                  "gradient_checkpointing": tcv.gradient_checkpointing if gc is None else gc,
                  "seconds": round(secs, 3), "response_tokens_per_s": round(tokens[1] / secs, 1),
                  "peak_gpu_gb": peak_gb()}, ctx)
        except torch.OutOfMemoryError as e:
            emit({"what": "update", "variant": name, "error": f"out of memory: {e}"[:200]}, ctx)
        del model, opt
        release(accelerator)
    write_out(args)


def write_out(args) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "x") as f:
            f.write("".join(json.dumps(x) + "\n" for x in OUT_LINES))


DISTRIBUTED_TIMEOUT_S = 900
"""Seconds one round under ``accelerate launch`` may take before the check reports it hung."""

DISTRIBUTED_LR = 2e-4
"""Learning rate of section 6: large enough that 4 AdamW steps show in the bf16 checkpoints."""


def distributed_check(args, work: Path, policy: Path, ctx: dict, name: str, config_file: str, layout: str) -> None:
    """Section 6: rounds 1 and 2 of the train stage as ``python -m pipeline.stages.train_launch`` under
    ``accelerate launch --config_file <config_file> --num_processes 1`` against the same rounds in
    the plain stage, both in fp32 (``train.mixed_precision=no``, so the two differ only by the
    wrapper's parameter handling and kernels) at ``DISTRIBUTED_LR``. For FSDP that is the
    sharded-parameter path, the model's own logits instead of the fused head, the gathered full
    state dict for the export and FSDP's save_state/load_state between rounds; for DeepSpeed ZeRO-2
    the engine's own backward/step and gradient clipping, ``train_micro_batch_size_per_gpu`` set by
    the trainer and DeepSpeed's checkpoint between rounds. Compared: each run's round-2 update
    (exported checkpoint minus the starting weights), the optimizer steps its state records, and
    its layout (``layout``: the ``distributed_type`` the state must record). Emits one line
    ``{name}_vs_plain`` (or ``{name}`` with the error when a round fails or hangs)."""
    import subprocess

    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.stages.base import round_paths
    from pipeline.stages.train import train_stage

    def overrides(run_id: str) -> list[str]:
        return [f"runs_dir={work / 'runs'}", f"data_dir={work / 'data'}", f"run_id={run_id}", f"rollout.policy={policy}",
                "train.measure_kl_to_start=true", f"train.learning_rate={DISTRIBUTED_LR}", "train.mixed_precision=no",
                "train.keep_states=1"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    cfgs = {run: load_config(None, overrides(f"gpu-{name}-{run}")) for run in ("plain", name)}
    for c in cfgs.values():
        for k in (1, 2):
            write_round(c, k, args.responses, args.group, args.prompt_len, args.response_len, len(tok), tok.eos_token_id)
    secs = {}
    for k in (1, 2):
        t0 = time.perf_counter()
        train_stage(cfgs["plain"], k)
        secs[("plain", k)] = time.perf_counter() - t0
        reset_peak()
        cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", config_file,
               "--num_processes", "1", "-m", "pipeline.stages.train_launch", "--round", str(k), *overrides(f"gpu-{name}-{name}")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DISTRIBUTED_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            emit({"what": name, "round": k, "ok": False, "error": f"no result in {DISTRIBUTED_TIMEOUT_S} s",
                  "stderr_tail": (e.stderr or b"")[-3000:].decode(errors="replace") if isinstance(e.stderr, bytes)
                  else (e.stderr or "")[-3000:]}, ctx)
            return
        secs[(name, k)] = time.perf_counter() - t0
        if done.returncode != 0:
            emit({"what": name, "round": k, "ok": False, "returncode": done.returncode,
                  "stderr_tail": done.stderr[-3000:]}, ctx)
            return
    start = load_weights(policy)
    ck = {run: load_weights(round_paths(c, 2)["checkpoint"]) for run, c in cfgs.items()}
    upd = {run: {n: w[n].double() - start[n].double() for n in start} for run, w in ck.items()}
    num = sum(float((upd[name][n] - upd["plain"][n]).norm() ** 2) for n in start) ** 0.5
    den = sum(float(upd["plain"][n].norm() ** 2) for n in start) ** 0.5
    dot = sum(float((upd[name][n] * upd["plain"][n]).sum()) for n in start)
    nf = sum(float(upd[name][n].norm() ** 2) for n in start) ** 0.5
    same = sum(int((ck[name][n] == ck["plain"][n]).sum()) for n in start) / sum(start[n].numel() for n in start)
    moved = sum(int((ck["plain"][n] != start[n]).sum()) for n in start) / sum(start[n].numel() for n in start)
    mans = {run: storage.read_manifest(round_paths(c, 2)["train_state"]) or {} for run, c in cfgs.items()}
    cosine = dot / (nf * den) if nf > 0 and den > 0 else float("nan")  # nan (not ok) when an update is zero
    rel = num / den if den > 0 else float("nan")
    try:
        import deepspeed

        versions = {"deepspeed": deepspeed.__version__}
    except ImportError:
        versions = {}
    emit({"what": f"{name}_vs_plain", "lr": DISTRIBUTED_LR, "mixed_precision": "no", **versions,
          "layout": {run: (m.get("distributed_type"), m.get("num_processes")) for run, m in mans.items()},
          "optimizer_steps_total": {run: m.get("optimizer_steps_total") for run, m in mans.items()},
          "round2_update_rel_l2_diff": rel, "round2_update_cosine": cosine,
          "checkpoint_elements_equal": same, "checkpoint_elements_moved_plain": moved,
          "seconds": {f"{n}_round{k}": round(v, 1) for (n, k), v in secs.items()},
          "ok": mans[name].get("distributed_type") == layout and mans["plain"].get("distributed_type") == "NO"
          and mans[name].get("optimizer_steps_total") == mans["plain"].get("optimizer_steps_total") > 0
          and cosine > 0.9999 and rel < 0.01},
         ctx)


if __name__ == "__main__":
    main()
