"""The light stages: verify (outcome), segment (steps), vote (step verdicts), reward (token rewards).

They are cheap (seconds per round) and run inside the flow process; only ``verify`` fans out to a
process pool, because math-verify enforces its timeouts with ``signal.alarm``, which works only in
a process's main thread.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.critique import critique_votes
from pipeline.core.rewards import (
    group_run_advantages,
    grpo_sequence_advantages,
    token_rewards,
)
from pipeline.core.segment import segment_response
from pipeline.core.voting import VOTING_RULES, flag_counts, vote
from pipeline.grading import grade
from pipeline.schemas import (
    OUTCOMES_SCHEMA,
    STEP_VERDICTS_SCHEMA,
    STEPS_SCHEMA,
    TOKEN_REWARDS_SCHEMA,
)
from pipeline.stages import (
    StageResult,
    prompts_path,
    provenance,
    round_paths,
    run_table_stage,
    stage_key,
)

log = logging.getLogger("capo.stages")


# ------------------------------------------------------------------------------------------- verify
def verify_stage(cfg: CAPOConfig, round_idx: int, force: bool = False, workers: int = 2) -> StageResult:
    """math-verify every response against its gold answer -> ``outcomes.parquet``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("verify", cfg, round_idx)

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "response_text"]).to_pylist()
        gold = {r["prompt_id"]: r["gold_answer"] for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "gold_answer"]).to_pylist()}
        pairs = [(gold[r["prompt_id"]], r["response_text"] or "") for r in ro]
        results = grade(pairs, workers=workers)
        rows = [{"run_id": cfg.run_id, "round": round_idx, "rollout_id": r["rollout_id"], "prompt_id": r["prompt_id"],
                 "gold_answer": gold[r["prompt_id"]], "extracted_answer": ext, "outcome_correct": ok, "verify_status": st}
                for r, (ext, ok, st) in zip(ro, results)]
        acc = float(np.mean([x[1] for x in results])) if results else 0.0
        return pa.Table.from_pylist(rows, schema=OUTCOMES_SCHEMA), provenance(cfg, {"accuracy": acc})

    return run_table_stage("verify", p["outcomes"], "outcomes", key, compute, force)


