"""Reference-guided critique against the plain critique, on the same rollouts.

Copies round 1's rollouts, outcomes and steps of a finished run (``--source-run``, e.g. one made by
``benchmarks/bench_signal.py``) into a new run, critiques them there with the problem's reference
solution in the critic prompt (``critique.include_reference=true``, N = ``--n``), and scores both
arms on the same responses with the first N critiques of each (the source run's sampled critiques
must number at least N): per voting rule and scope, the shares of right and wrong responses with a
penalized step and the AUROC of the penalized-token share against a wrong outcome with a 95 %
interval from a bootstrap over prompts (:mod:`pipeline.process_signal`), and the critic seconds per
response of each arm::

    .venv/bin/python benchmarks/bench_reference.py --source-run runs/bench_signal/signal-56 \\
        --config runs/bench_signal/signal-56/round_001/.config-<hash>.yaml --n 2 --out docs/data/x.jsonl

Prints one JSON line per arm x rule x scope. Resumable: the critique stage keeps its committed shards.
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import time
from pathlib import Path


def _copy_round(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("rollouts", "outcomes", "steps"):
        for f in (src / f"{name}.parquet", src / f"{name}.parquet.manifest.json"):
            if not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)


def score_arm(round_dir: Path, n: int, rules: tuple[str, ...], n_boot: int = 2000) -> list[dict]:
    """Vote the first ``n`` LLM critiques of every response under each rule and score the result."""
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.core.critique import critique_votes
    from pipeline.core.voting import flag_counts, vote
    from pipeline.process_signal import auroc_interval, final_answer_step, penalty_share

    out = {r["rollout_id"]: r for r in pq.read_table(round_dir / "outcomes.parquet").to_pylist()}
    steps: dict[str, list] = {}
    for s in pq.read_table(round_dir / "steps.parquet").to_pylist():
        steps.setdefault(s["rollout_id"], []).append(s)
    crit: dict[str, list] = {}
    for c in pq.read_table(round_dir / "critiques.parquet").to_pylist():
        if c.get("source", "llm") == "llm" and c["critique_idx"] < n:
            crit.setdefault(c["rollout_id"], []).append(critique_votes(c["parse_status"], c["wrong_steps"],
                                                                       c["steps_wrong_lines"], "list"))
    rids = sorted(out)
    rows = []
    for rule in rules:
        for scope in ("all_steps", "before_answer"):
            scores, pen = [], []
            for rid in rids:
                ss = sorted(steps[rid], key=lambda s: s["step_idx"])
                n_valid, n_flagged = flag_counts(crit.get(rid, []), len(ss))
                w = vote(n_flagged, np.int32(n_valid), rule).tolist()
                k = len(ss) if scope == "all_steps" else final_answer_step([s["step_text"] or "" for s in ss])
                toks = [s["token_end"] - s["token_start"] for s in ss]
                scores.append(penalty_share(w[:k], toks[:k]))
                pen.append(any(x > 0 for x in w[:k]))
            wrong = [not out[r]["outcome_correct"] for r in rids]
            auc, lo, hi = auroc_interval(scores, wrong, n_boot=n_boot, seed=0, groups=[out[r]["prompt_id"] for r in rids])
            n_w = sum(wrong)
            rows.append({"rule": rule, "scope": scope, "n_critiques": n, "n_responses": len(rids), "n_wrong": n_w,
                         "right_penalized": sum(p and not w_ for p, w_ in zip(pen, wrong)) / (len(rids) - n_w),
                         "wrong_penalized": sum(p and w_ for p, w_ in zip(pen, wrong)) / n_w,
                         "auroc": auc, "auroc_low": lo, "auroc_high": hi})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-run", required=True, help="a run folder whose round 1 has critiques")
    ap.add_argument("--config", required=True, help="the source run's resolved config (round_001/.config-*.yaml)")
    ap.add_argument("--n", type=int, default=2, help="critiques per response in both arms")
    ap.add_argument("--rules", nargs="+", default=["majority", "union"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.out and os.path.exists(args.out):  # evidence already written is never overwritten
        ap.error(f"--out {args.out} exists: give a new path (or delete it first)")

    from flows.runner import run_stage
    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.precision import detect

    src = Path(args.source_run)
    base = load_config(args.config)
    if base.critique.num_critiques < args.n:
        ap.error(f"--n {args.n} needs at least {args.n} critiques per response in {src}; it has "
                 f"{base.critique.num_critiques}")
    run_id = f"{src.name}-ref"
    cfg = load_config(args.config, [f"run_id={run_id}", f"runs_dir={src.parent}", "critique.include_reference=true",
                                    f"critique.num_critiques={args.n}"])
    _copy_round(src / "round_001", cfg.round_dir(1))
    t0 = time.perf_counter()
    run_stage("critique", cfg, 1)
    wall = round(time.perf_counter() - t0, 1)
    dev = detect()
    rows = []
    for arm, rd in (("plain", src / "round_001"), ("reference", cfg.round_dir(1))):
        man = storage.read_manifest(rd / "critiques.parquet") or {}
        eng = man.get("engine") or {}
        for r in score_arm(rd, args.n, tuple(args.rules)):
            per_critique = (eng.get("seconds") / (r["n_responses"] * base.critique.num_critiques if arm == "plain"
                                                  else r["n_responses"] * args.n)) if eng.get("seconds") else None
            rows.append({"arm": arm, **r, "critic": base.critique.critic, "template": base.critique.template,
                         "critic_seconds_per_critique": round(per_critique, 2) if per_critique else None,
                         "critique_wall_s": wall if arm == "reference" else None,
                         "cpu_model": dev.cpu_model, "torch_cpu_capability": dev.torch_cpu_capability})
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "x") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
