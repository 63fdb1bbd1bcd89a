"""Benchmark 1: rollout generation, our vLLM engine vs our transformers engine.

Both engines come from ``pipeline.engines.make_engine`` and get the same model, the same GSM8K
conversations (built like the rollout stage builds them), the same ``SamplingConfig`` and the same
``n``. Each engine runs in its own child process (a fresh interpreter: vLLM binds OpenMP threads and
keeps memory, so sharing one process would bias whichever runs second). In each child:

  * ``load``: building the engine (weights, vLLM's KV cache and warm-up), reported, not in tok/s;
  * one short warm-up call on a conversation outside the set (first-call costs), not timed;
  * ``generate``: ``engine.generate(convs, n, sampling)``, best of ``--repeats``.

tok/s counts the tokens the engine actually produced (EOS included, no padding after it): there is
no ``ignore_eos`` in our ``SamplingConfig``, so samples stop where the model stops.
Precision: the vLLM engine runs once per ``--dtypes`` (default ``bfloat16 float32``), each in its
own child, and a ``precision`` line says which dtype ``auto`` resolves to on this machine
(:mod:`pipeline.precision`), which one decoded faster, and whether the pick is the faster one. The
transformers engine runs once, in ``--hf-dtype`` (default ``auto``). Every line carries the CPU
model, cores, torch's CPU capability and the ``auto`` resolution (``bench_context``).

Prints one JSON line per (engine, dtype), the precision pick, and the vLLM/transformers ratio
(vLLM in the ``auto`` dtype).

    .venv/bin/python benchmarks/bench_generation.py --prompts 16 --max-tokens 128
    .venv/bin/python benchmarks/bench_generation.py --engines vllm --dtypes float32   # one run only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("transformers", "vllm")


def conversations(prompts_file: Path, k: int) -> list[list[dict]]:
    """The first ``k`` problems of the table, as the rollout stage asks them."""
    import pyarrow.parquet as pq

    from pipeline.config import load_config
    from pipeline.stages.base import policy_messages

    rows = pq.read_table(prompts_file, columns=["question"]).slice(0, k).to_pylist()
    instruction = load_config(None).instruction()
    return [policy_messages(r["question"], instruction) for r in rows]


def engine_config(name: str, dtype: str | None, batch_size: int):
    """The rollout engine of configs/default.yaml (vLLM) or a transformers engine, in ``dtype``."""
    from pipeline.config import TransformersEngineConfig, load_config

    if name == "vllm":  # the rollout engine of configs/default.yaml
        base = load_config(ROOT / "configs" / "default.yaml").rollout.engine
        return base.model_copy(update={"dtype": dtype}) if dtype else base
    kw = {"batch_size": batch_size, **({"dtype": dtype} if dtype else {})}
    return TransformersEngineConfig(**kw)


def child(a: argparse.Namespace) -> None:
    """Run one engine; print one JSON line."""
    from pipeline.config import SamplingConfig
    from pipeline.engines import make_engine

    convs = conversations(Path(a.prompts_file), a.prompts)
    cfg = engine_config(a.engine, a.dtype, a.hf_batch_size or a.prompts)
    sampling = SamplingConfig(temperature=a.temperature, top_p=1.0, max_tokens=a.max_tokens)
    t0 = time.perf_counter()
    engine = make_engine(str(a.model), cfg, seed=a.seed)
    load_s = time.perf_counter() - t0
    engine.generate([[{"role": "user", "content": "What is 2 + 3?"}]], 1, SamplingConfig(max_tokens=8))
    best = None
    for _ in range(a.repeats):  # best of N: the machine is shared and noisy
        t0 = time.perf_counter()
        gens = engine.generate(convs, a.n, sampling)
        secs = time.perf_counter() - t0
        if best is None or secs < best[0]:
            best = (secs, gens)
    secs, gens = best
    samples = [s for g in gens for s in g.samples]
    tokens = sum(len(s.token_ids) for s in samples)
    from pipeline.precision import bench_context

    print(json.dumps({
        "bench": "generation", "engine": a.engine, "model": Path(a.model).name, "dtype": engine.dtype,
        "prompts": len(convs), "n": a.n, "max_tokens": a.max_tokens, "temperature": a.temperature,
        "batch": getattr(cfg, "batch_size", None) or getattr(cfg, "max_num_seqs", None),
        "prompt_tokens": sum(len(g.prompt_token_ids) for g in gens), "generated_tokens": tokens,
        "hit_max_tokens": sum(s.finish_reason == "length" for s in samples),
        "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2), "load_seconds": round(load_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "ld_preload": os.environ.get("LD_PRELOAD", ""), **bench_context(),
    }), flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "data" / "models" / "qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--prompts-file", default=str(ROOT / "data" / "prompts" / "gsm8k_test.parquet"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (one request with n)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    choices=["auto", "bfloat16", "float16", "float32"],
                    help="vLLM engine dtypes, measured side by side (one child process each)")
    ap.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="the transformers engine's dtype")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="transformers prompts per generate call "
                                                                   "(default: all prompts in one batch, as vLLM gets them)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)  # child mode
    a = ap.parse_args()
    if a.engine:
        child(a)
        return
    from pipeline.engines.base import engine_process_env
    from pipeline.precision import bench_context, resolve_dtype

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ctx = bench_context()
    runs = [(name, d) for name in a.engines for d in (a.dtypes if name == "vllm" else [a.hf_dtype])]
    results = {}
    for name, dtype in runs:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--engine", name, "--dtype", dtype]
        # each engine's process gets what the pipeline gives its generation stages (tcmalloc on CPU)
        env = {**os.environ, **engine_process_env()}
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True, env=env).stdout
        for line in out.splitlines():
            if line.startswith("{") and '"bench": "generation"' in line:
                print(line, flush=True)
                results[(name, resolve_dtype(dtype).value)] = json.loads(line)
    vllm = {d: r["tokens_per_s"] for (e, d), r in results.items() if e == "vllm"}
    if len(vllm) > 1:
        fastest = max(vllm, key=vllm.get)
        pick = ctx["auto_dtype"]
        print(json.dumps({"bench": "generation", "precision": "vllm", "tokens_per_s_by_dtype": vllm,
                          "auto_picks": pick, "fastest": fastest,
                          "pick_is_fastest": pick == fastest if pick in vllm else None,
                          "pick_over_slowest": round(vllm[pick] / min(vllm.values()), 2) if pick in vllm else None,
                          **ctx}), flush=True)
    v, t = results.get(("vllm", ctx["auto_dtype"])), next((r for (e, _), r in results.items() if e == "transformers"), None)
    if v and t:
        print(json.dumps({"bench": "generation", "speedup_vllm_vs_transformers": round(v["tokens_per_s"] / t["tokens_per_s"], 2),
                          "vllm_dtype": v["dtype"], "transformers_dtype": t["dtype"],
                          "goal": 5.0, "goal_met": v["tokens_per_s"] / t["tokens_per_s"] >= 5.0,
                          "machine": platform.machine(), **ctx}))


if __name__ == "__main__":
    main()
