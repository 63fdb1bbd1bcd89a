"""The two generation stages: rollouts from the policy, critiques from the critic (GenPRM).

Both load an engine only when they have work to do, so a re-run over cached tables never starts a
model. The critique stage is resumable mid-stage: it commits shards of ``critique.batch_rollouts``
rollouts under ``critiques.parts/`` and, when run again, continues after the last committed shard.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.engines import make_engine
from pipeline.schemas import CRITIQUES_SCHEMA, ROLLOUTS_SCHEMA
from pipeline.stages import (
    StageResult,
    _run,
    _with_prov,
    policy_for_round,
    prompts_path,
    resolve_model,
    round_paths,
    select_prompt_indices,
    stage_key,
)
from pipeline.tokenization import decode_with_bytes

log = logging.getLogger("capo.stages")


def round_seed(cfg: CAPOConfig, round_idx: int, salt: int) -> int:
    return int(np.random.default_rng([cfg.seed, round_idx, salt]).integers(0, 2**31 - 1))


def policy_messages(question: str, instruction: str) -> list[dict]:
    """Chat messages that ask the policy for a step-by-step solution with one ``\\boxed{}``."""
    return [{"role": "user", "content": f"{question.strip()}\n\n{instruction}"}]


# ------------------------------------------------------------------------------------------ rollout
def rollout_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Sample G responses per prompt from the round's policy -> ``rollouts.parquet``."""
    p = round_paths(cfg, round_idx)
    key = stage_key("rollout", cfg, round_idx)

    def compute():
        policy = policy_for_round(cfg, round_idx)
        prompts = pq.read_table(prompts_path(cfg))
        idx = select_prompt_indices(prompts.num_rows, cfg.data.prompts_per_round, round_idx, cfg.seed)
        chosen = prompts.take(pa.array(idx)).to_pylist()
        convs = [policy_messages(r["question"], cfg.instruction()) for r in chosen]
        engine = make_engine(policy, cfg.rollout.engine, seed=round_seed(cfg, round_idx, 1))
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
        return pa.Table.from_pylist(rows, schema=ROLLOUTS_SCHEMA), _with_prov(cfg, {"engine": stats, "policy": policy})

    return _run("rollout", p["rollouts"], "rollouts", key, compute, force)


