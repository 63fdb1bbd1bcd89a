"""Stage ``verify``: math-verify every response against its gold answer -> ``outcomes.parquet``.

Light (seconds per round), but it fans out to a process pool (:func:`pipeline.grading.grade`):
math-verify enforces its timeouts with ``signal.alarm``, which works only in a process's main thread.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.grading import grade
from pipeline.schemas import OUTCOMES_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    prompts_path,
    provenance,
    round_paths,
    run_table_stage,
)


def verify_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the outcomes depend on: rollouts, prompts (gold answers), the verifier's version and rule."""
    from importlib.metadata import version

    return {"rollouts": input_fp(round_paths(cfg, round_idx)["rollouts"]),
            "prompts": storage.file_sha256(prompts_path(cfg)), "verifier": f"math-verify=={version('math-verify')}",
            "verify": cfg.verify.model_dump(mode="json")}


def verify_stage(cfg: CAPOConfig, round_idx: int, force: bool = False, workers: int = 2) -> StageResult:
    """math-verify every response against its gold answer -> ``outcomes.parquet``, under the rule of
    ``cfg.verify`` (a response cut at the token budget is wrong by default, status ``truncated``).

    Raises:
        ValueError: a rollout's prompt is not in the prompt table (the prompt ids named).
    """
    p = round_paths(cfg, round_idx)
    key = verify_key(cfg, round_idx)

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "response_text", "finish_reason"]).to_pylist()
        gold = {r["prompt_id"]: r["gold_answer"] for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "gold_answer"]).to_pylist()}
        missing = sorted({r["prompt_id"] for r in ro} - set(gold))
        if missing:
            raise ValueError(f"round {round_idx}'s rollouts answer prompts that {prompts_path(cfg)} does not hold: "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; the prompt table changed since the "
                             "rollouts were sampled: run the round's rollout stage again (--force) or restore the table")
        pairs = [(gold[r["prompt_id"]], r["response_text"] or "") for r in ro]
        results = grade(pairs, workers=workers, answer=cfg.verify.answer,
                        finish_reasons=[r["finish_reason"] for r in ro], truncated=cfg.verify.truncated)
        rows = [{"run_id": cfg.run_id, "round": round_idx, "rollout_id": r["rollout_id"], "prompt_id": r["prompt_id"],
                 "gold_answer": gold[r["prompt_id"]], "extracted_answer": ext, "outcome_correct": ok, "verify_status": st}
                for r, (ext, ok, st) in zip(ro, results)]
        acc = float(np.mean([x[1] for x in results])) if results else 0.0
        return pa.Table.from_pylist(rows, schema=OUTCOMES_SCHEMA), provenance(cfg, {"accuracy": acc})

    return run_table_stage("verify", p["outcomes"], "outcomes", key, compute, force)


STAGE = Stage("verify", ("rollouts",), ("outcomes",), False, verify_key, "pipeline.stages.verify:verify_stage")
