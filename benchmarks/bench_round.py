"""Benchmark 5: a whole finished round -- where the wall time and memory went, and resume time.

Reads what a finished round recorded (nothing is re-run for this part):

  * ``variants/<variant>/round_summary.json`` (written by ``capo round`` and the ``capo-round``
    flow): per stage skipped/ran, ``seconds`` (the stage's own compute, measured inside it),
    ``peak_rss_mb`` (heavy stages: their child process's peak resident memory), and the round's
    ``wall_seconds``;
  * every committed manifest of the round (``**/*.manifest.json``, ``superseded/`` and shard parts
    left out, plus ``round_000/eval.parquet`` for round 1): stage and ``elapsed_s``.

and prints one JSON line per stage and one with the split of the wall time: generation (rollout,
critique, eval), training (train), scoring (verify, segment, vote, reward: the method's light
stages), and *outside* = wall - sum of stage seconds (child process start-up and imports, key
checks, table writes, round summary: orchestration and storage). The goal counts both scoring
and outside as "outside generation and training".

Then it times ``capo round --round K`` through the CLI (a subprocess, best of ``--repeats``) on
the finished round with every stage skipped. By default on a copy of the runs directory made of
hard links (instant, no bytes copied; stage outputs are replaced by rename, never written in
place), so the real round keeps its ``round_summary.json`` (``capo round`` rewrites it) and the
real catalog is untouched; ``--in-place`` times the real directory. Before timing, every stage is
checked current in-process (``flows.runner.check_current``): a stage that would run aborts the
timing instead of starting a model. When the code or config gained a field since the round ran,
its outputs are stale under today's keys; ``--rekey-stale`` then re-commits those manifests under
today's key in the copy only (the outputs are not touched), so the all-skipped path can be timed.

    .venv/bin/python benchmarks/bench_round.py --runs-dir runs --run default --round 1
    .venv/bin/python benchmarks/bench_round.py --run majority --round 1 --preset capo-majority
    .venv/bin/python benchmarks/bench_round.py --run tiny --config configs/tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATION, TRAINING, SCORING = ("rollout", "critique", "eval"), ("train",), ("verify", "segment", "vote", "reward")


def manifests(round_dir: Path, variant: str) -> list[dict]:
    """Committed manifests of the round (and of round 0's eval for round 1), variant dirs limited to ``variant``."""
    out = []
    paths = sorted(round_dir.rglob("*.manifest.json"))
    r0 = round_dir.parent / "round_000" / "eval.parquet.manifest.json"
    if round_dir.name == "round_001" and r0.exists():
        paths.append(r0)
    for p in paths:
        rel = p.relative_to(round_dir.parent)
        if "superseded" in rel.parts or any(x.endswith(".parts") for x in rel.parts):
            continue
        if "variants" in rel.parts and rel.parts[rel.parts.index("variants") + 1] != variant:
            continue
        m = json.loads(p.read_text())
        out.append({"table": str(rel).removesuffix(".manifest.json"), "stage": m.get("stage"),
                    "elapsed_s": m.get("elapsed_s"), "rows": m.get("rows"), "created_at": m.get("created_at")})
    return out


def summary_from_manifests(mans: list[dict]) -> dict:
    """A stand-in for ``round_summary.json``: stage seconds from manifests (one per stage: train
    commits two tables), wall from the first stage's start to the last commit."""
    from datetime import datetime

    stages, spans = {}, []
    for m in mans:
        if m["stage"] and m["elapsed_s"] is not None and m["created_at"]:
            stages[(m["stage"], m["table"].split("/")[0])] = max(stages.get((m["stage"], m["table"].split("/")[0]), 0.0), m["elapsed_s"])
            end = datetime.fromisoformat(m["created_at"]).timestamp()
            spans += [end - m["elapsed_s"], end]
    return {"stages": [{"stage": st, "seconds": s} for (st, _), s in stages.items()],
            "wall_seconds": round(max(spans) - min(spans), 3)}


def split_wall(summary: dict) -> dict:
    """Wall seconds per group and the share outside generation and training."""
    ran = [s for s in summary["stages"] if not s.get("skipped")]
    sec = {g: round(sum(s["seconds"] for s in ran if s["stage"] in names), 3)
           for g, names in (("generation", GENERATION), ("training", TRAINING), ("scoring", SCORING))}
    wall = summary.get("wall_seconds") or summary.get("stage_seconds")
    sec["outside_stages"] = round(wall - sum(sec.values()), 3)
    return {"wall_seconds": wall, **{f"{k}_s": v for k, v in sec.items()},
            "share_outside_gen_train": round((sec["scoring"] + sec["outside_stages"]) / wall, 4),
            "share_outside_stages": round(sec["outside_stages"] / wall, 4),
            "goal": 0.05, "goal_met": (sec["scoring"] + sec["outside_stages"]) / wall < 0.05}


def link_copy(src: Path, dst: Path) -> None:
    """A copy of ``src`` made of hard links (mtimes preserved: stage outputs stay current)."""
    shutil.copytree(src, dst, copy_function=os.link, symlinks=True)


def cfg_for(config: str, runs_dir: Path, data_dir: Path, overrides: list[str], preset: str | None = None):
    from pipeline.config import load_config

    return load_config(config, [f"runs_dir={runs_dir}", f"data_dir={data_dir}", *overrides], preset)


def not_current(cfg, round_idx: int) -> list[str]:
    """Stages of the round (and its evals) that ``capo round`` would run, with the reason."""
    from flows.runner import check_current, not_applicable
    from pipeline.stages import round_plan

    todo = []
    for name, k in round_plan(round_idx):
        if not_applicable(name, cfg):
            continue
        cur = check_current(name, cfg, k)
        if not cur.current:
            todo.append(f"{name}@{k}: {cur.reason}")
    return todo


def rekey(cfg, round_idx: int, todo: list[str]) -> list[str]:
    """In a COPY only: re-commit the manifests of stages whose output exists but was produced under an
    older key (e.g. a config field added since) under today's key, so the resume path can be timed."""
    from pipeline import storage
    from pipeline.stages import get_stage, stage_key
    from pipeline.stages.base import round_paths

    done = []
    for item in todo:
        name, k = item.split(":", 1)[0].split("@")
        k = int(k)
        if "produced under another key" not in item:
            continue
        paths = [round_paths(cfg, k)[out] for out in get_stage(name).outputs]
        key = stage_key(name, cfg, k)
        for path in paths:
            mp = storage.manifest_path(path)
            man = json.loads(mp.read_text())
            man.update(key=key, key_hash=storage.key_hash(key))
            tmp = mp.with_suffix(".tmp")
            tmp.write_text(json.dumps(man, indent=1, default=str))
            os.replace(tmp, mp)  # a new inode: the hard-linked original is untouched
        done.append(item)
    return done


def time_resume(a, runs_dir: Path, data_dir: Path, may_rekey: bool = False) -> dict:
    cfg = cfg_for(a.config, runs_dir, data_dir, a.overrides, a.preset)
    todo = not_current(cfg, a.round)
    rekeyed = rekey(cfg, a.round, todo) if (todo and may_rekey and a.rekey_stale) else []
    if rekeyed:
        todo = not_current(cfg, a.round)
    if todo:
        return {"resume_timed": False, "would_run": todo, "rekeyed_in_copy": rekeyed}
    capo = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "capo")
    cmd = [capo, "round", "--round", str(a.round), "--config", a.config, *(["--preset", a.preset] if a.preset else []),
           f"runs_dir={runs_dir}", f"data_dir={data_dir}", *a.overrides]
    best, out = float("inf"), ""
    for _ in range(a.repeats):  # best of N: the machine is shared and noisy
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        secs = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        best, out = min(best, secs), proc.stderr
        print(f"resume: {secs:.2f}s (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    # an all-skipped round keeps the real run's round_summary.json and writes round_summary.resume.json
    vdir = runs_dir / cfg.run_id / f"round_{a.round:03d}" / "variants" / cfg.variant
    resumed = vdir / "round_summary.resume.json"
    summary = json.loads((resumed if resumed.exists() else vdir / "round_summary.json").read_text())
    ran = [s["stage"] for s in summary["stages"] if not s["skipped"]]
    return {"resume_timed": True, "rekeyed_in_copy": rekeyed, "resume_seconds": round(best, 3), "resume_stages_ran": ran,
            "resume_summary_wall_seconds": summary["wall_seconds"], "goal": 15.0, "goal_met": best < 15.0 and not ran,
            "command": " ".join(["capo", *cmd[1:]]), "skip_lines": sum("skipped" in line for line in out.splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs-dir", default=str(ROOT / "runs"))
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    ap.add_argument("--run", default="default")
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--variant", default=None, help="the variant whose round_summary.json to read (default: the "
                    "config's, with --preset and the overrides)")
    ap.add_argument("--config", default="configs/default.yaml", help="the config the round was run with")
    ap.add_argument("--preset", default=None, help="the preset the round was run with (capo round --preset)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-place", action="store_true", help="time the resume in the real runs dir (rewrites "
                                                            "its round_summary.json and catalog)")
    ap.add_argument("--rekey-stale", action="store_true", help="in the copy only: re-commit stage outputs made "
                    "under an older key (code/config changed since the round) under today's key before timing")
    ap.add_argument("--no-resume", action="store_true", help="only read what the round recorded")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as given to the round")
    a = ap.parse_args()
    runs_dir, data_dir = Path(a.runs_dir).resolve(), Path(a.data_dir).resolve()
    if not any(o.startswith("run_id=") for o in a.overrides):  # the round timed is --run's, not the config's run_id
        a.overrides = [f"run_id={a.run}", *a.overrides]
    a.variant = a.variant or cfg_for(a.config, runs_dir, data_dir, a.overrides, a.preset).variant
    round_dir = runs_dir / a.run / f"round_{a.round:03d}"
    from pipeline.precision import bench_context

    env = {**bench_context(), "machine": platform.machine(), "cpus": os.cpu_count(), "run": a.run, "round": a.round, "variant": a.variant}

    summary_path = round_dir / "variants" / a.variant / "round_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    mans = manifests(round_dir, a.variant)
    for m in mans:
        print(json.dumps({"bench": "round", "source": "manifest", **m, **env}))
    if summary is None:
        print(json.dumps({"bench": "round", "round_summary": None, "note": f"{summary_path} missing (the round was not "
                          "run by `capo round` or the flow): wall = first stage start to last commit, from manifests",
                          **split_wall(summary_from_manifests(mans)), **env}))
    else:
        for s in summary["stages"]:
            print(json.dumps({"bench": "round", "source": "round_summary", "stage": s["stage"], "skipped": s["skipped"],
                              "seconds": round(s.get("seconds", 0.0), 3), "peak_rss_mb": s.get("peak_rss_mb"),
                              "rows": s.get("rows"), **env}))
        print(json.dumps({"bench": "round", "finished_at": summary.get("finished_at"), "critic_calls": summary.get("critic_calls"),
                          **split_wall(summary), **env}))
    if a.no_resume:
        return
    if a.in_place:
        print(json.dumps({"bench": "round", "mode": "in-place", **time_resume(a, runs_dir, data_dir), **env}))
        return
    with tempfile.TemporaryDirectory(dir=runs_dir.parent, prefix=".bench-round-") as tmp:
        copy = Path(tmp) / "runs"
        link_copy(runs_dir, copy)
        print(json.dumps({"bench": "round", "mode": "hard-link copy", **time_resume(a, copy, data_dir, may_rekey=True), **env}))


if __name__ == "__main__":
    main()