# ----------------------------------------------------------------------------------------- critique
def critique_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """N critiques per response from the critic, parsed -> ``critiques.parquet`` (resumable)."""
    from pipeline.critique import (
        TEMPLATE_VERSION,
        build_critique_messages,
        build_outcome_messages,
        parse_critique,
        parse_outcome_verdict,
    )

    p = round_paths(cfg, round_idx)
    key = stage_key("critique", cfg, round_idx)
    parts_dir = p["critiques"].with_suffix(".parts")
    shard_key = storage.key_hash(key)
    stats_box: dict = {"critic_calls": 0}

    def compute():
        critic = resolve_model(cfg.critique.critic, cfg)
        rollouts = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "response_text"]).to_pylist()
        outcome_mode = cfg.critique.mode == "outcome"
        steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "step_text", "empty_response"])
        prompts = {r["prompt_id"]: r for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "question", "gold_answer"]).to_pylist()}
        by_rollout: dict[str, list[str]] = {}
        empty: set[str] = set()
        for r in steps.sort_by([("rollout_id", "ascending"), ("step_idx", "ascending")]).to_pylist():
            by_rollout.setdefault(r["rollout_id"], []).append(r["step_text"])
            if r["empty_response"]:
                empty.add(r["rollout_id"])
        done_parts = storage.read_parts(parts_dir, "critiques", shard_key)
        done = set()
        for t in done_parts:
            done.update(t.column("rollout_id").to_pylist())
        todo = [r for r in rollouts if r["rollout_id"] not in done]
        if done:
            log.info("[critique] resuming: %d rollouts already critiqued in %d shards, %d to go",
                     len(done), len(done_parts), len(todo))
        engine = None
        n = cfg.critique.num_critiques
        bs = cfg.critique.batch_rollouts
        part_idx = len(done_parts)
        t0 = time.perf_counter()
        for start in range(0, len(todo), bs):
            batch = todo[start : start + bs]
            live = [r for r in batch if r["rollout_id"] not in empty]
            gens = {}
            if live:
                if engine is None:
                    engine = make_engine(critic, cfg.critique.engine, seed=round_seed(cfg, round_idx, 2))
                convs = []
                for r in live:
                    pr = prompts[r["prompt_id"]]
                    gold = pr["gold_answer"] if cfg.critique.include_gold_answer else None
                    if outcome_mode:
                        convs.append(build_outcome_messages(pr["question"], r["response_text"], gold))
                    else:
                        convs.append(build_critique_messages(pr["question"], by_rollout[r["rollout_id"]], gold))
                for r, g in zip(live, engine.generate(convs, n, cfg.critique.sampling)):
                    gens[r["rollout_id"]] = g
                stats_box["critic_calls"] += len(live)
            rows = []
            for r in batch:
                rid, n_steps = r["rollout_id"], len(by_rollout[r["rollout_id"]])
                for k in range(n):
                    verdict = None
                    if rid in gens:
                        s = gens[rid].samples[k]
                        text, toks, fin = s.text, len(s.token_ids) or len(s.logprobs or []), s.finish_reason
                        if outcome_mode:
                            verdict, status = parse_outcome_verdict(s.text)
                            wrong = None
                        else:
                            parsed = parse_critique(s.text, n_steps)
                            status, wrong = parsed.status, (list(parsed.wrong_steps) if parsed.wrong_steps is not None else None)
                    else:
                        text, toks, fin, status, wrong = "", 0, None, "skipped_empty_response", None
                    rows.append({"run_id": cfg.run_id, "round": round_idx, "rollout_id": rid, "critique_idx": k,
                                 "mode": cfg.critique.mode, "outcome_verdict": verdict, "critic_model": critic, "template_version": TEMPLATE_VERSION,
                                 "include_gold_answer": cfg.critique.include_gold_answer, "n_steps": n_steps,
                                 "raw_text": text, "wrong_steps": wrong, "parse_status": status,
                                 "critic_tokens": toks, "finish_reason": fin})
            storage.write_part(pa.Table.from_pylist(rows, schema=CRITIQUES_SCHEMA), parts_dir, part_idx,
                               "critiques", {"key": shard_key})
            part_idx += 1
            elapsed = time.perf_counter() - t0
            finished = start + len(batch)
            eta = elapsed / finished * (len(todo) - finished)
            log.info("[critique] %d/%d rollouts critiqued (%.0fs elapsed, ~%.0fs left)", finished, len(todo), elapsed, eta)
        engine_stats = engine.stats.as_dict() if engine is not None else None
        if engine is not None:
            engine.close()
        table = pa.concat_tables(storage.read_parts(parts_dir, "critiques", shard_key)) if part_idx else CRITIQUES_SCHEMA.empty_table()
        table = table.sort_by([("rollout_id", "ascending"), ("critique_idx", "ascending")])
        n_fail = int(pc.sum(pc.not_equal(table.column("parse_status"), "ok")).as_py() or 0)
        return table, _with_prov(cfg, {"critic": critic, "critic_calls": stats_box["critic_calls"],
                                       "engine": engine_stats, "parse_failures": n_fail,
                                       "template_version": TEMPLATE_VERSION})

    res = _run("critique", p["critiques"], "critiques", key, compute, force)
    if not res.skipped:
        res = StageResult(res.stage, res.path, False, res.reason, res.rows, res.seconds, stats_box["critic_calls"])
    if not res.skipped and parts_dir.is_dir():
        for f in parts_dir.iterdir():
            f.unlink()
        parts_dir.rmdir()
    return res
