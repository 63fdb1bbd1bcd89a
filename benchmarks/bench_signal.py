"""How well the exact arithmetic check tells the default policy's wrong responses from its right ones.

Samples round 1 of a run of ``configs/default.yaml`` (or ``--config``) with ``--problems`` GSM8K
training problems x the config's group size, grades them and splits them into steps: the real
rollout, verify and segment stages, resumable (a finished stage is skipped when run again). No
critic runs. Then :func:`pipeline.process_signal.measure_round` scores the ``arithmetic`` source
(:mod:`pipeline.core.arithmetic`) against the outcomes:

    .venv/bin/python benchmarks/bench_signal.py --problems 64 --out docs/data/signal-arithmetic.jsonl

Prints one JSON line per scope (all steps; the steps before the one stating the final answer) with
the shares of right and wrong responses with a flagged step, the AUROC of the flagged-token share
against a wrong outcome and its 95 % interval from a bootstrap over prompts, the count of steps that
carry a checkable equation, and the machine and seconds per stage. With ``--out`` it also writes
one line per response (rollout id, prompt, outcome, verify status, finish reason, number of steps,
the flagged steps with the equation that failed) so every flag can be read.
"""

from __future__ import annotations

import argparse
import os
import json
import time


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--problems", type=int, default=64, help="training problems sampled (x the group size)")
    ap.add_argument("--run-id", default=None, help="default: signal-<problems>")
    ap.add_argument("--runs-dir", default="runs/bench_signal")
    ap.add_argument("--out", default=None, help="JSONL of per-response results (and the summary lines)")
    ap.add_argument("--critique", action="store_true",
                    help="also run the critique stage (the config's critic) and score every source: the vote of "
                         "each --variants preset, the arithmetic check and, with --readout, the log-prob readout")
    ap.add_argument("--readout", action="store_true", help="with --critique: critique.logprob_readout=true")
    ap.add_argument("--variants", nargs="+", default=["capo-majority", "capo-average"],
                    help="with --critique: presets whose vote and reward stages run on the round")
    ap.add_argument("--logprob-thresholds", nargs="+", type=float, default=[],
                    help="with --readout: each --variants preset that votes the readout also runs as "
                         "<preset>-t<threshold> with vote.logprob_threshold=<threshold>")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = ap.parse_args(argv)
    if args.out and os.path.exists(args.out):  # evidence already written is never overwritten
        ap.error(f"--out {args.out} exists: give a new path (or delete it first)")
    if args.problems < 1:
        ap.error(f"--problems must be >= 1, got {args.problems}")

    from flows.runner import run_stage
    from pipeline.config import load_config
    from pipeline.core.arithmetic import step_verdict
    from pipeline.process_signal import measure_round
    from pipeline.stages.base import round_paths

    run_id = args.run_id or f"signal-{args.problems}"
    cfg = load_config(args.config, [f"runs_dir={args.runs_dir}", f"run_id={run_id}",
                                    f"data.prompts_per_round={args.problems}", *args.overrides])
    seconds = {}
    for stage in ("rollout", "verify", "segment"):
        t0 = time.perf_counter()
        res = run_stage(stage, cfg, 1)
        seconds[stage] = None if res.skipped else round(time.perf_counter() - t0, 1)
    p = round_paths(cfg, 1)
    from pipeline.precision import detect

    dev = detect()
    env = {"cpu_model": dev.cpu_model, "torch_cpu_capability": dev.torch_cpu_capability, "policy": cfg.rollout.policy,
           "max_tokens": cfg.rollout.sampling.max_tokens, "group_size": cfg.rollout.group_size,
           "problems": args.problems, "seconds": seconds, "run_dir": str(cfg.run_dir())}
    if not args.critique:
        rows = [{**r, **env} for r in measure_round(p["round_dir"], n_boot=2000, seed=0)
                if r["source"] == "arithmetic"]
    else:
        rows = _critique_and_vote(args, cfg, p, env, run_stage, load_config)
    for r in rows:
        print(json.dumps(r))
    if args.out:
        import pyarrow.parquet as pq

        outc = {r["rollout_id"]: r for r in pq.read_table(p["outcomes"]).to_pylist()}
        ro = {r["rollout_id"]: r for r in pq.read_table(p["rollouts"], columns=["rollout_id", "finish_reason"]).to_pylist()}
        steps: dict[str, list] = {}
        for s in pq.read_table(p["steps"], columns=["rollout_id", "step_idx", "step_text"]).to_pylist():
            steps.setdefault(s["rollout_id"], []).append(s)
        per_step: dict[str, dict] = {}  # with --critique: the LLM vote (per variant's rule) and the readout per step
        for vdir in sorted((p["round_dir"] / "variants").glob("*")) if args.critique else []:
            sv = pq.read_table(vdir / "step_verdicts.parquet").to_pylist()
            for v in sv:
                d = per_step.setdefault(v["rollout_id"], {})
                if v["rule"] == vdir.name.removeprefix("capo-"):
                    d.setdefault(f"llm_{v['rule']}", {})[v["step_idx"]] = v["llm_weight"]
                d.setdefault("logprob", {})[v["step_idx"]] = v["logprob_score"]
        with open(args.out, "x") as f:
            for r in rows:
                f.write(json.dumps({"kind": "summary", **r}) + "\n")
            for rid in sorted(outc):
                ss = sorted(steps.get(rid, []), key=lambda s: s["step_idx"])
                flags = []
                for s in ss:
                    bad, why = step_verdict(s["step_text"] or "")
                    if bad:
                        flags.append({"step": s["step_idx"], "reason": why})
                o = outc[rid]
                f.write(json.dumps({"kind": "response", "rollout_id": rid, "prompt_id": o["prompt_id"],
                                    "correct": o["outcome_correct"], "verify_status": o["verify_status"],
                                    "extracted_answer": o["extracted_answer"], "gold_answer": o["gold_answer"],
                                    "finish_reason": ro[rid]["finish_reason"], "n_steps": len(ss),
                                    "flagged": flags,
                                    **{k: [v.get(i) for i in range(len(ss))] for k, v in per_step.get(rid, {}).items()}})
                        + "\n")
    return rows


