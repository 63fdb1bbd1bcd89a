"""Benchmark 6: does a run learn? GRPO-rule vs CAPO vs a no-update control, K on-policy rounds, several seeds.

1. **Training items with signal.** The starting policy samples ``--select-k`` responses for each of
   ``--select-n`` GSM8K train problems (a seeded subset); the problems it solves in
   ``[--pass-lo, --pass-hi]`` of its samples become the training set (a JSONL file under
   ``data/prompts/``, ingested by the rollout stage like any local prompt file). A group in which
   every response is right or every one wrong gives GRPO no advantage; these do.
2. **Arms.** ``grpo`` (preset ``grpo``: rule outcome, no critic), ``capo`` (the default critic, N and
   voting rule), ``control`` (the CAPO config with ``train.learning_rate=0``: every stage runs, no
   weight moves; its evals of an unchanged policy are the eval's noise floor). Each arm x seed is
   one run (``<runs-dir>/learn-<arm>-s<seed>``), run round by round through the same stage
   runner as ``capo run`` (so it resumes from its tables when stopped and started again).
3. **Held-out eval** on ``--eval-size`` GSM8K *test* problems (never the training ones), greedy, at
   rounds ``0, K//2, K`` (``--eval-every 1``: every round). Round 0 is computed once and copied
   into every run (same policy, items, engine: same key).
4. **Per round** (JSON lines): mean training outcome reward (the round's rollouts), held-out
   accuracy where evaluated, KL to the starting policy (``kl_ref`` of the round's first step, k3,
   ``train.measure_kl_to_start``), policy entropy and clip fraction (train metrics), and for CAPO
   the share of steps its voting rule flagged.
5. **Final table**: each arm's held-out accuracy at round K (mean and spread = max - min over
   seeds), its gain over the control and whether that gain exceeds twice the spreads, and whether
   CAPO beat GRPO. A plot ``learning.png`` in the runs dir.

    .venv/bin/python benchmarks/bench_learning.py                      # the full benchmark
    .venv/bin/python benchmarks/bench_learning.py --rounds 2 --seeds 0 --eval-size 50   # a smaller look

Cost: every round of every arm is a real round (rollouts, verification, for CAPO the critic, PPO
update); the CAPO arm costs what its critic costs. ``--critic`` picks a smaller critic.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = ("grpo", "capo", "control")
log = logging.getLogger("capo.bench_learning")


def base_overrides(a: argparse.Namespace, seed: int) -> list[str]:
    return [f"runs_dir={a.runs_dir}", f"data_dir={a.data_dir}", f"seed={seed}",
            f"data.prompts_per_round={a.prompts_per_round}", f"rollout.group_size={a.group}",
            f"rollout.policy={a.policy}", f"critique.critic={a.critic}", f"critique.num_critiques={a.n}",
            f"train.learning_rate={a.lr}", f"train.num_mini_batches={a.mini_batches}",
            "train.measure_kl_to_start=true", "eval.benchmarks=[gsm8k]", f"eval.sample_size={a.eval_size}",
            f"eval.max_tokens={a.eval_max_tokens}"]


def arm_config(a: argparse.Namespace, arm: str, seed: int, train_file: Path):
    from pipeline.config import load_config

    over = base_overrides(a, seed) + [f"run_id=learn-{arm}-s{seed}", f"data.train_prompts={train_file}",
                                      f"variant={arm}"]
    if arm == "control":
        over.append("train.learning_rate=0")
    return load_config(ROOT / "configs" / "default.yaml", over, preset="grpo" if arm == "grpo" else None)


# ------------------------------------------------------------------------------------- selection
def select_training_items(a: argparse.Namespace) -> Path:
    """The training problems the starting policy solves in [pass_lo, pass_hi] of its samples (cached)."""
    import pyarrow.parquet as pq

    from pipeline.config import load_config
    from pipeline.engines import make_engine
    from pipeline.evaluate import grade
    from pipeline.stage_generate import policy_messages
    from pipeline.stages import prompts_path, resolve_model

    cfg = load_config(ROOT / "configs" / "default.yaml", base_overrides(a, 0))
    tag = f"n{a.select_n}-k{a.select_k}-lo{a.pass_lo}-hi{a.pass_hi}-{Path(a.policy).name}"
    out = Path(a.data_dir).resolve() / "prompts" / f"learning-{tag}.jsonl"
    if out.exists():
        return out
    table = pq.read_table(prompts_path(cfg)).to_pylist()
    idx = np.random.default_rng(1234).permutation(len(table))[: a.select_n]
    items = [table[i] for i in idx]
    engine = make_engine(resolve_model(a.policy, cfg), cfg.rollout.engine, seed=0)
    t0 = time.perf_counter()
    gens = engine.generate([policy_messages(r["question"], cfg.instruction()) for r in items], a.select_k,
                           cfg.rollout.sampling)
    engine.close()
    graded = grade([(r["gold_answer"], s.text) for r, g in zip(items, gens) for s in g.samples])
    rates = np.asarray([c for _, c, _ in graded], dtype=float).reshape(len(items), a.select_k).mean(1)
    keep = [r for r, p in zip(items, rates) if a.pass_lo <= p <= a.pass_hi]
    if not keep:
        raise RuntimeError(f"none of {len(items)} problems has a pass rate in [{a.pass_lo}, {a.pass_hi}]; "
                           f"pass-rate histogram {np.histogram(rates, bins=a.select_k + 1, range=(0, 1))[0].tolist()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"question": r["question"], "gold_answer": r["gold_answer"],
                                       "solution": r.get("gold_solution"), "origin": r["prompt_id"]}) + "\n" for r in keep))
    tmp.replace(out)
    print(json.dumps({"bench": "learning", "selection": str(out), "candidates": len(items), "kept": len(keep),
                      "pass_rate_histogram": np.histogram(rates, bins=a.select_k + 1, range=(0, 1))[0].tolist(),
                      "mean_pass_rate_kept": float(np.mean([p for p in rates if a.pass_lo <= p <= a.pass_hi])),
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return out


def selection_in_child(a: argparse.Namespace) -> Path:
    """:func:`select_training_items` in a child process (vLLM's memory and threads end with it; the
    child gets the environment the pipeline gives its generation stages). Returns the JSONL path."""
    import subprocess

    from pipeline.engines import engine_process_env

    env = {**__import__("os").environ, **engine_process_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--select-only"], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT, check=True, env=env).stdout
    path = None
    for line in out.splitlines():
        if line.startswith("{"):
            print(line, flush=True)
            path = json.loads(line).get("selection_file", path)
    if path is None:
        raise RuntimeError("the selection child printed no selection_file line")
    return Path(path)


# ------------------------------------------------------------------------------------------ runs
def eval_rounds(a: argparse.Namespace) -> set[int]:
    K = a.rounds
    return set(range(K + 1)) if a.eval_every == 1 else {0, K // 2, K}


def run_arm(a: argparse.Namespace, arm: str, seed: int, train_file: Path, round0_from: Path | None) -> None:
    """Rounds 1..K of one arm (each stage skipped when current), eval at the scheduled rounds."""
    from flows.runner import run_stage
    from pipeline.stages import STAGES, round_paths

    cfg = arm_config(a, arm, seed, train_file)
    r0 = round_paths(cfg, 0)["eval"]
    if round0_from is not None and not r0.exists():  # the starting policy's eval: computed once
        from pipeline.storage import manifest_path

        r0.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(round0_from, r0)
        shutil.copy2(manifest_path(round0_from), manifest_path(r0))
    if 0 in eval_rounds(a):
        run_stage("eval", cfg, 0)
    for k in range(1, a.rounds + 1):
        for name in STAGES:
            res = run_stage(name, cfg, k)
            if not res.skipped:
                log.info("%s s%d round %d %s: %.1fs", arm, seed, k, name, res.seconds)
        if k in eval_rounds(a):
            run_stage("eval", cfg, k)


def round_metrics(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> list[dict]:
    """One dict per round 0..K from the run's tables."""
    import pyarrow.parquet as pq

    from pipeline.stages import round_paths

    cfg = arm_config(a, arm, seed, train_file)
    out = []
    for k in range(a.rounds + 1):
        p = round_paths(cfg, k)
        row = {"bench": "learning", "arm": arm, "seed": seed, "round": k}
        if p["eval"].exists():
            ev = pq.read_table(p["eval"]).to_pylist()
            greedy = [r["correct"] for r in ev if r["decoding"] == "greedy"]
            row.update(heldout_accuracy=float(np.mean(greedy)), heldout_n=len(greedy))
        if k >= 1 and p["outcomes"].exists():
            oc = pq.read_table(p["outcomes"]).column("outcome_correct").to_pylist()
            row["train_outcome_reward"] = float(np.mean(oc))
        if k >= 1 and p["train_metrics"].exists():
            tm = pq.read_table(p["train_metrics"]).to_pylist()
            first = {m["name"]: m["value"] for m in tm if m["step"] == 0}
            per = {}
            for m in tm:
                per.setdefault(m["name"], []).append(m["value"])
            row.update(kl_to_start=first.get("kl_ref"), entropy=first.get("entropy"),
                       clip_frac=float(np.mean(per.get("clip_frac", [np.nan]))))
        if k >= 1 and arm == "capo" and p["step_verdicts"].exists():
            sv = pq.read_table(p["step_verdicts"]).to_pylist()
            w = [r["weight"] for r in sv if r["rule"] == cfg.vote.rule]
            row["steps_flagged"] = float(np.mean([x > 0 for x in w])) if w else None
        out.append(row)
    return out


