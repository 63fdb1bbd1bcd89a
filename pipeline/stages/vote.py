"""Stage ``vote``: the N critiques of every response voted into step verdicts -> ``step_verdicts.parquet``.

Every voting rule is computed (one row per response x step x rule), so the reward stage and SQL can
compare rules without voting again; the rules are :mod:`pipeline.core.voting` (paper §3.3).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.critique import critique_votes
from pipeline.core.voting import VOTING_RULES, flag_counts, vote
from pipeline.schemas import STEP_VERDICTS_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    no_step_votes,
    provenance,
    round_paths,
    run_table_stage,
)

log = logging.getLogger("capo.stages")


def vote_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the step verdicts depend on: steps, critiques, vote settings and the variant."""
    p = round_paths(cfg, round_idx)
    return {"steps": input_fp(p["steps"]), "critiques": input_fp(p["critiques"]),
            "majority_threshold": cfg.vote.majority_threshold, "partial_critiques": cfg.vote.partial_critiques,
            "variant": cfg.variant}


def vote_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Vote the critiques of every response under ALL rules -> ``step_verdicts.parquet``."""
    p = round_paths(cfg, round_idx)
    key = vote_key(cfg, round_idx)

    def compute():
        steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "n_steps"]).to_pylist()
        n_steps = {r["rollout_id"]: r["n_steps"] for r in steps}
        crit = storage.read_table(p["critiques"], "critiques").select(
            ["rollout_id", "wrong_steps", "steps_wrong_lines", "parse_status"])
        lists: dict[str, list] = {rid: [] for rid in n_steps}
        counts: Counter = Counter()
        for r in crit.to_pylist():
            lists[r["rollout_id"]].append(critique_votes(r["parse_status"], r["wrong_steps"], r["steps_wrong_lines"],
                                                         cfg.vote.partial_critiques))
            counts[r["parse_status"]] += 1
        cols: dict[str, list] = {k: [] for k in ("rollout_id", "step_idx", "rule", "n_valid", "n_flagged", "weight")}
        for rid, S in n_steps.items():
            n_valid, n_flagged = flag_counts(lists[rid], S)
            for rule in VOTING_RULES:
                w = vote(n_flagged, np.int32(n_valid), rule, cfg.vote.majority_threshold)
                cols["rollout_id"] += [rid] * S
                cols["step_idx"] += list(range(S))
                cols["rule"] += [rule] * S
                cols["n_valid"] += [n_valid] * S
                cols["n_flagged"] += n_flagged.tolist()
                cols["weight"] += w.tolist()
        n = len(cols["rollout_id"])
        table = pa.table({"run_id": [cfg.run_id] * n, "round": pa.array([round_idx] * n, pa.int32()),
                          "variant": [cfg.variant] * n, **cols,
                          "majority_threshold": pa.array([cfg.vote.majority_threshold] * n, pa.float32())})
        voting = sum(v is not None for vs in lists.values() for v in vs)
        log.info("[vote] critiques by status %s; %d vote (partial critiques: %s)", dict(counts), voting,
                 cfg.vote.partial_critiques)
        return table.cast(STEP_VERDICTS_SCHEMA), provenance(cfg, {"critiques_by_status": dict(counts),
                                                                  "critiques_voting": voting,
                                                                  "partial_critiques": cfg.vote.partial_critiques})

    return run_table_stage("vote", p["step_verdicts"], "step_verdicts", key, compute, force)


STAGE = Stage("vote", ("steps", "critiques"), ("step_verdicts",), False, vote_key, "pipeline.stages.vote:vote_stage",
              no_step_votes)
