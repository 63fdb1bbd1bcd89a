"""Stage ``rollout``: G responses per prompt from the round's policy -> ``rollouts.parquet``.

The prompts of round k are a seeded slice of the training prompts (:func:`select_prompt_indices`);
round 1 samples from ``rollout.policy``, round k > 1 from round k-1's checkpoint
(:func:`pipeline.stages.base.policy_for_round`). Every sampled token's id and the engine's log-prob
of it (after temperature, the PPO ratio's old log-prob check) are stored.

With ``rollout.dynamic_sampling`` (DAPO §3.2) the stage grades each batch of groups as it is sampled
(the verify stage's rules) and keeps only groups whose outcomes differ, sampling further batches of
other prompts (:func:`extra_prompt_indices`) until the round has ``data.prompts_per_round`` of them
or ``rollout.max_gen_batches`` batches were sampled, then fills up with groups without signal
(:func:`filter_groups`); the manifest's ``dynamic_sampling`` says what was sampled and dropped.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

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
    """Indices of the prompts of round ``round_idx`` (1-based), shape ``(per_round,)``.

    A seeded permutation per epoch (:func:`epoch_permutation`); rounds take consecutive slices, so
    prompts do not repeat until the training set is used up, then a new epoch starts. A round that
    straddles two epochs never holds a prompt twice.

    Raises:
        ValueError: ``per_round`` exceeds ``n_prompts``.
    """
    if per_round > n_prompts:
        raise ValueError(f"data.prompts_per_round={per_round} exceeds the {n_prompts} prompts available")
    start, stop = (round_idx - 1) * per_round, round_idx * per_round
    perms: dict[int, np.ndarray] = {}
    out = []
    for pos in range(start, stop):
        epoch, off = divmod(pos, n_prompts)
        if epoch not in perms:
            perms[epoch] = epoch_permutation(n_prompts, per_round, seed, epoch)
        out.append(perms[epoch][off])
    return np.asarray(out, dtype=np.int64)


def epoch_permutation(n_prompts: int, per_round: int, seed: int, epoch: int) -> np.ndarray:
    """The prompt order of one epoch, shape ``(n_prompts,)``: a permutation seeded by ``(seed, epoch)``,
    except that when a round straddles the boundary from the previous epoch (``n_prompts`` is not a
    multiple of ``per_round``), a prompt of the new epoch's head that the round already holds from
    the old epoch's tail swaps places with the first later prompt that it does not hold. Epochs whose
    head does not collide are the plain seeded permutation."""
    prev = None
    for e in range(epoch + 1):  # each epoch's head depends on the (adjusted) tail before it
        perm = np.random.default_rng([seed, e]).permutation(n_prompts)
        t = (e * n_prompts) % per_round  # the straddling round's prompts in epoch e - 1
        if e and t:
            tail = set(prev[n_prompts - t:].tolist())
            head, rest = perm[: per_round - t].tolist(), perm[per_round - t:].tolist()
            for i, x in enumerate(head):
                if x in tail:  # of the n - t prompts outside the tail at most h - 1 are in the head, so
                    j = next(k for k, y in enumerate(rest) if y not in tail)  # rest holds >= n - per_round + 1
                    head[i], rest[j] = rest[j], head[i]
            perm = np.asarray(head + rest, dtype=perm.dtype)
        prev = perm
    return prev


def extra_prompt_indices(n_prompts: int, count: int, round_idx: int, seed: int, batch: int,
                         exclude: list[int]) -> np.ndarray:
    """Prompts of dynamic sampling's extra batch ``batch`` (1, 2, ...) of round ``round_idx``: the
    first ``count`` prompts of a permutation seeded by ``(seed, round_idx, batch)`` that are not in
    ``exclude`` (the prompts the round already sampled); fewer when the set runs out. Shape
    ``(<= count,)``, int64. The round's own slice (:func:`select_prompt_indices`) is untouched, so
    later rounds draw the same prompts with or without dynamic sampling; the cost is that an extra
    prompt may be one that another round of the same epoch trains on too (verl instead consumes the
    next batches of its data loader)."""
    skip = {int(i) for i in exclude}
    perm = np.random.default_rng([seed, round_idx, 1000 + batch]).permutation(n_prompts)
    return np.asarray([i for i in perm if int(i) not in skip][:count], dtype=np.int64)


def has_signal(correct: list[bool]) -> bool:
    """A group gives a group-normalized advantage some signal when its outcomes differ."""
    return 0 < sum(map(bool, correct)) < len(correct)


def filter_groups(correct: list[list[bool]], per_round: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice (DAPO §3.2, eq. 11's constraint ``0 < |{correct}| < G``): of the
    sampled groups (one list of verified outcomes per group, in sampling order), the first
    ``per_round`` with signal (:func:`has_signal`); when there are fewer, the first groups without
    signal fill the round up to ``per_round``.

    Returns ``(indices of the kept groups in sampling order, how many of them have no signal)``.
    Example: outcomes ``[[1,1], [0,1], [0,0], [1,0]]`` and ``per_round=2`` keep ``[1, 3]`` (0
    without signal); with ``per_round=3``, ``[0, 1, 3]`` (1 without signal).
    """
    signal = [i for i, c in enumerate(correct) if has_signal(c)][:per_round]
    fill = [i for i, c in enumerate(correct) if not has_signal(c)][: per_round - len(signal)]
    return sorted(signal + fill), len(fill)


