"""Stage ``reward``: per-token rewards and advantages for the config's variant -> ``token_rewards.parquet``.

The CAPO reward (paper §3.4, eq. 6): every token of step j gets ``C*r_v - P*w_j`` where ``r_v`` is the
outcome reward and ``w_j`` the step's vote; the formulas are :mod:`pipeline.core.rewards`. This module
turns the tables into their inputs, vectorized end to end (numpy + pyarrow list arrays).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.critique.mode import critique_mode
from pipeline.core.rewards import (
    ADVANTAGE_ESTIMATORS,
    RoundRewards,
    overlong_penalty,
    shuffle_within_groups,
    token_rewards,
)
from pipeline.schemas import TOKEN_REWARDS_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    provenance,
    round_paths,
    run_table_stage,
)

DENSR_WEIGHTS_VERSION = "noise-floor-1e-4"
"""In a DenseR reward key: divergences below :data:`pipeline.core.densr.NOISE_BELOW` count as 0
(token rewards written before the floor are recomputed)."""


def reward_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the token rewards depend on: rollouts, outcomes, the step verdicts
    (process mode) or critiques (GenORM), vote and reward settings and the variant."""
    p = round_paths(cfg, round_idx)
    c = cfg.model_dump(mode="json")
    ins = {"rollouts": input_fp(p["rollouts"]), "outcomes": input_fp(p["outcomes"])}
    mode = critique_mode(cfg.critique)
    if mode.type == "process":
        ins.update(steps=input_fp(p["steps"]), step_verdicts=input_fp(p["step_verdicts"]))
    if cfg.reward.estimator == "vineppo":
        ins.update(steps=input_fp(p["steps"]), mc_values=input_fp(p["mc_values"]), mc=cfg.mc.model_dump(mode="json"))
    if cfg.reward.estimator == "densr":
        ins.update(token_divergence=input_fp(p["token_divergence"]), densr=cfg.densr.model_dump(mode="json"),
                   densr_weights=DENSR_WEIGHTS_VERSION)
    if mode.type == "outcome":
        ins.update(critiques=input_fp(p["critiques"]))
    reward = dict(c["reward"])
    overlong = {k: reward.pop(k) for k in ("overlong_buffer", "overlong_penalty")}
    if overlong["overlong_buffer"]:  # in the key only when on: rewards computed before the option keep their key
        reward["overlong"] = {**overlong, "max_tokens": cfg.rollout.sampling.max_tokens}
    if cfg.reward.outcome == "shuffled":  # the permutation's seed, in the key only then (other keys stay)
        reward["shuffle_seed"] = [cfg.seed, round_idx]
    vote = dict(c["vote"])
    if vote["sources"] == ["llm"]:  # the default source and an unused threshold stay out: earlier keys hold
        del vote["sources"]
    if "logprob" not in cfg.vote.sources:
        del vote["logprob_threshold"]
    if not vote["random_credit"]:  # the control, in the key only when on
        del vote["random_credit"]
    return {**ins, "critique_enabled": cfg.critique.enabled, "critique_mode": cfg.critique.mode,
            "vote": vote, "reward": reward, "variant": cfg.variant}


