"""Stage ``mc``: Monte Carlo values of each response's first steps (VinePPO) -> ``mc_values.parquet``.

For every response with ``N >= 2`` steps, the states ``S_1 .. S_{M-1}`` (``M = min(N, mc.max_states)``;
``S_k`` is the prompt followed by the response's tokens up to the end of its k-th step) each get
``mc.continuations`` continuations from the round's policy (the rollout's engine and sampling, the
budget the response had left), verified like the rollouts (the verify stage's rules). A state's
value is the share of its continuations with the right answer. The prompt's value ``S_0`` comes
from the group (:func:`pipeline.core.mc.leave_one_out_means`), so it costs no generation. The reward
stage turns the values into step advantages (``reward.estimator: vineppo``,
:func:`pipeline.core.rewards.vineppo`). Runs only for that estimator; the table is cached like the
rollouts, so training again on it samples nothing.
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.grading import grade
from pipeline.schemas import MC_VALUES_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    model_fingerprint,
    policy_for_round,
    prompts_path,
    provenance,
    round_paths,
    round_seed,
    run_table_stage,
)

log = logging.getLogger("capo.stages")


def no_mc(cfg: CAPOConfig) -> str | None:
    """Why the mc stage has nothing to do under ``cfg`` (None: it has)."""
    return None if cfg.reward.estimator == "vineppo" else f"reward.estimator is {cfg.reward.estimator}, not vineppo"


def mc_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the values depend on: rollouts, steps, the mc settings, the rollout's sampling and engine,
    the policy, the prompts (gold answers) and the verifier."""
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    return {"rollouts": input_fp(p["rollouts"]), "steps": input_fp(p["steps"]), "seed": cfg.seed,
            "mc": cfg.mc.model_dump(mode="json"), "sampling": cfg.rollout.sampling.model_dump(mode="json"),
            "engine": cfg.rollout.engine.type, "dtype": precision_record(cfg)["rollout_dtype"],
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)),
            "prompts": storage.file_sha256(prompts_path(cfg)),
            "verifier": f"math-verify=={version('math-verify')}", "verify": cfg.verify.model_dump(mode="json")}


def mc_states(rollouts: list[dict], steps: list[dict], max_states: int) -> list[dict]:
    """The states to value: for each non-empty rollout with N >= 2 steps, ``k = 1 .. min(N, max_states) - 1``.

    Args:
        rollouts: rollout rows (``rollout_id``, ``prompt_token_ids``, ``response_token_ids``).
        steps: step rows (``rollout_id``, ``step_idx``, ``token_end``, ``empty_response``).
        max_states: ``mc.max_states``.

    Returns:
        One dict per state, in rollout then k order: ``rollout_id``, ``state_idx`` (k), ``prefix`` (the
        prompt's and the response's first token ids), ``token_end`` and ``response_ids`` (the response's
        first ``token_end`` token ids).
    """
    by_rid: dict[str, list[dict]] = {}
    for s in sorted(steps, key=lambda s: (s["rollout_id"], s["step_idx"])):
        by_rid.setdefault(s["rollout_id"], []).append(s)
    out = []
    for r in rollouts:
        st = by_rid.get(r["rollout_id"], [])
        if len(st) < 2 or st[0]["empty_response"]:
            continue
        for k in range(1, min(len(st), max_states)):
            end = st[k - 1]["token_end"]
            head = list(r["response_token_ids"][:end])
            out.append({"rollout_id": r["rollout_id"], "state_idx": k, "token_end": end,
                        "prefix": list(r["prompt_token_ids"]) + head, "response_ids": head})
    return out


def read_state_values(path) -> dict[str, dict[int, float]]:
    """``mc_values.parquet`` as ``{rollout_id: {state_idx: value}}`` (what the vineppo estimator and
    ``capo mc-labels`` read)."""
    out: dict[str, dict[int, float]] = {}
    for r in storage.read_table(path, "mc_values").select(["rollout_id", "state_idx", "value"]).to_pylist():
        out.setdefault(r["rollout_id"], {})[r["state_idx"]] = float(r["value"])
    return out


