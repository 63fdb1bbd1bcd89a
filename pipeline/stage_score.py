"""The light stages: verify (outcome), segment (steps), vote (step verdicts), reward (token rewards).

They are cheap (seconds per round) and run inside the flow process; only ``verify`` fans out to a
process pool, because math-verify enforces its timeouts with ``signal.alarm``, which works only in
a process's main thread.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.rewards import broadcast_to_tokens, group_token_advantages, grpo_sequence_advantages, token_rewards
from pipeline.schemas import OUTCOMES_SCHEMA, STEP_VERDICTS_SCHEMA, STEPS_SCHEMA, TOKEN_REWARDS_SCHEMA
from pipeline.segment import segment_response
from pipeline.stages import StageResult, _run, _with_prov, prompts_path, round_paths, stage_key
from pipeline.voting import VOTING_RULES, flag_counts, vote

log = logging.getLogger("capo.stages")


# ------------------------------------------------------------------------------------------- verify
def verify_answer(gold: str, response: str) -> tuple[str | None, bool, str]:
    """Grade one response with math-verify (call in a process's main thread).

    Returns:
        (extracted answer or None, correct, status) with status ``ok`` | ``no_answer`` |
        ``no_gold`` | ``error:<ExceptionType>``.
    """
    from math_verify import parse, verify

    try:
        # math-verify finds LaTeX only inside delimiters: a bare gold such as ``\\sqrt{2}`` or
        # ``2\\pi`` must be wrapped too, or it parses to nothing (or to ``2``).
        delimited = any(d in gold for d in ("$", "\\boxed", "\\(", "\\["))
        gold_parsed = parse(gold if delimited else f"${gold}$")
        if not gold_parsed:
            return None, False, "no_gold"
        pred = parse(response)
        if not pred:
            return None, False, "no_answer"
        return str(pred[-1]), bool(verify(gold_parsed, pred)), "ok"
    except Exception as e:  # math-verify raises many types on odd LaTeX; record it as data
        return None, False, f"error:{type(e).__name__}"


def _verify_chunk(pairs: list[tuple[str, str]]) -> list[tuple[str | None, bool, str]]:
    return [verify_answer(g, r) for g, r in pairs]


def verify_stage(cfg: CAPOConfig, round_idx: int, force: bool = False, workers: int = 2) -> StageResult:
    """math-verify every response against its gold answer -> ``outcomes.parquet``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("verify", cfg, round_idx)

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "response_text"]).to_pylist()
        gold = {r["prompt_id"]: r["gold_answer"] for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "gold_answer"]).to_pylist()}
        pairs = [(gold[r["prompt_id"]], r["response_text"] or "") for r in ro]
        chunks = [pairs[i : i + 64] for i in range(0, len(pairs), 64)]
        with ProcessPoolExecutor(max_workers=max(1, min(workers, len(chunks))), mp_context=mp.get_context("spawn")) as pool:
            results = [x for chunk in pool.map(_verify_chunk, chunks) for x in chunk]
        rows = [{"run_id": cfg.run_id, "round": round_idx, "rollout_id": r["rollout_id"], "prompt_id": r["prompt_id"],
                 "gold_answer": gold[r["prompt_id"]], "extracted_answer": ext, "outcome_correct": ok, "verify_status": st}
                for r, (ext, ok, st) in zip(ro, results)]
        acc = float(np.mean([x[1] for x in results])) if results else 0.0
        return pa.Table.from_pylist(rows, schema=OUTCOMES_SCHEMA), _with_prov(cfg, {"accuracy": acc})

    return _run("verify", p["outcomes"], "outcomes", key, compute, force)