# ------------------------------------------------------------------------------------------ segment
def segment_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Split responses into steps and map tokens to steps -> ``steps.parquet``."""
    from pipeline.core.tokenization import decode_with_bytes
    from pipeline.engines import load_tokenizer

    p = round_paths(cfg, round_idx)
    key = stage_key("segment", cfg, round_idx)

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "policy", "response_token_ids"])
        tokenizers: dict = {}
        rows = []
        for r in ro.to_pylist():
            tok = tokenizers.get(r["policy"]) or tokenizers.setdefault(r["policy"], load_tokenizer(r["policy"]))
            text, raw, nbytes = decode_with_bytes(tok, r["response_token_ids"])
            seg = segment_response(text, nbytes, cfg.steps.mode, text_bytes=raw)
            for s, ((cs, ce), st) in enumerate(zip(seg.step_spans, seg.step_texts)):
                rows.append({"run_id": cfg.run_id, "round": round_idx, "rollout_id": r["rollout_id"], "step_idx": s,
                             "n_steps": seg.n_steps, "char_start": cs, "char_end": ce,
                             "token_start": int(seg.token_start[s]), "token_end": int(seg.token_end[s]),
                             "step_text": st, "empty_response": seg.empty})
        return pa.Table.from_pylist(rows, schema=STEPS_SCHEMA), provenance(cfg)

    return run_table_stage("segment", p["steps"], "steps", key, compute, force)


# --------------------------------------------------------------------------------------------- vote
def vote_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Vote the critiques of every response under ALL rules -> ``step_verdicts.parquet``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("vote", cfg, round_idx)

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


# ------------------------------------------------------------------------------------------- reward
def reward_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Token rewards ``C*r_v - P*w`` and advantages for the config's variant -> ``token_rewards``.

    Vectorized end to end (numpy + pyarrow list arrays): no per-token Python.
    """
    p = round_paths(cfg, round_idx)
    key = stage_key("reward", cfg, round_idx)
    rc = cfg.reward

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "num_tokens"])
        rid = ro.column("rollout_id").combine_chunks()
        oc_t = storage.read_table(p["outcomes"], "outcomes").select(["rollout_id", "outcome_correct"])
        at = pc.index_in(rid, value_set=oc_t.column("rollout_id").combine_chunks())
        if at.null_count:
            raise ValueError(f"{at.null_count} rollouts have no outcome in {p['outcomes']}; re-run the verify stage")
        correct = oc_t.column("outcome_correct").combine_chunks().take(at).to_numpy(zero_copy_only=False).astype(bool)
        n_tok = ro.column("num_tokens").to_numpy().astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(n_tok)])
        r_v = correct.astype(np.float64)
        genorm_stats = {}
        if rc.outcome == "genorm":
            r_v, genorm_stats = _genorm_outcomes(p, rid.to_pylist(), r_v)
        groups = pc.dictionary_encode(ro.column("prompt_id").combine_chunks()).indices.to_numpy()
        process = cfg.critique.enabled and cfg.critique.mode == "process"
        B = len(n_tok)
        if process:  # one run per step: the tokens of a step share their reward
            pos_S, len_S, w_S, n_valid = _step_runs(p, rid, offsets, cfg.vote.rule)
        else:  # one run per response
            pos_S, len_S, w_S, n_valid = np.arange(B), n_tok, np.zeros(B, np.float32), np.zeros(B, np.int32)
        run_off = np.concatenate([[0], np.cumsum(np.bincount(pos_S, minlength=B))])
        R_S = token_rewards(r_v, w_S, run_off, rc.correct_weight, rc.process_weight)  # (S,), runs sorted by response
        if rc.estimator == "grpo":
            A_S = grpo_sequence_advantages(rc.correct_weight * r_v, groups, rc.scale_by_std, rc.eps)[pos_S]
        else:
            A_S = group_run_advantages(R_S, len_S, groups[pos_S], rc.scale_by_std, rc.eps)
        R, A = np.repeat(R_S, len_S), np.repeat(A_S, len_S)  # (N,): the only per-token work
        pen_S = (w_S > 0) & (rc.process_weight > 0)
        n_pen = np.bincount(pos_S, weights=len_S * pen_S, minlength=B).astype(np.int64)
        off32 = pa.array(offsets.astype(np.int32))
        table = pa.table({
            "run_id": pa.array([cfg.run_id] * B, pa.string()), "round": pa.array(np.full(B, round_idx, np.int32)),
            "variant": pa.array([cfg.variant] * B, pa.string()), "rollout_id": rid,
            "prompt_id": ro.column("prompt_id").combine_chunks(), "outcome_correct": pa.array(correct),
            "outcome_reward": pa.array(r_v.astype(np.float32)),
            "rule": pa.array([cfg.vote.rule if process else None] * B, pa.string()),
            "n_valid_critiques": pa.array(n_valid.astype(np.int32)), "n_penalized_tokens": pa.array(n_pen.astype(np.int32)),
            "rewards": pa.ListArray.from_arrays(off32, pa.array(R.astype(np.float32))),
            "advantages": pa.ListArray.from_arrays(off32, pa.array(A.astype(np.float32))),
            "reward_config_hash": pa.array([storage.key_hash(key)] * B, pa.string()),
        })
        extra = {"share_tokens_penalized": float(n_pen.sum() / max(len(R), 1)),
                 "mean_token_reward": float(R.mean()) if len(R) else None, "outcome_source": rc.outcome, **genorm_stats}
        return table.cast(TOKEN_REWARDS_SCHEMA), provenance(cfg, extra)

    return run_table_stage("reward", p["token_rewards"], "token_rewards", key, compute, force)