def mc_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Monte Carlo values of each response's first steps -> ``mc_values.parquet`` (module docstring).

    Raises:
        FileNotFoundError: the round's rollouts or steps table is missing.
        ValueError: the rollout engine cannot continue token prefixes (the openai engine).
    """
    p = round_paths(cfg, round_idx)
    key = mc_key(cfg, round_idx)

    def compute():
        from pipeline.core.tokenization import decode_with_bytes
        from pipeline.engines import make_engine
        from pipeline.engines.base import load_tokenizer

        ro = storage.read_table(p["rollouts"], "rollouts").select(
            ["rollout_id", "prompt_id", "prompt_token_ids", "response_token_ids"]).to_pylist()
        steps = storage.read_table(p["steps"], "steps").select(
            ["rollout_id", "step_idx", "token_end", "empty_response"]).to_pylist()
        gold = {r["prompt_id"]: r["gold_answer"]
                for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "gold_answer"]).to_pylist()}
        prompt_of = {r["rollout_id"]: r["prompt_id"] for r in ro}
        states = mc_states(ro, steps, cfg.mc.max_states)
        K, budget = cfg.mc.continuations, cfg.rollout.sampling.max_tokens
        stats = None
        rows = []
        if states:
            policy = policy_for_round(cfg, round_idx)  # the model that sampled the round's responses
            # the graded text of a state is its tokens' bytes decoded, as the segment stage decodes a response
            tok = load_tokenizer(policy)
            texts = [decode_with_bytes(tok, s["response_ids"])[0] for s in states]
            engine = make_engine(policy, cfg.rollout.engine, seed=round_seed(cfg, round_idx, 6))
            try:  # a state at the end of a budget-length response still gets one token to finish on
                gens = engine.continue_prefixes([s["prefix"] for s in states], K, cfg.rollout.sampling,
                                                [max(1, budget - s["token_end"]) for s in states])
                stats = engine.stats.as_dict()
            finally:
                engine.close()
            if len(gens) != len(states):
                raise RuntimeError(f"[mc] the engine returned {len(gens)} results for {len(states)} states of round "
                                   f"{round_idx}; an engine returns one result per prefix, in order")
            short = [(s["rollout_id"], s["state_idx"], len(g.samples)) for s, g in zip(states, gens) if len(g.samples) != K]
            if short:
                raise RuntimeError(f"[mc] states with other than mc.continuations = {K} continuations "
                                   f"(rollout, state, continuations): {short[:5]}")
            pairs, finish = [], []
            for s, text, g in zip(states, texts, gens, strict=True):
                for smp in g.samples:
                    pairs.append((gold[prompt_of[s["rollout_id"]]], text + smp.text))
                    finish.append(smp.finish_reason)
            graded = grade(pairs, answer=cfg.verify.answer, finish_reasons=finish, truncated=cfg.verify.truncated)
            for i, (s, g) in enumerate(zip(states, gens)):
                ok = [c for _, c, _ in graded[i * K : (i + 1) * K]]
                rows.append({"run_id": cfg.run_id, "round": round_idx, "rollout_id": s["rollout_id"],
                             "state_idx": s["state_idx"], "token_end": s["token_end"], "value": sum(ok) / K,
                             "n_continuations": K, "n_correct": int(sum(ok)),
                             "continuations": [x.text for x in g.samples], "correct": ok,
                             "finish_reasons": [x.finish_reason for x in g.samples]})
        log.info("[mc] %d states of %d responses valued with %d continuations each", len(states), len(ro), K)
        values = [r["value"] for r in rows]
        return (pa.Table.from_pylist(rows, schema=MC_VALUES_SCHEMA),
                provenance(cfg, {"engine": stats, "states": len(states), "continuations": len(states) * K,
                                 "mean_value": float(np.mean(values)) if values else None}))

    return run_table_stage("mc", p["mc_values"], "mc_values", key, compute, force)


STAGE = Stage("mc", ("rollouts", "steps"), ("mc_values",), True, mc_key, "pipeline.stages.mc:mc_stage", no_mc,
              engine_env=True)
