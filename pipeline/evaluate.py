"""Held-out evaluation of a policy: greedy accuracy (and pass@k) on math benchmarks.

Round 0 is the starting policy (``rollout.policy``); round k >= 1 is the checkpoint round k of the
variant wrote. Prompts are built exactly as the rollout stage builds them
(:func:`pipeline.stage_generate.policy_messages` with the run's instruction), generated through
:func:`pipeline.engines.make_engine` (one engine load, one ``generate`` call over every benchmark
for greedy decoding and one more for pass@k samples), and graded with math-verify in a process pool
(it times out with ``signal.alarm``, which works only in a process's main thread).

Sampled subsets are drawn from the eval seed and the benchmark name only (:func:`select_problems`),
never from the round or the run, so every round of every run sees the same problems.

Output (one row per benchmark x problem x sample, :data:`EVAL_SCHEMA`)::

    runs/<run>/round_000/eval.parquet                       starting policy (variant NULL)
    runs/<run>/round_<k>/variants/<variant>/eval.parquet    policy after round k of the variant
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline import storage
from pipeline.benchmarks import DEFAULT_BENCHMARKS, ensure_benchmark, get_benchmark
from pipeline.config import CAPOConfig, EngineConfig, SamplingConfig
from pipeline.stage_score import verify_answer

log = logging.getLogger("capo.stages")

EVAL_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("round", pa.int32(), nullable=False),  # 0 = starting policy, k = after round k's update
    pa.field("variant", pa.string()),  # null for round 0 (the starting policy every variant shares)
    pa.field("policy", pa.string()),  # checkpoint path or model id evaluated
    pa.field("benchmark", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("decoding", pa.string(), nullable=False),  # greedy (T=0, n=1) | sample (T=1, n=k, pass@k)
    pa.field("sample_idx", pa.int32(), nullable=False),
    pa.field("gold_answer", pa.string()),
    pa.field("response_text", pa.string()),
    pa.field("num_tokens", pa.int32()),  # generated tokens (EOS included); null when the engine gives none
    pa.field("finish_reason", pa.string()),  # stop | length
    pa.field("extracted_answer", pa.string()),  # what math-verify parsed from the response
    pa.field("correct", pa.bool_(), nullable=False),
    pa.field("verify_status", pa.string()),  # ok | no_answer | no_gold | error:<type>
])

EVAL_SUMMARY_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("round", pa.int32()), pa.field("variant", pa.string()),
    pa.field("benchmark", pa.string(), nullable=False),
    pa.field("n_problems", pa.int32()),  # problems with a greedy answer
    pa.field("accuracy", pa.float64()),  # greedy: share of problems answered right
    pa.field("mean_response_tokens", pa.float64()),  # greedy responses
    pa.field("share_truncated", pa.float64()),  # greedy responses that hit max_tokens
    pa.field("pass_k", pa.int32()),  # k, null without sampled rows
    pa.field("pass_at_k", pa.float64()),  # mean over problems of the unbiased pass@k
    pa.field("sampled_accuracy", pa.float64()),  # pass@1 estimated from the k samples (mean c/n)
])


class EvalConfig(BaseModel):
    """Held-out evaluation after every round (and of the starting policy as round 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    benchmarks: list[str] = Field(default_factory=lambda: list(DEFAULT_BENCHMARKS))
    """Names from :data:`pipeline.benchmarks.BENCHMARKS`: gsm8k, math500, minerva, svamp, asdiv,
    mawps, aime24."""
    sample_size: int | None = Field(50, ge=1)
    """Problems per benchmark (a seeded subset, the same every round); None evaluates the full sets."""
    seed: int = 0
    """Seed of the subsets (not the run's seed: runs with other seeds still see the same problems)."""
    max_tokens: int = Field(512, ge=1)
    """Most new tokens per answer (MATH-style answers need more than GSM8K ones)."""
    pass_k: int = Field(1, ge=1)
    """k > 1 adds k samples at temperature 1.0 per problem and reports pass@k beside greedy accuracy."""
    pass_k_benchmarks: list[str] | None = None
    """Benchmarks that get the k samples (None: all of ``benchmarks``); meant for the small sets."""
    engine: EngineConfig | None = None
    """None uses ``rollout.engine``."""

    @field_validator("benchmarks", "pass_k_benchmarks")
    @classmethod
    def _known(cls, names: list[str] | None) -> list[str] | None:
        for n in names or []:
            get_benchmark(n)  # ValueError listing the valid names
        return names


# -------------------------------------------------------------------------------------------- math
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are right (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    With ``n == k`` (what :func:`evaluate_policy` draws) it reduces to "any of the k samples is
    right": 1.0 when ``c > 0`` else 0.0. Computed as a product so large n does not overflow.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def select_problems(n_total: int, sample_size: int | None, seed: int, benchmark: str) -> np.ndarray:
    """Sorted row indices of the evaluated subset of a benchmark (all rows when ``sample_size`` is
    None or not smaller). Depends only on (seed, benchmark name): the same problems every round,
    and a larger ``sample_size`` keeps every problem of a smaller one."""
    if sample_size is None or sample_size >= n_total:
        return np.arange(n_total)
    perm = np.random.default_rng([seed, zlib.crc32(benchmark.encode())]).permutation(n_total)
    return np.sort(perm[:sample_size])


# ---------------------------------------------------------------------------------------- grading
def _grade_chunk(pairs: list[tuple[str, str]]) -> list[tuple[str | None, bool, str]]:
    return [verify_answer(g, r) for g, r in pairs]


def grade(pairs: list[tuple[str, str]], workers: int = 2, chunk: int = 64) -> list[tuple[str | None, bool, str]]:
    """math-verify ``(gold, response)`` pairs in a spawn process pool (main threads, so its
    ``signal.alarm`` timeouts work); returns ``(extracted, correct, status)`` per pair, in order."""
    if not pairs:
        return []
    chunks = [pairs[i : i + chunk] for i in range(0, len(pairs), chunk)]
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(chunks))), mp_context=mp.get_context("spawn")) as pool:
        return [x for part in pool.map(_grade_chunk, chunks) for x in part]


