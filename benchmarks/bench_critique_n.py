"""Benchmark 2: critique cost as N grows (N critiques per response share one prompt).

Takes real policy responses (a round's ``rollouts.parquet``, read only), splits them into steps
with ``pipeline.core.segment.split_steps`` and builds the critic conversations with
``pipeline.core.critique.build_critique_messages``, as the critique stage does. One engine
(``pipeline.engines.make_engine`` with the critique engine of ``configs/default.yaml``) then runs
``engine.generate(convs, n=N, sampling)`` on the same conversations for every N. Before each N the
prefix cache is emptied (``LLM.reset_prefix_cache()``, checked to return True), so every N starts
cold and only the sharing inside one call is measured; ``--fresh-engine`` builds a new engine
per N instead.

Prompt tokens come from two places, both reported: what our engine records
(``Generation.cached_prompt_tokens`` summed, ``engine.stats``) and vLLM's own counters
(``vllm:prompt_tokens``, ``vllm:prompt_tokens_cached``: every one of the N child requests counted),
read with ``LLM.get_metrics()``; for that the benchmark builds vLLM's ``LLM`` with
``disable_log_stats=False`` (the only change to the engine).

    .venv/bin/python benchmarks/bench_critique_n.py --responses 4 --max-tokens 160
    .venv/bin/python benchmarks/bench_critique_n.py --critic data/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _log_stats_llm() -> None:
    """Make ``vllm.LLM`` keep its Prometheus counters (our engine imports it at build time)."""
    import vllm

    base = vllm.LLM

    class LoggedLLM(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("disable_log_stats", False)
            super().__init__(*args, **kwargs)

    vllm.LLM = LoggedLLM


def counters(llm) -> dict[str, float]:
    """vLLM counters summed over labels; ``prompt_tokens_by_source`` split per source."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            name = m.name.removeprefix("vllm:")
            if "source" in m.labels:
                name = f"{name}:{m.labels['source']}"
            out[name] = out.get(name, 0) + m.value
    return out


def critique_conversations(rollouts_file: Path, prompts_file: Path, k: int) -> tuple[list[str], list[list[dict]]]:
    """The first ``k`` non-empty responses of the table (by rollout id) as critic conversations."""
    import pyarrow.parquet as pq

    from pipeline.core.critique import build_critique_messages
    from pipeline.core.segment import split_steps

    prompts = {r["prompt_id"]: r for r in pq.read_table(prompts_file, columns=["prompt_id", "question", "gold_answer"]).to_pylist()}
    rows = sorted(pq.read_table(rollouts_file, columns=["rollout_id", "prompt_id", "response_text"]).to_pylist(),
                  key=lambda r: r["rollout_id"])
    ids, convs = [], []
    for r in rows:
        text = r["response_text"]
        steps = [text[s:e] for s, e in split_steps(text)]
        if steps and len(convs) < k:
            p = prompts[r["prompt_id"]]
            ids.append(r["rollout_id"])
            convs.append(build_critique_messages(p["question"], steps, p["gold_answer"]))
    if len(convs) < k:
        raise ValueError(f"{rollouts_file} has only {len(convs)} non-empty responses; pass --responses {len(convs)}")
    return ids, convs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--critic", default=str(ROOT / "data" / "models" / "qwen2.5-coder-1.5b-instruct"))
    ap.add_argument("--rollouts", default=str(ROOT / "runs" / "default" / "round_001" / "rollouts.parquet"))
    ap.add_argument("--prompts-file", default=str(ROOT / "data" / "prompts" / "gsm8k_train.parquet"))
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=160, help="critique length cap (the stage default is 320)")
    ap.add_argument("--fresh-engine", action="store_true", help="a new engine per N instead of resetting the prefix cache")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from pipeline.config import load_config
    from pipeline.engines import make_engine

    _log_stats_llm()
    crit = load_config(ROOT / "configs" / "default.yaml").critique
    sampling = crit.sampling.model_copy(update={"max_tokens": a.max_tokens})
    ids, convs = critique_conversations(Path(a.rollouts), Path(a.prompts_file), a.responses)
    from pipeline.precision import bench_context, resolve_dtype

    env = {**bench_context(), "machine": platform.machine(), "cpus": os.cpu_count(), "critic": Path(a.critic).name,
           "dtype": resolve_dtype(crit.engine.dtype).value, "responses": len(convs), "max_tokens": a.max_tokens,
           "temperature": sampling.temperature, "cache": "fresh-engine" if a.fresh_engine else "reset_prefix_cache"}
    print(json.dumps({"bench": "critique_n", "rollout_ids": ids, **env}), flush=True)

    engine, load_s, results = None, None, {}
    for n in a.ns:
        if engine is None or a.fresh_engine:
            if engine is not None:
                engine.close()
            t0 = time.perf_counter()
            engine = make_engine(a.critic, crit.engine, seed=a.seed)
            load_s = time.perf_counter() - t0
            engine.generate([[{"role": "user", "content": "What is 2 + 3?"}]], 1, sampling.model_copy(update={"max_tokens": 8}))
        reset = engine.llm.reset_prefix_cache()
        if not reset:
            raise RuntimeError("LLM.reset_prefix_cache() returned False (requests still running?)")
        before, s0 = counters(engine.llm), engine.stats.as_dict()
        t0 = time.perf_counter()
        gens = engine.generate(convs, n, sampling)
        secs = time.perf_counter() - t0
        after, s1 = counters(engine.llm), engine.stats.as_dict()
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        prompt_unique = sum(len(g.prompt_token_ids) for g in gens)
        gen_tokens = sum(len(s.token_ids) for g in gens for s in g.samples)
        results[n] = secs
        print(json.dumps({
            "bench": "critique_n", "n": n, "seconds": round(secs, 3), "load_seconds": round(load_s, 2),
            "critiques": sum(len(g.samples) for g in gens), "generated_tokens": gen_tokens,
            "generated_tokens_per_s": round(gen_tokens / secs, 2),
            "hit_max_tokens": sum(s.finish_reason == "length" for g in gens for s in g.samples),
            "prompt_tokens_unique": prompt_unique, "prompt_tokens_requested": prompt_unique * n,
            "vllm_prompt_tokens": d.get("prompt_tokens"), "vllm_prompt_tokens_cached": d.get("prompt_tokens_cached"),
            "vllm_prompt_tokens_computed": (d["prompt_tokens"] - d["prompt_tokens_cached"]) if "prompt_tokens" in d else None,
            "vllm_prefix_cache_queries": d.get("prefix_cache_queries"), "vllm_prefix_cache_hits": d.get("prefix_cache_hits"),
            "vllm_prompt_tokens_by_source": {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("prompt_tokens_by_source:")},
            "engine_cached_prompt_tokens": sum(g.cached_prompt_tokens or 0 for g in gens),
            "engine_stats_prompt_tokens": s1["prompt_tokens"] - s0["prompt_tokens"],
            "engine_stats_cached_prompt_tokens": s1["cached_prompt_tokens"] - s0["cached_prompt_tokens"],
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            **env,
        }), flush=True)
    engine.close()
    if 1 in results:
        ratios = {f"n{n}_over_n1": round(s / results[1], 2) for n, s in results.items()}
        ok = results.get(4, float("inf")) / results[1] <= 2.5 if 4 in results else None
        print(json.dumps({"bench": "critique_n", **ratios, "goal_n4_over_n1": 2.5, "goal_met": ok, **env}))


if __name__ == "__main__":
    main()