def _genorm_outcomes(p, rollout_ids: list[str], rule_r_v: np.ndarray) -> tuple[np.ndarray, dict]:
    """GenORM outcome reward: 1 iff strictly more than half of the valid verdicts say correct.

    A response with no valid verdict gets 0. Returns (B,) rewards and agreement statistics with
    the rule verifier (how often the critic's majority equals math-verify's verdict).
    """
    crit = storage.read_table(p["critiques"], "critiques").select(["rollout_id", "outcome_verdict", "parse_status"])
    yes: dict[str, list[bool]] = {}
    for c in crit.to_pylist():
        if c["parse_status"] == "ok":
            yes.setdefault(c["rollout_id"], []).append(bool(c["outcome_verdict"]))
    r = np.array([1.0 if sum(yes.get(x, [])) * 2 > len(yes.get(x, [])) else 0.0 for x in rollout_ids])
    no_valid = sum(1 for x in rollout_ids if not yes.get(x))
    return r, {"genorm_agreement_with_rule": float((r == rule_r_v).mean()) if len(r) else None,
               "genorm_no_valid_verdict": no_valid}


def _step_runs(p, rid: pa.Array, offsets: np.ndarray, rule: str) -> tuple[np.ndarray, ...]:
    """Steps as runs of tokens, sorted by (response position, step_idx).

    Returns ``pos_S`` (S,) response position, ``len_S`` (S,) tokens, ``w_S`` (S,) voted weight of
    ``rule`` (0 without a verdict) and ``n_valid_B`` (B,) valid critiques per response. The step
    token spans must tile every response exactly (checked), so ``np.repeat(x_S, len_S)`` is the
    per-token array.
    """
    steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "token_start", "token_end"])
    verd = storage.read_table(p["step_verdicts"], "step_verdicts")
    verd = verd.filter(pc.equal(verd.column("rule"), rule)).select(["rollout_id", "step_idx", "n_valid", "weight"])
    j = steps.join(verd, keys=["rollout_id", "step_idx"], join_type="left outer")
    pos_arr = pc.index_in(j.column("rollout_id"), value_set=rid)
    if pos_arr.null_count:
        raise ValueError(f"steps.parquet has {pos_arr.null_count} steps of rollouts not in rollouts.parquet")
    pos = pos_arr.to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.lexsort((j.column("step_idx").to_numpy(), pos))
    pos = pos[order]
    start = j.column("token_start").to_numpy()[order].astype(np.int64)
    length = j.column("token_end").to_numpy()[order].astype(np.int64) - start
    weight = pc.fill_null(j.column("weight"), 0.0).to_numpy()[order].astype(np.float32)
    n_valid_s = pc.fill_null(j.column("n_valid"), 0).to_numpy()[order].astype(np.int32)
    B = len(offsets) - 1
    covered = np.bincount(pos, weights=length, minlength=B).astype(np.int64)
    first_tok = np.cumsum(length) - length - offsets[pos]  # where each step must start in its response
    bad = np.nonzero(covered != np.diff(offsets))[0]
    if len(bad) or np.any(first_tok != start):
        i = int(bad[0]) if len(bad) else int(pos[np.nonzero(first_tok != start)[0][0]])
        raise ValueError(f"steps of rollout {rid[i].as_py()} cover {covered[i]} tokens or are not contiguous, "
                         f"expected {np.diff(offsets)[i]} tokens tiled from 0: steps.parquet is inconsistent "
                         "with rollouts.parquet (re-run the segment stage)")
    missing = np.nonzero(np.bincount(pos, minlength=B) == 0)[0]
    if len(missing):
        raise ValueError(f"rollout {rid[int(missing[0])].as_py()} has no steps; re-run the segment stage")
    n_valid = np.zeros(B, dtype=np.int32)
    np.maximum.at(n_valid, pos, n_valid_s)
    return pos, length, weight, n_valid
