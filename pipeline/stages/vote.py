"""Stage ``vote``: the N critiques of every response voted into step verdicts -> ``step_verdicts.parquet``.

Every voting rule is computed (one row per response x step x rule), so the reward stage and SQL can
compare rules without voting again; the rules are :mod:`pipeline.core.voting` (paper §3.3). The
critiques table holds up to three sources: the critic's N critiques (``source = 'llm'``), voted under
each rule into ``llm_weight``; one exact arithmetic check per response (``source = 'arithmetic'``),
stored as ``arithmetic_flag``; and with ``critique.logprob_readout`` the calibrated log-prob readout
(``source = 'logprob'``), stored as ``logprob_score``. ``weight``, the w_s the reward stage subtracts, is the larger of the
verdicts of the sources ``vote.sources`` names; under ``vote.random_credit`` (a control) it is
permuted among the response's steps (:func:`random_step_order`).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.critique import critique_votes
from pipeline.core.voting import VOTING_RULES, flag_counts, score_weights, vote
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
            "sources": cfg.vote.sources, "variant": cfg.variant,
            **({"logprob_threshold": cfg.vote.logprob_threshold} if "logprob" in cfg.vote.sources else {}),
            **({"random_credit": [cfg.seed, round_idx]} if cfg.vote.random_credit else {})}


def random_step_order(seed: int, round_idx: int, rollout_id: str, n_steps: int) -> np.ndarray:
    """The permutation the random-credit control applies to one response's step weights, shape
    ``(n_steps,)``: step ``i`` gets the weight of step ``perm[i]``. Seeded by (seed, round, a hash of
    the rollout id), so it is the same for every rule and every run of the stage."""
    import hashlib

    h = int.from_bytes(hashlib.sha256(str(rollout_id).encode()).digest()[:8], "little")
    return np.random.default_rng([int(seed), int(round_idx), h]).permutation(n_steps)


def vote_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Vote the critiques of every response under ALL rules -> ``step_verdicts.parquet``.

    Raises:
        FileNotFoundError: the round's steps or critiques table is missing.
        ValueError: a critique lists a step outside its response (:func:`pipeline.core.voting.flag_counts`).
    """
    p = round_paths(cfg, round_idx)
    key = vote_key(cfg, round_idx)

    def compute():
        steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "n_steps"]).to_pylist()
        n_steps = {r["rollout_id"]: r["n_steps"] for r in steps}
        crit = storage.read_table(p["critiques"], "critiques").select(
            ["rollout_id", "source", "wrong_steps", "steps_wrong_lines", "parse_status", "step_scores"])
        lists: dict[str, list] = {rid: [] for rid in n_steps}
        arith: dict[str, list[int] | None] = {}
        scores: dict[str, list[float] | None] = {}
        counts: Counter = Counter()
        for r in crit.to_pylist():
            if r["source"] == "arithmetic":
                arith[r["rollout_id"]] = r["wrong_steps"]  # None: an empty response, nothing checked
                continue
            if r["source"] == "logprob":
                scores[r["rollout_id"]] = r["step_scores"]
                continue
            lists[r["rollout_id"]].append(critique_votes(r["parse_status"], r["wrong_steps"], r["steps_wrong_lines"],
                                                         cfg.vote.partial_critiques))
            counts[r["parse_status"]] += 1
        use_llm, use_arith, use_lp = (s in cfg.vote.sources for s in ("llm", "arithmetic", "logprob"))
        cols: dict[str, list] = {k: [] for k in ("rollout_id", "step_idx", "rule", "n_valid", "n_flagged", "weight",
                                                 "llm_weight", "arithmetic_flag", "logprob_score")}
        for rid, S in n_steps.items():
            n_valid, n_flagged = flag_counts(lists[rid], S)
            a = np.zeros(S, dtype=np.float32)
            a_flags: list = [None] * S
            if arith.get(rid) is not None:
                a[np.asarray(arith[rid], dtype=np.int64)] = 1.0
                a_flags = (a > 0).tolist()
            q = np.zeros(S, dtype=np.float32)
            q_list: list = [None] * S
            if scores.get(rid) is not None:
                q = np.asarray(scores[rid], dtype=np.float32)
                q_list = q.tolist()
            perm = random_step_order(cfg.seed, round_idx, rid, S) if cfg.vote.random_credit else None
            for rule in VOTING_RULES:
                w_llm = vote(n_flagged, np.int32(n_valid), rule, cfg.vote.majority_threshold)
                w_lp = score_weights(q, rule, cfg.vote.logprob_threshold)
                w = np.maximum.reduce([w_llm if use_llm else np.zeros(S, np.float32), a if use_arith else 0.0 * a,
                                       w_lp if use_lp else 0.0 * a]).astype(np.float32)
                if perm is not None:  # the control: the same weights on randomly chosen steps
                    w = w[perm]
                cols["rollout_id"] += [rid] * S
                cols["step_idx"] += list(range(S))
                cols["rule"] += [rule] * S
                cols["n_valid"] += [n_valid] * S
                cols["n_flagged"] += n_flagged.tolist()
                cols["weight"] += w.tolist()
                cols["llm_weight"] += w_llm.tolist()
                cols["arithmetic_flag"] += a_flags
                cols["logprob_score"] += q_list
        n = len(cols["rollout_id"])
        table = pa.table({"run_id": [cfg.run_id] * n, "round": pa.array([round_idx] * n, pa.int32()),
                          "variant": [cfg.variant] * n, **cols,
                          "majority_threshold": pa.array([cfg.vote.majority_threshold] * n, pa.float32()),
                          "sources": ["+".join(cfg.vote.sources)] * n})
        voting = sum(v is not None for vs in lists.values() for v in vs)
        log.info("[vote] critiques by status %s; %d vote (partial critiques: %s); sources %s, arithmetic flags "
                 "%d steps", dict(counts), voting, cfg.vote.partial_critiques, "+".join(cfg.vote.sources),
                 sum(len(v or []) for v in arith.values()))
        return table.select(STEP_VERDICTS_SCHEMA.names).cast(STEP_VERDICTS_SCHEMA), provenance(cfg, {"critiques_by_status": dict(counts),
                                                                  "critiques_voting": voting,
                                                                  "partial_critiques": cfg.vote.partial_critiques,
                                                                  "sources": cfg.vote.sources,
                                                                  "arithmetic_flagged_steps": sum(len(v or []) for v in arith.values())})

    return run_table_stage("vote", p["step_verdicts"], "step_verdicts", key, compute, force)


STAGE = Stage("vote", ("steps", "critiques"), ("step_verdicts",), False, vote_key, "pipeline.stages.vote:vote_stage",
              no_step_votes)
