"""Stage ``rollout``: G responses per prompt from the round's policy -> ``rollouts.parquet``.

The prompts of round k are a seeded slice of the training prompts (:func:`select_prompt_indices`);
round 1 samples from ``rollout.policy``, round k > 1 from round k-1's checkpoint
(:func:`pipeline.stages.base.policy_for_round`). Every sampled token's id and the engine's log-prob
of it (after temperature, the PPO ratio's old log-prob check) are stored.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.tokenization import decode_with_bytes
from pipeline.schemas import ROLLOUTS_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    model_fingerprint,
    policy_for_round,
    policy_messages,
    prompts_path,
    provenance,
    round_paths,
    round_seed,
    run_table_stage,
)

log = logging.getLogger("capo.stages")


def select_prompt_indices(n_prompts: int, per_round: int, round_idx: int, seed: int) -> np.ndarray:
    """Indices of the prompts of round ``round_idx`` (1-based).

    A seeded permutation per epoch; rounds take consecutive slices, so prompts do not repeat until
    the training set is used up, then a new epoch (a new permutation) starts.
    """
    if per_round > n_prompts:
        raise ValueError(f"data.prompts_per_round={per_round} exceeds the {n_prompts} prompts available")
    start, stop = (round_idx - 1) * per_round, round_idx * per_round
    out = []
    for pos in range(start, stop):
        epoch, off = divmod(pos, n_prompts)
        perm = np.random.default_rng([seed, epoch]).permutation(n_prompts)
        out.append(perm[off])
    return np.asarray(out, dtype=np.int64)


def rollout_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the rollouts depend on: data, rollout settings, resolved dtype, policy and prompts."""
    from pipeline.precision import precision_record

    c = cfg.model_dump(mode="json")
    return {"round": round_idx, "seed": cfg.seed, "data": c["data"], "rollout": c["rollout"],
            "dtype": precision_record(cfg)["rollout_dtype"], "engine_logprobs": "processed",  # after temperature/top-p
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)),
            "prompts": storage.file_sha256(prompts_path(cfg))}


def rollout_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Sample G responses per prompt from the round's policy -> ``rollouts.parquet``."""
    p = round_paths(cfg, round_idx)
    key = rollout_key(cfg, round_idx)

    def compute():
        policy = policy_for_round(cfg, round_idx)
        prompts = pq.read_table(prompts_path(cfg))
        idx = select_prompt_indices(prompts.num_rows, cfg.data.prompts_per_round, round_idx, cfg.seed)
        chosen = prompts.take(pa.array(idx)).to_pylist()
        convs = [policy_messages(r["question"], cfg.instruction()) for r in chosen]
        from pipeline.engines.host import policy_engine

        engine = policy_engine(policy, cfg.rollout.engine, seed=round_seed(cfg, round_idx, 1))
        gens = engine.generate(convs, cfg.rollout.group_size, cfg.rollout.sampling)
        rows = []
        for prompt, gen in zip(chosen, gens):
            for j, s in enumerate(gen.samples):
                text, _, _ = decode_with_bytes(engine.tokenizer, s.token_ids)
                rows.append({
                    "run_id": cfg.run_id, "round": round_idx,
                    "rollout_id": f"{cfg.run_id}/r{round_idx}/{prompt['prompt_id']}/{j}",
                    "prompt_id": prompt["prompt_id"], "sample_idx": j, "policy": policy,
                    "prompt_token_ids": gen.prompt_token_ids, "response_text": text,
                    "response_token_ids": s.token_ids, "rollout_logprobs": s.logprobs,
                    "finish_reason": s.finish_reason, "num_tokens": len(s.token_ids),
                })
        stats = engine.stats.as_dict()
        engine.close()
        log.info("rollout engine: %s", json.dumps(stats))
        return pa.Table.from_pylist(rows, schema=ROLLOUTS_SCHEMA), provenance(cfg, {"engine": stats, "policy": policy})

    return run_table_stage("rollout", p["rollouts"], "rollouts", key, compute, force)


STAGE = Stage("rollout", (), ("rollouts",), True, rollout_key, "pipeline.stages.rollout:rollout_stage")