def rollout_settings(cfg: CAPOConfig) -> dict:
    """``cfg.rollout`` as the rollout key holds it: dynamic sampling's fields only when it is on, so
    rounds sampled before the option existed keep their key (and their cached rollouts). When on, the
    grading that chooses the groups is part of it too: the verify rules and math-verify's version.
    Without an explicit ``rollout.instruction`` (None or empty) the policy is given ``steps.mode``'s default
    instruction (:meth:`CAPOConfig.instruction`), which is then part of the key for every mode but
    ``blank_line`` (whose rounds keep the key they had before it was): ``steps.mode=step_tag`` asks
    for ``<step k>`` markers, so rollouts sampled without them are not reused."""
    from importlib.metadata import version

    ro = cfg.rollout.model_dump(mode="json")
    if not ro["instruction"] and cfg.steps.mode != "blank_line":  # None or "": the mode's default is used
        ro["instruction"] = cfg.instruction()
    ds = {k: ro.pop(k) for k in ("dynamic_sampling", "max_gen_batches")}
    if ds["dynamic_sampling"]:
        ro["dynamic_sampling"] = {**ds, "verify": cfg.verify.model_dump(mode="json"),
                                  "verifier": f"math-verify=={version('math-verify')}"}
    return ro


def rollout_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the rollouts depend on: data, rollout settings, resolved dtype, policy and prompts."""
    from pipeline.precision import precision_record

    c = cfg.model_dump(mode="json")
    return {"round": round_idx, "seed": cfg.seed, "data": c["data"], "rollout": rollout_settings(cfg),
            "dtype": precision_record(cfg)["rollout_dtype"], "engine_logprobs": "processed",  # after temperature/top-p
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)),
            "prompts": storage.file_sha256(prompts_path(cfg))}


def rollout_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Sample G responses per prompt from the round's policy -> ``rollouts.parquet``.

    Raises:
        ValueError: ``data.prompts_per_round`` exceeds the prompt table (before the policy engine
            is started), or the round would hold a rollout id twice. The engine is closed on every
            path out once started.
        FileNotFoundError: round k-1's checkpoint is missing (:func:`policy_for_round`).
    """
    p = round_paths(cfg, round_idx)
    key = rollout_key(cfg, round_idx)

    def compute():
        from pipeline.engines.host import policy_engine

        policy = policy_for_round(cfg, round_idx)
        prompts = pq.read_table(prompts_path(cfg))
        per, rc = cfg.data.prompts_per_round, cfg.rollout
        idx = select_prompt_indices(prompts.num_rows, per, round_idx, cfg.seed)  # too few prompts: before the engine
        engine = policy_engine(policy, rc.engine, seed=round_seed(cfg, round_idx, 1))
        try:
            groups: list[tuple[dict, object, list[str]]] = []  # (prompt row, generation, response texts)
            correct: list[list[bool]] = []
            tried: list[int] = []
            n_batches = 0
            for batch in range(rc.max_gen_batches if rc.dynamic_sampling else 1):
                if batch:
                    idx = extra_prompt_indices(prompts.num_rows, per, round_idx, cfg.seed, batch, tried)
                    if not len(idx):
                        break
                tried += idx.tolist()
                n_batches += 1
                chosen = prompts.take(pa.array(idx)).to_pylist()
                gens = engine.generate([policy_messages(r["question"], cfg.instruction()) for r in chosen],
                                       rc.group_size, rc.sampling)
                new = [(r, g, [decode_with_bytes(engine.tokenizer, s.token_ids)[0] for s in g.samples])
                       for r, g in zip(chosen, gens, strict=True)]
                groups += new
                if not rc.dynamic_sampling:
                    break
                correct += _grade_groups(cfg, new)
                if sum(map(has_signal, correct)) >= per:
                    break
            stats = engine.stats.as_dict()
        finally:  # a failed generation or grading returns the engine's memory too
            engine.close()
        extra = {}
        if rc.dynamic_sampling:
            keep, n_flat = filter_groups(correct, per)
            kept = set(keep)
            dropped = [g[0]["prompt_id"] for i, g in enumerate(groups) if i not in kept]
            extra["dynamic_sampling"] = {
                "gen_batches": n_batches, "groups_sampled": len(groups),
                "groups_with_signal": sum(map(has_signal, correct)), "groups_kept": len(keep),
                "groups_kept_without_signal": n_flat, "dropped_prompt_ids": dropped,
                # the outcome reward over every sampled response (the table's kept groups are mixed by construction)
                "sampled_accuracy": float(np.mean([ok for c in correct for ok in c]))}
            log.info("dynamic sampling: %s", json.dumps({k: v for k, v in extra["dynamic_sampling"].items()
                                                         if k != "dropped_prompt_ids"}))
            groups = [groups[i] for i in keep]
        rows = []
        for prompt, gen, texts in groups:
            for j, (s, text) in enumerate(zip(gen.samples, texts)):
                rows.append({
                    "run_id": cfg.run_id, "round": round_idx,
                    "rollout_id": f"{cfg.run_id}/r{round_idx}/{prompt['prompt_id']}/{j}",
                    "prompt_id": prompt["prompt_id"], "sample_idx": j, "policy": policy,
                    "prompt_token_ids": gen.prompt_token_ids, "response_text": text,
                    "response_token_ids": s.token_ids, "rollout_logprobs": s.logprobs,
                    "finish_reason": s.finish_reason, "num_tokens": len(s.token_ids),
                })
        dup = [rid for rid, n in Counter(r["rollout_id"] for r in rows).items() if n > 1]
        if dup:  # a round holds each prompt once (select_prompt_indices, extra_prompt_indices)
            raise ValueError(f"round {round_idx} would hold rollout ids twice: {dup[:3]}")
        log.info("rollout engine: %s", json.dumps(stats))
        return (pa.Table.from_pylist(rows, schema=ROLLOUTS_SCHEMA),
                provenance(cfg, {"engine": stats, "policy": policy, **extra}))

    return run_table_stage("rollout", p["rollouts"], "rollouts", key, compute, force)


def _grade_groups(cfg: CAPOConfig, groups: list[tuple[dict, object, list[str]]]) -> list[list[bool]]:
    """Verified outcomes of freshly sampled groups, under the verify stage's rules (math-verify)."""
    from pipeline.grading import grade

    pairs = [(r["gold_answer"], t or "") for r, _, texts in groups for t in texts]
    fins = [s.finish_reason for _, g, _ in groups for s in g.samples]
    res = grade(pairs, answer=cfg.verify.answer, finish_reasons=fins, truncated=cfg.verify.truncated)
    out, i = [], 0
    for _, _, texts in groups:
        out.append([ok for _, ok, _ in res[i : i + len(texts)]])
        i += len(texts)
    return out


STAGE = Stage("rollout", (), ("rollouts",), True, rollout_key, "pipeline.stages.rollout:rollout_stage", engine_env=True)