# ----------------------------------------------------------------------------------------- policy
def load_problems(benchmarks: list[str], sample_size: int | None, seed: int, root: Path | None = None) -> list[dict]:
    """The evaluated problems of every benchmark, in order: prompt rows plus ``benchmark``."""
    out = []
    for name in benchmarks:
        table = pq.read_table(ensure_benchmark(name, root))
        idx = select_problems(table.num_rows, sample_size, seed, name)
        out += [{**r, "benchmark": name} for r in table.take(pa.array(idx)).to_pylist()]
    return out


def evaluate_policy(model: str, benchmarks: list[str], sample_size: int | None, seed: int, engine_cfg,
                    max_tokens: int, pass_k: int = 1, instruction: str = "", *,
                    pass_k_benchmarks: list[str] | None = None, run_id: str = "", round_idx: int = 0,
                    variant: str | None = None, eval_root: Path | None = None, workers: int = 2) -> pa.Table:
    """Generate and grade ``model``'s answers on the benchmarks -> an :data:`EVAL_SCHEMA` table.

    Every problem gets one greedy answer (temperature 0, n=1); with ``pass_k > 1`` the problems of
    ``pass_k_benchmarks`` (default: all) also get ``pass_k`` samples at temperature 1.0, top_p 1.0.
    The engine is loaded once; each decoding mode is one ``generate`` call over all benchmarks.
    ``eval_root`` is where benchmark tables live (default ``<data_dir>/eval``).
    """
    from pipeline.engines import make_engine
    from pipeline.stage_generate import policy_messages

    if not instruction:
        raise ValueError("instruction is empty; pass the run's policy instruction (CAPOConfig.instruction())")
    problems = load_problems(list(benchmarks), sample_size, seed, eval_root)
    k_set = set(benchmarks if pass_k_benchmarks is None else pass_k_benchmarks)
    sampled = [p for p in problems if pass_k > 1 and p["benchmark"] in k_set]
    runs = [("greedy", problems, 1, SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=max_tokens))]
    if sampled:
        runs.append(("sample", sampled, pass_k, SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=max_tokens)))
    engine = make_engine(model, engine_cfg, seed=seed)
    rows = []
    try:
        for decoding, probs, n, sampling in runs:
            gens = engine.generate([policy_messages(p["question"], instruction) for p in probs], n, sampling)
            for p, gen in zip(probs, gens):
                for j, s in enumerate(gen.samples):
                    rows.append({"run_id": run_id, "round": round_idx, "variant": variant, "policy": model,
                                 "benchmark": p["benchmark"], "prompt_id": p["prompt_id"], "decoding": decoding,
                                 "sample_idx": j, "gold_answer": p["gold_answer"], "response_text": s.text,
                                 "num_tokens": len(s.token_ids) if s.token_ids else None,
                                 "finish_reason": s.finish_reason})
        log.info("[eval] engine: %s", engine.stats.as_dict())
    finally:
        engine.close()
    graded = grade([(r["gold_answer"], r["response_text"] or "") for r in rows], workers)
    for r, (ext, ok, status) in zip(rows, graded):
        r.update(extracted_answer=ext, correct=ok, verify_status=status)
    return pa.Table.from_pylist(rows, schema=EVAL_SCHEMA)


