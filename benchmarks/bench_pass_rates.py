"""Pass rates of an embedded policy on the eval benchmarks, to choose a training set with signal.

    .venv/bin/python benchmarks/bench_pass_rates.py --policy qwen2.5-coder-0.5b-instruct --benchmarks mawps svamp

For each benchmark: ``--items`` seeded problems, ``--k`` samples each at temperature 1 (the
rollout engine of configs/default.yaml, ``--max-tokens``), graded with math-verify; prints one JSON
line per benchmark with the mean pass rate, the histogram of per-problem pass rates (bins of width
1/(k+1) over [0, 1]), the mean response length, the share cut at ``--max-tokens`` and the engine's
tokens per second. Run it in its own process: it holds a vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--benchmarks", nargs="+", default=["mawps", "svamp", "asdiv", "gsm8k"])
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    a = ap.parse_args()
    import pyarrow.parquet as pq

    from pipeline.assets.benchmarks import ensure_benchmark
    from pipeline.config import load_config
    from pipeline.engines import make_engine
    from pipeline.grading import grade
    from pipeline.precision import bench_context
    from pipeline.stages.base import policy_messages, resolve_model

    cfg = load_config(ROOT / "configs" / "default.yaml", [f"data_dir={a.data_dir}",
                                                          f"rollout.sampling.max_tokens={a.max_tokens}"])
    ctx = bench_context()
    engine = make_engine(resolve_model(a.policy, cfg), cfg.rollout.engine, seed=0)
    data = Path(a.data_dir)
    for name in a.benchmarks:
        table = pq.read_table(ensure_benchmark(name, data / "eval", cache_dir=data / "cache")).to_pylist()
        items = [table[i] for i in np.random.default_rng(7).permutation(len(table))[: a.items]]
        t0 = time.perf_counter()
        gens = engine.generate([policy_messages(r["question"], cfg.instruction()) for r in items], a.k,
                               cfg.rollout.sampling)
        secs = time.perf_counter() - t0
        ntok = [len(s.token_ids) for g in gens for s in g.samples]
        graded = grade([(r["gold_answer"], s.text) for r, g in zip(items, gens) for s in g.samples],
                       answer=cfg.verify.answer, finish_reasons=[s.finish_reason for g in gens for s in g.samples],
                       truncated=cfg.verify.truncated)
        rates = np.asarray([c for _, c, _ in graded], float).reshape(len(items), a.k).mean(1)
        print(json.dumps({"bench": "pass_rates", "policy": a.policy, "benchmark": name, "items": len(items), "k": a.k,
                          "mean_pass": float(rates.mean()),
                          "pass_rate_histogram": np.histogram(rates, bins=a.k + 1, range=(0, 1))[0].tolist(),
                          "mean_tokens": float(np.mean(ntok)), "cut_at_max_tokens": float(np.mean([n >= a.max_tokens for n in ntok])),
                          "generate_seconds": round(secs, 1), "tokens_per_s": round(sum(ntok) / secs, 1), **ctx}), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