def _critique_and_vote(args, cfg, p, env, run_stage, load_config) -> list[dict]:
    """Critique the round (the sampled critiques are kept when only the checkers are new), vote and
    reward it under each preset, and measure every source of every variant."""
    from pipeline import storage
    from pipeline.process_signal import measure_round

    before = storage.read_manifest(p["critiques"]) or {}
    llm_engine = before.get("engine")  # the sampled critiques' cost, from the run that made them
    extra = ["critique.logprob_readout=true"] if args.readout else []
    base = [f"runs_dir={args.runs_dir}", f"run_id={cfg.run_id}", f"data.prompts_per_round={args.problems}",
            *args.overrides, *extra]
    t0 = time.perf_counter()
    run_stage("critique", load_config(args.config, base), 1)
    env["seconds"]["critique"] = round(time.perf_counter() - t0, 1)
    man = storage.read_manifest(p["critiques"])
    llm_engine = man.get("engine") or llm_engine
    readout = man.get("readout")
    n = env["problems"] * cfg.rollout.group_size
    env["critic"] = {"model": cfg.critique.critic, "num_critiques": cfg.critique.num_critiques,
                     "template": cfg.critique.template,
                     "sampled_seconds_per_response": round(llm_engine["seconds"] / n, 2) if llm_engine else None,
                     "readout_seconds_per_response": round(readout["readout_seconds"] / n, 2) if readout else None,
                     "readout_load_seconds": round(readout["load_seconds"], 1) if readout else None}
    for preset in args.variants:
        vcfg = load_config(args.config, base, preset=preset)
        runs = [vcfg]
        if "logprob" in vcfg.vote.sources:
            runs += [load_config(args.config, [*base, f"variant={preset}-t{t:g}", f"vote.logprob_threshold={t}"],
                                 preset=preset) for t in args.logprob_thresholds]
        for c in runs:
            for stage in ("vote", "reward"):
                run_stage(stage, c, 1)
    return [{**r, **env} for r in measure_round(p["round_dir"], n_boot=2000, seed=0)]


if __name__ == "__main__":
    main()