def summarize_eval(table: pa.Table) -> pa.Table:
    """One row per (run_id, round, variant, benchmark) of an eval table (:data:`EVAL_SUMMARY_SCHEMA`).

    accuracy = mean correctness of the greedy answers; with sampled rows, pass_at_k = mean over
    problems of :func:`pass_at_k` (n = samples drawn for the problem, k = the most samples any problem
    has; n == k reduces it to any-correct) and sampled_accuracy = mean over problems of c / n.
    """
    groups: dict[tuple, dict] = {}
    for r in table.select(["run_id", "round", "variant", "benchmark", "prompt_id", "decoding",
                           "num_tokens", "finish_reason", "correct"]).to_pylist():
        g = groups.setdefault((r["run_id"], r["round"], r["variant"], r["benchmark"]), {"greedy": [], "sample": {}})
        if r["decoding"] == "greedy":
            g["greedy"].append(r)
        else:
            g["sample"].setdefault(r["prompt_id"], []).append(bool(r["correct"]))
    rows = []
    for (run_id, rnd, variant, bench), g in groups.items():
        gr, sm = g["greedy"], g["sample"]
        toks = [r["num_tokens"] for r in gr if r["num_tokens"] is not None]
        k = max((len(v) for v in sm.values()), default=0)
        rows.append({
            "run_id": run_id, "round": rnd, "variant": variant, "benchmark": bench, "n_problems": len(gr),
            "accuracy": float(np.mean([r["correct"] for r in gr])) if gr else None,
            "mean_response_tokens": float(np.mean(toks)) if toks else None,
            "share_truncated": float(np.mean([r["finish_reason"] == "length" for r in gr])) if gr else None,
            "pass_k": k or None,
            "pass_at_k": float(np.mean([pass_at_k(len(v), sum(v), k) for v in sm.values()])) if sm else None,
            "sampled_accuracy": float(np.mean([sum(v) / len(v) for v in sm.values()])) if sm else None,
        })
    return pa.Table.from_pylist(rows, schema=EVAL_SUMMARY_SCHEMA)


# ------------------------------------------------------------------------------------------ stage
def eval_config(cfg: CAPOConfig) -> EvalConfig:
    """``cfg.eval`` once the config has that section; the defaults until then."""
    return getattr(cfg, "eval", None) or EvalConfig()


def eval_path(cfg: CAPOConfig, round_idx: int) -> Path:
    """Where the eval table of round ``round_idx`` goes (round 0 is shared by every variant)."""
    if round_idx < 0:
        raise ValueError(f"eval round must be >= 0 (0 = the starting policy), got {round_idx}")
    rd = cfg.run_dir() / f"round_{round_idx:03d}"
    return rd / "eval.parquet" if round_idx == 0 else rd / "variants" / cfg.variant / "eval.parquet"


def eval_policy(cfg: CAPOConfig, round_idx: int) -> str:
    """The policy round ``round_idx`` evaluates: the starting one for 0, else round k's checkpoint.

    Raises:
        FileNotFoundError: round k has not committed its checkpoint yet.
    """
    from pipeline.stages import resolve_model, round_paths

    if round_idx == 0:
        return resolve_model(cfg.rollout.policy, cfg)
    ckpt = round_paths(cfg, round_idx)["checkpoint"]
    if storage.read_manifest(ckpt) is None:
        raise FileNotFoundError(f"eval of round {round_idx} needs the checkpoint {ckpt}, which does not exist "
                                f"yet: run round {round_idx} first (capo round --round {round_idx})")
    return str(ckpt)