# ------------------------------------------------------------------------------------------ segment
def segment_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Split responses into steps and map tokens to steps -> ``steps.parquet``."""
    from pipeline.engines import load_tokenizer
    from pipeline.tokenization import decode_with_bytes

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
        return pa.Table.from_pylist(rows, schema=STEPS_SCHEMA), _with_prov(cfg)

    return _run("segment", p["steps"], "steps", key, compute, force)


# --------------------------------------------------------------------------------------------- vote
def vote_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Vote the critiques of every response under ALL rules -> ``step_verdicts.parquet``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("vote", cfg, round_idx)

    def compute():
        steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "n_steps"]).to_pylist()
        n_steps = {r["rollout_id"]: r["n_steps"] for r in steps}
        crit = storage.read_table(p["critiques"], "critiques").select(["rollout_id", "wrong_steps", "parse_status"])
        lists: dict[str, list] = {rid: [] for rid in n_steps}
        for r in crit.to_pylist():
            lists[r["rollout_id"]].append(tuple(r["wrong_steps"]) if r["parse_status"] == "ok" else None)
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
        return table.cast(STEP_VERDICTS_SCHEMA), _with_prov(cfg)

    return _run("vote", p["step_verdicts"], "step_verdicts", key, compute, force)


# ------------------------------------------------------------------------------------------- reward
def reward_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Token rewards ``C*r_v - P*w`` and advantages for the config's variant -> ``token_rewards``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("reward", cfg, round_idx)
    rc = cfg.reward

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "num_tokens"]).to_pylist()
        oc = {r["rollout_id"]: r["outcome_correct"] for r in storage.read_table(p["outcomes"], "outcomes").to_pylist()}
        n_tok = np.array([r["num_tokens"] for r in ro], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n_tok)])
        r_v = np.array([1.0 if oc[r["rollout_id"]] else 0.0 for r in ro])
        genorm_stats = {}
        if rc.outcome == "genorm":
            r_v, genorm_stats = _genorm_outcomes(p, ro, r_v)
        groups = np.unique([r["prompt_id"] for r in ro], return_inverse=True)[1].reshape(-1)
        w_tok = np.zeros(int(offsets[-1]), dtype=np.float32)
        n_valid = {r["rollout_id"]: 0 for r in ro}
        if cfg.critique.enabled and cfg.critique.mode == "process":
            w_tok, n_valid = _token_weights(p, ro, offsets, cfg.vote.rule)
        R = token_rewards(r_v, w_tok, offsets, rc.correct_weight, rc.process_weight)
        if rc.estimator == "grpo":
            A = broadcast_to_tokens(grpo_sequence_advantages(rc.correct_weight * r_v, groups, rc.scale_by_std, rc.eps), offsets)
        else:
            A = group_token_advantages(R, offsets, groups, rc.scale_by_std, rc.eps)
        rows = [{"run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "rollout_id": r["rollout_id"],
                 "prompt_id": r["prompt_id"], "outcome_correct": bool(oc[r["rollout_id"]]), "outcome_reward": float(r_v[i]),
                 "rule": cfg.vote.rule if cfg.critique.enabled and cfg.critique.mode == "process" else None,
                 "n_valid_critiques": n_valid[r["rollout_id"]],
                 "n_penalized_tokens": int((w_tok[offsets[i] : offsets[i + 1]] > 0).sum()) if rc.process_weight > 0 else 0,
                 "rewards": R[offsets[i] : offsets[i + 1]], "advantages": A[offsets[i] : offsets[i + 1]],
                 "reward_config_hash": storage.key_hash(key)} for i, r in enumerate(ro)]
        table = pa.Table.from_pylist([{**r, "rewards": r["rewards"].tolist(), "advantages": r["advantages"].tolist()} for r in rows],
                                     schema=TOKEN_REWARDS_SCHEMA)
        penal = float((w_tok > 0).mean()) if len(w_tok) else 0.0
        return table, _with_prov(cfg, {"share_tokens_penalized": penal, "mean_token_reward": float(R.mean()) if len(R) else None,
                                       "outcome_source": rc.outcome, **genorm_stats})

    return _run("reward", p["token_rewards"], "token_rewards", key, compute, force)


def _genorm_outcomes(p, ro: list[dict], rule_r_v: np.ndarray) -> tuple[np.ndarray, dict]:
    """GenORM outcome reward: 1 iff strictly more than half of the valid verdicts say correct.

    A response with no valid verdict gets 0. Returns (B,) rewards and agreement statistics with
    the rule verifier (how often the critic's majority equals math-verify's verdict).
    """
    crit = storage.read_table(p["critiques"], "critiques").select(["rollout_id", "outcome_verdict", "parse_status"])
    yes: dict[str, list[bool]] = {}
    for c in crit.to_pylist():
        if c["parse_status"] == "ok":
            yes.setdefault(c["rollout_id"], []).append(bool(c["outcome_verdict"]))
    r = np.array([1.0 if sum(yes.get(x["rollout_id"], [])) * 2 > len(yes.get(x["rollout_id"], [])) else 0.0 for x in ro])
    no_valid = sum(1 for x in ro if not yes.get(x["rollout_id"]))
    return r, {"genorm_agreement_with_rule": float((r == rule_r_v).mean()) if len(r) else None,
               "genorm_no_valid_verdict": no_valid}


def _token_weights(p, ro: list[dict], offsets: np.ndarray, rule: str) -> tuple[np.ndarray, dict]:
    """(N,) voted weight of the step owning each token, and valid-critique count per rollout."""
    steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "token_start", "token_end"])
    verd = storage.read_table(p["step_verdicts"], "step_verdicts")
    verd = verd.filter(pc.equal(verd.column("rule"), rule)).select(["rollout_id", "step_idx", "n_valid", "weight"])
    wmap = {(r["rollout_id"], r["step_idx"]): (r["weight"], r["n_valid"]) for r in verd.to_pylist()}
    pos = {r["rollout_id"]: i for i, r in enumerate(ro)}
    w_tok = np.zeros(int(offsets[-1]), dtype=np.float32)
    n_valid = {r["rollout_id"]: 0 for r in ro}
    covered = np.zeros(len(ro), dtype=np.int64)
    for s in steps.to_pylist():
        i = pos[s["rollout_id"]]
        w, nv = wmap.get((s["rollout_id"], s["step_idx"]), (0.0, 0))
        w_tok[offsets[i] + s["token_start"] : offsets[i] + s["token_end"]] = w
        covered[i] += s["token_end"] - s["token_start"]
        n_valid[s["rollout_id"]] = nv
    bad = np.nonzero(covered != np.diff(offsets))[0]
    if len(bad):
        raise ValueError(f"steps of rollout {ro[bad[0]]['rollout_id']} cover {covered[bad[0]]} tokens, "
                         f"expected {np.diff(offsets)[bad[0]]}: steps.parquet is inconsistent with rollouts.parquet")
    return w_tok, n_valid