def summarize(a: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """Per arm at round K: mean/spread over seeds, gain over control, significance against 2 x spread."""
    K = a.rounds
    end = {arm: [r["heldout_accuracy"] for r in rows if r["arm"] == arm and r["round"] == K
                 and r.get("heldout_accuracy") is not None] for arm in a.arms}
    start = [r["heldout_accuracy"] for r in rows if r["round"] == 0 and r.get("heldout_accuracy") is not None]
    out = []
    ctrl = end.get("control") or []
    for arm, accs in end.items():
        if not accs:
            continue
        mean, spread = float(np.mean(accs)), float(np.max(accs) - np.min(accs))
        s = {"bench": "learning", "summary": arm, "round": K, "seeds": len(accs), "heldout_accuracy": mean,
             "spread": spread, "start_accuracy": float(np.mean(start)) if start else None}
        if ctrl and arm != "control":
            c_mean, c_spread = float(np.mean(ctrl)), float(np.max(ctrl) - np.min(ctrl))
            gain = mean - c_mean
            s.update(gain_over_control=gain, control_spread=c_spread,  # a spread needs >= 2 seeds per arm
                     beats_control=bool(gain > 2 * max(spread, c_spread)) if min(len(accs), len(ctrl)) >= 2 else None)
        out.append(s)
    if end.get("capo") and end.get("grpo"):
        out.append({"bench": "learning", "capo_minus_grpo": float(np.mean(end["capo"]) - np.mean(end["grpo"])),
                    "capo_beat_grpo": bool(np.mean(end["capo"]) > np.mean(end["grpo"]))})
    return out


def plot(a: argparse.Namespace, rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for arm in a.arms:
        for ax, key in ((ax1, "heldout_accuracy"), (ax2, "train_outcome_reward")):
            by: dict[int, list[float]] = {}
            for r in rows:
                if r["arm"] == arm and r.get(key) is not None:
                    by.setdefault(r["round"], []).append(100 * r[key])
            if not by:
                continue
            ks = sorted(by)
            m = [np.mean(by[k]) for k in ks]
            line = ax.plot(ks, m, marker="o", label=arm)[0]
            ax.fill_between(ks, [min(by[k]) for k in ks], [max(by[k]) for k in ks], color=line.get_color(), alpha=0.2)
    ax1.set(title=f"held-out GSM8K greedy ({a.eval_size} test problems)", xlabel="round", ylabel="accuracy (%)")
    ax2.set(title="training outcome reward (round's rollouts)", xlabel="round", ylabel="correct (%)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench_learning: mean over seeds {a.seeds}, band = min..max")
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--policy", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--critic", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--n", type=int, default=4, help="critiques per response (CAPO arm)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per round")
    ap.add_argument("--prompts-per-round", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--select-n", type=int, default=256, help="candidate training problems")
    ap.add_argument("--select-k", type=int, default=4, help="samples per candidate")
    ap.add_argument("--pass-lo", type=float, default=0.25)
    ap.add_argument("--pass-hi", type=float, default=0.75)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-max-tokens", type=int, default=320)
    ap.add_argument("--eval-every", type=int, choices=[0, 1], default=0, help="1: eval every round")
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_learning"))
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    ap.add_argument("--select-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.select_only:
        print(json.dumps({"bench": "learning", "selection_file": str(select_training_items(a))}), flush=True)
        return
    from pipeline.precision import bench_context

    ctx = bench_context()
    t0 = time.perf_counter()
    train_file = selection_in_child(a)
    round0 = None
    for seed in a.seeds:
        for arm in a.arms:
            run_arm(a, arm, seed, train_file, round0)
            if round0 is None:
                from pipeline.stages import round_paths

                r0 = round_paths(arm_config(a, arm, seed, train_file), 0)["eval"]
                round0 = r0 if r0.exists() else None
    rows = [r for seed in a.seeds for arm in a.arms for r in round_metrics(a, arm, seed, train_file)]
    for r in rows:
        print(json.dumps({**r, **ctx}), flush=True)
    for s in summarize(a, rows):
        print(json.dumps({**s, **ctx}), flush=True)
    out = Path(a.runs_dir) / "learning.png"
    plot(a, rows, out)
    print(json.dumps({"bench": "learning", "plot": str(out), "wall_seconds": round(time.perf_counter() - t0, 1),
                      "rounds": a.rounds, "seeds": a.seeds, "lr": a.lr, "policy": a.policy, "critic": a.critic, **ctx}))


if __name__ == "__main__":
    main()