def eval_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the eval table of a round depends on (policy, eval settings, engine, data, verifier)."""
    from importlib.metadata import version

    from pipeline.stages import model_fingerprint

    ec = eval_config(cfg)
    engine = ec.engine or cfg.rollout.engine
    root = Path(cfg.data_dir).resolve() / "eval"
    return {"round": round_idx, "variant": cfg.variant if round_idx else None,
            "policy": model_fingerprint(eval_policy(cfg, round_idx)),
            "eval": ec.model_dump(mode="json", exclude={"enabled", "engine"}), "engine": engine.model_dump(mode="json"),
            "instruction": cfg.instruction(),
            "benchmarks": {n: storage.file_sha256(ensure_benchmark(n, root)) for n in ec.benchmarks},
            "verifier": f"math-verify=={version('math-verify')}"}


def eval_current(cfg: CAPOConfig, round_idx: int) -> storage.Currency:
    """Is the round's eval table current? (cheap: manifests, file stats, benchmark hashes)."""
    return storage.is_current(eval_path(cfg, round_idx), eval_key(cfg, round_idx))


def eval_stage(cfg: CAPOConfig, round_idx: int, force: bool = False):
    """Evaluate round ``round_idx``'s policy on ``eval.benchmarks`` -> ``eval.parquet``."""
    import time

    from pipeline.stages import StageResult, _with_prov

    out, key = eval_path(cfg, round_idx), eval_key(cfg, round_idx)
    cur = storage.is_current(out, key)
    if cur.current and not force:
        res = StageResult("eval", str(out), True, cur.reason)
        log.info(res.line())
        return res
    log.info("[eval] running: %s", cur.reason)
    ec, t0 = eval_config(cfg), time.perf_counter()
    policy = eval_policy(cfg, round_idx)
    table = evaluate_policy(policy, ec.benchmarks, ec.sample_size, ec.seed, ec.engine or cfg.rollout.engine,
                            ec.max_tokens, ec.pass_k, cfg.instruction(), pass_k_benchmarks=ec.pass_k_benchmarks,
                            run_id=cfg.run_id, round_idx=round_idx, variant=cfg.variant if round_idx else None,
                            eval_root=Path(cfg.data_dir).resolve() / "eval")
    summary = summarize_eval(table).to_pylist()
    for s in summary:
        log.info("[eval] round %d %s: accuracy %.3f on %d problems, %.0f tokens on average", round_idx,
                 s["benchmark"], s["accuracy"] or 0.0, s["n_problems"], s["mean_response_tokens"] or 0.0)
    secs = time.perf_counter() - t0
    man = write_eval_table(table, out, key, _with_prov(cfg, {"elapsed_s": round(secs, 3), "policy": policy,
                                                             "summary": summary}))
    res = StageResult("eval", str(out), False, cur.reason, man["rows"], secs)
    log.info(res.line())
    return res


def write_eval_table(table: pa.Table, out: Path, key: dict, extra: dict | None = None) -> dict:
    """:func:`pipeline.storage.write_table` for :data:`EVAL_SCHEMA` (until it is in ``SCHEMAS``)."""
    import os
    import tempfile

    if not table.schema.equals(EVAL_SCHEMA, check_metadata=False):
        raise ValueError(f"eval table schema {table.schema} differs from EVAL_SCHEMA {EVAL_SCHEMA}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() or storage.manifest_path(out).exists():
        storage.supersede(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return storage.commit_manifest(out, stage="eval", key=key, rows=table.num_rows, extra=extra)


EVAL_SUMMARY_SQL = """
CREATE OR REPLACE VIEW cat.eval_summary AS
WITH g AS (
    SELECT run_id, round, variant, benchmark, count(*) AS n_problems, avg(correct::INT) AS accuracy,
           avg(num_tokens) AS mean_response_tokens, avg((finish_reason = 'length')::INT) AS share_truncated
    FROM cat.eval WHERE decoding = 'greedy' GROUP BY ALL
), per_problem AS (
    SELECT run_id, round, variant, benchmark, prompt_id, count(*) AS n, sum(correct::INT) AS c
    FROM cat.eval WHERE decoding = 'sample' GROUP BY ALL
), pk AS (
    SELECT run_id, round, variant, benchmark, max(n) AS pass_k, avg((c > 0)::INT) AS pass_at_k,
           avg(c / n) AS sampled_accuracy
    FROM per_problem GROUP BY ALL
)
SELECT g.*, pk.pass_k, pk.pass_at_k, pk.sampled_accuracy
FROM g LEFT JOIN pk ON g.run_id = pk.run_id AND g.round = pk.round AND g.benchmark = pk.benchmark
                       AND g.variant IS NOT DISTINCT FROM pk.variant
ORDER BY run_id, round, variant NULLS FIRST, benchmark
"""
"""Catalog view: :func:`summarize_eval` in SQL (pass@k as any-correct: every problem has n = k samples)."""
