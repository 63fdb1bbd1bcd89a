"""Stage ``eval``: held-out evaluation of a policy, greedy accuracy (and pass@k) on math benchmarks.

Round 0 is the starting policy (``rollout.policy``); round k >= 1 is the checkpoint round k of the
variant wrote. Prompts are built exactly as the rollout stage builds them
(:func:`pipeline.stages.base.policy_messages` with the run's instruction), generated through
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
import os
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.assets.benchmarks import ensure_benchmark
from pipeline.config import CAPOConfig, SamplingConfig
from pipeline.grading import grade
from pipeline.schemas import EVAL_SCHEMA
from pipeline.stages.base import (
    Stage,
    model_fingerprint,
    policy_messages,
    provenance,
    resolve_model,
    round_paths,
    run_table_stage,
)

log = logging.getLogger("capo.stages")

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


# -------------------------------------------------------------------------------------------- math
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are right (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    With ``n == k`` (what :func:`evaluate_policy` draws) it reduces to "any of the k samples is
    right": 1.0 when ``c > 0`` else 0.0. Computed as a product so large n does not overflow.

    Raises:
        ValueError: ``c`` outside ``[0, n]`` or ``k`` outside ``[1, n]`` (the values named).
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
                    variant: str | None = None, eval_root: Path | None = None, workers: int = 2,
                    answer: str = "boxed", truncated: str = "zero", sample_seed: int | None = None) -> pa.Table:
    """Generate and grade ``model``'s answers on the benchmarks -> an :data:`EVAL_SCHEMA` table.

    Every problem gets one greedy answer (temperature 0, n=1); with ``pass_k > 1`` the problems of
    ``pass_k_benchmarks`` (default: all) also get ``pass_k`` samples at temperature 1.0, top_p 1.0.
    The engine is loaded once; each decoding mode is one ``generate`` call over all benchmarks.
    ``eval_root`` is where benchmark tables live (default ``<data_dir>/eval``). ``answer`` and
    ``truncated`` are the verifier's rule (:class:`pipeline.config.VerifyConfig`, :func:`pipeline.grading.grade`).
    ``seed`` picks the problems and seeds the engine; ``sample_seed`` (None: ``seed``) seeds the engine
    alone, so the same problems can be sampled again under other random numbers (the sampled
    accuracy's own noise).

    Raises:
        ValueError: an empty ``instruction``, or the engine returned another number of results
            than prompts.
    """
    from pipeline.engines.host import policy_engine

    if not instruction:
        raise ValueError("instruction is empty; pass the run's policy instruction (CAPOConfig.instruction())")
    problems = load_problems(list(benchmarks), sample_size, seed, eval_root)
    k_set = set(benchmarks if pass_k_benchmarks is None else pass_k_benchmarks)
    sampled = [p for p in problems if pass_k > 1 and p["benchmark"] in k_set]
    runs = [("greedy", problems, 1, SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=max_tokens))]
    if sampled:
        runs.append(("sample", sampled, pass_k, SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=max_tokens)))
    engine = policy_engine(model, engine_cfg, seed=seed if sample_seed is None else sample_seed)  # the host's, when one runs
    rows = []
    try:
        for decoding, probs, n, sampling in runs:
            gens = engine.generate([policy_messages(p["question"], instruction) for p in probs], n, sampling)
            for p, gen in zip(probs, gens, strict=True):
                for j, s in enumerate(gen.samples):
                    rows.append({"run_id": run_id, "round": round_idx, "variant": variant, "policy": model,
                                 "benchmark": p["benchmark"], "prompt_id": p["prompt_id"], "decoding": decoding,
                                 "sample_idx": j, "gold_answer": p["gold_answer"], "response_text": s.text,
                                 "num_tokens": len(s.token_ids) if s.token_ids else None,
                                 "finish_reason": s.finish_reason})
        log.info("[eval] engine: %s", engine.stats.as_dict())
    finally:
        engine.close()
    graded = grade([(r["gold_answer"], r["response_text"] or "") for r in rows], workers, answer=answer,
                   finish_reasons=[r["finish_reason"] for r in rows], truncated=truncated)
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
def eval_path(cfg: CAPOConfig, round_idx: int) -> Path:
    """Where the eval table of round ``round_idx`` goes (round 0 is shared by every variant)."""
    return round_paths(cfg, round_idx)["eval"]


def eval_stage(cfg: CAPOConfig, round_idx: int, force: bool = False):
    """Evaluate round ``round_idx``'s policy on ``eval.benchmarks`` -> ``eval.parquet``.

    Raises:
        FileNotFoundError: round ``round_idx`` (> 0) has not written the checkpoint the eval reads.
    """
    ec = cfg.eval

    def compute():
        policy = eval_policy(cfg, round_idx)
        table = evaluate_policy(policy, ec.benchmarks, ec.sample_size, ec.seed, ec.engine or cfg.rollout.engine,
                                ec.max_tokens, ec.pass_k, cfg.instruction(), pass_k_benchmarks=ec.pass_k_benchmarks,
                                run_id=cfg.run_id, round_idx=round_idx, variant=cfg.variant if round_idx else None,
                                eval_root=Path(cfg.data_dir).resolve() / "eval", answer=cfg.verify.answer,
                                truncated=cfg.verify.truncated)
        summary = summarize_eval(table).to_pylist()
        for s in summary:
            log.info("[eval] round %d %s: accuracy %.3f on %d problems, %.0f tokens on average", round_idx,
                     s["benchmark"], s["accuracy"] or 0.0, s["n_problems"], s["mean_response_tokens"] or 0.0)
        # vLLM's batch-invariant kernels apply to a vLLM engine started in this process; the persistent
        # policy engine (vLLM only) generates in its own process, which records nothing here: not claimed
        from pipeline.engines.host import ADDRESS_ENV

        vllm_here = (ec.engine or cfg.rollout.engine).type == "vllm" and not os.environ.get(ADDRESS_ENV)
        invariant = os.environ.get("VLLM_BATCH_INVARIANT") == "1" and vllm_here
        return table, provenance(cfg, {"policy": policy, "summary": summary, "batch_invariant": invariant})

    return run_table_stage("eval", eval_path(cfg, round_idx), "eval", eval_key(cfg, round_idx), compute, force)


def eval_policy(cfg: CAPOConfig, round_idx: int) -> str:
    """The policy round ``round_idx`` evaluates: the starting one for 0, else round k's checkpoint.

    Raises:
        FileNotFoundError: round k has not committed its checkpoint yet.
    """
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

    from pipeline.assets.benchmarks import ensure_benchmark
    from pipeline.precision import precision_record

    ec = cfg.eval
    engine = ec.engine or cfg.rollout.engine
    root = Path(cfg.data_dir).resolve() / "eval"
    return {"round": round_idx, "dtype": precision_record(cfg)["eval_dtype"], "variant": cfg.variant if round_idx else None,
            "policy": model_fingerprint(eval_policy(cfg, round_idx)),
            "eval": ec.model_dump(mode="json", exclude={"enabled", "engine"}), "engine": engine.model_dump(mode="json"),
            "instruction": cfg.instruction(),
            "benchmarks": {n: storage.file_sha256(ensure_benchmark(n, root)) for n in ec.benchmarks},
            "verifier": f"math-verify=={version('math-verify')}", "verify": cfg.verify.model_dump(mode="json")}


def no_eval(cfg: CAPOConfig) -> str | None:
    """Why the eval stage has nothing to do under ``cfg`` (None: it has)."""
    return "eval.enabled is false: no held-out evaluation" if not cfg.eval.enabled else None


def eval_rounds(round_idx: int) -> list[int]:
    """Rounds to evaluate after training round ``round_idx``: its policy, and with round 1 also
    round 0 (the starting policy)."""
    return [0, round_idx] if round_idx == 1 else [round_idx]


STAGE = Stage("eval", ("checkpoint",), ("eval",), True, eval_key, "pipeline.stages.eval:eval_stage", no_eval,
              rounds=eval_rounds, engine_env=True, batch_invariant=True)
