"""What each credit-assignment method costs per round, on the same cached responses.

Takes one finished round (``--source RUN_DIR --round K``: its rollouts, outcomes and steps, and the
critiques CAPO needs) and, for each arm of ``--arms``, runs the stages that arm adds to the shared
rollout -> verify -> segment prefix, through the same stage runner as ``capo round``:

    grpo         reward, train
    capo         critique, vote, reward, train      (the source's critic settings; critique re-run)
    grpo-lambda  reward, train                      (the traced ratio is in the loss)
    fipo         reward, train                      (the future-KL weights are in the loss)
    vineppo      mc, reward, train                  (K continuations from each step's end)
    densr        densr, reward, train               (one forward pass of the policy per response)

Each arm is a run of its own under ``--runs-dir`` (``rivals-<arm>``) whose round holds hard links
to the source's tables, so the source is never written. Every stage the arm runs is forced and
timed; heavy stages run in a child process whose peak resident memory is measured. The checkpoint
and training state an arm's train stage writes are deleted once measured (several GB each). One JSON line
per arm and stage, then one per arm with its total and its extra seconds against GRPO and CAPO,
and the machine. Resumable: the lines already in ``--out`` are kept and their (arm, stage) pairs
not run again (``--fresh`` starts over). ``--no-train`` leaves the train stage out, and
``--train-arms`` measures it for some arms only: the train stage makes the same forward and backward
passes over the same tokens for every arm but grpo-lambda and fipo, whose losses differ (vineppo and
densr train with CAPO's token-level loss). The verdict lines give each arm's extra seconds against
GRPO and CAPO: the stages it adds, its reward stage, and its train stage where both were measured.

    .venv/bin/python benchmarks/bench_rivals.py --source runs/bench_learning/learn-capo-s0-175a5b96 \
        --round 1 --out docs/data/rivals-cost-default.jsonl

Run it alone: a second model-heavy job on the machine changes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARM_STAGES = {
    "grpo": ("reward", "train"),
    "capo": ("critique", "vote", "reward", "train"),
    "grpo-lambda": ("reward", "train"),
    "fipo": ("reward", "train"),
    "vineppo": ("mc", "reward", "train"),
    "densr": ("densr", "reward", "train"),
}
SHARED = ("rollouts", "outcomes", "steps")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="a finished run's folder (its round --round is reused)")
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=list(ARM_STAGES), choices=list(ARM_STAGES))
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_rivals"))
    ap.add_argument("--out", default=None, help="JSON-lines file the results go to (and are resumed from)")
    ap.add_argument("--no-train", action="store_true", help="leave the train stage out")
    ap.add_argument("--train-arms", nargs="*", default=None, help="the arms whose train stage is measured "
                    "(default: all); the others share GRPO's or CAPO's loss on the same tokens")
    ap.add_argument("--fresh", action="store_true", help="forget the lines already in --out")
    return ap


def source_config(source: Path, round_idx: int) -> dict:
    """The resolved config the source round's variant ran under (from its token_rewards manifest).

    Raises:
        FileNotFoundError: the round has no committed token rewards (it did not finish its reward stage).
    """
    found = sorted((source / f"round_{round_idx:03d}" / "variants").glob("*/token_rewards.parquet.manifest.json"))
    if not found:
        raise FileNotFoundError(f"{source}/round_{round_idx:03d} has no variants/*/token_rewards manifest: "
                                "give a run whose round finished its reward stage")
    return json.loads(found[0].read_text())["resolved_config"]


def arm_config(resolved: dict, arm: str, runs_dir: Path):
    """The source's settings with ``arm``'s preset on top (CAPO: the source's own), in a run of its own."""
    import yaml

    from pipeline.config import load_config

    base = {k: v for k, v in resolved.items() if k not in ("run_id", "runs_dir", "variant")}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(base, f)
    try:
        return load_config(f.name, [f"runs_dir={runs_dir}", f"run_id=rivals-{arm}", f"variant={arm}"],
                           preset=None if arm == "capo" else arm)
    finally:
        os.unlink(f.name)


def link_round(source: Path, cfg, round_idx: int, arm: str) -> None:
    """Hard links of the source round's shared tables (and CAPO's critiques) into ``cfg``'s run."""
    from pipeline.stages.base import round_paths

    if round_idx != 1:  # round k's policy is the source's round k-1 checkpoint, which the arms would not share
        raise ValueError(f"--round {round_idx}: only round 1 is supported (its policy, the starting one, is every arm's)")
    src, dst = source / f"round_{round_idx:03d}", round_paths(cfg, round_idx)["round_dir"]
    dst.mkdir(parents=True, exist_ok=True)
    names = [*SHARED, "critiques"] if arm == "capo" else list(SHARED)
    for name in names:
        for suffix in ("", ".manifest.json"):
            s, d = src / f"{name}.parquet{suffix}", dst / f"{name}.parquet{suffix}"
            if not s.exists():
                raise FileNotFoundError(f"{s} is missing: the source round lacks the {name} table")
            if not d.exists():
                os.link(s, d)


def main() -> None:
    a = parser().parse_args()
    from flows.runner import run_stage
    from pipeline.precision import bench_context
    from pipeline.stages.base import round_paths

    source, runs_dir = Path(a.source).resolve(), Path(a.runs_dir).resolve()
    resolved = source_config(source, a.round)
    import pyarrow.parquet as pq

    n_rollouts = pq.read_metadata(source / f"round_{a.round:03d}" / "rollouts.parquet").num_rows
    env = {**bench_context(), "machine": platform.machine(), "cpus": os.cpu_count(), "source": source.name,
           "round": a.round, "rollouts": n_rollouts}
    out = Path(a.out) if a.out else None
    lines = [] if (a.fresh or out is None or not out.exists()) else [json.loads(x) for x in out.read_text().splitlines() if x]
    lines = [x for x in lines if x.get("stage")]  # the measurements; the totals are made again below
    done = {(x["arm"], x["stage"]) for x in lines if x.get("stage")}

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        lines.append(rec)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
            os.replace(tmp, out)

    for arm in a.arms:
        cfg = arm_config(resolved, arm, runs_dir)
        link_round(source, cfg, a.round, arm)
        for stage in ARM_STAGES[arm]:
            skip_train = a.no_train or (a.train_arms is not None and arm not in a.train_arms)
            if (stage == "train" and skip_train) or (arm, stage) in done:
                continue
            res = run_stage(stage, cfg, a.round, force=True)
            if res.skipped:
                raise RuntimeError(f"{arm}: stage {stage} was skipped ({res.reason}); the arm's config does not run it")
            emit({"bench": "rivals", "arm": arm, "stage": stage, "seconds": round(res.seconds, 2),
                  "peak_rss_mb": res.peak_rss_mb, "rows": res.rows, **env})
            if stage == "train":  # the arm's checkpoint and training state (GBs each) are not the measurement
                p = round_paths(cfg, a.round)
                for path in (p["checkpoint"], p["train_state"]):
                    shutil.rmtree(path, ignore_errors=True)
    for arm in a.arms:  # totals, from every line measured for the arm (this run's and earlier ones)
        st = {x["stage"]: x for x in lines if x.get("arm") == arm and x.get("stage")}
        own = {s: x for s, x in st.items() if s not in ("reward", "train")}
        rss = [x["peak_rss_mb"] for x in own.values() if x["peak_rss_mb"] is not None]
        emit({"bench": "rivals", "arm": arm, "summary": True, "stages": sorted(st),
              "own_stages_s": round(sum(x["seconds"] for x in own.values()), 2),
              "own_stages_peak_rss_mb": max(rss) if rss else None,
              "reward_s": st["reward"]["seconds"] if "reward" in st else None,
              "train_s": st["train"]["seconds"] if "train" in st else None,
              "train_peak_rss_mb": st["train"]["peak_rss_mb"] if "train" in st else None, **env})
    totals = {x["arm"]: x for x in lines if x.get("summary")}
    for arm in a.arms:
        t = totals[arm]
        for base in ("grpo", "capo"):
            row = {"bench": "rivals", "arm": arm, "verdict": f"extra_vs_{base}"}
            b = totals.get(base)
            if b is None or t["reward_s"] is None or b["reward_s"] is None:
                emit({**row, "extra_s": "not run", **env})
                continue
            # the stages an arm adds, its reward stage, and its train stage where both were measured
            extra = t["own_stages_s"] - b["own_stages_s"] + t["reward_s"] - b["reward_s"]
            both = t["train_s"] is not None and b["train_s"] is not None
            if both:
                extra += t["train_s"] - b["train_s"]
            emit({**row, "extra_s": round(extra, 2), "train_compared": both, **env})


if __name__ == "__main__":
    main()