def reward_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Token rewards ``C*r_v - P*w`` and advantages for the config's variant -> ``token_rewards``.

    Vectorized end to end (numpy + pyarrow list arrays): no per-token Python.

    Raises:
        ValueError: the round's tables disagree (a rollout without an outcome or without steps,
            steps that do not cover a response's tokens, MC values of unknown rollouts or states);
            each message names the rollout and the stage to run again.
    """
    p = round_paths(cfg, round_idx)
    key = reward_key(cfg, round_idx)
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
        if rc.outcome == "shuffled":  # the control: each group's outcomes dealt out again at random
            r_v = shuffle_within_groups(r_v, groups, [cfg.seed, round_idx])
        process = critique_mode(cfg.critique).votes_steps
        vine, densr = rc.estimator == "vineppo", rc.estimator == "densr"
        B = len(n_tok)
        if process or vine:  # one run per step: the tokens of a step share their reward
            pos_S, len_S, w_S, n_valid = _step_runs(p, rid, offsets, cfg.vote.rule if process else None)
        elif densr:  # one run per token: each token has its own weight
            pos_S, len_S = np.repeat(np.arange(B), n_tok), np.ones(int(offsets[-1]), np.int64)
            w_S, n_valid = np.zeros(len(len_S), np.float32), np.zeros(B, np.int32)
        else:  # one run per response
            pos_S, len_S, w_S, n_valid = np.arange(B), n_tok, np.zeros(B, np.float32), np.zeros(B, np.int32)
        run_off = np.concatenate([[0], np.cumsum(np.bincount(pos_S, minlength=B))])
        R_S = token_rewards(r_v, w_S, run_off, rc.correct_weight, rc.process_weight)  # (S,), runs sorted by response
        pen_B = np.zeros(B, np.float32)
        if rc.overlong_buffer:  # DAPO's soft overlong punishment, the same for every token of a response
            pen_B = overlong_penalty(n_tok, cfg.rollout.sampling.max_tokens, rc.overlong_buffer, rc.overlong_penalty)
            R_S = R_S + pen_B[pos_S]
        values = _mc_state_values(p, rid.to_pylist(), r_v, groups, np.bincount(pos_S, minlength=B),
                                  cfg.mc.max_states) if vine else (None, None)
        token_w = _densr_weights(p, rid.to_pylist(), n_tok, offsets, cfg.densr.layer, cfg.densr.mix) if densr else None
        A_S = ADVANTAGE_ESTIMATORS[rc.estimator](RoundRewards(R_S, len_S, pos_S, r_v, pen_B, groups, rc.correct_weight,
                                                              rc.scale_by_std, rc.eps, *values, token_w))
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
        overlong_stats = ({"overlong_penalized": int((pen_B < 0).sum()), "mean_overlong_penalty": float(pen_B.mean())}
                          if rc.overlong_buffer else {})
        extra = {"share_tokens_penalized": float(n_pen.sum() / max(len(R), 1)),
                 "mean_token_reward": float(R.mean()) if len(R) else None, "outcome_source": rc.outcome, **genorm_stats, **overlong_stats}
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


def _mc_state_values(p, rollout_ids: list[str], r_v: np.ndarray, groups: np.ndarray, n_steps: np.ndarray,
                     max_states: int) -> tuple[np.ndarray, np.ndarray]:
    """Each response's Monte Carlo state values ``V(S_0) .. V(S_{M-1})`` for the vineppo estimator:
    ``V(S_0)`` the group's other outcomes (:func:`pipeline.core.mc.leave_one_out_means`), the rest from
    ``mc_values.parquet``. Returns ``(state_values (sum M,), n_states (B,))``.

    Raises:
        ValueError: the table lacks a state the steps call for, or holds one they do not (re-run the mc stage).
    """
    from pipeline.core.mc import leave_one_out_means
    from pipeline.stages.mc import read_state_values

    v0 = leave_one_out_means(r_v, groups)
    got = read_state_values(p["mc_values"])
    values, n_states = [], np.ones(len(rollout_ids), np.int64)
    for b, rid in enumerate(rollout_ids):
        have = got.pop(rid, {})
        m = len(have) + 1
        want = min(int(n_steps[b]), max_states) if n_steps[b] >= 2 else 1  # one step (or empty): S_0 only
        if sorted(have) != list(range(1, m)) or m != want:
            raise ValueError(f"mc_values.parquet holds states {sorted(have)} of rollout {rid}, which has "
                             f"{int(n_steps[b])} steps (mc.max_states={max_states}); re-run the mc stage")
        n_states[b] = m
        values += [v0[b]] + [have[k] for k in range(1, m)]
    if got:
        raise ValueError(f"mc_values.parquet holds states of {len(got)} rollouts not in rollouts.parquet, e.g. "
                         f"{next(iter(got))}; re-run the mc stage")
    return np.asarray(values, np.float64), n_states


def _densr_weights(p, rollout_ids: list[str], n_tok: np.ndarray, offsets: np.ndarray, layer: int,
                   mix: float) -> np.ndarray:
    """DenseR's (N,) per-token weights from ``token_divergence.parquet`` (:func:`pipeline.core.densr.densr_weights`)."""
    from pipeline.core.densr import densr_weights
    from pipeline.stages.densr import read_divergence

    return densr_weights(read_divergence(p["token_divergence"], rollout_ids, n_tok, layer), offsets, mix)


def _step_runs(p, rid: pa.Array, offsets: np.ndarray, rule: str | None) -> tuple[np.ndarray, ...]:
    """Steps as runs of tokens, sorted by (response position, step_idx).

    Returns ``pos_S`` (S,) response position, ``len_S`` (S,) tokens, ``w_S`` (S,) voted weight of
    ``rule`` (0 without a verdict, and everywhere when ``rule`` is None: no votes read) and
    ``n_valid_B`` (B,) valid critiques per response. The step token spans must tile every response
    exactly (checked), so ``np.repeat(x_S, len_S)`` is the per-token array.
    """
    steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "token_start", "token_end"])
    if rule is None:
        j = steps.append_column("n_valid", pa.nulls(steps.num_rows, pa.int32())).append_column(
            "weight", pa.nulls(steps.num_rows, pa.float32()))
    else:
        verd = storage.read_table(p["step_verdicts"], "step_verdicts")
        verd = verd.filter(pc.equal(verd.column("rule"), rule)).select(["rollout_id", "step_idx", "n_valid", "weight"])
        j = steps.join(verd, keys=["rollout_id", "step_idx"], join_type="left outer")
    pos_arr = pc.index_in(j.column("rollout_id"), value_set=rid)
    if pos_arr.null_count:
        strays = sorted(set(pc.filter(j.column("rollout_id"), pc.is_null(pos_arr)).to_pylist()))
        raise ValueError(f"steps.parquet has {pos_arr.null_count} steps of rollouts not in rollouts.parquet "
                         f"(e.g. {strays[:3]}): the steps were made from other rollouts; run the round again "
                         "(`capo round`), which segments the current rollouts first")
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


STAGE = Stage("reward", ("rollouts", "outcomes", "steps", "step_verdicts", "critiques", "mc_values", "token_divergence"),
              ("token_rewards",), False, reward_key, "pipeline.stages.reward:reward_stage")
