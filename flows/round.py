"""Prefect flows: ``capo-round`` runs one round, ``capo-run`` runs K on-policy rounds.

Flows only sequence. Each task runs one stage through :func:`flows.runner.run_stage`, which skips
the stage when its output table is current under its recorded key, so resuming is re-running.
Prefect's result cache is off on purpose: a cache keyed on inputs would skip work whose files
were deleted; the tables and their manifests are the only source of truth.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.runner import finish_round, run_stage
from pipeline.config import load_config
from pipeline.engines.host import policy_engine_session
from pipeline.runlock import run_lock
from pipeline.stages import round_plan

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "default.yaml")


def _require_at_least(low: int, **values: int) -> None:
    """Refuse a flow parameter below ``low`` (the CLI's ``min=1``), naming it and its value.

    Raises:
        ValueError: the first of ``values`` below ``low``.
    """
    for name, value in values.items():
        if value < low:
            why = "the number of rounds to run" if name == "rounds" else \
                "a round number; round 0 is the starting policy, evaluated only, and round 1 samples from it"
            raise ValueError(f"{name}={value}: must be >= {low} ({why})")


@task(cache_policy=NO_CACHE, task_run_name="{name}-round-{round_idx}")
def stage_task(name: str, config: str, overrides: list[str], round_idx: int, preset: Optional[str] = None) -> dict:
    """One stage of one round; returns what happened (skipped and why, or rows written)."""
    cfg = load_config(config, overrides, preset)
    return dataclasses.asdict(run_stage(name, cfg, round_idx, logger=get_run_logger()))


@task(cache_policy=NO_CACHE)
def finish_task(config: str, overrides: list[str], round_idx: int, results: list[dict], wall_s: float,
                preset: Optional[str] = None) -> dict:
    """The round's tail (:func:`flows.runner.finish_round`: summary, DuckDB catalog, report; the flow
    never keeps the catalog open), the report published as Prefect artifacts."""
    from flows.artifacts import publish_artifacts

    cfg = load_config(config, overrides, preset)
    done = finish_round(cfg, round_idx, results, wall_s)
    report = {k: v for k, v in done.items() if k not in ("summary", "catalog")}
    publish_artifacts(report, f"capo-{cfg.run_id}")
    return {k: str(v) for k, v in done.items()}


@flow(name="capo-round", log_prints=True)
def capo_round(round: int = 1, config: str = DEFAULT_CONFIG, overrides: Optional[list[str]] = None,
               preset: Optional[str] = None) -> list[dict]:
    """Run one CAPO round: rollout, verify, segment, mc (VinePPO only), densr (DenseR only), critique, vote,
    reward, train, eval, catalog, report.

    Args:
        round: round number; round 1 samples from ``rollout.policy``, round k from round k-1's
            checkpoint.
        config: YAML config path (``configs/default.yaml``: the embedded offline defaults).
        overrides: ``section.key=value`` strings, e.g. ``["vote.rule=union", "reward.process_weight=0.5"]``.
        preset: a name from ``configs/presets/`` (capo-intersection, capo-union, capo-majority,
            capo-average, capo-majority-arithmetic, capo-arithmetic, capo-logprob-arithmetic, capo-readout, grpo, grpo-genorm, grpo-lambda, fipo, vineppo,
            densr); it also names the variant.

    Raises:
        ValueError: ``round`` below 1 (checked first, before the config is read), or a bad config.
        FileNotFoundError: round ``round - 1``'s checkpoint is missing (before the run lock).
    """
    _require_at_least(1, round=round)
    overrides = list(overrides or [])
    cfg = load_config(config, overrides, preset)  # fail before any work on a bad config
    from pipeline.precision import describe, precision_record
    from pipeline.stages.base import policy_for_round

    if round > 1:
        policy_for_round(cfg, round)  # round k-1's checkpoint must exist: fail before taking the run lock

    get_run_logger().info(describe(precision_record(cfg)))
    t0 = time.perf_counter()
    with run_lock(cfg.run_dir()):  # one writer per run: a second one fails here, naming the holder
        with policy_engine_session(cfg, get_run_logger()):  # a no-op unless scale.policy_engine=persistent
            results = [stage_task(name, config, overrides, k, preset) for name, k in round_plan(round)]
        finish_task(config, overrides, round, results, time.perf_counter() - t0, preset)
    logger = get_run_logger()
    for r in results:
        logger.info("%s: %s", r["stage"], "skipped" if r["skipped"] else f"ran in {r['seconds']:.1f}s")
    return results


@flow(name="capo-run", log_prints=True)
def capo_run(rounds: int = 2, start_round: int = 1, config: str = DEFAULT_CONFIG,
             overrides: Optional[list[str]] = None, preset: Optional[str] = None) -> None:
    """Run rounds ``start_round .. start_round + rounds - 1`` on-policy (each from the last checkpoint).

    With ``scale.policy_engine=persistent`` one vLLM policy engine serves every round's rollout
    and eval stages, loading each new checkpoint in place (:mod:`pipeline.engines.host`).

    Raises:
        ValueError: ``rounds`` or ``start_round`` below 1 (checked first, before the config is
            read), or a bad config.
        FileNotFoundError: round ``start_round - 1``'s checkpoint is missing (before the run lock).
    """
    _require_at_least(1, rounds=rounds, start_round=start_round)
    cfg = load_config(config, list(overrides or []), preset)
    if start_round > 1:
        from pipeline.stages.base import policy_for_round

        policy_for_round(cfg, start_round)  # round start_round - 1's checkpoint: fail before taking the run lock
    with run_lock(cfg.run_dir()), policy_engine_session(cfg, get_run_logger()):
        for k in range(start_round, start_round + rounds):
            capo_round(round=k, config=config, overrides=overrides, preset=preset)
